// GML engine: the attention of one decode position over gml.llm's KV cache (attention_row), split out of
// decode.h (the rest of a decode step's glue). The math, SDPA's for one query row:
//     out[h] = sum_{j in [lo, pos]} softmax_j(scale * q[h] . K[j]) V[j]        (fp32, bf16 or fp16 cache)
// per query head h of KV head h / (heads / kv) (GQA / MQA read the shared rows in place); lo > 0 is a
// sliding window (the keys before it are masked).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "avx2_math.h"  // exp, horizontal sums
#include "woq_pool.h"  // the decode pool that attention_row splits its items over

#define GML_DECODE_AVX2 __attribute__((target("avx2,fma")))

namespace gml_decode {

// ---------------------------------------------------------------- attention of one position
// Flash-decoding over the cache. The S = pos + 1 - lo attended positions of each KV head are cut into
// items of kItem positions (the last one shorter); an item is one unit of work for a thread (the decode
// pool of woq_pool.h: the caller claims items, helpers take what is left when they get to run). For
// an item [j0, j1) and each of the G query heads that share its KV head, the item computes
//   s[j] = scale * q . K[j],   m = max_j s[j],   l = sum_j exp(s[j] - m),   a = sum_j exp(s[j] - m) V[j]
// reading each K row once for all G heads (in sub-groups of up to 8) and each V row once. The merge
// (caller, after all items): M = max_c m_c,  out = sum_c exp(m_c - M) a_c / sum_c exp(m_c - M) l_c —
// the softmax over all S positions, exactly regrouped. Items have a fixed length, so the result does
// not depend on the thread count (bit for bit). Within an item the values are weighted in blocks of
// kBlock positions (that block of V stays in L1 while every 8- or 16-float slice of the outputs is summed).
//
// Three tiers of the same loops (AttnTier, chosen by the caller from GML's CPU description): AVX-512F
// (16 lanes; head sizes that are multiples of 16), AVX2 + FMA + F16C (8 lanes), scalar. They differ
// only in the order of the fp32 sums.
//
// The cache stores K and V as fp32, bf16 or fp16 (KvType): 16-bit entries are widened to fp32 as they
// are loaded (bf16: a 16-bit shift; fp16: F16C's vcvtph2ps), so every sum is fp32 and the 16-bit cache
// halves the bytes a step reads. The new k / v are rounded to the cache type when written (nearest,
// ties to even: torch's .to(bfloat16) / .to(float16), so prefill's torch writes and these agree).

enum KvType : int { kKvF32 = 0, kKvBF16 = 1, kKvF16 = 2 };
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(f16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16, e = (x.bits >> 10) & 0x1fu, m = x.bits & 0x3ffu;
  uint32_t u;
  if (e == 0) {  // zero or subnormal: m * 2^-24
    const float f = std::ldexp(static_cast<float>(m), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
T from_f32(float f);
template <>
inline float from_f32<float>(float f) {
  return f;
}
template <>
inline bf16_t from_f32<bf16_t>(float f) {  // nearest, ties to even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
template <>
inline f16_t from_f32<f16_t>(float f) {  // nearest, ties to even; beyond 65504 (after rounding): inf
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (ax >= 0x47800000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // >= 2^16 (and inf): inf
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal (or zero), m = round(|f| * 2^24) (exact scaling)
    float a;
    std::memcpy(&a, &ax, 4);
    return {static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)))};
  }
  // rebias the exponent (127 -> 15) and round 23 mantissa bits to 10; a carry moves into the exponent
  // (65520 and up become inf, as they should)
  const uint32_t r = ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u);
  return {static_cast<uint16_t>(sign | (r >> 13))};
}

#define GML_DECODE_F16C __attribute__((target("avx2,fma,f16c")))

// 8 cache entries as fp32.
GML_DECODE_F16C inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
GML_DECODE_F16C inline __m256 load8(const bf16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
GML_DECODE_F16C inline __m256 load8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

#define GML_DECODE_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// 16 cache entries as fp32.
GML_DECODE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
GML_DECODE_AVX512 inline __m512 load16(const bf16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
GML_DECODE_AVX512 inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

constexpr int64_t kItem = 128;  // positions per work item (one thread's share is whole items)
constexpr int64_t kBlock = 32;  // positions per block of the weighted values (that V block stays in L1)
constexpr int kSub = 8;         // query heads whose scores / outputs are in registers at once
// The loops over the NH heads carry `#pragma GCC unroll 8`: without it GCC kept the NH accumulators of
// scores_avx2 / pv_avx2 in a stack array (a load and a store around every FMA) and a TinyLlama-shaped
// layer's attention over 2,048 positions took 1.87 ms on one thread.

// Software prefetch (measured, TinyLlama-shaped layer over 2,048 fp16 positions with the cache cold as in
// a model, one thread, AVX-512: 0.43-0.45 -> 0.30-0.32 ms): while scoring key j, the K row kPrefetch
// keys ahead and V row j (the values this item weights next) are requested.
constexpr int64_t kPrefetch = 16;
template <class T>
inline void prefetch_rows(const T* k_row, const T* v_row, int64_t d) {
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(k_row + kPrefetch * d) + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v_row) + b, _MM_HINT_T0);
  }
}

