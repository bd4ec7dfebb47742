// GML engine: weight-only quantized linear layers (torch.ops.gml.woq_linear; src/gml/ir/llm_ops.py).
//
//   y[m, n] = sum_g s[n, g] * ( sum_{k in group g} x[m, k] * (q[n, k] - z[n, g]) ) + b[n]
//
// x fp32 [M, K] (activations stay fp32), y fp32 [M, N]. Weights as the op stores them, read in place
// (no repacking: a row of either format is already contiguous along K):
//   bits 8: q int8 [N, K], z = 0; group 32, 64 or 128 (llama.cpp's Q8_0 is group 32), or K (one
//           scale per output channel, any K);
//   bits 4: q uint8 [N, K/2], q[n, 2i] = low nibble of byte i, q[n, 2i+1] = high nibble; z = 8 when
//           zeros is null, else zeros uint8 [N, K/group]; group 32, 64 or 128.
// Decoding is a GEMV bound by memory bandwidth: each weight byte is read once per token, expanded to
// fp32 in registers (int8 -> int32 -> fp32; q - z is exact in int32) and FMA'd with x. Per group the
// partial sum is scaled once. Four output rows are computed together (four FMA chains per x load);
// for M > 1 (prefill) their weights stay in L1 while every x row passes over them. Blocks of rows
// are split across OpenMP threads.
//
// Dispatch is the caller's: `isa` is a kernel tier (cpu_has below; "vnni" runs the "avx512" code and
// "avxvnni" the "avx2" code here), chosen from GML's CPU description at the API boundary; an ISA this
// CPU lacks is refused, never run. Int8 activations: woq_int8act.h; many rows (prefill): woq_gemm.h.
// The summation order differs from the Python reference (dequantize + F.linear) only in fp32 rounding;
// with integer x and power-of-two scales every partial sum is exact and both agree bit for bit.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#define GML_WOQ_AVX512 __attribute__((target("avx512f,avx512bw")))
#define GML_WOQ_AVX2 __attribute__((target("avx2,fma")))

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace gml_woq {

// Every kernel prefetches the weight line kPrefetchRows rows ahead of each one it reads. A GEMV streams
// its matrix once, rows back to back, and the L2 streamer stops at every 4 KiB page: with rows of 640
// bytes (Gemma-3's 262,144 x 640 LM head) one thread read ~7 GB/s without, ~11.5 with (docs/llm.md).
// A prefetch past the end of the matrix does not fault (the address is formed as an integer: it may
// lie past the weight's allocation).
constexpr int64_t kPrefetchRows = 16;
inline void prefetch_row_ahead(const void* w, int64_t row_bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) + kPrefetchRows * row_bytes), _MM_HINT_T0);
}

struct Problem {
  const float* x = nullptr;  // [M, K]
  int64_t M = 0, K = 0, N = 0;
  const void* q = nullptr;  // int8 [N, K] | uint8 [N, K/2]
  int bits = 8;
  int64_t group = 0;               // 32 | 64 | 128, or K (bits 8: per output channel)
  const float* scales = nullptr;   // [N, K/group]
  const uint8_t* zeros = nullptr;  // [N, K/group] (bits 4) or null
  const float* bias = nullptr;     // [N] or null
  float* y = nullptr;              // [M, N]
};

// q - z of row n, element k (the scalar definition every vector path must equal).
inline int32_t weight_int(const Problem& p, int64_t n, int64_t k) {
  if (p.bits == 8) return static_cast<const int8_t*>(p.q)[n * p.K + k];
  const uint8_t b = static_cast<const uint8_t*>(p.q)[n * (p.K / 2) + k / 2];
  const int32_t v = (k & 1) ? (b >> 4) : (b & 0xF);
  return v - (p.zeros ? p.zeros[n * (p.K / p.group) + k / p.group] : 8);
}

inline void row_scalar(const Problem& p, int64_t n) {
  const int64_t G = p.K / p.group;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    float total = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) acc += x[k] * static_cast<float>(weight_int(p, n, k));
      total += acc * p.scales[n * G + g];
    }
    p.y[m * p.N + n] = total + (p.bias ? p.bias[n] : 0.f);
  }
}

