// Does an instruction mix slow the core down after it has run? (ADR 010, session-26 amendment)
//
//   g++ -O2 -mavx2 -mfma benchmarks/clock_probe.cpp -o build/clock_probe && taskset -c 1 build/clock_probe
//
// Each workload runs for 2 ms after 3 ms of scalar code; then a probe times 20,000 dependent 64-bit
// multiply-adds (register-only: its time is 80,000 cycles over the core's clock, whatever the caches
// or the other core do), right after and again 0.5 ms later. Medians of 40 interleaved rounds. A
// probe slower than after the scalar workload means the core runs at a lower clock after that mix:
// on the Intel Xeon of session 26 (KVM), 256-bit integer multiplies at full rate did that (GML's
// int16 vpmaddwd kernels and oneDNN's u8 x s8 chain alike), FMAs and plain loads / stores did not.
// AVX2 only: run it on any x86 CPU with AVX2.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double micros_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double probe() {
  const auto t0 = Clock::now();
  uint64_t acc = 1;
  for (int r = 0; r < 20000; ++r) {
    acc = acc * 6364136223846793005ULL + 1442695040888963407ULL;
    asm volatile("" : "+r"(acc));  // one dependent chain, kept in a register
  }
  return micros_since(t0);
}

alignas(64) int16_t g_i16[32768];
alignas(64) uint8_t g_u8[65536];
const __m256i kW16 = _mm256_set1_epi16(3);

void scalar() {
  uint64_t s = 1;
  for (int i = 0; i < 1000; ++i) {
    s = s * 3 + 1;
    asm volatile("" : "+r"(s));
  }
}

// vpmaddwd whose every result feeds the next: latency-bound, few multiplies per cycle
void madd_chain() {
  __m256i a = kW16, b = kW16;
  for (int i = 0; i < 1000; ++i) {
    a = _mm256_add_epi32(a, _mm256_madd_epi16(b, kW16));
    b = _mm256_add_epi32(b, _mm256_madd_epi16(a, kW16));
    asm volatile("" : "+x"(a), "+x"(b));
  }
}

// vpmaddwd into 8 independent accumulators: as many multiplies per cycle as the core issues
void madd_throughput() {
  __m256i c[8];
  for (auto& v : c) v = kW16;
  for (int i = 0; i < 1000; ++i) {
    for (auto& v : c) v = _mm256_add_epi32(v, _mm256_madd_epi16(kW16, kW16));
    asm volatile("" : "+x"(c[0]), "+x"(c[1]), "+x"(c[2]), "+x"(c[3]), "+x"(c[4]), "+x"(c[5]), "+x"(c[6]), "+x"(c[7]));
  }
}

// GML's int16 kernels' inner loop (dw_int8.h columns, the Winograd GEMM): a loaded int16 vector
// times the weights into 4 accumulators
void madd_loads() {
  __m256i c0 = kW16, c1 = kW16, c2 = kW16, c3 = kW16;
  for (int i = 0; i < 256; ++i) {
    const int16_t* t = g_i16 + (i * 64) % 30000;
    for (int j = 0; j < 6; ++j) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(g_i16 + 31000 + j * 16));
      const auto at = [&](int k) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(t + j * 32 + k)); };
      c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(at(0), w));
      c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(at(16), w));
      c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(at(32), w));
      c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(at(48), w));
    }
    asm volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3));
  }
}

// oneDNN's AVX2 u8 x s8 chain: vpmaddubsw, vpmaddwd with ones, vpaddd, on loaded bytes
void u8s8_loads() {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i c0 = ones, c1 = ones, c2 = ones, c3 = ones;
  for (int i = 0; i < 256; ++i) {
    const uint8_t* t = g_u8 + (i * 128) % 59000;
    for (int j = 0; j < 6; ++j) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(g_i16 + 31000 + j * 16));
      const auto dot = [&](int k) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + j * 32 + k));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), ones);
      };
      c0 = _mm256_add_epi32(c0, dot(0));
      c1 = _mm256_add_epi32(c1, dot(200));
      c2 = _mm256_add_epi32(c2, dot(400));
      c3 = _mm256_add_epi32(c3, dot(600));
    }
    asm volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3));
  }
}

// fp32 FMA into 8 independent accumulators
void fma_throughput() {
  const __m256 w = _mm256_set1_ps(0.999f);
  __m256 c[8];
  for (auto& v : c) v = _mm256_set1_ps(1.0f);
  for (int i = 0; i < 1000; ++i) {
    for (auto& v : c) v = _mm256_fmadd_ps(v, w, w);
    asm volatile("" : "+x"(c[0]), "+x"(c[1]), "+x"(c[2]), "+x"(c[3]), "+x"(c[4]), "+x"(c[5]), "+x"(c[6]), "+x"(c[7]));
  }
}

// 32-byte loads and stores over 64 KB, one add between: the memory traffic without multiplies
void loads_stores() {
  for (int i = 0; i < 2048; ++i) {
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(g_i16 + (i * 16) % 32000));
    _mm256_store_si256(reinterpret_cast<__m256i*>(g_i16 + (i * 16 + 8192) % 32000), _mm256_add_epi16(v, v));
  }
}

template <class F>
void run_for(double us, F f) {
  const auto t0 = Clock::now();
  while (micros_since(t0) < us) f();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  struct Workload {
    const char* name;
    void (*run)();
  };
  const std::vector<Workload> workloads = {
      {"scalar (the baseline)", scalar},
      {"vpmaddwd, dependent chain", madd_chain},
      {"vpmaddwd, 8 accumulators", madd_throughput},
      {"vpmaddwd on loads (GML int16 kernels)", madd_loads},
      {"vpmaddubsw+vpmaddwd on loads (oneDNN)", u8s8_loads},
      {"vfmadd231ps, 8 accumulators", fma_throughput},
      {"loads + stores, no multiply", loads_stores},
  };
  std::vector<std::vector<double>> right_after(workloads.size()), later(workloads.size());
  for (int round = 0; round < 40; ++round)
    for (size_t i = 0; i < workloads.size(); ++i) {
      run_for(3000, scalar);
      run_for(2000, workloads[i].run);
      right_after[i].push_back(probe());
      run_for(500, scalar);
      later[i].push_back(probe());
    }
  std::printf("%-40s %18s %18s\n", "2 ms of", "probe right after", "0.5 ms later");
  for (size_t i = 0; i < workloads.size(); ++i)
    std::printf("%-40s %15.2f us %15.2f us\n", workloads[i].name, median(right_after[i]), median(later[i]));
}
