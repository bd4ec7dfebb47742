// GML engine, the attention step: gml.attention as one GML kernel step (the fused kernel is
// attention.h). Python fills an AttentionStep (gml/runtime/plan_steps.py) and calls Plan.add(step).
#pragma once

#include "attention.h"
#include "bind.h"
#include "plan.h"

namespace gml_engine {

// dst = softmax(scale * q @ kᵀ + sum(masks)) @ v: value ids of q / k / v / dst (one rank) and of
// the additive fp32 masks.
struct AttentionStep {
  int q = -1, k = -1, v = -1, dst = -1;
  std::vector<int> masks;
  float scale = 1.0f;
  std::string name;
};

// gml.attention in one Kernel step (native/attention.h): O = softmax(scale * Q Kᵀ + masks) V, bf16
// or fp32 q / k / v / out of one rank (batch dims of size 1 broadcast), unit last-dim strides; ``masks``:
// additive fp32 values of that rank. The Python side calls it only when fused_attention_available().
inline void build(Plan& plan, const AttentionStep& desc) {
  const int q = desc.q, k = desc.k, v = desc.v, dst = desc.dst;
  const std::vector<int>& masks = desc.masks;
  const float scale = desc.scale;
  const std::string& name = desc.name;
  if (!gml_attention::cpu_supported()) throw std::invalid_argument("gml engine: fused attention needs AVX512-BF16");
  if (!plan.resolved(dst))
    plan.resolve(dst, memory::desc(plan.md_out(dst).get_dims(), plan.md_in(q).get_data_type(), plain_strides(plan.md_out(dst).get_dims())));
  const memory::desc od = plan.md_in(dst);
  const memory::dims odims = od.get_dims();
  const int rank = static_cast<int>(odims.size());
  if (rank < 2) throw std::invalid_argument("gml engine: attention output of rank < 2");
  const int nb = rank - 2;
  gml_attention::Problem pb;
  pb.batch.assign(odims.begin(), odims.begin() + nb);
  // an operand's batch strides (0 where it broadcasts), row and column strides
  auto operand = [&](int id, dt want, const char* what) {
    const memory::desc md = plan.md_in(id);
    if (md.get_data_type() != want || md.get_ndims() != rank)
      throw std::invalid_argument(std::string("gml engine: attention ") + what + " of another dtype or rank");
    const memory::dims d = md.get_dims(), st = md.get_strides();
    gml_attention::Operand op;
    for (int i = 0; i < nb; ++i) {
      if (d[i] != 1 && d[i] != odims[i]) throw std::invalid_argument(std::string("gml engine: attention ") + what + " batch dims");
      op.batch_strides.push_back(d[i] == 1 ? 0 : st[i]);
    }
    op.row = d[rank - 2] == 1 ? 0 : st[rank - 2];
    op.col = d[rank - 1] == 1 ? 0 : st[rank - 1];
    return std::make_pair(op, d);
  };
  const dt type = plan.md_in(q).get_data_type();  // bf16, or fp32 (the same kernel with FMA for vdpbf16ps)
  if (type != dt::bf16 && type != dt::f32) throw std::invalid_argument("gml engine: attention of bf16 or f32 values");
  pb.f32 = type == dt::f32;
  auto [qo, qd] = operand(q, type, "q");
  auto [ko, kd] = operand(k, type, "k");
  auto [vo, vd] = operand(v, type, "v");
  auto [oo, odd] = operand(dst, type, "output");
  pb.L = qd[rank - 2], pb.E = qd[rank - 1], pb.S = kd[rank - 2], pb.Ev = vd[rank - 1];
  if (kd[rank - 1] != pb.E || vd[rank - 2] != pb.S || odims[rank - 2] != pb.L || odims[rank - 1] != pb.Ev)
    throw std::invalid_argument("gml engine: attention shapes do not match");
  if (!gml_attention::shape_supported(pb.E, pb.Ev)) throw std::invalid_argument("gml engine: attention head size");
  if (pb.L > 1 && qo.row == 0) throw std::invalid_argument("gml engine: attention q rows");
  for (const auto* o : {&qo, &ko, &vo, &oo})
    if (o->col != 1) throw std::invalid_argument("gml engine: attention operands need unit last-dim strides");
  if (16 * 4 * std::max<int64_t>(ko.row, 1) >= (int64_t{1} << 31))  // K is packed by gathers with int32 offsets
    throw std::invalid_argument("gml engine: attention K rows too far apart for the fused kernel");
  pb.scale = scale;
  pb.q = qo, pb.k = ko, pb.v = vo, pb.out = oo;
  for (int m : masks) {
    auto [mo, md] = operand(m, dt::f32, "mask");
    if ((md[rank - 2] != 1 && md[rank - 2] != pb.L) || (md[rank - 1] != 1 && md[rank - 1] != pb.S))
      throw std::invalid_argument("gml engine: attention mask shape");
    pb.masks.push_back(mo);
  }
  const int nsrc = 3 + static_cast<int>(masks.size());
  Kernel kern = [pb, nsrc](const std::unordered_map<int, memory>& args) {
    gml_attention::Problem p = pb;
    p.q.data = args.at(DNNL_ARG_MULTIPLE_SRC).get_data_handle();
    p.k.data = args.at(DNNL_ARG_MULTIPLE_SRC + 1).get_data_handle();
    p.v.data = args.at(DNNL_ARG_MULTIPLE_SRC + 2).get_data_handle();
    for (int i = 3; i < nsrc; ++i) p.masks[i - 3].data = args.at(DNNL_ARG_MULTIPLE_SRC + i).get_data_handle();
    p.out.data = args.at(DNNL_ARG_DST).get_data_handle();
    gml_attention::run(p);
  };
  std::vector<std::pair<int, int>> value_args{{DNNL_ARG_DST, dst}, {DNNL_ARG_MULTIPLE_SRC, q},
                                              {DNNL_ARG_MULTIPLE_SRC + 1, k}, {DNNL_ARG_MULTIPLE_SRC + 2, v}};
  for (size_t i = 0; i < masks.size(); ++i) value_args.emplace_back(DNNL_ARG_MULTIPLE_SRC + 3 + static_cast<int>(i), masks[i]);
  plan.push_kernel(std::move(kern), std::move(value_args), memory::desc(), name,
                   pb.f32 ? "gml:attention_avx512_f32" : "gml:attention_avx512_bf16");
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(AttentionStep, q, k, v, dst, masks, scale, name)

}  // namespace gml_engine