// 32 INT4 weights from 16 bytes (weight 2i in byte i's low nibble, 2i + 1 in its high one, as
// above): v0 = weights 0..15, v1 = 16..31, one per byte (0..15). SSE2: every tier's kernels use it;
// always inlined, so compiled with the caller's target (VEX-encoded): a call into non-VEX SSE code
// from AVX-512 / AVX2 code with dirty upper halves costs a state transition per instruction (~40x).
__attribute__((always_inline)) inline void unpack_int4x32(const uint8_t* bytes, __m128i& v0, __m128i& v1) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
  v0 = _mm_unpacklo_epi8(lo, hi);
  v1 = _mm_unpackhi_epi8(lo, hi);
}

// ---------------------------------------------------------------- AVX-512: 16 fp32 lanes
GML_WOQ_AVX512 inline __m512 int8x16_ps(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// R consecutive output rows at once: every x vector loaded feeds R independent FMA chains (the
// dependency chain of one accumulator, not the memory, would otherwise bound the loop).
template <int R>
GML_WOQ_AVX512 inline void rows_avx512(const Problem& p, int64_t n0) {
  const int64_t G = p.K / p.group;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    __m512 total[R];
    float tail[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps(), tail[r] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      const int64_t k0 = g * p.group, k1 = k0 + p.group;
      int64_t k = k0;
      if (p.bits == 8) {
        const int8_t* q = static_cast<const int8_t*>(p.q) + n0 * p.K;
        for (; k + 16 <= k1; k += 16) {
          const __m512 xv = _mm512_loadu_ps(x + k);
          for (int r = 0; r < R; ++r) {
            if (k % 64 == 0) prefetch_row_ahead(q + r * p.K + k, p.K);
            acc[r] = _mm512_fmadd_ps(xv, int8x16_ps(q + r * p.K + k), acc[r]);
          }
        }
        for (int r = 0; r < R; ++r) {  // K not a multiple of 16 (bits 8, group = K: other groups are 32/64/128)
          float t = 0.f;
          for (int64_t kk = k; kk < k1; ++kk) t += x[kk] * static_cast<float>(q[r * p.K + kk]);
          tail[r] += t * p.scales[(n0 + r) * G + g];
        }
      } else {
        const uint8_t* q = static_cast<const uint8_t*>(p.q) + n0 * (p.K / 2);
        __m512i z[R];
        for (int r = 0; r < R; ++r) z[r] = _mm512_set1_epi32(p.zeros ? p.zeros[(n0 + r) * G + g] : 8);
        for (; k + 32 <= k1; k += 32) {
          const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
          for (int r = 0; r < R; ++r) {
            if (k % 128 == 0) prefetch_row_ahead(q + r * (p.K / 2) + k / 2, p.K / 2);
            __m128i v0, v1;  // weights k..k+15, k+16..k+31
            unpack_int4x32(q + r * (p.K / 2) + k / 2, v0, v1);
            acc[r] = _mm512_fmadd_ps(x0, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v0), z[r])), acc[r]);
            acc[r] = _mm512_fmadd_ps(x1, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v1), z[r])), acc[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        total[r] = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(p.scales[(n0 + r) * G + g]), total[r]);
    }
    for (int r = 0; r < R; ++r)
      p.y[m * p.N + n0 + r] = _mm512_reduce_add_ps(total[r]) + tail[r] + (p.bias ? p.bias[n0 + r] : 0.f);
  }
  _mm256_zeroupper();  // GCC does not insert it in target("avx...") functions: SSE code follows
}

// ---------------------------------------------------------------- AVX2: 8 fp32 lanes
GML_WOQ_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

GML_WOQ_AVX2 inline __m256 u8x8_minus_ps(__m128i v, __m256i z) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(v), z));
}

