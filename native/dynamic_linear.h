// GML engine, gml::dynamic_linear (docs/adr/008-dynamic-int8-gemm.md): an fp32 Linear whose source
// rows are quantized to int8 per call (GML's quantize_row_s8 kernel step), then an s8 x s8 GEMM: a
// oneDNN matmul, or GML's exact AVX2 kernel (int8_gemm_avx2.h) where oneDNN's would saturate.
// Python fills a DynamicLinearStep (gml/runtime/plan_steps.py) and calls Plan.add(step).
#pragma once

#include <cmath>

#include "int8_gemm_avx2.h"
#include "bind.h"
#include "plan.h"

namespace gml_engine {

// src [M, K] fp32 -> dst [1, M, N] fp32 through the arena temporaries q (s8 [1, M, K]) and amax
// (f32 [1, M, 1]); weight the caller's int8 [N, K] rows, w_scales weight_scale / 127 (1 or N).
struct DynamicLinearStep {
  int src = -1, dst = -1, q = -1, amax = -1;
  uintptr_t weight = 0;
  Dims wdims;
  std::vector<float> w_scales;
  uintptr_t bias = 0;               // N fp32 values, or 0
  std::vector<float> smooth_inv;    // K values (SmoothQuant), or empty
  Eltwise eltwise;
  std::string name;
  int sum_src = -1;                 // a [1, M, N] fp32 residual added last, or -1
  bool exact_gemm = false;          // GML's exact GEMM (CPUs without VNNI: gml.runtime.plan.exact_int8_gemm)
};

// Per-row symmetric int8 quantization, bit for bit the math of gml.kernels.dynamic_int8.quantize_rows:
//   v[k] = x[k] * smooth_inv[k] (or x[k]);  amax = max(max_k |v[k]|, kAmaxFloor);
//   inv = 127 / amax (one IEEE fp32 division);  q[k] = round_half_even(v[k] * inv)
// |v * inv| <= 127 up to one rounding, so q fits int8 with no clamp. round_half_even(t) is
// (t + 1.5 * 2^23) - 1.5 * 2^23: exact for |t| < 2^22 in the default rounding mode, and it
// vectorizes (nearbyintf does not). The file is compiled with -ffp-contract=off (CMakeLists.txt): an
// FMA fused into v * inv + 1.5 * 2^23 would round once instead of twice and could pick another
// integer than torch.round(v * inv) does. target_clones: AVX-512, AVX2 and baseline bodies, picked
// when the library loads.
constexpr float kAmaxFloor = 1e-30f;  // = gml.kernels.dynamic_int8.AMAX_FLOOR
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

__attribute__((target_clones("avx512f", "avx2", "default"))) static void quantize_row_s8(
    const float* x, const float* smooth_inv, int64_t k, int8_t* q, float* amax_out) {
  float amax = 0.0f;
  if (smooth_inv) {
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i] * smooth_inv[i]));
  } else {
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  }
  amax = std::max(amax, kAmaxFloor);
  const float inv = 127.0f / amax;
  if (smooth_inv) {
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      const float t = (x[i] * smooth_inv[i]) * inv;
      q[i] = static_cast<int8_t>(static_cast<int32_t>((t + kRoundMagic) - kRoundMagic));
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      const float t = x[i] * inv;
      q[i] = static_cast<int8_t>(static_cast<int32_t>((t + kRoundMagic) - kRoundMagic));
    }
  }
  *amax_out = amax;
}

