// GML engine: executes a planned GML graph segment as oneDNN primitives.
//
// The Python side (src/gml/runtime/) does all graph work: it translates each lowered node into one
// of the op calls below, infers every value's shape and strides, and plans an activation arena from
// value lifetimes. This file only turns that plan into oneDNN primitives, once per input shape, the
// way oneDNN's own examples do (examples/primitives/convolution.cpp, cnn_inference_int8.cpp):
//
//   * a primitive descriptor per op, weights described with format_tag::any and reordered once
//     into the layout the primitive picks; scales / zero points / bias kept as constant memories;
//   * activations are plain strided memories (u8 NHWC as the Python executor keeps them), placed
//     at planned offsets in one arena or in the caller's input / output tensors; a value added
//     with no strides is "free": its producer's primitive picks its layout (format_tag::any, e.g.
//     fp32 nChw16c on AVX-512), and the Python side plans its bytes after the steps exist
//     (value_bytes / set_offset, see gml/runtime/plan.py); tie() gives a value another's layout
//     (the residual sum accumulates in the skip value's memory and layout);
//   * run() executes the primitive list on a stream with the GIL released.
//
// Concurrency: primitives are immutable after creation and may run from several threads at once.
// Everything a run writes (arena, scratchpad, memory objects whose data handle changes per call)
// lives in a Context; a run takes a free Context from a pool (or makes one), so concurrent calls
// never share one.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "attention.h"
#include "int8_gemm_avx2.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "winograd.h"
#include "woq.h"

namespace nb = nanobind;
using dnnl::memory;
using dt = dnnl::memory::data_type;

namespace {

using Dims = std::vector<int64_t>;
using QP = std::optional<std::pair<float, int>>;                  // (scale, zero point) or none
using Eltwise = std::vector<std::tuple<std::string, float, float>>;  // (algorithm, alpha, beta)

constexpr size_t kAlign = 64;

dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dt parse_dtype(const std::string& s) {
  if (s == "u8") return dt::u8;
  if (s == "s8") return dt::s8;
  if (s == "f32") return dt::f32;
  if (s == "bf16") return dt::bf16;  // bf16 conv / inner product / reorder (gml.kernels.bf16)
  if (s == "s32") return dt::s32;
  // int64 (token ids, read only by the embedding kernel): oneDNN has no s64, so the values are
  // described with the other 8-byte type; no primitive ever reads them
  if (s == "s64") return dt::f64;
  if (s == "bf16") return dt::bf16;
  throw std::invalid_argument("gml engine: unsupported dtype '" + s + "'");
}

dnnl::algorithm parse_eltwise(const std::string& s) {
  using A = dnnl::algorithm;
  if (s == "relu") return A::eltwise_relu;
  if (s == "clip") return A::eltwise_clip;  // hardtanh(alpha, beta)
  if (s == "hardswish") return A::eltwise_hardswish;
  if (s == "swish") return A::eltwise_swish;
  if (s == "linear") return A::eltwise_linear;  // alpha * x + beta
  if (s == "gelu_erf") return A::eltwise_gelu_erf;
  if (s == "gelu_tanh") return A::eltwise_gelu_tanh;
  if (s == "logistic") return A::eltwise_logistic;
  if (s == "hardsigmoid") return A::eltwise_hardsigmoid;  // max(0, min(1, alpha * x + beta))
  if (s == "tanh") return A::eltwise_tanh;
  throw std::invalid_argument("gml engine: unsupported eltwise post-op '" + s + "'");
}

// A fixed memory block owned by the plan (weights, bias, scales, zero points).
struct Constant {
  std::shared_ptr<void> data;
  memory mem;
};

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

std::shared_ptr<void> aligned_buffer(size_t bytes) {
  size_t n = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, n == 0 ? kAlign : n);
  if (p == nullptr) throw std::bad_alloc();
  return std::shared_ptr<void>(p, AlignedFree());
}

// Where a value's bytes live: in the arena, or in the k-th input / output of run().
// kConst: plan-owned bytes (add_constant), e.g. a causal attention mask.
enum class Where : int { kArena = 0, kInput = 1, kOutput = 2, kConst = 3 };

struct Value {
  memory::desc md;  // format_tag::any until its producer resolves it (a free value)
  Where where;
  int index;       // input / output number (unused for the arena)
  int64_t offset;  // bytes from the base
  bool free = false;
  int tie = -1;  // takes this value's layout
};

// A step that is not a oneDNN primitive (gml::dynamic_linear's per-row quantization): it reads and
// writes the memories of its args map, as a primitive would.
using Kernel = std::function<void(const std::unordered_map<int, memory>&)>;

struct Step {
  dnnl::primitive prim;  // empty for a Kernel step
  Kernel kernel;
  std::vector<std::pair<int, int>> value_args;  // (DNNL_ARG_*, value id)
  std::vector<std::pair<int, memory>> const_args;
  memory::desc scratchpad_md;
  std::string name;
  std::string impl = "gml:row_quantize_s8";  // what step_impls() reports for a Kernel step
};

// Per-call mutable state (see the file comment).
struct Context {
  std::shared_ptr<void> arena, scratch;
  std::vector<memory> values;
  std::vector<std::unordered_map<int, memory>> args;
  dnnl::stream stream;
};

// ---------------------------------------------------------------- gml::dynamic_linear
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

