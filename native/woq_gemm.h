// GML engine: torch.ops.gml.woq_linear for many rows (prefill) as fp32 GEMMs over dequantized tiles.
//
// The GEMV kernels of woq.h expand every weight in registers once per row of x: fine for decode
// (M = 1, memory bound), but a prompt of M rows pays the expansion M times and never reaches a
// GEMM's arithmetic intensity. Here the weight is dequantized in tiles of kTileRows output rows,
//
//   Wt[r, k] = float(q[n0 + r, k] - z[n0 + r, g]) * s[n0 + r, g]        (one fp32 multiply: the
//                                                                          reference's exact value)
//
// into a buffer owned by the thread (kTileRows x K fp32: 1 MiB for K = 2048, within L2 on recent Xeons), and oneDNN's fp32
// GEMM (dnnl_sgemm, row major) writes y[:, n0 : n0 + kTileRows] = x Wt^T in place (ldc = N), then the
// bias is added. Tiles are split across OpenMP threads; inside the parallel region dnnl_sgemm runs on
// the calling thread. Each weight is expanded once per call, whatever M. The result differs from the
// Python reference (dequantize + F.linear) only in the GEMM's summation order.
//
// The dequantization reuses woq.h's formats and unpacking (low nibble first; q - z in int32, exact);
// `isa` is the caller's choice as for woq.h's kernels ("avx512" | "avx2" | "scalar", or a VNNI tier,
// which dequantizes as its fp32 ISA does).
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "oneapi/dnnl/dnnl.h"
#include "woq.h"

namespace gml_woq {

constexpr int64_t kTileRows = 128;  // rows per tile: 128 x 2048 fp32 = 1 MiB (measured best of 64..256)

// Row n of the weight, k in [0, K), as fp32 into out[0, K).
inline void dequantize_row_scalar(const Problem& p, int64_t n, float* out) {
  const int64_t G = p.K / p.group;
  for (int64_t k = 0; k < p.K; ++k) out[k] = static_cast<float>(weight_int(p, n, k)) * p.scales[n * G + k / p.group];
}

GML_WOQ_AVX512 inline void dequantize_row_avx512(const Problem& p, int64_t n, float* out) {
  const int64_t G = p.K / p.group;
  if (p.bits == 8) {  // per group (group = K: one), a 16-lane tail only when group = K
    const int8_t* q = static_cast<const int8_t*>(p.q) + n * p.K;
    for (int64_t g = 0; g < G; ++g) {
      const float sg = p.scales[n * G + g];
      const __m512 s = _mm512_set1_ps(sg);
      const int64_t k1 = (g + 1) * p.group;
      int64_t k = g * p.group;
      for (; k + 16 <= k1; k += 16) _mm512_storeu_ps(out + k, _mm512_mul_ps(int8x16_ps(q + k), s));
      for (; k < k1; ++k) out[k] = static_cast<float>(q[k]) * sg;
    }
    _mm256_zeroupper();  // GCC does not insert it in target("avx...") functions: SSE code follows
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * (p.K / 2);
  for (int64_t g = 0; g < G; ++g) {
    const __m512i z = _mm512_set1_epi32(p.zeros ? p.zeros[n * G + g] : 8);
    const __m512 s = _mm512_set1_ps(p.scales[n * G + g]);
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 32) {  // groups are multiples of 32
      __m128i v0, v1;  // weights k..k+15, k+16..k+31
      unpack_int4x32(q + k / 2, v0, v1);
      _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v0), z)), s));
      _mm512_storeu_ps(out + k + 16,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(v1), z)), s));
    }
  }
  _mm256_zeroupper();
}

GML_WOQ_AVX2 inline void dequantize_row_avx2(const Problem& p, int64_t n, float* out) {
  const int64_t G = p.K / p.group;
  if (p.bits == 8) {  // per group (group = K: one), an 8-lane tail only when group = K
    const int8_t* q = static_cast<const int8_t*>(p.q) + n * p.K;
    for (int64_t g = 0; g < G; ++g) {
      const float sg = p.scales[n * G + g];
      const __m256 s = _mm256_set1_ps(sg);
      const int64_t k1 = (g + 1) * p.group;
      int64_t k = g * p.group;
      for (; k + 8 <= k1; k += 8) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s));
      }
      for (; k < k1; ++k) out[k] = static_cast<float>(q[k]) * sg;
    }
    _mm256_zeroupper();  // GCC does not insert it in target("avx...") functions: SSE code follows
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * (p.K / 2);
  for (int64_t g = 0; g < G; ++g) {
    const __m256i z = _mm256_set1_epi32(p.zeros ? p.zeros[n * G + g] : 8);
    const __m256 s = _mm256_set1_ps(p.scales[n * G + g]);
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 32) {
      __m128i v0, v1;  // weights k..k+15, k+16..k+31
      unpack_int4x32(q + k / 2, v0, v1);
      _mm256_storeu_ps(out + k, _mm256_mul_ps(u8x8_minus_ps(v0, z), s));
      _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(u8x8_minus_ps(_mm_srli_si128(v0, 8), z), s));
      _mm256_storeu_ps(out + k + 16, _mm256_mul_ps(u8x8_minus_ps(v1, z), s));
      _mm256_storeu_ps(out + k + 24, _mm256_mul_ps(u8x8_minus_ps(_mm_srli_si128(v1, 8), z), s));
    }
  }
  _mm256_zeroupper();
}

// Rows [n0, n1) of the weight into out ([n1 - n0, K] fp32).
inline void dequantize_rows(const Problem& p, int64_t n0, int64_t n1, float* out, int level) {
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * p.K;
    if (level == 2)
      dequantize_row_avx512(p, n, o);
    else if (level == 1)
      dequantize_row_avx2(p, n, o);
    else
      dequantize_row_scalar(p, n, o);
  }
}

struct FreeDeleter {
  void operator()(float* f) const { std::free(f); }
};

// y = x W^T + b for all M rows, the weight dequantized tile by tile (see the file comment).
inline void gemm(const Problem& p, const std::string& isa, int nthreads) {
  check(p, isa);
  const int level = fp32_level(isa);
  const int threads = nthreads > 0 ? nthreads : omp_get_max_threads();
  const int64_t tiles = (p.N + kTileRows - 1) / kTileRows;
  const size_t buf_bytes = static_cast<size_t>(kTileRows * p.K) * sizeof(float);
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    std::unique_ptr<float, FreeDeleter> buf(static_cast<float*>(std::aligned_alloc(64, (buf_bytes + 63) / 64 * 64)));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; ++t) {
      if (!buf) continue;
      const int64_t n0 = t * kTileRows, n1 = std::min(n0 + kTileRows, p.N);
      dequantize_rows(p, n0, n1, buf.get(), level);
      // y[:, n0:n1] (row stride N) = x [M, K] . buf[n1 - n0, K]^T
      if (dnnl_sgemm('N', 'T', p.M, n1 - n0, p.K, 1.f, p.x, p.K, buf.get(), p.K, 0.f, p.y + n0, p.N) != dnnl_success) {
#pragma omp atomic write
        failed = true;
      }
      if (p.bias)
        for (int64_t m = 0; m < p.M; ++m)
          for (int64_t n = n0; n < n1; ++n) p.y[m * p.N + n] += p.bias[n];
    }
    if (!buf) {
#pragma omp atomic write
      failed = true;
    }
  }
  if (failed) throw std::runtime_error("woq_linear: dequantized GEMM failed (out of memory or dnnl_sgemm error)");
}

}  // namespace gml_woq
