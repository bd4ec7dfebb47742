// GML engine: the glue of a batch-1 decode step of gml.llm (src/gml/llm/decode.py) — everything between
// the matrix calls that works on one row of a few hundred to a few thousand floats: norms, the residual
// add fused with the next norm, and the q/k norm + RoPE of the fused QKV row. Each torch op on such a
// row costs more in dispatch (a few µs) than in arithmetic (well under one); one call here replaces
// 5-20 of them. Single-threaded (no OpenMP region: a row is far too small to split). The attention over
// the KV cache is decode_attention.h.
//
// The math is gml.llm.model's (HF's):
//   rms norm:   y = x * rsqrt(mean(x^2) + eps) * w            (Gemma's (1 + w): w is given as 1 + w)
//   layer norm: y = (x - mean(x)) * rsqrt(var(x) + eps) * w + b   (biased variance, as F.layer_norm)
//   RoPE (first r of d dims, HF's rotate_half): for i < r/2, with c = cos[i], s = sin[i] (cos/sin are
//   [r] with both halves equal, as HF's tables):
//     y[i] = x[i] * cos[i] - x[i + r/2] * sin[i],   y[i + r/2] = x[i + r/2] * cos[i + r/2] + x[i] * sin[i + r/2]
// Sums of squares / means accumulate in double, so these differ from torch's float reductions only in
// fp32 rounding. -ffp-contract=off (CMakeLists.txt): the RoPE products round as torch's do.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>

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

}  // namespace gml_decode