__attribute__((target_clones("avx512f", "avx2", "default"))) void quantize_row_s8(
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

std::string isa_name();

class Plan {
 public:
  Plan() = default;

  int add_value(const Dims& dims, const Dims& strides, const std::string& dtype, int where, int index,
                int64_t offset) {
    if (!strides.empty() && dims.size() != strides.size()) throw std::invalid_argument("gml engine: dims/strides rank mismatch");
    if (where < 0 || where > 2) throw std::invalid_argument("gml engine: bad value location");
    memory::dims d(dims.begin(), dims.end()), s(strides.begin(), strides.end());
    const bool free = strides.empty() && !dims.empty();
    if (free && where != 0) throw std::invalid_argument("gml engine: a free-layout value must live in the arena");
    memory::desc md = free ? memory::desc(d, parse_dtype(dtype), memory::format_tag::any)
                           : memory::desc(d, parse_dtype(dtype), s);
    values_.push_back(Value{md, static_cast<Where>(where), index, offset, free, -1});
    if (where == 1 && index + 1 > n_inputs_) n_inputs_ = index + 1;
    if (where == 2 && index + 1 > n_outputs_) n_outputs_ = index + 1;
    return static_cast<int>(values_.size()) - 1;
  }

  // Convolution, INT8 (u8 src, s8 weights, per-channel or per-tensor weight scales) or fp32.
  // ``weight`` points at a contiguous [O, I/groups, k...] tensor copied (reordered) here, never kept.
  void conv(int src, int dst, uintptr_t weight, const Dims& wdims, const std::string& wdtype,
            const std::vector<float>& w_scales, uintptr_t bias, const Dims& strides, const Dims& dilation,
            const Dims& pad_l, const Dims& pad_r, int64_t groups, QP src_q, QP dst_q, QP sum,
            const Eltwise& eltwise, const std::string& name, int nthreads, int winograd, bool native_bf16) {
    const memory::desc src_md = md_in(src);
    const memory::desc dst_md = md_out(dst);
    const bool quant = wdtype == "s8";
    // User weights: [O, I/g, k...] contiguous, as [g, O/g, I/g, k...] when grouped (same bytes).
    memory::dims wd(wdims.begin(), wdims.end());
    const int nsp = static_cast<int>(wd.size()) - 2;
    if (nsp < 1 || nsp > 3) throw std::invalid_argument("gml engine: conv weight must be 3-D to 5-D");
    check_conv_geometry(src_md, dst_md, wdims, strides, dilation, pad_l, pad_r, groups);
    if (groups > 1) {
      wd[0] /= groups;
      wd.insert(wd.begin(), groups);
    }
    memory::desc user_w(wd, parse_dtype(wdtype), plain_strides(wd));
    memory::desc any_w(wd, parse_dtype(wdtype), memory::format_tag::any);
    const int64_t oc = wdims[0];
    memory::desc bias_md = bias ? memory::desc({oc}, dt::f32, memory::format_tag::a) : memory::desc();

    dnnl::primitive_attr attr;
    dnnl::post_ops po;
    if (sum) po.append_sum(sum->first, sum->second);
    append_eltwise(po, eltwise);
    attr.set_post_ops(po);
    std::vector<std::pair<int, memory>> consts;
    if (quant) add_quant_attrs(attr, consts, src_q, dst_q, w_scales, groups > 1 ? 3 : 1);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);

    memory::dims st(strides.begin(), strides.end()), dl(dilation.begin(), dilation.end());
    memory::dims pl(pad_l.begin(), pad_l.end()), pr(pad_r.begin(), pad_r.end());
    auto pd = dnnl::convolution_forward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct, src_md, any_w,
        bias_md, dst_md, st, dl, pl, pr, attr);
    resolve(dst, pd.dst_desc());
    consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
    if (bias) consts.emplace_back(DNNL_ARG_BIAS, copy_constant(bias, bias_md));
    dnnl::convolution_forward prim(pd);
    if (!quant && winograd > 0 &&
        try_winograd(src, dst, weight, wdims, wdtype, bias, strides, dilation, pad_l, pad_r, groups, sum, eltwise,
                     name, nthreads, winograd == 1, native_bf16, prim, consts, pd.scratchpad_desc()))
      return;
    push(prim, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, std::move(consts), pd.scratchpad_desc(), name);
  }

  // An fp32 / bf16 conv as Winograd F(2x2, 3x3) (native/winograd.h, docs/adr/010-winograd-conv.md):
  // for a 2-D 3x3 conv, stride 1, dilation 1, groups 1, padding 1, NHWC dense src and dst of the
  // weights' type, post-ops within winograd.h's Epilogue. GML_WINOGRAD=auto (gml.runtime.plan's
  // winograd_mode) times it against ``direct`` (the oneDNN primitive conv() made, on dummy buffers,
  // ``nthreads`` threads) and takes it when it is at least 10% faster; the choice is cached per
  // problem in the process (``force``: GML_WINOGRAD=1, no timing). Pushes a Kernel step and
  // returns true, or returns false (the caller pushes ``direct``).
  bool try_winograd(int src, int dst, uintptr_t weight, const Dims& wdims, const std::string& wdtype, uintptr_t bias,
                    const Dims& strides, const Dims& dilation, const Dims& pad_l, const Dims& pad_r, int64_t groups,
                    QP sum, const Eltwise& eltwise, const std::string& name, int nthreads, bool force,
                    bool native_bf16, const dnnl::primitive& direct, const std::vector<std::pair<int, memory>>& consts,
                    const memory::desc& direct_scratch) {
    const memory::desc s = md_in(src), d = md_in(dst);
    const dt type = s.get_data_type();
    gml_winograd::Epilogue epi;
    if ((type != dt::f32 && type != dt::bf16) || d.get_data_type() != type || parse_dtype(wdtype) != type) return false;
    if (wdims.size() != 4 || wdims[2] != 3 || wdims[3] != 3 || groups != 1) return false;
    const memory::dims src_dims = s.get_dims();
    if (std::any_of(src_dims.begin(), src_dims.end(), [](int64_t d) { return d <= 0; }))
      return false;  // an empty batch: the direct conv (a no-op in oneDNN); Winograd has no tiles to plan
    if (strides != Dims{1, 1} || dilation != Dims{0, 0} || pad_l != Dims{1, 1} || pad_r != Dims{1, 1}) return false;
    if ((sum && sum->second != 0) || !gml_winograd::parse_eltwise(eltwise, epi)) return false;
    const memory::dims sd = s.get_dims(), dd = d.get_dims();
    if (sd.size() != 4) return false;
    const int64_t n = sd[0], c = sd[1], h = sd[2], w = sd[3], k = wdims[0];
    if (dd != memory::dims{n, k, h, w} || wdims[1] != c || !nhwc_dense(s) || !nhwc_dense(d))
      return false;
    if (sum) epi.sum = true, epi.sum_scale = sum->first;

    std::string key = std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" +
                      std::to_string(w) + ">" + std::to_string(k) + (type == dt::f32 ? ":f32" : ":bf16") +
                      (bias ? ":bias" : "") + (sum ? ":sum" + std::to_string(sum->first) : "") + ":" + isa_name() +
                      (native_bf16 ? ":nbf16" : "") +
                      ":t" + std::to_string(nthreads > 0 ? nthreads : omp_get_max_threads());
    for (const auto& [alg, alpha, beta] : eltwise)
      key += ":" + alg + std::to_string(alpha) + "," + std::to_string(beta);
    static std::mutex cache_mu;
    static std::unordered_map<std::string, bool> cache;  // problem -> Winograd measured faster
    if (!force) {
      std::lock_guard<std::mutex> lock(cache_mu);
      auto it = cache.find(key);
      if (it != cache.end() && !it->second) return false;
    }
    std::shared_ptr<const gml_winograd::Conv> conv;
    try {
      conv = std::make_shared<const gml_winograd::Conv>(cpu_engine(), n, c, h, w, k, type,
                                                         reinterpret_cast<const void*>(weight), type,
                                                         reinterpret_cast<const float*>(bias), epi, native_bf16);
    } catch (const dnnl::error&) {
      return false;  // no matmul for this problem: the direct conv
    }
    if (!force) {
      bool known = false, faster = false;
      {
        std::lock_guard<std::mutex> lock(cache_mu);
        auto it = cache.find(key);
        if ((known = it != cache.end())) faster = it->second;
      }
      if (!known) {
        faster = winograd_faster(*conv, s, d, direct, consts, direct_scratch, nthreads);
        std::lock_guard<std::mutex> lock(cache_mu);
        cache.emplace(key, faster);
      }
      if (!faster) return false;
    }
    Kernel kernel = [conv](const std::unordered_map<int, memory>& args) {
      conv->run(args.at(DNNL_ARG_SRC).get_data_handle(), args.at(DNNL_ARG_DST).get_data_handle(),
                args.at(DNNL_ARG_SCRATCHPAD).get_data_handle());
    };
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    // the scratchpad holds V, M and the matmul's own scratchpad (per Context: concurrent runs never share it)
    Step step{dnnl::primitive(), std::move(kernel), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, {},
              memory::desc({static_cast<int64_t>(conv->scratch_bytes())}, dt::u8, memory::format_tag::a), name};
    step.impl = conv->impl();
    steps_.push_back(std::move(step));
    return true;
  }

  // Times ``direct`` and ``conv`` alternately on zero-filled dummy buffers (one warm-up call each,
  // then the best of 3): whether Winograd takes at most 0.9x the direct conv's time.
  static bool winograd_faster(const gml_winograd::Conv& conv, const memory::desc& s, const memory::desc& d,
                              const dnnl::primitive& direct, const std::vector<std::pair<int, memory>>& consts,
                              const memory::desc& direct_scratch, int nthreads) {
    if (nthreads > 0) omp_set_num_threads(nthreads);
    auto src = aligned_buffer(s.get_size()), dst = aligned_buffer(d.get_size());
    const size_t scratch_bytes = std::max(conv.scratch_bytes(), direct_scratch.get_size());
    auto scratch = aligned_buffer(scratch_bytes);
    std::memset(src.get(), 0, s.get_size());
    std::memset(dst.get(), 0, d.get_size());
    std::memset(scratch.get(), 0, scratch_bytes);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(s, cpu_engine(), src.get())},
                                         {DNNL_ARG_DST, memory(d, cpu_engine(), dst.get())}};
    for (const auto& [arg, m] : consts) args.emplace(arg, m);
    if (direct_scratch.get_size() > 0)
      args.emplace(DNNL_ARG_SCRATCHPAD, memory(direct_scratch, cpu_engine(), scratch.get()));
    dnnl::stream stream(cpu_engine());
    using clock = std::chrono::steady_clock;
    double best_direct = 1e30, best_wino = 1e30;
    for (int rep = 0; rep < 4; ++rep) {
      auto t0 = clock::now();
      direct.execute(stream, args);
      stream.wait();
      auto t1 = clock::now();
      conv.run(src.get(), dst.get(), scratch.get());
      auto t2 = clock::now();
      if (rep == 0) continue;  // warm-up
      best_direct = std::min(best_direct, std::chrono::duration<double>(t1 - t0).count());
      best_wino = std::min(best_wino, std::chrono::duration<double>(t2 - t1).count());
    }
    return best_wino <= 0.9 * best_direct;
  }

  // Inner product (Linear) on a 2-D src: INT8 or fp32, like conv().
  void inner_product(int src, int dst, uintptr_t weight, const Dims& wdims, const std::string& wdtype,
                     const std::vector<float>& w_scales, uintptr_t bias, QP src_q, QP dst_q,
                     const Eltwise& eltwise, const std::string& name) {
    const bool quant = wdtype == "s8";
    memory::dims wd(wdims.begin(), wdims.end());
    if (wd.size() != 2) throw std::invalid_argument("gml engine: inner product weight must be 2-D");
    memory::desc user_w(wd, parse_dtype(wdtype), memory::format_tag::ab);
    memory::desc any_w(wd, parse_dtype(wdtype), memory::format_tag::any);
    memory::desc bias_md = bias ? memory::desc({wd[0]}, dt::f32, memory::format_tag::a) : memory::desc();
    dnnl::primitive_attr attr;
    dnnl::post_ops po;
    append_eltwise(po, eltwise);
    attr.set_post_ops(po);
    std::vector<std::pair<int, memory>> consts;
    if (quant) add_quant_attrs(attr, consts, src_q, dst_q, w_scales, 1);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::inner_product_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_inference,
                                                          md_in(src), any_w, bias_md, md_out(dst), attr);
    resolve(dst, pd.dst_desc());
    consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
    if (bias) consts.emplace_back(DNNL_ARG_BIAS, copy_constant(bias, bias_md));
    push(dnnl::inner_product_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, std::move(consts),
         pd.scratchpad_desc(), name);
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
  void dynamic_linear(int src, int dst, int q, int amax, uintptr_t weight, const Dims& wdims,
                      const std::vector<float>& w_scales, uintptr_t bias, const std::vector<float>& smooth_inv,
                      const Eltwise& eltwise, const std::string& name, int sum_src, bool exact_gemm) {
    const memory::desc src_md = md_in(src), q_md = md_in(q), amax_md = md_in(amax), dst_md = md_out(dst);
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
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    steps_.push_back(Step{dnnl::primitive(), std::move(quantize),
                          {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, q}, {DNNL_ARG_DST_1, amax}}, {}, memory::desc(),
                          name + ":quantize"});

    if (exact_gemm) {
      gemm_step(q, amax, dst, sum_src, weight, n, k, w_scales, bias, eltwise, name);
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
      if (md_in(sum_src).get_dims() != memory::dims{1, m, n})
        throw std::invalid_argument("gml engine: dynamic_linear's residual must be [1, M, N]");
      po.append_binary(dnnl::algorithm::binary_add, md_in(sum_src));
    }
    attr.set_post_ops(po);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::matmul::primitive_desc(cpu_engine(), q_md, any_w, dst_md, attr);
    resolve(dst, pd.dst_desc());
    consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
    if (bias) consts.emplace_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1, copy_constant(bias, bias_md));
    std::vector<std::pair<int, int>> args{
        {DNNL_ARG_SRC, q}, {DNNL_ARG_DST, dst}, {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, amax}};
    if (sum_src >= 0) args.emplace_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(sum_index) | DNNL_ARG_SRC_1, sum_src);
    push(dnnl::matmul(pd), std::move(args), std::move(consts), pd.scratchpad_desc(), name);
  }

  // dynamic_linear's step 2 as GML's exact int8 GEMM (native/int8_gemm_avx2.h), one Kernel step:
  //   z = relu?(((float(q . w) * w_scales[n]) * amax[m]) + bias[n])          (the GEMM's epilogue)
  //   z = eltwise(z)   other post-ops (GELU): oneDNN eltwise primitives, in place on dense rows
  //   dst = z + residual[m, n]                                                 (if any)
  // the operations and their order of the oneDNN matmul's post-op chain. The eltwise runs on dst when
  // its rows are dense, else on a dense copy in the scratchpad (copied out after, exactly).
  void gemm_step(int q, int amax, int dst, int sum_src, uintptr_t weight, int64_t n, int64_t k,
                 const std::vector<float>& w_scales, uintptr_t bias, const Eltwise& eltwise, const std::string& name) {
    const memory::desc dst_md = md_in(dst);
    const int64_t m = dst_md.get_dims()[1];
    const int64_t ldy = m > 1 ? dst_md.get_strides()[1] : n;
    if (n > 1 && dst_md.get_strides()[2] != 1) throw std::invalid_argument("gml engine: dynamic_linear output columns must be dense");
    int64_t ldr = 0;
    if (sum_src >= 0) {
      const memory::desc r = md_in(sum_src);
      if (r.get_data_type() != dt::f32 || (n > 1 && r.get_strides()[2] != 1))
        throw std::invalid_argument("gml engine: dynamic_linear's residual must be f32 with dense columns");
      ldr = m > 1 ? r.get_strides()[1] : n;
    }
    auto gemm = std::make_shared<const gml_int8_gemm::Gemm>(reinterpret_cast<const int8_t*>(weight), n, k, k, w_scales,
                                                             reinterpret_cast<const float*>(bias));
    // the epilogue's ReLU is exact in the kernel; other activations are oneDNN eltwise primitives
    bool relu = false;
    std::vector<dnnl::eltwise_forward> acts;
    std::string impl = "gml:int8_gemm_avx2";
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
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    std::vector<std::pair<int, int>> args{{DNNL_ARG_SRC, q}, {DNNL_ARG_SRC_1, amax}, {DNNL_ARG_DST, dst}};
    if (has_res) args.emplace_back(DNNL_ARG_SRC_2, sum_src);
    Step step{dnnl::primitive(), std::move(kernel), std::move(args), {},
              memory::desc({static_cast<int64_t>(scratch)}, dt::u8, memory::format_tag::a), name};
    step.impl = impl;
    steps_.push_back(std::move(step));
  }

  // Reorder: layout change, quantize (f32 -> u8, dst_q), dequantize (u8 -> f32, src_q) or
  // requantize (both). real = (q - zp) * scale on either side.
  void reorder(int src, int dst, QP src_q, QP dst_q, const std::string& name) {
    dnnl::primitive_attr attr;
    std::vector<std::pair<int, memory>> consts;
    if (src_q) add_qparams(attr, consts, DNNL_ARG_SRC, *src_q);
    if (dst_q) add_qparams(attr, consts, DNNL_ARG_DST, *dst_q);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (!resolved(dst)) resolve(dst, md_in(src));  // a free destination takes the source's layout
    auto pd = dnnl::reorder::primitive_desc(cpu_engine(), md_in(src), cpu_engine(), md_in(dst), attr);
    push(dnnl::reorder(pd), {{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, dst}}, std::move(consts), pd.scratchpad_desc(),
         name);
  }

  // Max / average pooling; requantization (if any) is an eltwise ``linear`` post-op.
  void pool(int src, int dst, const std::string& alg, const Dims& kernel, const Dims& strides, const Dims& dilation,
            const Dims& pad_l, const Dims& pad_r, const Eltwise& eltwise, const std::string& name) {
    dnnl::algorithm a;
    if (alg == "max") a = dnnl::algorithm::pooling_max;
    else if (alg == "avg_include") a = dnnl::algorithm::pooling_avg_include_padding;
    else if (alg == "avg_exclude") a = dnnl::algorithm::pooling_avg_exclude_padding;
    else throw std::invalid_argument("gml engine: unknown pooling '" + alg + "'");
    dnnl::primitive_attr attr;
    dnnl::post_ops po;
    append_eltwise(po, eltwise);
    attr.set_post_ops(po);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const int src_rank = md_in(src).get_ndims();
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
                                                    md_in(src), md_out(dst), st, k, dl, pl, pr, attr);
    resolve(dst, pd.dst_desc());
    push(dnnl::pooling_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, {}, pd.scratchpad_desc(), name);
  }

  // Element-wise binary op: dst = post_ops(scale0 * src0 <alg> scale1 * src1).
  void binary(int src0, int src1, int dst, const std::string& alg, std::optional<float> scale0,
              std::optional<float> scale1, const Eltwise& eltwise, const std::string& name) {
    dnnl::algorithm a;
    if (alg == "add") a = dnnl::algorithm::binary_add;
    else if (alg == "mul") a = dnnl::algorithm::binary_mul;
    else if (alg == "max") a = dnnl::algorithm::binary_max;
    else throw std::invalid_argument("gml engine: unknown binary op '" + alg + "'");
    dnnl::primitive_attr attr;
    dnnl::post_ops po;
    append_eltwise(po, eltwise);
    attr.set_post_ops(po);
    std::vector<std::pair<int, memory>> consts;
    if (scale0) add_scale(attr, consts, DNNL_ARG_SRC_0, *scale0);
    if (scale1) add_scale(attr, consts, DNNL_ARG_SRC_1, *scale1);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::binary::primitive_desc(cpu_engine(), a, md_in(src0), md_in(src1), md_out(dst), attr);
    resolve(dst, pd.dst_desc());
    push(dnnl::binary(pd), {{DNNL_ARG_SRC_0, src0}, {DNNL_ARG_SRC_1, src1}, {DNNL_ARG_DST, dst}}, std::move(consts),
         pd.scratchpad_desc(), name);
  }

  // Concatenation along ``axis`` (same dtype and qparams on every input: the caller requantizes).
  void concat(const std::vector<int>& srcs, int dst, int axis, const std::string& name) {
    std::vector<memory::desc> mds;
    std::vector<std::pair<int, int>> args{{DNNL_ARG_DST, dst}};
    for (size_t i = 0; i < srcs.size(); ++i) {
      mds.push_back(md_in(srcs[i]));
      args.emplace_back(DNNL_ARG_MULTIPLE_SRC + static_cast<int>(i), srcs[i]);
    }
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::concat::primitive_desc(cpu_engine(), md_out(dst), axis, mds, attr);
    resolve(dst, pd.dst_desc());
    push(dnnl::concat(pd), std::move(args), {}, pd.scratchpad_desc(), name);
  }

  // ---------------------------------------------------------------- transformer ops (#15 / #14)
  // Post-ops of matmul(), applied in order to the fp32 accumulator: an eltwise (algorithm, alpha,
  // beta, -1) as in Eltwise, or ("binary_add" | "binary_mul", 0, 0, value id): a value whose dims
  // equal dst's or are 1 where it broadcasts (an attention mask, a residual).
  using PostOps = std::vector<std::tuple<std::string, float, float, int>>;

  // dst = post_ops(src @ wei [+ bias]): 2-D or batched (batch dims of size 1 broadcast), fp32 or
  // bf16 sources with fp32 accumulation, any strided layouts (a transposed K is a stride swap).
  // ``wei`` is a value (activation x activation: attention's Q.K^T and P.V), or, when wei < 0, a
  // constant [K, N] at ``weight`` with strides ``wstrides`` (a Linear's [N, K] weight seen
  // transposed), reordered once into the layout the primitive picks. ``bias``: N fp32 values.
  void matmul(int src, int wei, int dst, uintptr_t weight, const Dims& wdims, const Dims& wstrides,
              const std::string& wdtype, uintptr_t bias, const PostOps& post, const std::string& name) {
    const memory::desc dst_md = md_out(dst);
    const int rank = dst_md.get_ndims();
    dnnl::primitive_attr attr;
    dnnl::post_ops po;
    std::vector<std::pair<int, int>> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}};
    int index = 0;
    for (const auto& [alg, alpha, beta, value] : post) {
      if (alg == "binary_add" || alg == "binary_mul") {
        po.append_binary(alg == "binary_add" ? dnnl::algorithm::binary_add : dnnl::algorithm::binary_mul,
                         md_in(value));
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
      wei_md = md_in(wei);
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
    auto pd = dnnl::matmul::primitive_desc(cpu_engine(), md_in(src), wei_md, bias_md, dst_md, attr);
    resolve(dst, pd.dst_desc());
    if (wei < 0) consts.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
    if (bias) consts.emplace_back(DNNL_ARG_BIAS, copy_constant(bias, bias_md));
    push(dnnl::matmul(pd), std::move(args), std::move(consts), pd.scratchpad_desc(), name);
  }

  // A constant value read by steps (not by run()'s callers): the bytes at ``ptr`` (dense in the
  // given strides) are copied into the plan.
  int add_constant(const Dims& dims, const Dims& strides, const std::string& dtype, uintptr_t ptr) {
    if (dims.size() != strides.size()) throw std::invalid_argument("gml engine: dims/strides rank mismatch");
    memory::dims d(dims.begin(), dims.end()), st(strides.begin(), strides.end());
    memory::desc md(d, parse_dtype(dtype), st);
    std::shared_ptr<void> data = aligned_buffer(md.get_size());
    std::memcpy(data.get(), reinterpret_cast<void*>(ptr), md.get_size());
    const_data_.push_back(std::move(data));
    values_.push_back(Value{md, Where::kConst, static_cast<int>(const_data_.size()) - 1, 0, false, -1});
    return static_cast<int>(values_.size()) - 1;
  }

  // Softmax along ``axis`` (softmax_accurate: max subtracted, fp32 math); src / dst f32 or bf16.
  // nn.Embedding's lookup, a Kernel step: dst[i, :] = table[ids[i], :] for every id (int64, any
  // rank and strides) into a dense [..., dim] dst (f32 or bf16, the table's dtype). ``table`` points
  // at the caller's [num, dim] rows (``ld`` elements apart). It is NOT copied (a vocabulary is tens
  // of MB and a segment keeps up to 8 plans): the Python side keeps the tensor alive with the plan
  // (Plan.keep). An id outside [0, num) throws std::out_of_range (an IndexError in Python).
  void embedding(int ids, int dst, uintptr_t table, int64_t num, int64_t dim, int64_t ld, const std::string& name) {
    const memory::desc ids_md = md_in(ids), dst_md = md_out(dst);
    if (ids_md.get_data_type() != dt::f64) throw std::invalid_argument("gml engine: embedding ids must be int64");
    const dt wdt = dst_md.get_data_type();
    if (wdt != dt::f32 && wdt != dt::bf16) throw std::invalid_argument("gml engine: embedding of f32 / bf16 rows");
    const memory::dims idims = ids_md.get_dims(), istr = ids_md.get_strides();
    memory::dims want = idims;
    want.push_back(dim);
    if (dst_md.get_dims() != want || dst_md.get_strides() != plain_strides(want))
      throw std::invalid_argument("gml engine: embedding writes a dense [..., dim] destination");
    if (num <= 0 || dim <= 0 || ld < dim) throw std::invalid_argument("gml engine: bad embedding table");
    const size_t item = wdt == dt::f32 ? 4 : 2;
    const char* rows = reinterpret_cast<const char*>(table);
    Kernel gather = [idims, istr, rows, num, dim, ld, item](const std::unordered_map<int, memory>& args) {
      const int64_t* id = static_cast<const int64_t*>(args.at(DNNL_ARG_SRC).get_data_handle());
      char* out = static_cast<char*>(args.at(DNNL_ARG_DST).get_data_handle());
      int64_t n = 1;
      for (int64_t d : idims) n *= d;
      const int rank = static_cast<int>(idims.size());
      for (int64_t i = 0; i < n; ++i) {
        int64_t off = 0, rest = i;  // element i of the ids in logical order -> its strided offset
        for (int d = rank - 1; d >= 0; --d) {
          off += (rest % idims[d]) * istr[d];
          rest /= idims[d];
        }
        const int64_t v = id[off];
        if (v < 0 || v >= num)
          throw std::out_of_range("gml engine: embedding id " + std::to_string(v) + " is outside the table's [0, " +
                                  std::to_string(num) + ") (a token id the model's vocabulary does not have)");
        std::memcpy(out + i * dim * item, rows + v * ld * item, dim * item);
      }
    };
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    Step step{dnnl::primitive(), std::move(gather), {{DNNL_ARG_SRC, ids}, {DNNL_ARG_DST, dst}}, {}, memory::desc(), name};
    step.impl = "gml:embedding_gather";
    steps_.push_back(std::move(step));
  }

  // The small integer / bool ops of a padding mask's arithmetic (transformers' mask builder), as Kernel
  // steps: strided loops over the dense destination ``dst`` (rank R). Each source is read through
  // ``strides[i]`` (R entries, in elements, 0 along a broadcast dim), computed by the Python side.
  //   "ne0":   dst = (src0 != 0)                       int64 -> bool (u8)
  //   "and":   dst = src0 & src1                       bool
  //   "index": dst[j.., r..] = src0[i1[j..], .., ik[j..], r..]   (aten.index with k int64 index
  //            tensors src1..srck on src0's leading dims; ``index_dims`` / ``index_strides``: src0's
  //            sizes / strides of those dims; an index outside [-size, size) throws)
  void mask_op(const std::string& op, const std::vector<int>& srcs, int dst, const std::vector<Dims>& strides,
               const Dims& index_dims, const Dims& index_strides, const std::string& name) {
    const memory::desc dst_md = md_out(dst);
    const memory::dims shape = dst_md.get_dims();
    if (dst_md.get_strides() != plain_strides(shape)) throw std::invalid_argument("gml engine: mask op writes dense");
    if (strides.size() != srcs.size()) throw std::invalid_argument("gml engine: mask op strides per source");
    for (const auto& st : strides)
      if (st.size() != shape.size()) throw std::invalid_argument("gml engine: mask op strides of rank R");
    int kind;
    if (op == "ne0" && srcs.size() == 1) kind = 0;
    else if (op == "and" && srcs.size() == 2) kind = 1;
    else if (op == "index" && srcs.size() == index_dims.size() + 1 && index_dims.size() == index_strides.size()) kind = 2;
    else throw std::invalid_argument("gml engine: unknown mask op '" + op + "'");
    const size_t item0 = memory::data_type_size(md_in(srcs[0]).get_data_type());  // index: any dtype
    if (kind == 2 ? dst_md.get_data_type() != md_in(srcs[0]).get_data_type() : dst_md.get_data_type() != dt::u8)
      throw std::invalid_argument("gml engine: mask op " + op + " of these dtypes");
    const int ns = static_cast<int>(srcs.size());
    Kernel k = [kind, shape, strides, index_dims, index_strides, ns, item0](const std::unordered_map<int, memory>& args) {
      const int rank = static_cast<int>(shape.size());
      std::vector<const char*> in(ns);
      for (int i = 0; i < ns; ++i) in[i] = static_cast<const char*>(args.at(DNNL_ARG_MULTIPLE_SRC + i).get_data_handle());
      char* out = static_cast<char*>(args.at(DNNL_ARG_DST).get_data_handle());
      const int64_t inner = rank ? shape[rank - 1] : 1;
      int64_t outer = 1;
      for (int d = 0; d + 1 < rank; ++d) outer *= shape[d];
      std::vector<int64_t> pos(std::max(rank - 1, 0), 0), base(ns, 0);
      const size_t out_item = kind == 2 ? item0 : 1;
      for (int64_t o = 0; o < outer; ++o) {
        for (int i = 0; i < ns; ++i) {
          int64_t b = 0;
          for (int d = 0; d + 1 < rank; ++d) b += pos[d] * strides[i][d];
          base[i] = b;
        }
        const int64_t last = rank ? rank - 1 : 0;
        char* dst_row = out + o * inner * out_item;
        for (int64_t j = 0; j < inner; ++j) {
          if (kind == 0) {
            const int64_t* x = reinterpret_cast<const int64_t*>(in[0]);
            dst_row[j] = x[base[0] + j * (rank ? strides[0][last] : 0)] != 0;
          } else if (kind == 1) {
            dst_row[j] = static_cast<char>((in[0][base[0] + j * (rank ? strides[0][last] : 0)] != 0) &
                                           (in[1][base[1] + j * (rank ? strides[1][last] : 0)] != 0));
          } else {
            int64_t off = base[0] + j * (rank ? strides[0][last] : 0);
            for (int i = 1; i < ns; ++i) {
              const int64_t* ix = reinterpret_cast<const int64_t*>(in[i]);
              int64_t v = ix[base[i] + j * (rank ? strides[i][last] : 0)];
              const int64_t size = index_dims[i - 1];
              if (v < -size || v >= size)
                throw std::out_of_range("gml engine: index " + std::to_string(v) + " is out of bounds for size " +
                                        std::to_string(size));
              if (v < 0) v += size;
              off += v * index_strides[i - 1];
            }
            std::memcpy(dst_row + j * item0, in[0] + off * item0, item0);
          }
        }
        for (int d = rank - 2; d >= 0; --d) {  // the next outer position (odometer)
          if (++pos[d] < shape[d]) break;
          pos[d] = 0;
        }
      }
    };
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    std::vector<std::pair<int, int>> value_args{{DNNL_ARG_DST, dst}};
    for (int i = 0; i < ns; ++i) value_args.emplace_back(DNNL_ARG_MULTIPLE_SRC + i, srcs[i]);
    Step step{dnnl::primitive(), std::move(k), std::move(value_args), {}, memory::desc(), name};
    step.impl = "gml:mask_" + op;
    steps_.push_back(std::move(step));
  }

  // gml.attention in one Kernel step (native/attention.h): O = softmax(scale * Q Kᵀ + masks) V, bf16
  // or fp32 q / k / v / out of one rank (batch dims of size 1 broadcast), unit last-dim strides; ``masks``:
  // additive fp32 values of that rank. The Python side calls it only when fused_attention_available().
  void attention(int q, int k, int v, int dst, const std::vector<int>& masks, float scale, const std::string& name) {
    if (!gml_attention::cpu_supported()) throw std::invalid_argument("gml engine: fused attention needs AVX512-BF16");
    if (!resolved(dst))
      resolve(dst, memory::desc(md_out(dst).get_dims(), md_in(q).get_data_type(), plain_strides(md_out(dst).get_dims())));
    const memory::desc od = md_in(dst);
    const memory::dims odims = od.get_dims();
    const int rank = static_cast<int>(odims.size());
    if (rank < 2) throw std::invalid_argument("gml engine: attention output of rank < 2");
    const int nb = rank - 2;
    gml_attention::Problem pb;
    pb.batch.assign(odims.begin(), odims.begin() + nb);
    // an operand's batch strides (0 where it broadcasts), row and column strides
    auto operand = [&](int id, dt want, const char* what) {
      const memory::desc md = md_in(id);
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
    const dt type = md_in(q).get_data_type();  // bf16, or fp32 (the same kernel with FMA for vdpbf16ps)
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
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    std::vector<std::pair<int, int>> value_args{{DNNL_ARG_DST, dst}, {DNNL_ARG_MULTIPLE_SRC, q},
                                                {DNNL_ARG_MULTIPLE_SRC + 1, k}, {DNNL_ARG_MULTIPLE_SRC + 2, v}};
    for (size_t i = 0; i < masks.size(); ++i) value_args.emplace_back(DNNL_ARG_MULTIPLE_SRC + 3 + static_cast<int>(i), masks[i]);
    Step step{dnnl::primitive(), std::move(kern), std::move(value_args), {}, memory::desc(), name};
    step.impl = pb.f32 ? "gml:attention_avx512_f32" : "gml:attention_avx512_bf16";
    steps_.push_back(std::move(step));
  }

  void softmax(int src, int dst, int axis, const std::string& name) {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::softmax_forward::primitive_desc(cpu_engine(), dnnl::prop_kind::forward_inference,
                                                    dnnl::algorithm::softmax_accurate, md_in(src), md_out(dst),
                                                    axis, attr);
    resolve(dst, pd.dst_desc());
    push(dnnl::softmax_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, {}, pd.scratchpad_desc(), name);
  }

  // Layer normalization over the last dim: dst = (src - mean) / sqrt(var + eps) * gamma + beta, the
  // statistics in fp32 whatever the data type (oneDNN's). src / dst f32 or bf16; gamma / beta: the
  // last dim's fp32 values, copied (0: not applied).
  void layer_norm(int src, int dst, uintptr_t gamma, uintptr_t beta, float eps, const std::string& name) {
    const memory::desc src_md = md_in(src);
    const int64_t c = src_md.get_dims().back();
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto flags = dnnl::normalization_flags::none;
    if (gamma) flags |= dnnl::normalization_flags::use_scale;
    if (beta) flags |= dnnl::normalization_flags::use_shift;
    auto pd = dnnl::layer_normalization_forward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::forward_inference, src_md, md_out(dst), eps, flags, attr);
    resolve(dst, pd.dst_desc());
    std::vector<std::pair<int, memory>> consts;
    const memory::desc param({c}, dt::f32, memory::format_tag::a);
    if (gamma) consts.emplace_back(DNNL_ARG_SCALE, copy_constant(gamma, param));
    if (beta) consts.emplace_back(DNNL_ARG_SHIFT, copy_constant(beta, param));
    push(dnnl::layer_normalization_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, std::move(consts),
         pd.scratchpad_desc(), name);
  }

  // ``v`` takes ``other``'s layout (resolved when either is first used).
  void tie(int v, int other) {
    val(v);
    val(other);
    if (!values_[v].free) throw std::invalid_argument("gml engine: only a free-layout value can be tied");
    values_[v].tie = other;
  }

  // Bytes of a value's (resolved) layout, for the arena plan of free values.
  int64_t value_bytes(int id) const { return static_cast<int64_t>(md_in(id).get_size()); }

  void set_offset(int id, int64_t offset) {
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    if (offset < 0) throw std::invalid_argument("gml engine: negative offset");
    values_[id_ok(id)].offset = offset;
  }

  // The layout a value has in the plan, as oneDNN prints it (e.g. "aBcd16b"), for reports / tests.
  std::string value_layout(int id) const {
    const memory::desc md = md_in(id);
    if (md.get_format_kind() != memory::format_kind::blocked) return "?";
    const dnnl_memory_desc_t c = md.get();
    int nblks = 0;
    dnnl::error::wrap_c_api(dnnl_memory_desc_query(c, dnnl_query_inner_nblks_s32, &nblks), "layout");
    std::string out;
    for (int64_t s : md.get_strides()) out += std::to_string(s) + ",";
    if (nblks > 0) {
      dnnl_dims_t *blks = nullptr, *idxs = nullptr;
      dnnl::error::wrap_c_api(dnnl_memory_desc_query(c, dnnl_query_inner_blks, &blks), "layout");
      dnnl::error::wrap_c_api(dnnl_memory_desc_query(c, dnnl_query_inner_idxs, &idxs), "layout");
      for (int i = 0; i < nblks; ++i) out += "/" + std::to_string((*blks)[i]) + "@" + std::to_string((*idxs)[i]);
    }
    return out;
  }

  // The bytes the caller's ``index``-th input (where 1) or output (where 2) tensor has from its data
  // pointer (first to last element). finalize() checks that every value placed in it lies inside: a
  // value reaching past it would make a primitive write past the caller's tensor, which no sanitizer
  // sees (oneDNN's JIT kernels are not instrumented; issue #24, HF Dinov2's pooler output).
  void external_bytes(int where, int index, int64_t bytes) {
    if ((where != 1 && where != 2) || index < 0 || bytes < 0) throw std::invalid_argument("gml engine: bad external size");
    auto& sizes = where == 1 ? in_bytes_ : out_bytes_;
    if (static_cast<int>(sizes.size()) <= index) sizes.resize(index + 1, -1);
    sizes[index] = bytes;
  }

  void finalize(int64_t arena_bytes) {
    if (arena_bytes < 0) throw std::invalid_argument("gml engine: negative arena size");
    for (size_t v = 0; v < values_.size(); ++v) {
      const Value& val = values_[v];
      if (val.where != Where::kInput && val.where != Where::kOutput) continue;
      const auto& sizes = val.where == Where::kInput ? in_bytes_ : out_bytes_;
      if (val.index >= static_cast<int>(sizes.size()) || sizes[val.index] < 0 || !resolved(static_cast<int>(v))) continue;
      const int64_t end = val.offset + extent_bytes(md_in(static_cast<int>(v)));
      if (end > sizes[val.index])
        throw std::runtime_error("gml engine: a value reaches past the caller's " +
                                 std::string(val.where == Where::kInput ? "input " : "output ") +
                                 std::to_string(val.index) + " (" + std::to_string(end) + " > " +
                                 std::to_string(sizes[val.index]) + " bytes)");
    }
    for (size_t v = 0; v < values_.size(); ++v)
      if (!resolved(static_cast<int>(v))) values_[v].md = memory::desc();  // never used by a step
    arena_bytes_ = arena_bytes;
    for (const auto& s : steps_) scratch_bytes_ = std::max(scratch_bytes_, s.scratchpad_md.get_size());
    finalized_ = true;
  }

  // One inference: inputs / outputs are data pointers of tensors laid out as planned.
  void run(const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs, int nthreads) {
    run_impl(inputs, outputs, nthreads, nullptr);
  }

  // run(), returning each step's wall time in µs (a profile: what each primitive / kernel step
  // costs in the plan, oneDNN's and GML's own alike; EngineModule.profile()).
  std::vector<double> run_timed(const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
                                int nthreads) {
    std::vector<double> times(steps_.size(), 0.0);
    run_impl(inputs, outputs, nthreads, &times);
    return times;
  }

 private:
  void run_impl(const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs, int nthreads,
                std::vector<double>* times) {
    if (!finalized_) throw std::runtime_error("gml engine: plan not finalized");
    // an input no step reads (a segment whose only node is dead code) is never added as a value
    if (static_cast<int>(inputs.size()) < n_inputs_ || static_cast<int>(outputs.size()) != n_outputs_)
      throw std::invalid_argument("gml engine: wrong number of inputs or outputs");
    if (nthreads > 0) omp_set_num_threads(nthreads);  // this OS thread's OpenMP team size
    std::unique_ptr<Context> ctx = acquire();
    for (size_t v = 0; v < values_.size(); ++v) {
      const Value& val = values_[v];
      if (val.where == Where::kArena || val.where == Where::kConst) continue;
      uintptr_t base = val.where == Where::kInput ? inputs[val.index] : outputs[val.index];
      ctx->values[v].set_data_handle(reinterpret_cast<void*>(base + val.offset));
    }
    try {
      for (size_t i = 0; i < steps_.size(); ++i) {
        const auto t0 = times ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
        if (steps_[i].kernel) steps_[i].kernel(ctx->args[i]);  // CPU primitives run synchronously: in order
        else steps_[i].prim.execute(ctx->stream, ctx->args[i]);
        if (times) {
          ctx->stream.wait();
          (*times)[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        }
      }
      ctx->stream.wait();
    } catch (...) {
      release(std::move(ctx));
      throw;
    }
    release(std::move(ctx));
  }

 public:
  size_t num_steps() const { return steps_.size(); }
  int64_t arena_bytes() const { return arena_bytes_; }
  size_t scratch_bytes() const { return scratch_bytes_; }
  std::vector<std::string> step_names() const {
    std::vector<std::string> out;
    for (const auto& s : steps_) out.push_back(s.name);
    return out;
  }
  // The implementation oneDNN picked for each step (e.g. "brg:avx512_core_vnni"), for reports.
  std::vector<std::string> step_impls() const {
    std::vector<std::string> out;
    for (const auto& s : steps_) {
      if (s.kernel) {
        out.emplace_back(s.impl);
        continue;
      }
      const_dnnl_primitive_desc_t cpd;
      dnnl::error::wrap_c_api(dnnl_primitive_get_primitive_desc(s.prim.get(), &cpd), "no primitive desc");
      const char* impl = nullptr;
      dnnl::error::wrap_c_api(dnnl_primitive_desc_query(cpd, dnnl_query_impl_info_str, 0, &impl), "no impl");
      out.emplace_back(impl ? impl : "?");
    }
    return out;
  }

 private:
  const Value& val(int id) const { return values_[id_ok(id)]; }

  int id_ok(int id) const {
    if (id < 0 || id >= static_cast<int>(values_.size())) throw std::invalid_argument("gml engine: bad value id");
    return id;
  }

  // The value whose layout ``id`` has (itself, or what it is tied to).
  int layout_root(int id) const {
    for (int hops = 0; values_[id_ok(id)].tie >= 0; ++hops) {
      if (hops > static_cast<int>(values_.size())) throw std::invalid_argument("gml engine: tie cycle");
      id = values_[id].tie;
    }
    return id;
  }

  bool resolved(int id) const {
    return values_[layout_root(id)].md.get_format_kind() != memory::format_kind::any;
  }

  // A value a step reads: its layout must be known by now.
  memory::desc md_in(int id) const {
    if (!resolved(id)) throw std::invalid_argument("gml engine: a free-layout value is read before it is written");
    return values_[layout_root(id)].md;
  }

  // A value a step writes: its layout, or format_tag::any for a free value not yet resolved.
  memory::desc md_out(int id) const { return values_[layout_root(id)].md; }

  void resolve(int id, const memory::desc& md) {
    Value& root = values_[layout_root(id)];
    if (root.md.get_format_kind() == memory::format_kind::any) root.md = md;
    if (id != layout_root(id)) values_[id].md = root.md;
  }

  // A conv's geometry, checked before oneDNN sees it (a crafted graph's stride of 0 made a division by
  // zero, issue #24): one entry per spatial dim; strides >= 1; dilation (oneDNN's: 0 = dense) and
  // left padding >= 0; groups >= 1 dividing both channel counts; source / weight / destination agreeing
  // on channels and batch; the output size the geometry gives.
  static void check_conv_geometry(const memory::desc& src, const memory::desc& dst, const Dims& wdims,
                                  const Dims& strides, const Dims& dilation, const Dims& pad_l, const Dims& pad_r,
                                  int64_t groups) {
    const size_t nsp = wdims.size() - 2;
    auto bad = [](const std::string& what) { throw std::invalid_argument("gml engine: conv " + what); };
    if (strides.size() != nsp || dilation.size() != nsp || pad_l.size() != nsp || pad_r.size() != nsp)
      bad("geometry of another rank than the weight's spatial dims");
    if (src.get_ndims() != static_cast<int>(nsp) + 2) bad("source of another rank than the weight");
    if (groups < 1) bad("groups must be >= 1");
    for (int64_t d : wdims)
      if (d < 1) bad("weight with an empty dim");
    if (wdims[0] % groups != 0) bad("output channels not divisible by groups");
    const memory::dims sd = src.get_dims();
    if (sd[1] != wdims[1] * groups) bad("source channels do not match the weight's input channels x groups");
    const bool dst_known = dst.get_ndims() == src.get_ndims();
    const memory::dims dd = dst_known ? dst.get_dims() : memory::dims();
    if (dst_known && (dd[0] != sd[0] || dd[1] != wdims[0])) bad("destination batch / channels do not match");
    for (size_t i = 0; i < nsp; ++i) {
      if (strides[i] < 1) bad("stride must be >= 1");
      // pad_r may be negative: the plan sets it so the geometry gives the executor's output size
      // (oneDNN takes that: a stride-2 conv whose last window would start past the input)
      if (dilation[i] < 0 || pad_l[i] < 0) bad("dilation and left padding must be >= 0");
      const int64_t span = (wdims[2 + i] - 1) * (dilation[i] + 1) + 1;
      const int64_t out = (sd[2 + i] + pad_l[i] + pad_r[i] - span) / strides[i] + 1;
      if (dst_known && sd[0] > 0 && dd[2 + i] != out) bad("destination size does not match the geometry");
    }
  }

  // Bytes from a plain strided value's first element to its last (0 for an empty one); a blocked
  // layout: its size.
  static int64_t extent_bytes(const memory::desc& md) {
    const memory::dims d = md.get_dims();
    for (int64_t x : d)
      if (x == 0) return 0;
    const dnnl_memory_desc_t c = md.get();
    int nblks = 0;
    if (md.get_format_kind() != memory::format_kind::blocked ||
        dnnl_memory_desc_query(c, dnnl_query_inner_nblks_s32, &nblks) != dnnl_success || nblks != 0)
      return static_cast<int64_t>(md.get_size());
    const memory::dims st = md.get_strides();
    int64_t last = 0;
    for (size_t i = 0; i < d.size(); ++i) last += (d[i] - 1) * st[i];
    return (last + 1) * static_cast<int64_t>(memory::data_type_size(md.get_data_type()));
  }

  static memory::dims plain_strides(const memory::dims& d) {
    memory::dims s(d.size(), 1);
    for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * d[i + 1];
    return s;
  }

  // A 4-D plain layout with dense NHWC strides (the strides of size-1 dims aside).
  static bool nhwc_dense(const memory::desc& md) {
    if (md.get_format_kind() != memory::format_kind::blocked || md.get_ndims() != 4) return false;
    const dnnl_memory_desc_t cmd = md.get();
    int nblks = 0;
    dnnl::error::wrap_c_api(dnnl_memory_desc_query(cmd, dnnl_query_inner_nblks_s32, &nblks), "layout");
    if (nblks != 0) return false;
    const memory::dims dims = md.get_dims(), st = md.get_strides();
    const memory::dims want{dims[1] * dims[2] * dims[3], 1, dims[3] * dims[1], dims[1]};
    for (int i = 0; i < 4; ++i)
      if (dims[i] != 1 && st[i] != want[i]) return false;
    return true;
  }

  static void append_eltwise(dnnl::post_ops& po, const Eltwise& eltwise) {
    for (const auto& [alg, alpha, beta] : eltwise) po.append_eltwise(parse_eltwise(alg), alpha, beta);
  }

  static memory f32_constant(std::vector<std::pair<int, memory>>& consts, const std::vector<float>& v, int arg) {
    memory m(memory::desc({static_cast<int64_t>(v.size())}, dt::f32, memory::format_tag::a), cpu_engine());
    std::memcpy(m.get_data_handle(), v.data(), v.size() * sizeof(float));
    consts.emplace_back(arg, m);
    return m;
  }

  static void add_scale(dnnl::primitive_attr& attr, std::vector<std::pair<int, memory>>& consts, int arg, float s) {
    attr.set_scales_mask(arg, 0);
    f32_constant(consts, {s}, DNNL_ARG_ATTR_SCALES | arg);
  }

  static void add_qparams(dnnl::primitive_attr& attr, std::vector<std::pair<int, memory>>& consts, int arg,
                          std::pair<float, int> qp) {
    add_scale(attr, consts, arg, qp.first);
    if (qp.second != 0) {
      attr.set_zero_points_mask(arg, 0);
      memory m(memory::desc({1}, dt::s32, memory::format_tag::a), cpu_engine());
      *static_cast<int32_t*>(m.get_data_handle()) = qp.second;
      consts.emplace_back(DNNL_ARG_ATTR_ZERO_POINTS | arg, m);
    }
  }

  // src/dst scales + zero points and the weights' scales of an INT8 conv / inner product.
  // oneDNN 3.x: dst = post_ops(src_scale * w_scale * sum((src - src_zp) * w) + bias) / dst_scale + dst_zp.
  static void add_quant_attrs(dnnl::primitive_attr& attr, std::vector<std::pair<int, memory>>& consts, QP src_q,
                              QP dst_q, const std::vector<float>& w_scales, int per_channel_mask) {
    if (!src_q) throw std::invalid_argument("gml engine: an INT8 op needs the input's qparams");
    add_qparams(attr, consts, DNNL_ARG_SRC, *src_q);
    if (dst_q) add_qparams(attr, consts, DNNL_ARG_DST, *dst_q);
    attr.set_scales_mask(DNNL_ARG_WEIGHTS, w_scales.size() > 1 ? per_channel_mask : 0);
    f32_constant(consts, w_scales, DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS);
  }

  // Copies the caller's bytes at ``ptr`` (layout ``user``) into plan-owned memory of layout ``want``.
  memory reorder_constant(uintptr_t ptr, const memory::desc& user, const memory::desc& want) {
    memory src(user, cpu_engine(), reinterpret_cast<void*>(ptr));
    memory dst(want, cpu_engine());
    dnnl::stream s(cpu_engine());
    dnnl::reorder(src, dst).execute(s, src, dst);
    s.wait();
    return dst;
  }

  memory copy_constant(uintptr_t ptr, const memory::desc& md) {
    memory m(md, cpu_engine());
    std::memcpy(m.get_data_handle(), reinterpret_cast<void*>(ptr), md.get_size());
    return m;
  }

  void push(dnnl::primitive prim, std::vector<std::pair<int, int>> value_args,
            std::vector<std::pair<int, memory>> consts, memory::desc scratch, const std::string& name) {
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    steps_.push_back(Step{std::move(prim), {}, std::move(value_args), std::move(consts), std::move(scratch), name});
  }

  std::unique_ptr<Context> acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pool_.empty()) {
        auto ctx = std::move(pool_.back());
        pool_.pop_back();
        return ctx;
      }
    }
    auto ctx = std::make_unique<Context>();
    ctx->arena = aligned_buffer(static_cast<size_t>(arena_bytes_));
    ctx->scratch = aligned_buffer(scratch_bytes_);
    ctx->stream = dnnl::stream(cpu_engine());
    char* arena = static_cast<char*>(ctx->arena.get());
    for (size_t i = 0; i < values_.size(); ++i) {
      const Value& v = values_[i];
      const memory::desc md = resolved(static_cast<int>(i)) ? values_[layout_root(static_cast<int>(i))].md : memory::desc();
      void* h = v.where == Where::kArena ? static_cast<void*>(arena + v.offset) : nullptr;
      if (v.where == Where::kConst) h = const_data_[v.index].get();
      if (v.where == Where::kArena && v.offset + static_cast<int64_t>(md.get_size()) > arena_bytes_)
        throw std::runtime_error("gml engine: a value lies outside the arena");
      ctx->values.emplace_back(md, cpu_engine(), h);  // external handles are set per run
    }
    for (const auto& s : steps_) {
      std::unordered_map<int, memory> args;
      for (const auto& [arg, v] : s.value_args) args.emplace(arg, ctx->values[v]);
      for (const auto& [arg, m] : s.const_args) args.emplace(arg, m);
      if (s.scratchpad_md.get_size() > 0) args.emplace(DNNL_ARG_SCRATCHPAD, memory(s.scratchpad_md, cpu_engine(), ctx->scratch.get()));
      ctx->args.push_back(std::move(args));
    }
    return ctx;
  }

  void release(std::unique_ptr<Context> ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    pool_.push_back(std::move(ctx));
  }

  std::vector<Value> values_;
  std::vector<int64_t> in_bytes_, out_bytes_;  // external_bytes(); -1: not given
  std::vector<std::shared_ptr<void>> const_data_;  // add_constant()
  std::vector<Step> steps_;
  int n_inputs_ = 0, n_outputs_ = 0;
  int64_t arena_bytes_ = 0;
  size_t scratch_bytes_ = 0;
  bool finalized_ = false;
  std::mutex mu_;
  std::vector<std::unique_ptr<Context>> pool_;
};

