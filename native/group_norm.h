// gml.group_norm's engine step (gml/ir/group_norm.py): GroupNorm of an fp32 [N, C, *S] tensor,
//   dst[n, c] = (x[n, c] - mean[n, g]) / sqrt(var[n, g] + eps) * weight[c] + bias[c],  g = c / (C / G),
// the mean and biased variance over the group's C/G channels and all S positions. oneDNN 3.2 has
// no group normalization (and its layer normalization has no per-channel scale across positions),
// so this is a GML kernel step. x and dst are each dense NCHW-style (plain) or dense channels-last
// (NHWC-style: the fp32 convs' layout, so a norm between two convs needs no reorder); the
// translation rule is gml/runtime/rules/eltwise.py ``emit_group_norm``.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "bind.h"
#include "plan.h"

namespace gml_engine {

struct GroupNormStep {
  int x = -1, weight = -1, bias = -1, dst = -1;  // weight / bias -1: none (affine=False)
  int64_t num_groups = 1;
  float eps = 1e-5f;
  std::string name;
};

// Per-channel shifted sums over `len` values at `x` spaced `step` floats apart, added into
// s[c], q[c] for `ch` channels spaced `cstep` apart: d = x - k[c], s += d, q += d * d (in double;
// the shift by the channel's first value keeps a large mean from cancelling the variance).
// Channels-last (cstep 1) vectorizes across channels; plain rows use 8 partial sums.
inline void moments_channels_last(const float* x, int64_t len, int64_t c, const double* k, double* s, double* q) {
  for (int64_t p = 0; p < len; ++p) {
    const float* row = x + p * c;
    for (int64_t j = 0; j < c; ++j) {
      const double d = static_cast<double>(row[j]) - k[j];
      s[j] += d;
      q[j] += d * d;
    }
  }
}

inline void moments_row(const float* x, int64_t len, double k, double* s, double* q) {
  double ps[8] = {}, pq[8] = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    for (int j = 0; j < 8; ++j) {
      const double d = static_cast<double>(x[i + j]) - k;
      ps[j] += d;
      pq[j] += d * d;
    }
  for (int j = 0; i < len; ++i, ++j) {
    const double d = static_cast<double>(x[i]) - k;
    ps[j] += d;
    pq[j] += d * d;
  }
  for (int j = 0; j < 8; ++j) *s += ps[j], *q += pq[j];
}

// The kernel step: per-channel shifted sums (parallel over positions), each group's mean and
// variance from its channels', one scale a and shift b per (sample, channel), then
// y = x * a + b (parallel). weight and bias dense [C] fp32 plan constants.
inline void build(Plan& p, const GroupNormStep& desc) {
  const memory::desc x_md = p.md_in(desc.x), dst_md = p.md_out(desc.dst);
  const memory::dims dims = x_md.get_dims();
  if (dims.size() < 2 || x_md.get_data_type() != dt::f32 || dst_md.get_data_type() != dt::f32 ||
      dst_md.get_dims() != dims)
    throw std::invalid_argument("gml engine: group_norm takes and writes fp32 [N, C, ...] of one shape");
  const bool x_cl = channels_last_or_plain(x_md, "group_norm's source");
  const bool y_cl = channels_last_or_plain(dst_md, "group_norm's destination");
  const int64_t n = dims[0], c = dims[1], g = desc.num_groups;
  if (g <= 0 || c % g != 0)
    throw std::invalid_argument("gml engine: group_norm's " + std::to_string(g) + " groups do not divide " +
                                std::to_string(c) + " channels");
  for (int which : {desc.weight, desc.bias}) {
    if (which < 0) continue;
    const memory::desc md = p.md_in(which);
    if (md.get_data_type() != dt::f32 || md.get_dims() != memory::dims{c})
      throw std::invalid_argument("gml engine: group_norm's weight and bias are fp32 [" + std::to_string(c) + "]");
  }
  if (!(desc.eps >= 0.0f) || !std::isfinite(desc.eps)) throw std::invalid_argument("gml engine: group_norm eps");
  int64_t s = 1;
  for (size_t d = 2; d < dims.size(); ++d) s *= dims[d];
  const bool has_w = desc.weight >= 0, has_b = desc.bias >= 0;
  const double eps = desc.eps;
  Kernel k = [n, c, g, s, x_cl, y_cl, has_w, has_b, eps](const std::unordered_map<int, memory>& args) {
    const float* x = static_cast<const float*>(args.at(DNNL_ARG_SRC).get_data_handle());
    const float* w = has_w ? static_cast<const float*>(args.at(DNNL_ARG_WEIGHTS).get_data_handle()) : nullptr;
    const float* bias = has_b ? static_cast<const float*>(args.at(DNNL_ARG_BIAS).get_data_handle()) : nullptr;
    float* y = static_cast<float*>(args.at(DNNL_ARG_DST).get_data_handle());
    if (s == 0 || n == 0) return;
    const int64_t per = c / g;
    // element (n, ch, pos) at x[n * c * s + (cl ? pos * c + ch : ch * s + pos)]
    auto at = [c, s](bool cl, int64_t b, int64_t ch, int64_t pos) {
      return b * c * s + (cl ? pos * c + ch : ch * s + pos);
    };
    std::vector<double> shift(n * c), sum(n * c, 0.0), sq(n * c, 0.0);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t ch = 0; ch < c; ++ch) shift[b * c + ch] = x[at(x_cl, b, ch, 0)];
    if (x_cl) {  // per sample, position blocks in parallel, each with its own partial sums
      const int64_t blocks = std::min<int64_t>(s, 4 * omp_get_max_threads());
      std::vector<double> ps(blocks * c), pq(blocks * c);
      for (int64_t b = 0; b < n; ++b) {
        std::fill(ps.begin(), ps.end(), 0.0);
        std::fill(pq.begin(), pq.end(), 0.0);
#pragma omp parallel for schedule(static) if (blocks > 1)
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t lo = s * blk / blocks, hi = s * (blk + 1) / blocks;
          moments_channels_last(x + at(true, b, 0, lo), hi - lo, c, &shift[b * c], &ps[blk * c], &pq[blk * c]);
        }
        for (int64_t blk = 0; blk < blocks; ++blk)
          for (int64_t ch = 0; ch < c; ++ch) sum[b * c + ch] += ps[blk * c + ch], sq[b * c + ch] += pq[blk * c + ch];
      }
    } else {
#pragma omp parallel for schedule(static) if (n * c > 1)
      for (int64_t r = 0; r < n * c; ++r) moments_row(x + r * s, s, shift[r], &sum[r], &sq[r]);
    }
    // group (b, grp): mean = sum of its channels' (k + s / S) / per; the sum of squared deviations
    // from it = sum over channels of q - s^2 / S + S (mean_c - mean)^2
    std::vector<float> a(n * c), sh(n * c);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t grp = 0; grp < g; ++grp) {
        const int64_t first = b * c + grp * per;
        double mu = 0.0;
        for (int64_t r = first; r < first + per; ++r) mu += shift[r] + sum[r] / static_cast<double>(s);
        mu /= static_cast<double>(per);
        double dev = 0.0;
        for (int64_t r = first; r < first + per; ++r) {
          const double mc = shift[r] + sum[r] / static_cast<double>(s);
          dev += std::max(0.0, sq[r] - sum[r] * sum[r] / static_cast<double>(s)) + static_cast<double>(s) * (mc - mu) * (mc - mu);
        }
        const double rstd = 1.0 / std::sqrt(dev / static_cast<double>(per * s) + eps);
        for (int64_t r = first; r < first + per; ++r) {
          const int64_t ch = r - b * c;
          const double scale = rstd * (w ? w[ch] : 1.0);
          a[r] = static_cast<float>(scale);
          sh[r] = static_cast<float>((bias ? bias[ch] : 0.0) - mu * scale);
        }
      }
    if (x_cl && y_cl) {  // y[b, pos, :] = x[b, pos, :] * a[b, :] + sh[b, :], vectorized across channels
#pragma omp parallel for schedule(static) collapse(2)
      for (int64_t b = 0; b < n; ++b)
        for (int64_t pos = 0; pos < s; ++pos) {
          const float* xr = x + at(true, b, 0, pos);
          float* yr = y + at(true, b, 0, pos);
          const float *ar = &a[b * c], *br = &sh[b * c];
          for (int64_t ch = 0; ch < c; ++ch) yr[ch] = xr[ch] * ar[ch] + br[ch];
        }
    } else if (!x_cl && !y_cl) {
#pragma omp parallel for schedule(static) if (n * c > 1)
      for (int64_t r = 0; r < n * c; ++r) {
        const float* xr = x + r * s;
        float* yr = y + r * s;
        const float ar = a[r], br = sh[r];
        for (int64_t pos = 0; pos < s; ++pos) yr[pos] = xr[pos] * ar + br;
      }
    } else {  // mixed layouts (rare): element by element
#pragma omp parallel for schedule(static) collapse(2)
      for (int64_t b = 0; b < n; ++b)
        for (int64_t ch = 0; ch < c; ++ch)
          for (int64_t pos = 0; pos < s; ++pos)
            y[at(y_cl, b, ch, pos)] = x[at(x_cl, b, ch, pos)] * a[b * c + ch] + sh[b * c + ch];
    }
  };
  ValueArgs value_args{{DNNL_ARG_SRC, desc.x}, {DNNL_ARG_DST, desc.dst}};
  if (has_w) value_args.emplace_back(DNNL_ARG_WEIGHTS, desc.weight);
  if (has_b) value_args.emplace_back(DNNL_ARG_BIAS, desc.bias);
  p.push_kernel(std::move(k), std::move(value_args), memory::desc(), desc.name, "gml:group_norm");
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(GroupNormStep, x, num_groups, weight, bias, dst, eps, name)

}  // namespace gml_engine
