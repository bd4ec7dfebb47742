// gml.rms_norm's engine step (gml/ir/rms_norm.py): dst = x / sqrt(mean(x², last dim) + eps) · weight.
// oneDNN 3.2's layer normalization always subtracts the mean, so this is a GML kernel step. Its
// fields are the op's schema arguments plus dst (the generic rule, gml/runtime/rules/kernel.py).
#pragma once

#include <cmath>
#include <stdexcept>

#include "bind.h"
#include "plan.h"

namespace gml_engine {

struct RmsNormStep {
  int x = -1, weight = -1, dst = -1;  // plan values; weight -1: none (nn.RMSNorm without affine)
  float eps = 1e-6f;
  std::string name;
};

// The sum of squares of a row in 16 fp32 partial sums (a fixed order the compiler vectorizes;
// -ffp-contract=off keeps it free of FMA contraction); l2_norm.h's row uses it too.
inline float row_sum_of_squares(const float* x, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[i + j] * x[i + j];
  for (int j = 0; i < n; ++i, ++j) part[j] += x[i] * x[i];
  float ss = 0.0f;
  for (float v : part) ss += v;
  return ss;
}

// The rows of a kernel step that reads x and writes dst as dense fp32 [..., D] rows of one shape:
// (rows, D); throws naming `what` otherwise.
inline std::pair<int64_t, int64_t> dense_f32_rows(Plan& p, int x, int dst, const std::string& what) {
  const memory::desc x_md = p.md_in(x), dst_md = p.md_out(dst);
  const memory::dims dims = x_md.get_dims();
  if (dims.empty() || x_md.get_data_type() != dt::f32 || dst_md.get_data_type() != dt::f32)
    throw std::invalid_argument("gml engine: " + what + " takes and writes fp32 of rank >= 1");
  if (x_md.get_strides() != plain_strides(dims) || dst_md.get_dims() != dims ||
      dst_md.get_strides() != plain_strides(dims))
    throw std::invalid_argument("gml engine: " + what + " reads and writes dense rows of the same shape");
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < dims.size(); ++d) rows *= dims[d];
  return {rows, dims.back()};
}

// One row: the mean of squares, then one multiply per element.
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float inv = 1.0f / std::sqrt(row_sum_of_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
  if (w) {
    for (i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
  } else {
    for (i = 0; i < n; ++i) y[i] = x[i] * inv;
  }
}

// The kernel step: rows split over the OpenMP team. x and dst are dense [..., D] fp32 (the generic
// rule copies another layout first), weight a dense [D] fp32 plan constant.
inline void build(Plan& p, const RmsNormStep& desc) {
  const std::pair<int64_t, int64_t> shape = dense_f32_rows(p, desc.x, desc.dst, "rms_norm");
  const int64_t rows = shape.first, n = shape.second;
  if (desc.weight >= 0) {
    const memory::desc w_md = p.md_in(desc.weight);
    if (w_md.get_data_type() != dt::f32 || w_md.get_dims() != memory::dims{n})
      throw std::invalid_argument("gml engine: rms_norm's weight is fp32 [" + std::to_string(n) + "]");
  }
  if (!(desc.eps >= 0.0f) || !std::isfinite(desc.eps)) throw std::invalid_argument("gml engine: rms_norm eps");
  const bool has_w = desc.weight >= 0;
  const float eps = desc.eps;
  Kernel k = [rows, n, has_w, eps](const std::unordered_map<int, memory>& args) {
    const float* x = static_cast<const float*>(args.at(DNNL_ARG_SRC).get_data_handle());
    const float* w = has_w ? static_cast<const float*>(args.at(DNNL_ARG_WEIGHTS).get_data_handle()) : nullptr;
    float* y = static_cast<float*>(args.at(DNNL_ARG_DST).get_data_handle());
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * n, w, eps, n, y + r * n);
  };
  ValueArgs value_args{{DNNL_ARG_SRC, desc.x}, {DNNL_ARG_DST, desc.dst}};
  if (has_w) value_args.emplace_back(DNNL_ARG_WEIGHTS, desc.weight);
  p.push_kernel(std::move(k), std::move(value_args), memory::desc(), desc.name, "gml:rms_norm");
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(RmsNormStep, x, weight, dst, eps, name)

}  // namespace gml_engine
