// GML engine: the glue of a batch-1 decode step of gml.llm (src/gml/llm/decode.py) — everything between
// the matrix calls that works on one row of a few hundred to a few thousand floats: norms, the residual
// add fused with the next norm, and the q/k norm + RoPE of the fused QKV row. Each torch op on such a
// row costs more in dispatch (a few µs) than in arithmetic (well under one); one call here replaces
// 5-20 of them. Single-threaded (no OpenMP region: a row is far too small to split), except attention,
// whose positions are split over the decode pool on long contexts (below).
//
// The math is gml.llm.model's (HF's):
//   rms norm:   y = x * rsqrt(mean(x^2) + eps) * w            (Gemma's (1 + w): w is given as 1 + w)
//   layer norm: y = (x - mean(x)) * rsqrt(var(x) + eps) * w + b   (biased variance, as F.layer_norm)
//   RoPE (first r of d dims, HF's rotate_half): for i < r/2, with c = cos[i], s = sin[i] (cos/sin are
//   [r] with both halves equal, as HF's tables):
//     y[i] = x[i] * cos[i] - x[i + r/2] * sin[i],   y[i + r/2] = x[i + r/2] * cos[i + r/2] + x[i] * sin[i + r/2]
//   attention of the new position (attention_row): the new k / v rows written into the cache at `pos`,
//   then per query head h (of KV head h / (heads / kv): GQA / MQA read the shared rows in place)
//     out[h] = sum_{j in [lo, pos]} softmax_j(scale * q[h] . K[j]) V[j]        (fp32, bf16 or fp16 cache)
//   — SDPA's math for one query row; lo > 0 is a sliding window (the keys before it are masked).
// Sums of squares / means accumulate in double, so these differ from torch's float reductions only in
// fp32 rounding. -ffp-contract=off (CMakeLists.txt): the RoPE products round as torch's do.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "woq_pool.h"  // the decode pool that attention_row splits its items over

#define GML_DECODE_AVX2 __attribute__((target("avx2,fma")))

namespace gml_decode {

enum NormKind : int { kRms = 0, kLayer = 1 };

// y[0, n) = norm(x) (y may be x). w null: no weight (1); b: layer norm's bias or null.
inline void norm_row(const float* x, int64_t n, const float* w, const float* b, int kind, float eps, float* y) {
  if (kind == kRms) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float r = 1.f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int64_t i = 0; i < n; ++i) y[i] = w ? (x[i] * r) * w[i] : x[i] * r;
  } else if (kind == kLayer) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += x[i];
    const double mean = s / n;
    double v = 0.0;
    for (int64_t i = 0; i < n; ++i) v += (x[i] - mean) * (x[i] - mean);
    const float r = 1.f / std::sqrt(static_cast<float>(v / n) + eps);
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) {
      const float t = (x[i] - m) * r;
      y[i] = (w ? t * w[i] : t) + (b ? b[i] : 0.f);
    }
  } else {
    throw std::invalid_argument("decode norm: kind is 0 (rms) or 1 (layer)");
  }
}

// h += (delta_norm ? norm(delta) (dw, db) : delta), then y = norm(h) (w, b). delta is overwritten by
// its norm (it is the output buffer of the matrix call before).
inline void residual_norm(float* h, float* delta, int64_t n, bool delta_norm, const float* dw, const float* db,
                          const float* w, const float* b, int kind, float eps, float* y) {
  if (delta_norm) norm_row(delta, n, dw, db, kind, eps, delta);
  for (int64_t i = 0; i < n; ++i) h[i] += delta[i];
  norm_row(h, n, w, b, kind, eps, y);
}

// The fused QKV row [q: heads * d | k: kv * d | v: kv * d], in place: q and k heads normed (qw / kw
// [d], null: no q/k norm) and rotated (r dims, 0: no RoPE; cos / sin [r] of this position).
inline void qk_norm_rope(float* qkv, int64_t heads, int64_t kv, int64_t d, const float* qw, const float* kw,
                         int kind, float eps, int64_t r, const float* cos, const float* sin) {
  if (r < 0 || r > d || r % 2) throw std::invalid_argument("decode rope: rotary dims must be even and <= head_dim");
  const int64_t half = r / 2;
  for (int64_t h = 0; h < heads + kv; ++h) {
    float* x = qkv + h * d;
    const float* nw = h < heads ? qw : kw;
    if (nw) norm_row(x, d, nw, nullptr, kind, eps, x);
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], c = x[i + half];
      x[i] = a * cos[i] - c * sin[i];
      x[i + half] = c * cos[i + half] + a * sin[i + half];
    }
  }
}

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
// kBlock positions (that block of V stays in L1 while every 8-float slice of the outputs is summed).
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

// exp(x) for x <= 0 (softmax after the max is subtracted; below -87 it is 0): Cephes' expf — x = n ln2
// + r, a degree-5 polynomial for e^r, n added to the exponent. Relative error ~1e-7 (std::exp: ~6e-8).
GML_DECODE_AVX2 inline __m256 exp_neg_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
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

GML_DECODE_AVX2 inline float hsum_avx2(__m256 t) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

constexpr int64_t kItem = 128;  // positions per work item (one thread's share is whole items)
constexpr int64_t kBlock = 32;  // positions per block of the weighted values (that V block stays in L1)
constexpr int kSub = 8;         // query heads whose scores / outputs are in registers at once
// The loops over the NH heads carry `#pragma GCC unroll 8`: without it GCC kept the NH accumulators of
// scores_avx2 / pv_avx2 in a stack array (a load and a store around every FMA) and a TinyLlama-shaped
// layer's attention over 2,048 positions took 1.87 ms on one thread.

