// GML engine, the linear step family: oneDNN's inner product (nn.Linear on a 2-D source: INT8, fp32,
// bf16) and matmul (2-D or batched, activation x activation or x a constant weight, with eltwise /
// binary post-ops: the transformer ops). gml::dynamic_linear is dynamic_linear.h.
// Python fills an InnerProductStep / MatmulStep (gml/runtime/plan_steps.py) and calls Plan.add(step).
#pragma once

#include "bind.h"
#include "plan.h"

namespace gml_engine {

// An inner product, like ConvStep without the geometry: weight a contiguous [O, I] tensor.
struct InnerProductStep {
  int src = -1, dst = -1;
  uintptr_t weight = 0;
  Dims wdims;
  std::string wdtype = "f32";
  std::vector<float> w_scales;
  uintptr_t bias = 0;
  QP src_q, dst_q;
  Eltwise eltwise;
  std::string name;
};

// Inner product (Linear) on a 2-D src: INT8 or fp32, like conv().
inline void build(Plan& p, const InnerProductStep& desc) {
  const int src = desc.src, dst = desc.dst;
  const uintptr_t weight = desc.weight, bias = desc.bias;
  const Dims& wdims = desc.wdims;
  const std::string &wdtype = desc.wdtype, &name = desc.name;
  const std::vector<float>& w_scales = desc.w_scales;
  const QP &src_q = desc.src_q, &dst_q = desc.dst_q;
  const Eltwise& eltwise = desc.eltwise;
  const bool quant = wdtype == "s8";
  memory::dims wd(wdims.begin(), wdims.end());
  if (wd.size() != 2) throw std::invalid_argument("gml engine: inner product weight must be 2-D");
  memory::desc user_w(wd, parse_dtype(wdtype), memory::format_tag::ab);
  memory::desc any_w(wd, parse_dtype(wdtype), memory::format_tag::any);
  memory::desc bias_md = bias ? memory::desc({wd[0]}, dt::f32, memory::format_tag::a) : memory::desc();
  dnnl::primitive_attr attr = eltwise_attr(eltwise);
  std::vector<std::pair<int, memory>> consts;
  if (quant) add_quant_attrs(attr, consts, src_q, dst_q, w_scales, 1);
  auto pd = dnnl::inner_product_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_inference,
                                                        p.md_in(src), any_w, bias_md, p.md_out(dst), attr);
  p.resolve(dst, pd.dst_desc());
  consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
  if (bias) consts.emplace_back(DNNL_ARG_BIAS, copy_constant(bias, bias_md));
  p.push(dnnl::inner_product_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, std::move(consts),
         pd.scratchpad_desc(), name);
}

// Post-ops of a matmul, applied in order to the fp32 accumulator: an eltwise (algorithm, alpha,
// beta, -1) as in Eltwise, or ("binary_add" | "binary_mul", 0, 0, value id): a value whose dims
// equal dst's or are 1 where it broadcasts (an attention mask, a residual).
using PostOps = std::vector<std::tuple<std::string, float, float, int>>;

// dst = post(src @ wei + bias): ``wei`` a value id, or -1 and a constant [K, N] ``weight`` with
// ``wdims`` / ``wstrides`` / ``wdtype``; ``bias``: N fp32 values (or 0).
struct MatmulStep {
  int src = -1, wei = -1, dst = -1;
  uintptr_t weight = 0;
  Dims wdims, wstrides;
  std::string wdtype = "f32";
  uintptr_t bias = 0;
  PostOps post;
  std::string name;
};

// dst = post_ops(src @ wei [+ bias]): 2-D or batched (batch dims of size 1 broadcast), fp32 or
// bf16 sources with fp32 accumulation, any strided layouts (a transposed K is a stride swap).
// ``wei`` is a value (activation x activation: attention's Q.K^T and P.V), or, when wei < 0, a
// constant [K, N] at ``weight`` with strides ``wstrides`` (a Linear's [N, K] weight seen
// transposed), reordered once into the layout the primitive picks. ``bias``: N fp32 values.
inline void build(Plan& p, const MatmulStep& desc) {
  const int src = desc.src, wei = desc.wei, dst = desc.dst;
  const uintptr_t weight = desc.weight, bias = desc.bias;
  const Dims &wdims = desc.wdims, &wstrides = desc.wstrides;
  const std::string &wdtype = desc.wdtype, &name = desc.name;
  const PostOps& post = desc.post;
  const memory::desc dst_md = p.md_out(dst);
  const int rank = dst_md.get_ndims();
  dnnl::primitive_attr attr;
  dnnl::post_ops po;
  std::vector<std::pair<int, int>> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}};
  int index = 0;
  for (const auto& [alg, alpha, beta, value] : post) {
    if (alg == "binary_add" || alg == "binary_mul") {
      po.append_binary(alg == "binary_add" ? dnnl::algorithm::binary_add : dnnl::algorithm::binary_mul,
                       p.md_in(value));
      args.emplace_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(index) | DNNL_ARG_SRC_1, value);
    } else {
      po.append_eltwise(parse_eltwise(alg), alpha, beta);
    }
    ++index;
  }
  attr.set_post_ops(po);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  std::vector<std::pair<int, memory>> consts;
  memory::desc wei_md, user_w;
  if (wei >= 0) {
    wei_md = p.md_in(wei);
    args.emplace_back(DNNL_ARG_WEIGHTS, wei);
  } else {
    memory::dims wd(wdims.begin(), wdims.end()), ws(wstrides.begin(), wstrides.end());
    user_w = memory::desc(wd, parse_dtype(wdtype), ws);
    wei_md = memory::desc(wd, parse_dtype(wdtype), memory::format_tag::any);
  }
  memory::desc bias_md;
  if (bias) {
    memory::dims bd(rank, 1);
    bd[rank - 1] = dst_md.get_dims()[rank - 1];
    bias_md = memory::desc(bd, dt::f32, plain_strides(bd));
  }
  auto pd = dnnl::matmul::primitive_desc(cpu_engine(), p.md_in(src), wei_md, bias_md, dst_md, attr);
  p.resolve(dst, pd.dst_desc());
  if (wei < 0) consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
  if (bias) consts.emplace_back(DNNL_ARG_BIAS, copy_constant(bias, bias_md));
  p.push(dnnl::matmul(pd), std::move(args), std::move(consts), pd.scratchpad_desc(), name);
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(InnerProductStep, src, dst, weight, wdims, wdtype, w_scales, bias, src_q, dst_q, eltwise, name)
GML_STEP(MatmulStep, src, wei, dst, weight, wdims, wstrides, wdtype, bias, post, name)

}  // namespace gml_engine