// The scores of one key are a row s[j * NH, (j + 1) * NH): the NH heads side by side, so a key's scores
// are one vector store and the softmax runs down the columns with no horizontal step (exp_rows_avx2).

// row[h] = scale * (the 8 lanes of a[h] summed), h < NH.
template <int NH>
GML_DECODE_AVX2 __attribute__((always_inline)) inline void store_sums(const __m256* a, float scale, float* row) {
  if constexpr (NH == 8) {  // the 8 sums at once: a transposing tree of hadds, not 8 horizontal sums
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 t = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(row, _mm256_mul_ps(t, _mm256_set1_ps(scale)));
  } else if constexpr (NH == 4) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    _mm_storeu_ps(row, _mm_mul_ps(t, _mm_set1_ps(scale)));
  } else {
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) row[h] = scale * gml_avx2::hsum(a[h]);
  }
}

// s[j * NH + h] = scale * q[h] . K[j] for NH heads (q[h] = q + h * d), j < n: each K row loaded once.
template <int NH, class T>
GML_DECODE_F16C void scores_avx2(const float* q, const T* K, const T* V, int64_t n, int64_t d, float scale, float* s) {
  const int64_t dv = d / 8 * 8;
  for (int64_t j = 0; j < n; ++j) {
    const T* k = K + j * d;
    prefetch_rows(k, V + j * d, d);
    __m256 a[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) a[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dv; i += 8) {
      const __m256 kv = load8(k + i);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), kv, a[h]);
    }
    float* row = s + j * NH;
    if (dv == d) {
      store_sums<NH>(a, scale, row);
    } else {  // a head size not a multiple of 8: the last dims added before the scale
      store_sums<NH>(a, 1.f, row);
      for (int h = 0; h < NH; ++h) {
        float t = row[h];
        for (int64_t i = dv; i < d; ++i) t += q[h * d + i] * to_f32(k[i]);
        row[h] = scale * t;
      }
    }
  }
  _mm256_zeroupper();
}

// The AVX-512 twins of scores_avx2 / pv_avx2 for d a multiple of 16: the same loops on 16 lanes, half
// the FMAs and loads per key (each 16-lane sum is folded to 8 lanes, then summed as above).
template <int NH, class T>
GML_DECODE_AVX512 void scores_avx512(const float* q, const T* K, const T* V, int64_t n, int64_t d, float scale,
                                     float* s) {
  for (int64_t j = 0; j < n; ++j) {
    const T* k = K + j * d;
    prefetch_rows(k, V + j * d, d);
    __m512 a[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) a[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 kv = load16(k + i);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) a[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * d + i), kv, a[h]);
    }
    __m256 a8[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h)
      a8[h] = _mm256_add_ps(_mm512_castps512_ps256(a[h]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[h]), 1)));
    store_sums<NH>(a8, scale, s + j * NH);
  }
  _mm256_zeroupper();
}

// The first NH floats of r (lanes: the mask of those lanes).
template <int NH>
GML_DECODE_AVX2 __attribute__((always_inline)) inline __m256 load_row(const float* r, __m256i lanes) {
  if constexpr (NH == 8) return _mm256_loadu_ps(r);
  return _mm256_maskload_ps(r, lanes);
}

