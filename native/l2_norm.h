// F.normalize(x, p=2, dim=-1)'s engine step: each row of the last dim divided by its Euclidean norm,
//   dst = x / max(sqrt(sum(x^2)), eps),
// as torch computes it (the norm clamped below by eps, then a division). oneDNN 3.2 has no such
// primitive (its layer normalization subtracts the mean), so this is a GML kernel step; the
// translation rule (gml/runtime/rules/eltwise.py ``emit_normalize``) hands it dense rows. XCiT's
// cross-covariance attention and EdgeNeXt normalize q and k so.
#pragma once

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "bind.h"
#include "plan.h"
#include "rms_norm.h"

namespace gml_engine {

struct L2NormStep {
  int x = -1, dst = -1;
  float eps = 1e-12f;
  std::string name;
};

// One row: the sum of squares (rms_norm.h's, the same order), then one division per element.
inline void l2_norm_row(const float* x, float eps, int64_t n, float* y) {
  const float d = std::max(std::sqrt(row_sum_of_squares(x, n)), eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] / d;
}

inline void build(Plan& p, const L2NormStep& desc) {
  const std::pair<int64_t, int64_t> shape = dense_f32_rows(p, desc.x, desc.dst, "l2_norm");
  const int64_t rows = shape.first, n = shape.second;
  if (!(desc.eps >= 0.0f) || !std::isfinite(desc.eps)) throw std::invalid_argument("gml engine: l2_norm eps");
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
