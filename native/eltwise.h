// GML engine, the element-wise step family: oneDNN binary ops (add / mul / max with input scales
// and eltwise post-ops), softmax and layer normalization.
// Python fills a BinaryStep / SoftmaxStep / LayerNormStep (gml/runtime/plan_steps.py) and calls
// Plan.add(step).
#pragma once

#include "bind.h"
#include "plan.h"
#include "strided.h"

namespace gml_engine {

// dst = eltwise(scale0 * src0 <alg> scale1 * src1), alg "add", "sub", "mul" or "max" (a source of size 1 in a
// dim broadcasts); a scale left empty is 1.
struct BinaryStep {
  int src0 = -1, src1 = -1, dst = -1;
  std::string alg;
  std::optional<float> scale0, scale1;
  Eltwise eltwise;
  std::string name;
};

// Element-wise binary op: dst = post_ops(scale0 * src0 <alg> scale1 * src1). An fp32 add, sub or mul
// without scales or post-ops for whose layouts oneDNN has only its reference kernel runs as GML's
// strided loop instead (strided.h, "gml:strided_add" / "gml:strided_sub" / "gml:strided_mul").
inline void build(Plan& p, const BinaryStep& desc) {
  const int src0 = desc.src0, src1 = desc.src1, dst = desc.dst;
  const std::string &alg = desc.alg, &name = desc.name;
  const std::optional<float> &scale0 = desc.scale0, &scale1 = desc.scale1;
  const Eltwise& eltwise = desc.eltwise;
  using A = dnnl::algorithm;
  const A a = algorithm_of(
      alg, {{"add", A::binary_add}, {"sub", A::binary_sub}, {"mul", A::binary_mul}, {"max", A::binary_max}},
      "binary op");
  dnnl::primitive_attr attr = eltwise_attr(eltwise);
  std::vector<std::pair<int, memory>> consts;
  if (scale0) add_scale(attr, consts, DNNL_ARG_SRC_0, *scale0);
  if (scale1) add_scale(attr, consts, DNNL_ARG_SRC_1, *scale1);
  auto pd = dnnl::binary::primitive_desc(cpu_engine(), a, p.md_in(src0), p.md_in(src1), p.md_out(dst), attr);
  p.resolve(dst, pd.dst_desc());
  const std::string impl = pd.impl_info_str();
  const bool arithmetic = a == A::binary_add || a == A::binary_sub || a == A::binary_mul;
  if (impl.rfind("ref", 0) == 0 && arithmetic && !scale0 && !scale1 && eltwise.empty()) {
    // oneDNN has only its reference binary for these layouts (strided.h): GML's strided loop
    const auto op = a == A::binary_add   ? gml_strided::Op::add
                    : a == A::binary_sub ? gml_strided::Op::sub
                                         : gml_strided::Op::mul;
    if (auto k = gml_strided::Binary::make(op, p.md_in(src0), p.md_in(src1), p.md_in(dst))) {
      Kernel kernel = [k = *k](const std::unordered_map<int, memory>& args) {
        k.run(static_cast<const float*>(args.at(DNNL_ARG_SRC_0).get_data_handle()),
              static_cast<const float*>(args.at(DNNL_ARG_SRC_1).get_data_handle()),
              static_cast<float*>(args.at(DNNL_ARG_DST).get_data_handle()));
      };
      p.push_kernel(std::move(kernel), {{DNNL_ARG_SRC_0, src0}, {DNNL_ARG_SRC_1, src1}, {DNNL_ARG_DST, dst}},
                    memory::desc(), name, gml_strided::impl_name(op));
      return;
    }
  }
  p.push(dnnl::binary(pd), {{DNNL_ARG_SRC_0, src0}, {DNNL_ARG_SRC_1, src1}, {DNNL_ARG_DST, dst}}, std::move(consts),
         pd.scratchpad_desc(), name);
}

struct SoftmaxStep {
  int src = -1, dst = -1, axis = -1;
  std::string name;
};

// Softmax along ``axis`` (softmax_accurate: max subtracted, fp32 math); src / dst f32 or bf16.
inline void build(Plan& p, const SoftmaxStep& desc) {
  const int src = desc.src, dst = desc.dst, axis = desc.axis;
  const std::string& name = desc.name;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto pd = dnnl::softmax_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_inference,
                                                  dnnl::algorithm::softmax_accurate, p.md_in(src), p.md_out(dst),
                                                  axis, attr);
  p.resolve(dst, pd.dst_desc());
  p.push(dnnl::softmax_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, {}, pd.scratchpad_desc(), name);
}

// gamma / beta: the caller's last-dim fp32 values (copied), or 0.
struct LayerNormStep {
  int src = -1, dst = -1;
  uintptr_t gamma = 0, beta = 0;
  float eps = 1e-5f;
  std::string name;
};

// Layer normalization over the last dim: dst = (src - mean) / sqrt(var + eps) * gamma + beta, the
// statistics in fp32 whatever the data type (oneDNN's). src / dst f32 or bf16; gamma / beta: the
// last dim's fp32 values, copied (0: not applied).
inline void build(Plan& p, const LayerNormStep& desc) {
  const int src = desc.src, dst = desc.dst;
  const uintptr_t gamma = desc.gamma, beta = desc.beta;
  const float eps = desc.eps;
  const std::string& name = desc.name;
  const memory::desc src_md = p.md_in(src);
  const int64_t c = src_md.get_dims().back();
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto flags = dnnl::normalization_flags::none;
  if (gamma) flags |= dnnl::normalization_flags::use_scale;
  if (beta) flags |= dnnl::normalization_flags::use_shift;
  auto pd = dnnl::layer_normalization_forward::primitive_desc(
      cpu_engine(), dnnl::prop_kind::forward_inference, src_md, p.md_out(dst), eps, flags, attr);
  p.resolve(dst, pd.dst_desc());
  std::vector<std::pair<int, memory>> consts;
  const memory::desc param({c}, dt::f32, memory::format_tag::a);
  if (gamma) consts.emplace_back(DNNL_ARG_SCALE, copy_constant(gamma, param));
  if (beta) consts.emplace_back(DNNL_ARG_SHIFT, copy_constant(beta, param));
  p.push(dnnl::layer_normalization_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, std::move(consts),
         pd.scratchpad_desc(), name);
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(BinaryStep, src0, src1, dst, alg, scale0, scale1, eltwise, name)
GML_STEP(SoftmaxStep, src, dst, axis, name)
GML_STEP(LayerNormStep, src, dst, gamma, beta, eps, name)

}  // namespace gml_engine
