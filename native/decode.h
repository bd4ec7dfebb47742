// GML engine: the glue of a batch-1 decode step of gml.llm (src/gml/llm/decode.py) — everything between
// the matrix calls that works on one row of a few hundred to a few thousand floats: norms, the residual
// add fused with the next norm, and the q/k norm + RoPE of the fused QKV row. Each torch op on such a
// row costs more in dispatch (a few µs) than in arithmetic (well under one); one call here replaces
// 5-20 of them. Single-threaded (no OpenMP region: a row is far too small to split).
//
// The math is gml.llm.model's (HF's):
//   rms norm:   y = x * rsqrt(mean(x^2) + eps) * w            (Gemma's (1 + w): w is given as 1 + w)
//   layer norm: y = (x - mean(x)) * rsqrt(var(x) + eps) * w + b   (biased variance, as F.layer_norm)
//   RoPE (first r of d dims, HF's rotate_half): for i < r/2, with c = cos[i], s = sin[i] (cos/sin are
//   [r] with both halves equal, as HF's tables):
//     y[i] = x[i] * cos[i] - x[i + r/2] * sin[i],   y[i + r/2] = x[i + r/2] * cos[i + r/2] + x[i] * sin[i + r/2]
//   attention of the new position (attention_row): the new k / v rows written into the cache at `pos`,
//   then per query head h (of KV head h / (heads / kv): GQA / MQA read the shared rows in place)
//     out[h] = sum_{j in [lo, pos]} softmax_j(scale * q[h] . K[j]) V[j]        (fp32 cache)
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
#include <vector>

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
// Three passes per query head over its S keys: scores p[j] = scale * q . K[j]; softmax in place
// (max subtracted, exp, sum); out = sum_j p[j] V[j] / sum. AVX2 + FMA (`vector`, the caller's tier from
// GML's CPU description) runs up to 4 heads of one KV head together; scalar one head at a time.

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

// NH query heads that share a KV head at once (GQA / MQA), so each K and V row is read once for all of
// them. Scores: p[h][j] = scale * q[h] . K[j]; returns nothing, maxima into m[h].
template <int NH>
GML_DECODE_AVX2 void scores_avx2(const float* const* q, const float* K, int64_t S, int64_t d, float scale,
                                 float* const* p, float* m) {
  const int64_t dv = d / 8 * 8;
  for (int h = 0; h < NH; ++h) m[h] = -INFINITY;
  for (int64_t j = 0; j < S; ++j) {
    const float* k = K + j * d;
    __m256 a[NH];
    for (int h = 0; h < NH; ++h) a[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dv; i += 8) {
      const __m256 kv = _mm256_loadu_ps(k + i);
      for (int h = 0; h < NH; ++h) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), kv, a[h]);
    }
    for (int h = 0; h < NH; ++h) {
      float t = hsum_avx2(a[h]);
      for (int64_t i = dv; i < d; ++i) t += q[h][i] * k[i];
      m[h] = std::max(m[h], p[h][j] = scale * t);
    }
  }
  _mm256_zeroupper();
}

// p[j] = exp(p[j] - m) / sum over j (the weights of the values).
GML_DECODE_AVX2 inline void softmax_avx2(float* p, int64_t S, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= S; j += 8) {
    const __m256 e = exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum_avx2(sv);
  for (; j < S; ++j) sum += p[j] = std::exp(p[j] - m);
  const float inv = 1.f / sum;
  for (j = 0; j < S; ++j) p[j] *= inv;
  _mm256_zeroupper();
}