std::string isa_name() {
  using I = dnnl::cpu_isa;
  switch (dnnl::get_effective_cpu_isa()) {
    case I::avx512_core_amx: return "avx512_core_amx";
    case I::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
    case I::avx512_core_fp16: return "avx512_core_fp16";
    case I::avx512_core_bf16: return "avx512_core_bf16";
    case I::avx512_core_vnni: return "avx512_core_vnni";
    case I::avx512_core: return "avx512_core";
    case I::avx2_vnni_2: return "avx2_vnni_2";
    case I::avx2_vnni: return "avx2_vnni";
    case I::avx2: return "avx2";
    case I::sse41: return "sse41";
    default: return "other";
  }
}

}  // namespace

NB_MODULE(_engine, m) {
  m.doc() = "GML engine: planned graph segments executed as oneDNN primitives (see native/engine.cpp).";
  m.def("onednn_version", [] {
    const dnnl_version_t* v = dnnl_version();
    return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  });
  m.def("cpu_isa", &isa_name, "The instruction set oneDNN dispatches to on this CPU.");
  m.def("fused_attention_available", &gml_attention::cpu_supported,
        "Whether this CPU runs the fused bf16 attention kernel (AVX512-BF16; native/attention.h).");
  m.def(
      "woq_linear",
      [](uintptr_t x, int64_t M, int64_t K, uintptr_t q, int bits, int64_t group, uintptr_t scales, uintptr_t zeros,
         uintptr_t bias, uintptr_t y, int64_t N, const std::string& isa, int nthreads) {
        gml_woq::Problem p;
        p.x = reinterpret_cast<const float*>(x);
        p.M = M, p.K = K, p.N = N, p.bits = bits, p.group = group;
        p.q = reinterpret_cast<const void*>(q);
        p.scales = reinterpret_cast<const float*>(scales);
        p.zeros = reinterpret_cast<const uint8_t*>(zeros);
        p.bias = reinterpret_cast<const float*>(bias);
        p.y = reinterpret_cast<float*>(y);
        gml_woq::linear(p, isa, nthreads);
      },
      nb::arg("x"), nb::arg("M"), nb::arg("K"), nb::arg("q"), nb::arg("bits"), nb::arg("group"), nb::arg("scales"),
      nb::arg("zeros"), nb::arg("bias"), nb::arg("y"), nb::arg("N"), nb::arg("isa"), nb::arg("nthreads") = 0,
      nb::call_guard<nb::gil_scoped_release>(),
      "torch.ops.gml.woq_linear on contiguous tensors given by address (native/woq.h); isa: avx512 | avx2 | scalar.");
  m.def("woq_isa_supported", &gml_woq::cpu_has, "Whether this CPU runs woq_linear's kernel for `isa`.");
  nb::class_<Plan>(m, "Plan", nb::dynamic_attr())  // dynamic attributes: ``keep`` (see embedding())
      .def(nb::init<>())
      .def("add_value", &Plan::add_value, nb::arg("dims"), nb::arg("strides"), nb::arg("dtype"), nb::arg("where"),
           nb::arg("index"), nb::arg("offset"))
      .def("conv", &Plan::conv, nb::arg("src"), nb::arg("dst"), nb::arg("weight"), nb::arg("wdims"),
           nb::arg("wdtype"), nb::arg("w_scales"), nb::arg("bias"), nb::arg("strides"), nb::arg("dilation"),
           nb::arg("pad_l"), nb::arg("pad_r"), nb::arg("groups"), nb::arg("src_q").none(), nb::arg("dst_q").none(),
           nb::arg("sum").none(), nb::arg("eltwise"), nb::arg("name"), nb::arg("nthreads") = 0, nb::arg("winograd") = 0,
           nb::arg("native_bf16") = false)
      .def("inner_product", &Plan::inner_product, nb::arg("src"), nb::arg("dst"), nb::arg("weight"),
           nb::arg("wdims"), nb::arg("wdtype"), nb::arg("w_scales"), nb::arg("bias"), nb::arg("src_q").none(),
           nb::arg("dst_q").none(), nb::arg("eltwise"), nb::arg("name"))
      .def("dynamic_linear", &Plan::dynamic_linear, nb::arg("src"), nb::arg("dst"), nb::arg("q"), nb::arg("amax"),
           nb::arg("weight"), nb::arg("wdims"), nb::arg("w_scales"), nb::arg("bias"), nb::arg("smooth_inv"),
           nb::arg("eltwise"), nb::arg("name"), nb::arg("sum_src") = -1, nb::arg("exact_gemm") = false)
      .def("reorder", &Plan::reorder, nb::arg("src"), nb::arg("dst"), nb::arg("src_q").none(),
           nb::arg("dst_q").none(), nb::arg("name"))
      .def("pool", &Plan::pool, nb::arg("src"), nb::arg("dst"), nb::arg("alg"), nb::arg("kernel"), nb::arg("strides"),
           nb::arg("dilation"), nb::arg("pad_l"), nb::arg("pad_r"), nb::arg("eltwise"), nb::arg("name"))
      .def("binary", &Plan::binary, nb::arg("src0"), nb::arg("src1"), nb::arg("dst"), nb::arg("alg"),
           nb::arg("scale0").none(), nb::arg("scale1").none(), nb::arg("eltwise"), nb::arg("name"))
      .def("concat", &Plan::concat, nb::arg("srcs"), nb::arg("dst"), nb::arg("axis"), nb::arg("name"))
      .def("matmul", &Plan::matmul, nb::arg("src"), nb::arg("wei"), nb::arg("dst"), nb::arg("weight"),
           nb::arg("wdims"), nb::arg("wstrides"), nb::arg("wdtype"), nb::arg("bias"), nb::arg("post"), nb::arg("name"))
      .def("add_constant", &Plan::add_constant, nb::arg("dims"), nb::arg("strides"), nb::arg("dtype"), nb::arg("data"))
      .def("embedding", &Plan::embedding, nb::arg("ids"), nb::arg("dst"), nb::arg("table"), nb::arg("num"),
           nb::arg("dim"), nb::arg("ld"), nb::arg("name"))
      .def("mask_op", &Plan::mask_op, nb::arg("op"), nb::arg("srcs"), nb::arg("dst"), nb::arg("strides"),
           nb::arg("index_dims"), nb::arg("index_strides"), nb::arg("name"))
      .def("attention", &Plan::attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("dst"), nb::arg("masks"),
           nb::arg("scale"), nb::arg("name"))
      .def("softmax", &Plan::softmax, nb::arg("src"), nb::arg("dst"), nb::arg("axis"), nb::arg("name"))
      .def("layer_norm", &Plan::layer_norm, nb::arg("src"), nb::arg("dst"), nb::arg("gamma"), nb::arg("beta"),
           nb::arg("eps"), nb::arg("name"))
      .def("tie", &Plan::tie, nb::arg("value"), nb::arg("other"))
      .def("value_bytes", &Plan::value_bytes, nb::arg("value"))
      .def("value_layout", &Plan::value_layout, nb::arg("value"))
      .def("set_offset", &Plan::set_offset, nb::arg("value"), nb::arg("offset"))
      .def("external_bytes", &Plan::external_bytes, nb::arg("where"), nb::arg("index"), nb::arg("bytes"))
      .def("finalize", &Plan::finalize, nb::arg("arena_bytes"))
      .def("run", &Plan::run, nb::arg("inputs"), nb::arg("outputs"), nb::arg("nthreads"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("run_timed", &Plan::run_timed, nb::arg("inputs"), nb::arg("outputs"), nb::arg("nthreads"),
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("num_steps", &Plan::num_steps)
      .def_prop_ro("arena_bytes", &Plan::arena_bytes)
      .def_prop_ro("scratch_bytes", &Plan::scratch_bytes)
      .def("step_names", &Plan::step_names)
      .def("step_impls", &Plan::step_impls);
}
