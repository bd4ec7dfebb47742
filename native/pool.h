// GML engine, the pooling step family: oneDNN max / average pooling (any spatial rank).
// Python fills a PoolStep (gml/runtime/plan_steps.py) and calls Plan.add(step).
#pragma once

#include "bind.h"
#include "plan.h"

namespace gml_engine {

// Pooling of src into dst: alg "max", "avg_include" or "avg_exclude" (padding counted or not); the
// geometry in oneDNN's terms as in ConvStep; eltwise: post-ops (an INT8 requantization is ``linear``).
struct PoolStep {
  int src = -1, dst = -1;
  std::string alg;
  Dims kernel, strides, dilation, pad_l, pad_r;
  Eltwise eltwise;
  std::string name;
};

// Max / average pooling; requantization (if any) is an eltwise ``linear`` post-op.
inline void build(Plan& p, const PoolStep& desc) {
  const int src = desc.src, dst = desc.dst;
  const std::string &alg = desc.alg, &name = desc.name;
  const Dims &kernel = desc.kernel, &strides = desc.strides, &dilation = desc.dilation, &pad_l = desc.pad_l,
             &pad_r = desc.pad_r;
  const Eltwise& eltwise = desc.eltwise;
  using A = dnnl::algorithm;
  const A a = algorithm_of(alg,
                           {{"max", A::pooling_max},
                            {"avg_include", A::pooling_avg_include_padding},
                            {"avg_exclude", A::pooling_avg_exclude_padding}},
                           "pooling");
  const dnnl::primitive_attr attr = eltwise_attr(eltwise);
  const int src_rank = p.md_in(src).get_ndims();
  if (src_rank < 3) throw std::invalid_argument("gml engine: pooling of a source without spatial dims");
  const size_t nsp = static_cast<size_t>(src_rank - 2);
  if (kernel.size() != nsp || strides.size() != nsp || dilation.size() != nsp || pad_l.size() != nsp ||
      pad_r.size() != nsp)
    throw std::invalid_argument("gml engine: pooling geometry of another rank than the source's spatial dims");
  for (size_t i = 0; i < nsp; ++i)
    if (kernel[i] < 1 || strides[i] < 1 || dilation[i] < 0 || pad_l[i] < 0)  // pad_r < 0: as in conv()
      throw std::invalid_argument("gml engine: pooling needs kernel and stride >= 1, dilation and left padding >= 0");
  memory::dims k(kernel.begin(), kernel.end()), st(strides.begin(), strides.end());
  memory::dims dl(dilation.begin(), dilation.end()), pl(pad_l.begin(), pad_l.end()), pr(pad_r.begin(), pad_r.end());
  auto pd = dnnl::pooling_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_inference, a,
                                                  p.md_in(src), p.md_out(dst), st, k, dl, pl, pr, attr);
  p.resolve(dst, pd.dst_desc());
  p.push(dnnl::pooling_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, {}, pd.scratchpad_desc(), name);
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(PoolStep, src, dst, alg, kernel, strides, dilation, pad_l, pad_r, eltwise, name)

}  // namespace gml_engine