template <int R>
GML_WOQ_AVX2 inline void rows_avx2(const Problem& p, int64_t n0) {
  const int64_t G = p.K / p.group;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    __m256 total[R];
    float tail[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps(), tail[r] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      const int64_t k0 = g * p.group, k1 = k0 + p.group;
      int64_t k = k0;
      if (p.bits == 8) {
        const int8_t* q = static_cast<const int8_t*>(p.q) + n0 * p.K;
        for (; k + 8 <= k1; k += 8) {
          const __m256 xv = _mm256_loadu_ps(x + k);
          for (int r = 0; r < R; ++r) {
            if (k % 64 == 0) prefetch_row_ahead(q + r * p.K + k, p.K);
            const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + r * p.K + k));
            acc[r] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), acc[r]);
          }
        }
        for (int r = 0; r < R; ++r) {
          float t = 0.f;
          for (int64_t kk = k; kk < k1; ++kk) t += x[kk] * static_cast<float>(q[r * p.K + kk]);
          tail[r] += t * p.scales[(n0 + r) * G + g];
        }
      } else {
        const uint8_t* q = static_cast<const uint8_t*>(p.q) + n0 * (p.K / 2);
        __m256i z[R];
        for (int r = 0; r < R; ++r) z[r] = _mm256_set1_epi32(p.zeros ? p.zeros[(n0 + r) * G + g] : 8);
        for (; k + 32 <= k1; k += 32) {
          const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
          const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
          for (int r = 0; r < R; ++r) {
            if (k % 128 == 0) prefetch_row_ahead(q + r * (p.K / 2) + k / 2, p.K / 2);
            __m128i v0, v1;  // weights k..k+15, k+16..k+31
            unpack_int4x32(q + r * (p.K / 2) + k / 2, v0, v1);
            acc[r] = _mm256_fmadd_ps(x0, u8x8_minus_ps(v0, z[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(x1, u8x8_minus_ps(_mm_srli_si128(v0, 8), z[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(x2, u8x8_minus_ps(v1, z[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(x3, u8x8_minus_ps(_mm_srli_si128(v1, 8), z[r]), acc[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(p.scales[(n0 + r) * G + g]), total[r]);
    }
    for (int r = 0; r < R; ++r)
      p.y[m * p.N + n0 + r] = hsum256(total[r]) + tail[r] + (p.bias ? p.bias[n0 + r] : 0.f);
  }
  _mm256_zeroupper();
}

// ---------------------------------------------------------------- INT8 in groups of GS (32 | 64 | 128)
// The generic kernels above loop over groups of a run-time size with a K tail in each; for INT8 in
// small groups that per-group overhead doubled the time (measured, docs/llm.md). Here GS is a
// compile-time constant: per chunk of 32 weights, W lanes (16 AVX-512 / 8 AVX2) of x feed R rows'
// FMA chains, and every group's partial sum is scaled into the row's total once. No tail: 32 | GS | K.
template <int R, int GS>
GML_WOQ_AVX512 inline void rows8_grouped_avx512(const Problem& p, int64_t n0) {
  const int64_t G = p.K / GS;
  const int8_t* q = static_cast<const int8_t*>(p.q) + n0 * p.K;
  const float* sc = p.scales + n0 * G;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * GS;
      __m512 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < GS; c += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + k0 + c), x1 = _mm512_loadu_ps(x + k0 + c + 16);
        for (int r = 0; r < R; ++r) {
          if (c % 64 == 0) prefetch_row_ahead(q + r * p.K + k0 + c, p.K);
          part[r] = _mm512_fmadd_ps(x0, int8x16_ps(q + r * p.K + k0 + c), part[r]);
          part[r] = _mm512_fmadd_ps(x1, int8x16_ps(q + r * p.K + k0 + c + 16), part[r]);
        }
      }
      for (int r = 0; r < R; ++r) total[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(sc[r * G + g]), total[r]);
    }
    for (int r = 0; r < R; ++r) p.y[m * p.N + n0 + r] = _mm512_reduce_add_ps(total[r]) + (p.bias ? p.bias[n0 + r] : 0.f);
  }
  _mm256_zeroupper();  // GCC does not insert it in target("avx...") functions: SSE code follows
}

GML_WOQ_AVX2 inline __m256 int8x8_ps(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

template <int R, int GS>
GML_WOQ_AVX2 inline void rows8_grouped_avx2(const Problem& p, int64_t n0) {
  const int64_t G = p.K / GS;
  const int8_t* q = static_cast<const int8_t*>(p.q) + n0 * p.K;
  const float* sc = p.scales + n0 * G;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    __m256 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * GS;
      __m256 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
      for (int c = 0; c < GS; c += 16) {  // 16 at a time: 2 x + R part + R total registers, no spills
        const __m256 x0 = _mm256_loadu_ps(x + k0 + c), x1 = _mm256_loadu_ps(x + k0 + c + 8);
        for (int r = 0; r < R; ++r) {
          if (c % 64 == 0) prefetch_row_ahead(q + r * p.K + k0 + c, p.K);
          part[r] = _mm256_fmadd_ps(x0, int8x8_ps(q + r * p.K + k0 + c), part[r]);
          part[r] = _mm256_fmadd_ps(x1, int8x8_ps(q + r * p.K + k0 + c + 8), part[r]);
        }
      }
      for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(part[r], _mm256_set1_ps(sc[r * G + g]), total[r]);
    }
    for (int r = 0; r < R; ++r) p.y[m * p.N + n0 + r] = hsum256(total[r]) + (p.bias ? p.bias[n0 + r] : 0.f);
  }
  _mm256_zeroupper();
}

// rows [n0, n0 + R) of grouped INT8 on level 2 (AVX-512) or 1 (AVX2); false when p is not grouped INT8.
template <int R>
inline bool rows8_grouped(const Problem& p, int64_t n0, int level) {
  if (p.bits != 8 || level == 0 || p.group == p.K) return false;
  switch (p.group) {
    case 32:
      level == 2 ? rows8_grouped_avx512<R, 32>(p, n0) : rows8_grouped_avx2<R, 32>(p, n0);
      return true;
    case 64:
      level == 2 ? rows8_grouped_avx512<R, 64>(p, n0) : rows8_grouped_avx2<R, 64>(p, n0);
      return true;
    case 128:
      level == 2 ? rows8_grouped_avx512<R, 128>(p, n0) : rows8_grouped_avx2<R, 128>(p, n0);
      return true;
    default:
      return false;
  }
}

// The kernel tiers: "vnni" (AVX-512 VNNI), "avx512" (AVX-512F/BW), "avxvnni" (AVX2 + AVX-VNNI),
// "avx2" (AVX2 + FMA), "scalar". The VNNI tiers differ only with int8 activations (woq_int8act.h).
inline bool cpu_has(const std::string& isa) {
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (isa == "scalar") return true;
  if (isa == "avx2") return avx2;
  if (isa == "avxvnni") return avx2 && __builtin_cpu_supports("avxvnni");
  if (isa == "avx512") return avx512;
  if (isa == "vnni") return avx512 && __builtin_cpu_supports("avx512vnni");
  return false;
}

// The fp32-activation code a tier runs: 2 AVX-512, 1 AVX2, 0 scalar.
inline int fp32_level(const std::string& isa) {
  return (isa == "avx512" || isa == "vnni") ? 2 : (isa == "avx2" || isa == "avxvnni") ? 1 : 0;
}

// Refuses a kernel this CPU lacks and a format the kernels do not read.
inline void check(const Problem& p, const std::string& isa) {
  if (!cpu_has(isa)) throw std::invalid_argument("woq_linear: this CPU cannot run the '" + isa + "' kernel");
  // groups: 32, 64, 128 (both widths), or K (8-bit, per output channel). The int8-activation kernels
  // rely on a group being a multiple of 32 (one scale per activation block) unless it is K.
  const bool grouped = p.group == 32 || p.group == 64 || p.group == 128;
  if ((p.bits != 8 && p.bits != 4) || p.group <= 0 || p.K % p.group || (p.bits == 4 && !grouped) ||
      (p.bits == 8 && ((!grouped && p.group != p.K) || p.zeros)))
    throw std::invalid_argument("woq_linear: unsupported bits / group_size / zeros combination");
}

// Rows per block of the fp32-activation GEMV (see rows_avx512).
constexpr int64_t kRowBlock = 4;

// Block `blk` (rows blk * kRowBlock ..) of the fp32-activation GEMV with the kernel of level
// `which` (fp32_level): grouped INT8 first, then the ISA's row kernels, a short last block row by
// row. The one dispatch both the OpenMP loop below and the decode pool (woq_pool.h) run.
inline void row_block(const Problem& p, int64_t blk, int which) {
  constexpr int64_t R = kRowBlock;
  const int64_t n0 = blk * R;
  if (n0 + R <= p.N && rows8_grouped<R>(p, n0, which)) {
    // grouped INT8 (above)
  } else if (n0 + R <= p.N && which == 2) {
    rows_avx512<R>(p, n0);
  } else if (n0 + R <= p.N && which == 1) {
    rows_avx2<R>(p, n0);
  } else {
    for (int64_t n = n0; n < std::min(n0 + R, p.N); ++n) {
      if (rows8_grouped<1>(p, n, which))
        continue;
      if (which == 2)
        rows_avx512<1>(p, n);
      else if (which == 1)
        rows_avx2<1>(p, n);
      else
        row_scalar(p, n);
    }
  }
}

// Runs the problem with `isa`'s kernel on `nthreads` threads (0: OpenMP's default).
inline void linear(const Problem& p, const std::string& isa, int nthreads) {
  check(p, isa);
  const int threads = nthreads > 0 ? nthreads : omp_get_max_threads();
  const int which = fp32_level(isa);
  const int64_t blocks = (p.N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) row_block(p, blk, which);
}

}  // namespace gml_woq

#pragma GCC diagnostic pop