// s[h * n + j] = scale * q[h] . K[j] for NH heads (q[h] = q + h * d), j < n: each K row loaded once.
template <int NH, class T>
GML_DECODE_F16C void scores_avx2(const float* q, const T* K, int64_t n, int64_t d, float scale, float* s) {
  const int64_t dv = d / 8 * 8;
  for (int64_t j = 0; j < n; ++j) {
    const T* k = K + j * d;
    __m256 a[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) a[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dv; i += 8) {
      const __m256 kv = load8(k + i);
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), kv, a[h]);
    }
    float t[NH];
    if constexpr (NH == 8) {  // the 8 sums at once: a transposing tree of hadds, not 8 horizontal sums
      const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      _mm256_storeu_ps(t, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
    } else if constexpr (NH == 4) {
      const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      _mm_storeu_ps(t, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
    } else {
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) t[h] = hsum_avx2(a[h]);
    }
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      for (int64_t i = dv; i < d; ++i) t[h] += q[h * d + i] * to_f32(k[i]);
      s[h * n + j] = scale * t[h];
    }
  }
  _mm256_zeroupper();
}

// p[j] = exp(p[j] - max) in place; returns (max, sum).
GML_DECODE_AVX2 inline void exp_avx2(float* p, int64_t n, float* m_out, float* l_out) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; j < n; ++j) m = std::max(m, p[j]);
  mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum_avx2(sv);
  for (; j < n; ++j) sum += p[j] = std::exp(p[j] - m);
  _mm256_zeroupper();
  *m_out = m;
  *l_out = sum;
}

// a[h * lda + i] = sum_j p[h * n + j] V[j][i] for NH heads: per block of kBlock positions, each 8-float
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
        for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * n + j), v, acc[h]);
      }
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) _mm256_storeu_ps(a + h * lda + i, acc[h]);
    }
    for (int64_t i = dv; i < d; ++i)
      for (int h = 0; h < NH; ++h) {
        float t = b0 ? a[h * lda + i] : 0.f;
        for (int64_t j = b0; j < b1; ++j) t += p[h * n + j] * to_f32(V[j * d + i]);
        a[h * lda + i] = t;
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
      s[h * n + j] = scale * t;
    }
}

inline void exp_scalar(float* p, int64_t n, float* m_out, float* l_out) {
  float m = -INFINITY, sum = 0.f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
  for (int64_t j = 0; j < n; ++j) sum += p[j] = std::exp(p[j] - m);
  *m_out = m;
  *l_out = sum;
}

template <class T>
void pv_scalar(int nh, const float* p, int64_t n, const T* V, int64_t d, float* a, int64_t lda) {
  for (int h = 0; h < nh; ++h) std::fill(a + h * lda, a + h * lda + d, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int h = 0; h < nh; ++h)
      for (int64_t i = 0; i < d; ++i) a[h * lda + i] += p[h * n + j] * to_f32(V[j * d + i]);
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

// One call's work: items [0, kv * per_head), item c of KV head g = c / per_head.
struct AttnJob {
  const float* q;  // the query heads, [heads * d]
  const void* kc;
  const void* vc;  // this layer's cache, [kv, max_len, d] of the cache type each
  int64_t max_len, d, group, lo, S, per_head;
  float scale;
  bool vector;
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
    if (J.vector) {
      with_heads(nh, [&](auto NH) { scores_avx2<decltype(NH)::value>(q, K, n, d, J.scale, s); });
      for (int h = 0; h < nh; ++h) exp_avx2(s + h * n, n, part + h * (d + 2), part + h * (d + 2) + 1);
      with_heads(nh, [&](auto NH) { pv_avx2<decltype(NH)::value>(s, n, V, d, part + 2, d + 2); });
    } else {
      scores_scalar(nh, q, K, n, d, J.scale, s);
      for (int h = 0; h < nh; ++h) exp_scalar(s + h * n, n, part + h * (d + 2), part + h * (d + 2) + 1);
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
// [heads * d]. vector: the AVX2 + FMA (+ F16C) code, else scalar (the caller's tier from GML's CPU
// description); nthreads > 1: items over the decode pool (woq_pool.h).
inline void attention_row(const float* qkv, int64_t heads, int64_t kv, int64_t d, void* kc, void* vc, int64_t max_len,
                          int64_t lo, int64_t pos, float scale, int kv_type, bool vector, int nthreads, float* out) {
  if (heads <= 0 || kv <= 0 || heads % kv || d <= 0 || pos < 0 || pos >= max_len || lo < 0 || lo > pos)
    throw std::invalid_argument("decode attention: heads a multiple of kv heads, 0 <= lo <= pos < max_length");
  if (kv_type != kKvF32 && kv_type != kKvBF16 && kv_type != kKvF16)
    throw std::invalid_argument("decode attention: kv_type is 0 (fp32), 1 (bf16) or 2 (fp16)");
  const float* kn = qkv + heads * d;
  const float* vn = kn + kv * d;
  if (kv_type == kKvF16 && !__builtin_cpu_supports("f16c")) vector = false;  // no vcvtph2ps: scalar widening
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
  const AttnJob job{qkv, kc, vc, max_len, d, group, lo, S, per_head, scale, vector, part.data()};
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