// dynamic_linear's step 2 as GML's exact int8 GEMM (native/int8_gemm_avx2.h), one Kernel step:
//   z = relu?(((float(q . w) * w_scales[n]) * amax[m]) + bias[n])          (the GEMM's epilogue)
//   z = eltwise(z)   other post-ops (GELU): oneDNN eltwise primitives, in place on dense rows
//   dst = z + residual[m, n]                                                 (if any)
// the operations and their order of the oneDNN matmul's post-op chain. The eltwise runs on dst when
// its rows are dense, else on a dense copy in the scratchpad (copied out after, exactly).
inline void gemm_step(Plan& p, int q, int amax, int dst, int sum_src, uintptr_t weight, int64_t n, int64_t k,
                      const std::vector<float>& w_scales, uintptr_t bias, const Eltwise& eltwise, const std::string& name) {
  const memory::desc dst_md = p.md_in(dst);
  const int64_t m = dst_md.get_dims()[1];
  const int64_t ldy = m > 1 ? dst_md.get_strides()[1] : n;
  if (n > 1 && dst_md.get_strides()[2] != 1) throw std::invalid_argument("gml engine: dynamic_linear output columns must be dense");
  int64_t ldr = 0;
  if (sum_src >= 0) {
    const memory::desc r = p.md_in(sum_src);
    if (r.get_data_type() != dt::f32 || (n > 1 && r.get_strides()[2] != 1))
      throw std::invalid_argument("gml engine: dynamic_linear's residual must be f32 with dense columns");
    ldr = m > 1 ? r.get_strides()[1] : n;
  }
  auto gemm = std::make_shared<const gml_int8_gemm::Gemm>(reinterpret_cast<const int8_t*>(weight), n, k, k, w_scales,
                                                           reinterpret_cast<const float*>(bias));
  // the epilogue's ReLU is exact in the kernel; other activations are oneDNN eltwise primitives
  bool relu = false;
  std::vector<dnnl::eltwise_forward> acts;
  std::string impl = gemm->seven_bit() ? "gml:int8_gemm_avx2_u8s7" : "gml:int8_gemm_avx2";
  const memory::desc rows({m, n}, dt::f32, memory::format_tag::ab);
  for (const auto& [alg, alpha, beta] : eltwise) {
    if (alg == "relu" && alpha == 0.0f && acts.empty() && !relu) {
      relu = true;
      continue;
    }
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::eltwise_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_inference,
                                                    parse_eltwise(alg), rows, rows, alpha, beta, attr);
    if (pd.scratchpad_desc().get_size() > 0) throw std::invalid_argument("gml engine: eltwise with a scratchpad");
    impl += std::string("+") + pd.impl_info_str();
    acts.emplace_back(pd);
  }
  const bool staged = !acts.empty() && (ldy != n || sum_src >= 0);  // eltwise on a dense copy, then out
  const size_t gemm_bytes = (gemm->scratch_bytes(m) + kAlign - 1) / kAlign * kAlign;
  const size_t scratch = gemm_bytes + (staged ? static_cast<size_t>(m * n) * sizeof(float) : 0);
  const bool parallel = m * n * k >= (int64_t{1} << 18);  // below: an OpenMP fork costs more than it saves
  const bool has_res = sum_src >= 0;
  Kernel kernel = [gemm, acts, relu, staged, gemm_bytes, m, n, ldy, ldr, has_res, parallel,
                   rows](const std::unordered_map<int, memory>& args) {
    const int8_t* qx = static_cast<const int8_t*>(args.at(DNNL_ARG_SRC).get_data_handle());
    const float* am = static_cast<const float*>(args.at(DNNL_ARG_SRC_1).get_data_handle());
    float* y = static_cast<float*>(args.at(DNNL_ARG_DST).get_data_handle());
    const float* res = has_res ? static_cast<const float*>(args.at(DNNL_ARG_SRC_2).get_data_handle()) : nullptr;
    char* scratch = static_cast<char*>(args.at(DNNL_ARG_SCRATCHPAD).get_data_handle());
    if (acts.empty()) {
      gemm->run(qx, m, gemm->k(), am, y, ldy, relu, res, ldr, scratch, parallel);
      return;
    }
    float* z = staged ? reinterpret_cast<float*>(scratch + gemm_bytes) : y;
    const int64_t ldz = staged ? n : ldy;
    gemm->run(qx, m, gemm->k(), am, z, ldz, relu, nullptr, 0, scratch, parallel);
    dnnl::stream stream(cpu_engine());  // CPU primitives run synchronously on the calling thread
    memory zm(rows, cpu_engine(), z);
    for (const auto& act : acts) act.execute(stream, {{DNNL_ARG_SRC, zm}, {DNNL_ARG_DST, zm}});
    stream.wait();
    if (!staged) return;
    for (int64_t r = 0; r < m; ++r) {
      float* yr = y + r * ldy;
      const float* zr = z + r * n;
      if (res) {
        const float* rr = res + r * ldr;
        for (int64_t c = 0; c < n; ++c) yr[c] = zr[c] + rr[c];
      } else {
        std::memcpy(yr, zr, static_cast<size_t>(n) * sizeof(float));
      }
    }
  };
  std::vector<std::pair<int, int>> args{{DNNL_ARG_SRC, q}, {DNNL_ARG_SRC_1, amax}, {DNNL_ARG_DST, dst}};
  if (has_res) args.emplace_back(DNNL_ARG_SRC_2, sum_src);
  p.push_kernel(std::move(kernel), std::move(args),
                memory::desc({static_cast<int64_t>(scratch)}, dt::u8, memory::format_tag::a), name, impl);
}

