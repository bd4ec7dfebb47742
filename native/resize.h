// Nearest-neighbour resizing (F.interpolate(mode="nearest" / "nearest-exact")), a GML kernel step:
//   dst[n, c, o_1, ..., o_k] = src[n, c, index[0][o_1], ..., index[k-1][o_k]]
// The source position of each output position per spatial dim is computed by the translation rule
// (gml/runtime/rules/shape.py ``emit_interpolate``, torch's own formula for the mode), so this step
// only gathers. oneDNN 3.2's resampling computes its own nearest positions (a rounding that differs
// from torch's for non-integer factors), hence GML's. src and dst are each plain (NCHW-style) or
// channels-last (NHWC-style: the fp32 convs' layout): a channels-last output copies whole channel
// vectors.
#pragma once

#include <cstring>
#include <stdexcept>
#include <vector>

#include "bind.h"
#include "plan.h"

namespace gml_engine {

struct ResizeStep {
  int src = -1, dst = -1;
  std::vector<std::vector<int64_t>> index;  // per spatial dim: the source position of each output one
  std::string name;
};

inline void build(Plan& p, const ResizeStep& desc) {
  const memory::desc s_md = p.md_in(desc.src), d_md = p.md_out(desc.dst);
  const memory::dims sd = s_md.get_dims(), dd = d_md.get_dims();
  const size_t k = desc.index.size();
  if (sd.size() < 3 || sd.size() != dd.size() || k != sd.size() - 2 || sd[0] != dd[0] || sd[1] != dd[1])
    throw std::invalid_argument("gml engine: resize maps [N, C, *S] to [N, C, *S'] with one index per spatial dim");
  if (s_md.get_data_type() != d_md.get_data_type() || s_md.get_data_type() != dt::f32)
    throw std::invalid_argument("gml engine: resize takes and writes fp32");
  for (size_t i = 0; i < k; ++i) {
    if (static_cast<int64_t>(desc.index[i].size()) != dd[i + 2])
      throw std::invalid_argument("gml engine: resize index " + std::to_string(i) + " has the wrong length");
    for (int64_t v : desc.index[i])
      if (v < 0 || v >= sd[i + 2]) throw std::invalid_argument("gml engine: resize index out of the source");
  }
  const bool s_cl = channels_last_or_plain(s_md, "resize's source");
  const bool d_cl = channels_last_or_plain(d_md, "resize's destination");
  const memory::dims s_st = s_md.get_strides(), d_st = d_md.get_strides();
  // each output position's spatial offset in the source and in the destination (last dim fastest)
  int64_t positions = 1;
  for (size_t i = 2; i < dd.size(); ++i) positions *= dd[i];
  std::vector<int64_t> src_off(positions), dst_off(positions);
  for (int64_t pos = 0; pos < positions; ++pos) {
    int64_t rest = pos, so = 0, doff = 0;
    for (size_t i = k; i-- > 0;) {
      const int64_t o = rest % dd[i + 2];
      rest /= dd[i + 2];
      so += desc.index[i][o] * s_st[i + 2];
      doff += o * d_st[i + 2];
    }
    src_off[pos] = so, dst_off[pos] = doff;
  }
  const int64_t n = dd[0], c = dd[1];
  const int64_t s_n = s_st[0], s_c = s_st[1], d_n = d_st[0], d_c = d_st[1];
  const bool both_cl = s_cl && d_cl, both_plain = !s_cl && !d_cl;
  Kernel kern = [src_off, dst_off, positions, n, c, s_n, s_c, d_n, d_c, both_cl,
                 both_plain](const std::unordered_map<int, memory>& args) {
    const float* x = static_cast<const float*>(args.at(DNNL_ARG_SRC).get_data_handle());
    float* y = static_cast<float*>(args.at(DNNL_ARG_DST).get_data_handle());
    if (both_cl) {  // one channel vector per output position
#pragma omp parallel for schedule(static) collapse(2)
      for (int64_t b = 0; b < n; ++b)
        for (int64_t pos = 0; pos < positions; ++pos)
          std::memcpy(y + b * d_n + dst_off[pos], x + b * s_n + src_off[pos], sizeof(float) * c);
    } else if (both_plain) {  // one output plane per (sample, channel), written in order
#pragma omp parallel for schedule(static) collapse(2)
      for (int64_t b = 0; b < n; ++b)
        for (int64_t ch = 0; ch < c; ++ch) {
          const float* xs = x + b * s_n + ch * s_c;
          float* ys = y + b * d_n + ch * d_c;
          for (int64_t pos = 0; pos < positions; ++pos) ys[dst_off[pos]] = xs[src_off[pos]];
        }
    } else {  // mixed layouts: element by element
#pragma omp parallel for schedule(static) collapse(2)
      for (int64_t b = 0; b < n; ++b)
        for (int64_t pos = 0; pos < positions; ++pos)
          for (int64_t ch = 0; ch < c; ++ch)
            y[b * d_n + ch * d_c + dst_off[pos]] = x[b * s_n + ch * s_c + src_off[pos]];
    }
  };
  p.push_kernel(std::move(kern), {{DNNL_ARG_SRC, desc.src}, {DNNL_ARG_DST, desc.dst}}, memory::desc(), desc.name,
                "gml:resize_nearest");
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(ResizeStep, src, dst, index, name)

}  // namespace gml_engine