// Per head h < NH (a column of the rows p[j * NH + h], j < n): p = exp(p - max) in place, and
// ml[h * stride] = max, ml[h * stride + 1] = sum. The NH columns are the lanes of one vector.
template <int NH>
GML_DECODE_AVX2 void exp_rows_avx2(float* p, int64_t n, float* ml, int64_t stride) {
  const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(NH), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; ++j) mv = _mm256_max_ps(mv, load_row<NH>(p + j * NH, lanes));
  __m256 sv = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 e = gml_avx2::exp_neg(_mm256_sub_ps(load_row<NH>(p + j * NH, lanes), mv));
    if constexpr (NH == 8)
      _mm256_storeu_ps(p + j * NH, e);
    else
      _mm256_maskstore_ps(p + j * NH, lanes, e);
    sv = _mm256_add_ps(sv, e);
  }
  float m[8], l[8];
  _mm256_storeu_ps(m, mv);
  _mm256_storeu_ps(l, sv);
  _mm256_zeroupper();
  for (int h = 0; h < NH; ++h) {
    ml[h * stride] = m[h];
    ml[h * stride + 1] = l[h];
  }
}

// a[h * lda + i] = sum_j p[j * NH + h] V[j][i] for NH heads: per block of kBlock positions, each 8-float
// slice of the NH outputs in registers while the block's V rows stream by (each V entry loaded once).
template <int NH, class T>
GML_DECODE_F16C void pv_avx2(const float* p, int64_t n, const T* V, int64_t d, float* a, int64_t lda) {
  const int64_t dv = d / 8 * 8;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    for (int64_t i = 0; i < dv; i += 8) {
      __m256 acc[NH];
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) acc[h] = b0 ? _mm256_loadu_ps(a + h * lda + i) : _mm256_setzero_ps();
      for (int64_t j = b0; j < b1; ++j) {
        const __m256 v = load8(V + j * d + i);
#pragma GCC unroll 8
        for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j * NH + h), v, acc[h]);
      }
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) _mm256_storeu_ps(a + h * lda + i, acc[h]);
    }
    for (int64_t i = dv; i < d; ++i)
      for (int h = 0; h < NH; ++h) {
        float t = b0 ? a[h * lda + i] : 0.f;
        for (int64_t j = b0; j < b1; ++j) t += p[j * NH + h] * to_f32(V[j * d + i]);
        a[h * lda + i] = t;
      }
  }
  _mm256_zeroupper();
}

template <int NH, class T>
GML_DECODE_AVX512 void pv_avx512(const float* p, int64_t n, const T* V, int64_t d, float* a, int64_t lda) {
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    for (int64_t i = 0; i < d; i += 16) {
      __m512 acc[NH];
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) acc[h] = b0 ? _mm512_loadu_ps(a + h * lda + i) : _mm512_setzero_ps();
      for (int64_t j = b0; j < b1; ++j) {
        const __m512 v = load16(V + j * d + i);
#pragma GCC unroll 8
        for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * NH + h]), v, acc[h]);
      }
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) _mm512_storeu_ps(a + h * lda + i, acc[h]);
    }
  }
  _mm256_zeroupper();
}

template <class T>
void scores_scalar(int nh, const float* q, const T* K, int64_t n, int64_t d, float scale, float* s) {
  for (int64_t j = 0; j < n; ++j)
    for (int h = 0; h < nh; ++h) {
      float t = 0.f;
      for (int64_t i = 0; i < d; ++i) t += q[h * d + i] * to_f32(K[j * d + i]);
      s[j * nh + h] = scale * t;
    }
}

inline void exp_rows_scalar(int nh, float* p, int64_t n, float* ml, int64_t stride) {
  for (int h = 0; h < nh; ++h) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j * nh + h]);
    for (int64_t j = 0; j < n; ++j) sum += p[j * nh + h] = std::exp(p[j * nh + h] - m);
    ml[h * stride] = m;
    ml[h * stride + 1] = sum;
  }
}

