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
// Dot products and y += a * x over a head's d floats: AVX2 + FMA (8 lanes, 4 chains) or scalar. `vector`
// is the caller's tier (GML's CPU description, chosen at the API boundary).
GML_DECODE_AVX2 inline float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int c = 0; c < 4; ++c) s[c] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * c), _mm256_loadu_ps(b + i + 8 * c), s[c]);
  for (; i + 8 <= n; i += 8) s[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s[0]);
  const __m256 t = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; i < n; ++i) r += a[i] * b[i];
  _mm256_zeroupper();
  return r;
}

GML_DECODE_AVX2 inline void axpy_avx2(float alpha, const float* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
  _mm256_zeroupper();
}

inline float dot(const float* a, const float* b, int64_t n, bool vector) {
  if (vector) return dot_avx2(a, b, n);
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n, bool vector) {
  if (vector) return axpy_avx2(alpha, x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

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
  const int64_t S = pos + 1 - lo, group = heads / kv;
  std::vector<float> p(static_cast<size_t>(S));
  for (int64_t h = 0; h < heads; ++h) {
    const float* q = qkv + h * d;
    const float* K = kc + ((h / group) * max_len + lo) * d;
    const float* V = vc + ((h / group) * max_len + lo) * d;
    float m = -INFINITY;
    for (int64_t j = 0; j < S; ++j) m = std::max(m, p[j] = scale * dot(q, K + j * d, d, vector));
    float sum = 0.f;
    for (int64_t j = 0; j < S; ++j) sum += p[j] = std::exp(p[j] - m);
    float* o = out + h * d;
    std::fill(o, o + d, 0.f);
    for (int64_t j = 0; j < S; ++j) axpy(p[j] / sum, V + j * d, o, d, vector);
  }
}

}  // namespace gml_decode