// o[h] = sum_j p[h][j] V[j] for NH heads: 16 outputs of each head in registers over all keys.
template <int NH>
GML_DECODE_AVX2 void pv_avx2(const float* const* p, const float* V, int64_t S, int64_t d, float* const* o) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m256 a[NH][2];
    for (int h = 0; h < NH; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < S; ++j) {
      const __m256 v0 = _mm256_loadu_ps(V + j * d + i), v1 = _mm256_loadu_ps(V + j * d + i + 8);
      for (int h = 0; h < NH; ++h) {
        const __m256 w = _mm256_broadcast_ss(p[h] + j);
        a[h][0] = _mm256_fmadd_ps(w, v0, a[h][0]);
        a[h][1] = _mm256_fmadd_ps(w, v1, a[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(o[h] + i, a[h][0]), _mm256_storeu_ps(o[h] + i + 8, a[h][1]);
  }
  for (; i < d; ++i)
    for (int h = 0; h < NH; ++h) {
      float t = 0.f;
      for (int64_t j = 0; j < S; ++j) t += p[h][j] * V[j * d + i];
      o[h][i] = t;
    }
  _mm256_zeroupper();
}

template <int NH>
void heads_avx2(const float* const* q, const float* K, const float* V, int64_t S, int64_t d, float scale,
                float* const* p, float* const* o) {
  float m[NH];
  scores_avx2<NH>(q, K, S, d, scale, p, m);
  for (int h = 0; h < NH; ++h) softmax_avx2(p[h], S, m[h]);
  pv_avx2<NH>(p, V, S, d, o);
}

inline float scores_scalar(const float* q, const float* K, int64_t S, int64_t d, float scale, float* p) {
  float m = -INFINITY;
  for (int64_t j = 0; j < S; ++j) {
    float t = 0.f;
    for (int64_t i = 0; i < d; ++i) t += q[i] * K[j * d + i];
    m = std::max(m, p[j] = scale * t);
  }
  return m;
}

inline float softmax_scalar(float* p, int64_t S, float m) {
  float sum = 0.f;
  for (int64_t j = 0; j < S; ++j) sum += p[j] = std::exp(p[j] - m);
  return sum;
}

inline void pv_scalar(const float* p, const float* V, int64_t S, int64_t d, float inv, float* o) {
  std::fill(o, o + d, 0.f);
  for (int64_t j = 0; j < S; ++j)
    for (int64_t i = 0; i < d; ++i) o[i] += (p[j] * inv) * V[j * d + i];
}

// Denormals flushed to zero (MXCSR FTZ + DAZ) while it lives, the caller's mode restored after. Softmax
// weights of far-away keys are tiny (e^-80), and their products with the values fall below 2^-126:
// each such product or operand costs the CPU a microcode assist. Measured on Gemma-3-270M's real cache
// (one thread): 18 layers' attention 3.5 ms per step, 0.6 ms flushed. Only values below 1.2e-38 change.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// qkv: the fused QKV row [q: heads * d | k: kv * d | v: kv * d] after RoPE; kc / vc: this layer's cache
// [kv, max_len, d] (batch 1, fp32); positions [lo, pos] attended, pos written first; out [heads * d].
inline void attention_row(const float* qkv, int64_t heads, int64_t kv, int64_t d, float* kc, float* vc,
                          int64_t max_len, int64_t lo, int64_t pos, float scale, bool vector, float* out) {
  if (heads <= 0 || kv <= 0 || heads % kv || d <= 0 || pos < 0 || pos >= max_len || lo < 0 || lo > pos)
    throw std::invalid_argument("decode attention: heads a multiple of kv heads, 0 <= lo <= pos < max_length");
  const float* kn = qkv + heads * d;
  const float* vn = kn + kv * d;
  for (int64_t g = 0; g < kv; ++g) {
    std::memcpy(kc + (g * max_len + pos) * d, kn + g * d, sizeof(float) * d);
    std::memcpy(vc + (g * max_len + pos) * d, vn + g * d, sizeof(float) * d);
  }
  const FlushDenormals flush;
  const int64_t S = pos + 1 - lo, group = heads / kv;
  std::vector<float> scores(static_cast<size_t>(S * heads));
  for (int64_t h0 = 0; h0 < heads;) {  // up to 4 heads of one KV head at a time
    const int64_t g = h0 / group, nh = std::min<int64_t>(4, (g + 1) * group - h0);
    const float* K = kc + (g * max_len + lo) * d;
    const float* V = vc + (g * max_len + lo) * d;
    const float* q[4];
    float* p[4];
    float* o[4];
    for (int64_t h = 0; h < nh; ++h) q[h] = qkv + (h0 + h) * d, p[h] = scores.data() + (h0 + h) * S, o[h] = out + (h0 + h) * d;
    if (!vector) {
      for (int64_t h = 0; h < nh; ++h) {
        const float m = scores_scalar(q[h], K, S, d, scale, p[h]);
        pv_scalar(p[h], V, S, d, 1.f / softmax_scalar(p[h], S, m), o[h]);
      }
    } else if (nh == 4) {
      heads_avx2<4>(q, K, V, S, d, scale, p, o);
    } else if (nh == 3) {
      heads_avx2<3>(q, K, V, S, d, scale, p, o);
    } else if (nh == 2) {
      heads_avx2<2>(q, K, V, S, d, scale, p, o);
    } else {
      heads_avx2<1>(q, K, V, S, d, scale, p, o);
    }
    h0 += nh;
  }
}

}  // namespace gml_decode