template <class T>
void pv_scalar(int nh, const float* p, int64_t n, const T* V, int64_t d, float* a, int64_t lda) {
  for (int h = 0; h < nh; ++h) std::fill(a + h * lda, a + h * lda + d, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int h = 0; h < nh; ++h)
      for (int64_t i = 0; i < d; ++i) a[h * lda + i] += p[j * nh + h] * to_f32(V[j * d + i]);
}

// NH (a compile-time count for the registers) from a run-time nh in [1, kSub].
template <class F>
void with_heads(int nh, F&& f) {
  switch (nh) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Denormals flushed to zero (MXCSR FTZ + DAZ) while it lives, the caller's mode restored after. Softmax
// weights of far-away keys are tiny (e^-80), and their products with the values fall below 2^-126:
// each such product or operand costs the CPU a microcode assist. Measured on Gemma-3-270M's real cache
// (one thread): 18 layers' attention 3.5 ms per step, 0.6 ms flushed. Only values below 1.2e-38 change.
// MXCSR is per thread: every item sets it on the thread that runs it.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// Which kernels an item runs (attention_row's tier).
enum AttnTier : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// One call's work: items [0, kv * per_head), item c of KV head g = c / per_head.
struct AttnJob {
  const float* q;  // the query heads, [heads * d]
  const void* kc;
  const void* vc;  // this layer's cache, [kv, max_len, d] of the cache type each
  int64_t max_len, d, group, lo, S, per_head;
  float scale;
  int tier;  // kScalar, kAvx2 or kAvx512 (AttnTier)
  float* part;  // per item and query head of its KV head: [m, l, a[d]]
};

template <class T>
void attention_item(const AttnJob& J, int64_t item) {
  const FlushDenormals flush;
  const int64_t g = item / J.per_head, j0 = (item % J.per_head) * kItem, n = std::min(kItem, J.S - j0), d = J.d;
  const T* K = static_cast<const T*>(J.kc) + (g * J.max_len + J.lo + j0) * d;
  const T* V = static_cast<const T*>(J.vc) + (g * J.max_len + J.lo + j0) * d;
  float s[kSub * kItem];
  for (int64_t h0 = 0; h0 < J.group; h0 += kSub) {
    const int nh = static_cast<int>(std::min<int64_t>(kSub, J.group - h0));
    const float* q = J.q + (g * J.group + h0) * d;
    float* part = J.part + (item * J.group + h0) * (d + 2);  // head h: part + h * (d + 2)
    if (J.tier == kAvx512) {
      with_heads(nh, [&](auto NH) { scores_avx512<decltype(NH)::value>(q, K, V, n, d, J.scale, s); });
      with_heads(nh, [&](auto NH) { exp_rows_avx2<decltype(NH)::value>(s, n, part, d + 2); });
      with_heads(nh, [&](auto NH) { pv_avx512<decltype(NH)::value>(s, n, V, d, part + 2, d + 2); });
    } else if (J.tier == kAvx2) {
      with_heads(nh, [&](auto NH) { scores_avx2<decltype(NH)::value>(q, K, V, n, d, J.scale, s); });
      with_heads(nh, [&](auto NH) { exp_rows_avx2<decltype(NH)::value>(s, n, part, d + 2); });
      with_heads(nh, [&](auto NH) { pv_avx2<decltype(NH)::value>(s, n, V, d, part + 2, d + 2); });
    } else {
      scores_scalar(nh, q, K, n, d, J.scale, s);
      exp_rows_scalar(nh, s, n, part, d + 2);
      pv_scalar(nh, s, n, V, d, part + 2, d + 2);
    }
  }
}

template <class T>
void write_kv(const float* kn, const float* vn, int64_t kv, int64_t d, void* kc, void* vc, int64_t max_len,
              int64_t pos) {
  if (std::is_same<T, f16_t>::value)  // fp16 would store inf (then NaN logits): refused, nothing written
    for (int64_t i = 0; i < 2 * kv * d; ++i)
      if (std::fabs(kn[i]) >= 65520.f)  // rounds to inf (kn and vn are one row: [k: kv * d | v: kv * d])
        throw std::overflow_error("decode attention: a key / value beyond fp16's range (65504) for an fp16 KV cache");
  for (int64_t g = 0; g < kv; ++g)
    for (int64_t i = 0; i < d; ++i) {
      static_cast<T*>(kc)[(g * max_len + pos) * d + i] = from_f32<T>(kn[g * d + i]);
      static_cast<T*>(vc)[(g * max_len + pos) * d + i] = from_f32<T>(vn[g * d + i]);
    }
}

// qkv: the fused QKV row [q: heads * d | k: kv * d | v: kv * d] after RoPE; kc / vc: this layer's cache
// [kv, max_len, d] of type kv_type (batch 1); positions [lo, pos] attended, pos written first; out
// [heads * d]. tier (AttnTier, the caller's from GML's CPU description): kAvx512 (AVX-512F; used when d is a
// multiple of 16, else AVX2), kAvx2 (AVX2 + FMA + F16C) or kScalar; lowered here when this CPU lacks one
// description); nthreads > 1: items over the decode pool (woq_pool.h).
inline void attention_row(const float* qkv, int64_t heads, int64_t kv, int64_t d, void* kc, void* vc, int64_t max_len,
                          int64_t lo, int64_t pos, float scale, int kv_type, int tier, int nthreads, float* out) {
  if (heads <= 0 || kv <= 0 || heads % kv || d <= 0 || pos < 0 || pos >= max_len || lo < 0 || lo > pos)
    throw std::invalid_argument("decode attention: heads a multiple of kv heads, 0 <= lo <= pos < max_length");
  if (kv_type != kKvF32 && kv_type != kKvBF16 && kv_type != kKvF16)
    throw std::invalid_argument("decode attention: kv_type is 0 (fp32), 1 (bf16) or 2 (fp16)");
  const float* kn = qkv + heads * d;
  const float* vn = kn + kv * d;
  if (tier < kScalar || tier > kAvx512) throw std::invalid_argument("decode attention: tier is 0, 1 or 2");
  if (tier == kAvx512 && (d % 16 || !__builtin_cpu_supports("avx512f"))) tier = kAvx2;
  if (tier == kAvx2 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c")))
    tier = kScalar;  // (bf16 / fp32 caches need no F16C, but no AVX2 CPU lacks it)
  using Item = void (*)(const AttnJob&, int64_t);
  Item item;
  if (kv_type == kKvF32) {
    write_kv<float>(kn, vn, kv, d, kc, vc, max_len, pos);
    item = attention_item<float>;
  } else if (kv_type == kKvBF16) {
    write_kv<bf16_t>(kn, vn, kv, d, kc, vc, max_len, pos);
    item = attention_item<bf16_t>;
  } else {
    write_kv<f16_t>(kn, vn, kv, d, kc, vc, max_len, pos);
    item = attention_item<f16_t>;
  }
  const int64_t S = pos + 1 - lo, group = heads / kv, per_head = (S + kItem - 1) / kItem, items = kv * per_head;
  std::vector<float> part(static_cast<size_t>(items * group * (d + 2)));
  const AttnJob job{qkv, kc, vc, max_len, d, group, lo, S, per_head, scale, tier, part.data()};
  if (nthreads <= 1 || items < 2) {
    for (int64_t c = 0; c < items; ++c) item(job, c);
  } else {
    gml_woq::HelperPool::get().run(items, nthreads - 1, [&](int64_t c) { item(job, c); });
  }
  // the merge: per query head, the items' partial softmaxes rescaled to the largest maximum
  const FlushDenormals flush;
  for (int64_t g = 0; g < kv; ++g)
    for (int64_t h = 0; h < group; ++h) {
      float M = -INFINITY;
      for (int64_t c = 0; c < per_head; ++c) M = std::max(M, part[((g * per_head + c) * group + h) * (d + 2)]);
      float* o = out + (g * group + h) * d;
      std::fill(o, o + d, 0.f);
      float L = 0.f;
      for (int64_t c = 0; c < per_head; ++c) {
        const float* p = part.data() + ((g * per_head + c) * group + h) * (d + 2);
        const float w = std::exp(p[0] - M);
        L += w * p[1];
        for (int64_t i = 0; i < d; ++i) o[i] += w * p[2 + i];
      }
      const float inv = 1.f / L;
      for (int64_t i = 0; i < d; ++i) o[i] *= inv;
    }
}

}  // namespace gml_decode
