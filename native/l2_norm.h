// F.normalize(x, p=2, dim=-1)'s engine step: each row of the last dim divided by its Euclidean norm,
//   dst = x / max(sqrt(sum(x^2)), eps),
// as torch computes it (the norm clamped below by eps, then a division). oneDNN 3.2 has no such
// primitive (its layer normalization subtracts the mean), so this is a GML kernel step; the
// translation rule (gml/runtime/rules/eltwise.py ``emit_normalize``) hands it dense rows. XCiT's
// cross-covariance attention and EdgeNeXt normalize q and k so.
#pragma once

#include <cmath>
#include <stdexcept>

#include "bind.h"
#include "plan.h"

namespace gml_engine {

struct L2NormStep {
  int x = -1, dst = -1;
  float eps = 1e-12f;
  std::string name;
};

// One row: the sum of squares in 16 fp32 partial sums (a fixed order the compiler vectorizes, as
// rms_norm.h), then one division per element.
inline void l2_norm_row(const float* x, float eps, int64_t n, float* y) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[i + j] * x[i + j];
  for (int j = 0; i < n; ++i, ++j) part[j] += x[i] * x[i];
  float ss = 0.0f;
  for (float v : part) ss += v;
  const float d = std::max(std::sqrt(ss), eps);
  for (i = 0; i < n; ++i) y[i] = x[i] / d;
}

inline void build(Plan& p, const L2NormStep& desc) {
  const memory::desc x_md = p.md_in(desc.x), dst_md = p.md_out(desc.dst);
  const memory::dims dims = x_md.get_dims();
  if (dims.empty() || x_md.get_data_type() != dt::f32 || dst_md.get_data_type() != dt::f32)
    throw std::invalid_argument("gml engine: l2_norm takes and writes fp32 of rank >= 1");
  if (x_md.get_strides() != plain_strides(dims) || dst_md.get_dims() != dims ||
      dst_md.get_strides() != plain_strides(dims))
    throw std::invalid_argument("gml engine: l2_norm reads and writes dense rows of the same shape");
  if (!(desc.eps >= 0.0f) || !std::isfinite(desc.eps)) throw std::invalid_argument("gml engine: l2_norm eps");
  const int64_t n = dims.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < dims.size(); ++d) rows *= dims[d];
  const float eps = desc.eps;
  Kernel k = [rows, n, eps](const std::unordered_map<int, memory>& args) {
    const float* x = static_cast<const float*>(args.at(DNNL_ARG_SRC).get_data_handle());
    float* y = static_cast<float*>(args.at(DNNL_ARG_DST).get_data_handle());
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) l2_norm_row(x + r * n, eps, n, y + r * n);
  };
  p.push_kernel(std::move(k), {{DNNL_ARG_SRC, desc.x}, {DNNL_ARG_DST, desc.dst}}, memory::desc(), desc.name,
                "gml:l2_norm");
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(L2NormStep, x, dst, eps, name)

}  // namespace gml_engine
