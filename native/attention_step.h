// GML engine, the attention step: gml.attention as one GML kernel step (the fused kernels are
// attention.h, AVX-512 bf16 / fp32, and attention_avx2.h, AVX2 fp32). Python fills an AttentionStep
// (gml/runtime/plan_steps.py) and calls Plan.add(step).
#pragma once

#include "attention.h"
#include "attention_avx2.h"
#include "bind.h"
#include "plan.h"

namespace gml_engine {

// dst = softmax(scale * q @ kᵀ + sum(masks)) @ v: value ids of q / k / v / dst (one rank) and of
// the additive fp32 masks. ``kernel``: "avx512" (attention.h) or "avx2" (attention_avx2.h, fp32
// only), chosen by the Python side from GML's CPU description (rules/attention.py).
struct AttentionStep {
  int q = -1, k = -1, v = -1, dst = -1;
  std::vector<int> masks;
  float scale = 1.0f;
  bool zero_masked_rows = false;  // a bool mask: a row with every key masked is zeros (attention_problem.h)
  std::string kernel = "avx512";
  std::string name;
};

// The fused attention kernels this CPU runs ("avx512": AVX512-BF16; "avx2": AVX2 + FMA).
inline std::vector<std::string> fused_attention_kernels() {
  std::vector<std::string> have;
  if (gml_attention::cpu_supported()) have.emplace_back("avx512");
  if (gml_attention_avx2::cpu_supported()) have.emplace_back("avx2");
  return have;
}

// gml.attention in one Kernel step (native/attention.h): O = softmax(scale * Q Kᵀ + masks) V, bf16
// or fp32 q / k / v / out of one rank (batch dims of size 1 broadcast), unit last-dim strides; ``masks``:
// additive fp32 values of that rank. The Python side asks for a kernel of fused_attention_kernels().
inline void build(Plan& plan, const AttentionStep& desc) {
  const int q = desc.q, k = desc.k, v = desc.v, dst = desc.dst;
  const std::vector<int>& masks = desc.masks;
  const float scale = desc.scale;
  const std::string& name = desc.name;
  const bool avx2 = desc.kernel == "avx2";
  if (!avx2 && desc.kernel != "avx512") throw std::invalid_argument("gml engine: no fused attention kernel '" + desc.kernel + "'");
  if (avx2 ? !gml_attention_avx2::cpu_supported() : !gml_attention::cpu_supported())
    throw std::invalid_argument(avx2 ? "gml engine: fused attention 'avx2' needs AVX2 and FMA"
                                     : "gml engine: fused attention 'avx512' needs AVX512-BF16");
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
  if (avx2 && !pb.f32) throw std::invalid_argument("gml engine: the AVX2 fused attention is fp32 only");
  auto [qo, qd] = operand(q, type, "q");
  auto [ko, kd] = operand(k, type, "k");
  auto [vo, vd] = operand(v, type, "v");
  auto [oo, odd] = operand(dst, type, "output");
  pb.L = qd[rank - 2], pb.E = qd[rank - 1], pb.S = kd[rank - 2], pb.Ev = vd[rank - 1];
  if (kd[rank - 1] != pb.E || vd[rank - 2] != pb.S || odims[rank - 2] != pb.L || odims[rank - 1] != pb.Ev)
    throw std::invalid_argument("gml engine: attention shapes do not match");
  if (avx2 ? pb.E <= 0 || pb.Ev <= 0 : !gml_attention::shape_supported(pb.E, pb.Ev, pb.f32)) throw std::invalid_argument("gml engine: attention head size");
  if (pb.L > 1 && qo.row == 0) throw std::invalid_argument("gml engine: attention q rows");
  for (const auto* o : {&qo, &ko, &vo, &oo})
    if (o->col != 1) throw std::invalid_argument("gml engine: attention operands need unit last-dim strides");
  if (!avx2 && 16 * 4 * std::max<int64_t>(ko.row, 1) >= (int64_t{1} << 31))  // attention.h packs K by gathers with int32 offsets
    throw std::invalid_argument("gml engine: attention K rows too far apart for the fused kernel");
  pb.scale = scale;
  pb.zero_masked_rows = desc.zero_masked_rows;
  pb.q = qo, pb.k = ko, pb.v = vo, pb.out = oo;
  for (int m : masks) {
    auto [mo, md] = operand(m, dt::f32, "mask");
    if ((md[rank - 2] != 1 && md[rank - 2] != pb.L) || (md[rank - 1] != 1 && md[rank - 1] != pb.S))
      throw std::invalid_argument("gml engine: attention mask shape");
    pb.masks.push_back(mo);
  }
  const int nsrc = 3 + static_cast<int>(masks.size());
  Kernel kern = [pb, nsrc, avx2](const std::unordered_map<int, memory>& args) {
    gml_attention::Problem p = pb;
    p.q.data = args.at(DNNL_ARG_MULTIPLE_SRC).get_data_handle();
    p.k.data = args.at(DNNL_ARG_MULTIPLE_SRC + 1).get_data_handle();
    p.v.data = args.at(DNNL_ARG_MULTIPLE_SRC + 2).get_data_handle();
    for (int i = 3; i < nsrc; ++i) p.masks[i - 3].data = args.at(DNNL_ARG_MULTIPLE_SRC + i).get_data_handle();
    p.out.data = args.at(DNNL_ARG_DST).get_data_handle();
    if (avx2) gml_attention_avx2::run(p);
    else gml_attention::run(p);
  };
  std::vector<std::pair<int, int>> value_args{{DNNL_ARG_DST, dst}, {DNNL_ARG_MULTIPLE_SRC, q},
                                              {DNNL_ARG_MULTIPLE_SRC + 1, k}, {DNNL_ARG_MULTIPLE_SRC + 2, v}};
  for (size_t i = 0; i < masks.size(); ++i) value_args.emplace_back(DNNL_ARG_MULTIPLE_SRC + 3 + static_cast<int>(i), masks[i]);
  plan.push_kernel(std::move(kern), std::move(value_args), memory::desc(), name,
                   avx2 ? "gml:attention_avx2_f32" : pb.f32 ? "gml:attention_avx512_f32" : "gml:attention_avx512_bf16");
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(AttentionStep, q, k, v, dst, masks, scale, zero_masked_rows, kernel, name)

}  // namespace gml_engine
