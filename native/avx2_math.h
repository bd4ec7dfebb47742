// GML engine: the AVX2 + FMA vector math GML's own fp32 kernels share (the decode attention of
// decode_attention.h, the fused attention of attention_avx2.h): a softmax's exp, horizontal sums and
// maxima, and lane masks for a vector's tail.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define GML_AVX2_MATH __attribute__((target("avx2,fma")))

namespace gml_avx2 {

// exp(x) for x <= 0 (softmax after the max is subtracted; below -87 it is 0, -inf included): Cephes'
// expf — x = n ln2 + r, a degree-5 polynomial for e^r, n added to the exponent. Relative error ~1e-7
// (std::exp: ~6e-8). A NaN stays NaN (``max(lo, x)`` returns its second operand when one is NaN).
GML_AVX2_MATH inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

GML_AVX2_MATH inline float hsum(__m256 t) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

GML_AVX2_MATH inline float hmax(__m256 t) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// The lanes i < n of an 8-float vector (n clamped to 0..8), as vmaskmovps' mask.
GML_AVX2_MATH inline __m256i lanes_below(int64_t n) {
  const int k = static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

}  // namespace gml_avx2