// gml::dynamic_linear (docs/adr/008-dynamic-int8-gemm.md): fp32 src [M, K] (unit column stride,
// any row stride) -> fp32 dst [M, N], as two steps:
//   1. quantize_row_s8 per row into ``q`` (s8, dense) and ``amax`` (f32, one per row), arena temps;
//   2. a oneDNN matmul q x W (s8 x s8 -> f32), W prepacked once from the caller's int8 [N, K] (format
//      any), with dst = eltwise((acc * w_scales[n]) * amax[m] + bias[n]): the weight scales per
//      output channel, then a binary-mul post-op broadcasting amax over N, a binary-add post-op for
//      the bias (the matmul's own bias would be added before the per-row multiply), then the
//      eltwise post-op. oneDNN 3.2's matmul takes one src scale per tensor only, hence the binary
//      mul. ``w_scales`` are weight_scale / 127 (computed by the caller, as the Python kernel does).
// The matmul is planned 3-D, q [1, M, K] x W [1, K, N] -> dst [1, M, N] with amax [1, M, 1] and bias
// [1, 1, N] (the caller adds q, amax and dst as 3-D views): measured on oneDNN 3.2 (avx512_core_vnni),
// the 2-D form with an [M, 1] binary operand finds only the reference matmul ("ref:any", ~100x
// slower), the 3-D form brgemm ("brg:avx512_core_vnni").
//
// ``exact_gemm`` (CPUs without VNNI, chosen by the caller from the target CPU): step 2 is GML's own
// exact s8 x s8 GEMM instead (native/int8_gemm_avx2.h, gemm_step()): without VNNI oneDNN's int8
// matmul multiplies with vpmaddubsw, whose int16 pair sums saturate, and runs its slow ``gemm:jit``.
inline void build(Plan& p, const DynamicLinearStep& desc) {
  const int src = desc.src, dst = desc.dst, q = desc.q, amax = desc.amax, sum_src = desc.sum_src;
  const uintptr_t weight = desc.weight, bias = desc.bias;
  const Dims& wdims = desc.wdims;
  const std::vector<float> &w_scales = desc.w_scales, &smooth_inv = desc.smooth_inv;
  const Eltwise& eltwise = desc.eltwise;
  const std::string& name = desc.name;
  const bool exact_gemm = desc.exact_gemm;
  const memory::desc src_md = p.md_in(src), q_md = p.md_in(q), amax_md = p.md_in(amax), dst_md = p.md_out(dst);
  if (src_md.get_ndims() != 2 || src_md.get_data_type() != dt::f32)
    throw std::invalid_argument("gml engine: dynamic_linear takes a 2-D fp32 source");
  const memory::dims sd = src_md.get_dims(), ss = src_md.get_strides();
  const int64_t m = sd[0], k = sd[1];
  if (wdims.size() != 2 || wdims[1] != k) throw std::invalid_argument("gml engine: dynamic_linear weight is not [N, K]");
  const int64_t n = wdims[0];
  if (ss[1] != 1 && k > 1) throw std::invalid_argument("gml engine: dynamic_linear source columns must be dense");
  if (q_md.get_data_type() != dt::s8 || q_md.get_dims() != memory::dims{1, m, k} || q_md.get_strides()[1] != k ||
      (k > 1 && q_md.get_strides()[2] != 1))
    throw std::invalid_argument("gml engine: dynamic_linear needs a dense s8 [1, M, K] temporary");
  if (amax_md.get_data_type() != dt::f32 || amax_md.get_dims() != memory::dims{1, m, 1} ||
      (m > 1 && amax_md.get_strides()[1] != 1))
    throw std::invalid_argument("gml engine: dynamic_linear needs a dense f32 [1, M, 1] temporary");
  if (dst_md.get_ndims() != 3 || dst_md.get_dims() != memory::dims{1, m, n})
    throw std::invalid_argument("gml engine: dynamic_linear writes a [1, M, N] destination");
  if (!smooth_inv.empty() && static_cast<int64_t>(smooth_inv.size()) != k)
    throw std::invalid_argument("gml engine: dynamic_linear smooth_inv must have K entries");
  if (w_scales.size() != 1 && static_cast<int64_t>(w_scales.size()) != n)
    throw std::invalid_argument("gml engine: dynamic_linear needs 1 or N weight scales");

  // Step 1: the row quantization (rows split over the OpenMP team when there is enough work).
  auto smooth = std::make_shared<std::vector<float>>(smooth_inv);
  const int64_t ld = ss[0];
  Kernel quantize = [m, k, ld, smooth](const std::unordered_map<int, memory>& args) {
    const float* x = static_cast<const float*>(args.at(DNNL_ARG_SRC).get_data_handle());
    int8_t* qx = static_cast<int8_t*>(args.at(DNNL_ARG_DST).get_data_handle());
    float* am = static_cast<float*>(args.at(DNNL_ARG_DST_1).get_data_handle());
    const float* si = smooth->empty() ? nullptr : smooth->data();
#pragma omp parallel for schedule(static) if (m * k >= (1 << 15))
    for (int64_t r = 0; r < m; ++r) quantize_row_s8(x + r * ld, si, k, qx + r * k, am + r);
  };
  p.push_kernel(std::move(quantize), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, q}, {DNNL_ARG_DST_1, amax}},
                memory::desc(), name + ":quantize", "gml:row_quantize_s8");

  if (exact_gemm) {
    gemm_step(p, q, amax, dst, sum_src, weight, n, k, w_scales, bias, eltwise, name);
    return;
  }
  // Step 2: the matmul. The caller's [N, K] int8 rows are the [K, N] weights in column-major order.
  memory::desc user_w({1, k, n}, dt::s8, memory::dims{k * n, 1, k});
  memory::desc any_w({1, k, n}, dt::s8, memory::format_tag::any);
  dnnl::primitive_attr attr;
  std::vector<std::pair<int, memory>> consts;
  attr.set_scales_mask(DNNL_ARG_WEIGHTS, w_scales.size() > 1 ? 1 << 2 : 0);  // per N
  f32_constant(consts, w_scales, DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS);
  dnnl::post_ops po;
  po.append_binary(dnnl::algorithm::binary_mul, amax_md);  // post-op 0: * amax[m], broadcast over N
  memory::desc bias_md({1, 1, n}, dt::f32, memory::format_tag::abc);
  if (bias) po.append_binary(dnnl::algorithm::binary_add, bias_md);  // post-op 1: + bias[n], over M
  append_eltwise(po, eltwise);
  // the residual add after the linear (transformer_rules._fuse_into_dynamic_linear): + sum_src[m, n]
  const int sum_index = 1 + (bias ? 1 : 0) + static_cast<int>(eltwise.size());
  if (sum_src >= 0) {
    if (p.md_in(sum_src).get_dims() != memory::dims{1, m, n})
      throw std::invalid_argument("gml engine: dynamic_linear's residual must be [1, M, N]");
    po.append_binary(dnnl::algorithm::binary_add, p.md_in(sum_src));
  }
  attr.set_post_ops(po);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto pd = dnnl::matmul::primitive_desc(cpu_engine(), q_md, any_w, dst_md, attr);
  p.resolve(dst, pd.dst_desc());
  consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
  if (bias) consts.emplace_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1, copy_constant(bias, bias_md));
  std::vector<std::pair<int, int>> args{
      {DNNL_ARG_SRC, q}, {DNNL_ARG_DST, dst}, {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, amax}};
  if (sum_src >= 0) args.emplace_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(sum_index) | DNNL_ARG_SRC_1, sum_src);
  p.push(dnnl::matmul(pd), std::move(args), std::move(consts), pd.scratchpad_desc(), name);
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(DynamicLinearStep,
        src, dst, q, amax, weight, wdims, w_scales, bias, smooth_inv, eltwise, name, sum_src, exact_gemm)

}  // namespace gml_engine
