// GML engine, the convolution step family: oneDNN's direct convolution (INT8, fp32, bf16) and, for
// eligible 3x3 convs, GML's Winograd F(2x2, 3x3) when it is measured faster: fp32 / bf16
// (winograd.h) and INT8 on targets without VNNI (winograd_int8.h); on those targets also GML's patch
// GEMM for INT8 convs with few input channels (im2col_int8.h) and its depthwise INT8 conv
// (dw_int8.h), when measured faster.
// Python fills a ConvStep (gml/runtime/plan_steps.py, conv_step) and calls Plan.add(step).
#pragma once

#include <functional>

#include "bind.h"
#include "plan.h"
#include "winograd.h"
#include "dw_int8.h"
#include "im2col_int8.h"
#include "winograd_int8.h"

namespace gml_engine {

// One convolution: src / dst value ids, the caller's weight tensor (copied here, never kept) and the
// geometry in oneDNN's terms (dilation 0 = dense; pad_r may be negative, see check_conv_geometry).
struct ConvStep {
  int src = -1, dst = -1;
  uintptr_t weight = 0;  // contiguous [O, I/groups, k...]
  Dims wdims;
  std::string wdtype = "f32";      // "s8": INT8 (u8 src), "f32" or "bf16"
  std::vector<float> w_scales;     // INT8: one per tensor or per output channel
  uintptr_t bias = 0;              // O fp32 values, or 0
  Dims strides, dilation, pad_l, pad_r;
  int64_t groups = 1;
  QP src_q, dst_q;                 // INT8: (scale, zero point) of the source / destination
  QP sum;                          // residual accumulated into dst: (scale, zero point) of oneDNN's sum post-op
  Eltwise eltwise;                 // fused post-ops after the sum
  std::string name;
  int nthreads = 0;                // the OpenMP team the Winograd choice is timed with (0: the current)
  int winograd = 0;                // 0 never, 1 always (if eligible), 2 when timed faster, 3 always with
                                   // F(2x2, 3x3) tiles only (GML_WINOGRAD=f2x3; gml.runtime.options)
  bool native_bf16 = false;        // the CPU has bf16 dot products (Winograd's bf16 matmul)
  // INT8 convs may take GML's own INT8 convs (winograd_int8.h for 3x3 stride 1, im2col_int8.h for
  // few input channels) when winograd == 2: the target has no VNNI-class dot product
  // (gml.ir.target.Target.int8_winograd); winograd == 1 or 3 forces them on any CPU with AVX2
  bool int8_winograd = false;
};


// A conv's geometry, checked before oneDNN sees it (a crafted graph's stride of 0 made a division by
// zero, issue #24): one entry per spatial dim; strides >= 1; dilation (oneDNN's: 0 = dense) and
// left padding >= 0; groups >= 1 dividing both channel counts; source / weight / destination agreeing
// on channels and batch; the output size the geometry gives.
inline void check_conv_geometry(const memory::desc& src, const memory::desc& dst, const Dims& wdims,
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

// The measured choices, per process: problem key -> Winograd measured faster than the direct conv.
struct WinogradChoices {
  std::mutex mu;
  std::unordered_map<std::string, int> chosen;
  static WinogradChoices& get() {
    static WinogradChoices c;
    return c;
  }
  // The cached answer for ``key``: -1 not measured yet, 0 the direct conv, else the caller's code
  // for what was faster (1 for a yes / no question; the INT8 Winograd's output tile size).
  int known(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = chosen.find(key);
    return it == chosen.end() ? -1 : it->second;
  }
  // The answer for ``key``, from ``measure()`` the first time (two plans built at once may both
  // measure; the first answer stays).
  int pick(const std::string& key, const std::function<int()>& measure) {
    const int k = known(key);
    if (k >= 0) return k;
    const int answer = measure();
    std::lock_guard<std::mutex> lock(mu);
    return chosen.emplace(key, answer).first->second;
  }
  bool choose(const std::string& key, const std::function<bool()>& measure) {
    return pick(key, [&] { return measure() ? 1 : 0; }) == 1;
  }
};

// Evicts [p, p + bytes) from every cache level (clflush is SSE2: every x86-64 CPU).
inline void flush_from_caches(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t i = 0; i < bytes; i += 64) _mm_clflush(c + i);
  _mm_mfence();
}

// Times ``direct`` and ``conv`` (gml_winograd::Conv, or one of GML's own INT8 convs) alternately on
// zero-filled dummy buffers (one warm-up call each, then the best of ``rounds``): ``conv``'s time
// over the direct conv's. ``cold_weights``: each call starts with its
// weights evicted from the caches (the conv's ``weights()``, the direct conv's DNNL_ARG_WEIGHTS), as
// in a model whose weights do not stay in cache between calls: timed with hot weights, ResNet18's
// 512-channel INT8 Winograd at batch 1 (8.4 MB of transformed weights against 2.4 MB) measured
// 0.83x the direct conv and ran 1.26x its time in the model.
template <typename WinogradConv>
inline double winograd_ratio(const WinogradConv& conv, const memory::desc& s, const memory::desc& d,
                             const dnnl::primitive& direct, const std::vector<std::pair<int, memory>>& consts,
                             const memory::desc& direct_scratch, int nthreads, int rounds, bool cold_weights) {
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
  const auto cold = [&](bool of_direct) {
    if (!cold_weights) return;
    if (of_direct) {
      const memory& w = args.at(DNNL_ARG_WEIGHTS);
      flush_from_caches(w.get_data_handle(), w.get_desc().get_size());
    } else {
      const auto [p, bytes] = conv.weights();
      flush_from_caches(p, bytes);
    }
  };
  dnnl::stream stream(cpu_engine());
  using clock = std::chrono::steady_clock;
  double best_direct = 1e30, best_wino = 1e30;
  for (int rep = 0; rep <= rounds; ++rep) {
    cold(true);
    auto t0 = clock::now();
    direct.execute(stream, args);
    stream.wait();
    auto t1 = clock::now();
    cold(false);
    auto t2 = clock::now();
    conv.run(src.get(), dst.get(), scratch.get());
    auto t3 = clock::now();
    if (rep == 0) continue;  // warm-up
    best_direct = std::min(best_direct, std::chrono::duration<double>(t1 - t0).count());
    best_wino = std::min(best_wino, std::chrono::duration<double>(t3 - t2).count());
  }
  return best_wino / best_direct;
}

// Whether ``conv`` takes at most ``ratio`` x the direct conv's time (winograd_ratio).
template <typename WinogradConv>
inline bool winograd_faster(const WinogradConv& conv, const memory::desc& s, const memory::desc& d,
                            const dnnl::primitive& direct, const std::vector<std::pair<int, memory>>& consts,
                            const memory::desc& direct_scratch, int nthreads, double ratio = 0.9, int rounds = 3,
                            bool cold_weights = false) {
  return winograd_ratio(conv, s, d, direct, consts, direct_scratch, nthreads, rounds, cold_weights) <= ratio;
}

// An fp32 / bf16 conv as Winograd F(2x2, 3x3) (native/winograd.h, docs/adr/010-winograd-conv.md):
// for a 2-D 3x3 conv, stride 1, dilation 1, groups 1, padding 1, NHWC dense src and dst of the
// weights' type, post-ops within winograd.h's Epilogue. GML_WINOGRAD=auto (gml.runtime.plan's
// winograd_mode) times it against ``direct`` (the oneDNN primitive conv() made, on dummy buffers,
// ``nthreads`` threads) and takes it when it is at least 10% faster; the choice is cached per
// problem in the process (``force``: GML_WINOGRAD=1, no timing; ``direct_consts()`` makes the direct
// conv's constants for the timing only). Pushes a Kernel step and returns true, or returns false
// (the caller pushes ``direct``).
inline bool try_winograd(Plan& p, int src, int dst, uintptr_t weight, const Dims& wdims, const std::string& wdtype, uintptr_t bias,
                  const Dims& strides, const Dims& dilation, const Dims& pad_l, const Dims& pad_r, int64_t groups,
                  QP sum, const Eltwise& eltwise, const std::string& name, int nthreads, bool force,
                  bool native_bf16, const dnnl::primitive& direct, const std::function<Consts()>& direct_consts,
                  const memory::desc& direct_scratch) {
  const memory::desc s = p.md_in(src), d = p.md_in(dst);
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
  auto& choices = WinogradChoices::get();
  if (!force && choices.known(key) == 0) return false;
  std::shared_ptr<const gml_winograd::Conv> conv;
  try {
    conv = std::make_shared<const gml_winograd::Conv>(cpu_engine(), n, c, h, w, k, type,
                                                       reinterpret_cast<const void*>(weight), type,
                                                       reinterpret_cast<const float*>(bias), epi, native_bf16);
  } catch (const dnnl::error&) {
    return false;  // no matmul for this problem: the direct conv
  }
  if (!force && !choices.choose(key, [&] {
        return winograd_faster(*conv, s, d, direct, direct_consts(), direct_scratch, nthreads);
      }))
    return false;
  Kernel kernel = [conv](const std::unordered_map<int, memory>& args) {
    conv->run(args.at(DNNL_ARG_SRC).get_data_handle(), args.at(DNNL_ARG_DST).get_data_handle(),
              args.at(DNNL_ARG_SCRATCHPAD).get_data_handle());
  };
  // the scratchpad holds V, M and the matmul's own scratchpad (per Context: concurrent runs never share it)
  p.push_kernel(std::move(kernel), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}},
                memory::desc({static_cast<int64_t>(conv->scratch_bytes())}, dt::u8, memory::format_tag::a), name,
                conv->impl());
  return true;
}

// The part of an INT8 conv's eligibility that GML's own INT8 conv kernels share (winograd_int8.h,
// im2col_int8.h, dw_int8.h): a CPU with AVX2, s8 weights, groups 1 (``depthwise``: one filter per
// channel instead, groups = channels), 2-D, dilation 1, a u8 / s8 source and a u8 / s8 / f32
// destination (with qparams exactly when INT8), both NHWC dense, post-ops within Epilogue. Fills the
// output stage (``epi``, ``q``) and the problem's cache key prefix.
inline bool own_int8_conv_io(Plan& p, const ConvStep& desc, gml_winograd::Epilogue& epi, gml_winograd::QuantOut& q,
                             std::string& key, bool depthwise = false) {
  const memory::desc s = p.md_in(desc.src), d = p.md_in(desc.dst);
  const dt st = s.get_data_type(), dtp = d.get_data_type();
  if (!gml_winograd::int8_winograd_cpu() || desc.wdtype != "s8" || !desc.src_q) return false;
  if ((st != dt::u8 && st != dt::s8) || (dtp != dt::u8 && dtp != dt::s8 && dtp != dt::f32)) return false;
  if ((dtp == dt::f32) == static_cast<bool>(desc.dst_q)) return false;  // an INT8 dst has qparams, an f32 one none
  if (desc.wdims.size() != 4 || desc.dilation != Dims{0, 0}) return false;
  if (!gml_winograd::parse_eltwise(desc.eltwise, epi, true)) return false;
  const memory::dims sd = s.get_dims();
  if (sd.size() == 4 && (depthwise ? desc.groups != sd[1] || desc.wdims[0] != sd[1] || desc.wdims[1] != 1
                                   : desc.groups != 1))
    return false;
  if (sd.size() != 4 || std::any_of(sd.begin(), sd.end(), [](int64_t v) { return v <= 0; })) return false;
  if (!nhwc_dense(s) || !nhwc_dense(d)) return false;
  q.dst_type = dtp;
  if (desc.dst_q) q.dst_inv_scale = 1.0f / desc.dst_q->first, q.dst_zp = static_cast<float>(desc.dst_q->second);
  if (desc.sum) epi.sum = true, epi.sum_scale = desc.sum->first, q.sum_zp = static_cast<float>(desc.sum->second);
  const memory::dims dd = d.get_dims();
  key = "int8:";
  for (int64_t v : sd) key += std::to_string(v) + "x";
  key += ">";
  for (int64_t v : desc.wdims) key += std::to_string(v) + "x";
  key += ">";
  for (int64_t v : dd) key += std::to_string(v) + "x";
  for (const Dims* g : {&desc.strides, &desc.pad_l, &desc.pad_r})
    for (int64_t v : *g) key += ":" + std::to_string(v);
  key += ":" + std::to_string(static_cast<int>(st)) + ">" + std::to_string(static_cast<int>(dtp)) +
         (desc.bias ? ":bias" : "") + (desc.sum ? ":sum" : "") + ":" + isa_name() + ":t" +
         std::to_string(desc.nthreads > 0 ? desc.nthreads : omp_get_max_threads());
  for (const auto& [alg, alpha, beta] : desc.eltwise) key += ":" + alg;
  return true;
}

// The own-INT8-conv timing rule: cold weights, best of 7, taken at <= 0.95x the direct conv.
// (fp32 Winograd asks for 0.9x: it rounds differently from the direct conv. These compute the same
// integers as the direct conv, so only noise argues for a margin; with 0.9x and the best of 3, the
// choice for ResNet18's stem flipped between runs on a shared VM: 2 of 6 processes took the direct
// conv at a measured 0.83x.)
constexpr double kOwnInt8Ratio = 0.95;
constexpr int kOwnInt8Rounds = 7;

template <typename Int8Conv>
inline double own_int8_ratio(Plan& p, const ConvStep& desc, const Int8Conv& conv, const dnnl::primitive& direct,
                             const std::function<Consts()>& direct_consts, const memory::desc& direct_scratch) {
  return winograd_ratio(conv, p.md_in(desc.src), p.md_in(desc.dst), direct, direct_consts(), direct_scratch,
                        desc.nthreads, kOwnInt8Rounds, true);
}

// Pushes ``conv`` (one of GML's own INT8 convs) as the conv's step.
template <typename Int8Conv>
inline void push_own_int8_conv(Plan& p, const ConvStep& desc, const std::shared_ptr<const Int8Conv>& conv) {
  Kernel kernel = [conv](const std::unordered_map<int, memory>& args) {
    conv->run(args.at(DNNL_ARG_SRC).get_data_handle(), args.at(DNNL_ARG_DST).get_data_handle(),
              args.at(DNNL_ARG_SCRATCHPAD).get_data_handle());
  };
  // the scratchpad holds the kernel's per-call buffers (per Context: concurrent runs never share it)
  p.push_kernel(std::move(kernel), {{DNNL_ARG_SRC, desc.src}, {DNNL_ARG_DST, desc.dst}},
                memory::desc({static_cast<int64_t>(conv->scratch_bytes())}, dt::u8, memory::format_tag::a), desc.name,
                conv->impl());
}

// Pushes ``conv`` (an Int8Conv of im2col_int8.h or dw_int8.h) as the step, unless timing says
// otherwise: ``force`` (GML_WINOGRAD=1) takes it untimed; else it is timed against ``direct`` on
// dummy buffers (own_int8_ratio), the answer cached per ``key``.
template <typename Int8Conv>
inline bool take_own_int8_conv(Plan& p, const ConvStep& desc, bool force, const std::string& key,
                               const std::shared_ptr<const Int8Conv>& conv, const dnnl::primitive& direct,
                               const std::function<Consts()>& direct_consts, const memory::desc& direct_scratch) {
  if (!force && !WinogradChoices::get().choose(key, [&] {
        return own_int8_ratio(p, desc, *conv, direct, direct_consts, direct_scratch) <= kOwnInt8Ratio;
      }))
    return false;
  push_own_int8_conv(p, desc, conv);
  return true;
}

// An INT8 conv as GML's INT8 Winograd (native/winograd_int8.h: exact integer arithmetic in int16 /
// int32, for CPUs without VNNI): own_int8_conv_io's eligibility, 3x3, stride 1, padding 1. Two
// tile sizes: F(4x4, 3x3) (2.25 products per output, transformed weights 8x the int8 bytes) where
// its exactness bound holds for these weights and ``big_tiles``, and F(2x2, 3x3) (4 products per
// output, 3.6x the bytes) up to kMaxChannels input channels. ``force`` (GML_WINOGRAD=1 / f2x3) takes
// the larger eligible tile untimed; else each eligible one is timed against the direct conv and the
// fastest under kOwnInt8Ratio is taken (at batch 1 a 14x14 map's F(4x4, 3x3) computes 16x16
// outputs and reads 8x the weight bytes: the measurement decides, per problem, cached).
inline bool try_winograd_int8(Plan& p, const ConvStep& desc, bool force, bool big_tiles, const dnnl::primitive& direct,
                              const std::function<Consts()>& direct_consts, const memory::desc& direct_scratch) {
  using gml_winograd::Int8ConvT;
  gml_winograd::Epilogue epi;
  gml_winograd::QuantOut q;
  std::string key;
  if (!own_int8_conv_io(p, desc, epi, q, key)) return false;
  const Dims& wdims = desc.wdims;
  if (wdims[2] != 3 || wdims[3] != 3 || desc.strides != Dims{1, 1} || desc.pad_l != Dims{1, 1} ||
      desc.pad_r != Dims{1, 1})
    return false;
  const memory::dims sd = p.md_in(desc.src).get_dims();
  const int64_t n = sd[0], c = sd[1], h = sd[2], w = sd[3], k = wdims[0];
  const dt st = p.md_in(desc.src).get_data_type();
  const auto* weight = reinterpret_cast<const int8_t*>(desc.weight);
  const int zp = desc.src_q->second;
  if (p.md_in(desc.dst).get_dims() != memory::dims{n, k, h, w}) return false;
  const bool f2 = Int8ConvT<2>::exact(weight, k, c, st, zp), f4 = big_tiles && Int8ConvT<4>::exact(weight, k, c, st, zp);
  if (!f2 && !f4) return false;
  // the answer depends on which tiles these weights allow
  key = "winograd:" + key + (f2 ? ":f2" : "") + (f4 ? ":f4" : "");
  const int known = force ? (f4 ? 4 : 2) : WinogradChoices::get().known(key);
  if (known == 0) return false;
  const int threads = desc.nthreads > 0 ? desc.nthreads : omp_get_max_threads();
  const auto make = [&](auto tile) {
    using Conv = Int8ConvT<decltype(tile)::value>;
    return std::make_shared<const Conv>(n, c, h, w, k, st, desc.src_q->first, zp, weight, desc.w_scales,
                                        reinterpret_cast<const float*>(desc.bias), epi, q, threads);
  };
  std::shared_ptr<const Int8ConvT<2>> conv2;
  std::shared_ptr<const Int8ConvT<4>> conv4;
  if (f2 && known != 4) conv2 = make(std::integral_constant<int, 2>());
  if (f4 && known != 2) conv4 = make(std::integral_constant<int, 4>());
  const int choice = known >= 0 ? known : WinogradChoices::get().pick(key, [&] {
    double best = kOwnInt8Ratio;
    int pick = 0;
    if (conv4) {
      const double r = own_int8_ratio(p, desc, *conv4, direct, direct_consts, direct_scratch);
      if (r <= best) best = r, pick = 4;
    }
    if (conv2 && own_int8_ratio(p, desc, *conv2, direct, direct_consts, direct_scratch) < best) pick = 2;
    return pick;
  });
  if (choice == 4) push_own_int8_conv(p, desc, conv4 ? conv4 : make(std::integral_constant<int, 4>()));
  else if (choice == 2) push_own_int8_conv(p, desc, conv2 ? conv2 : make(std::integral_constant<int, 2>()));
  return choice != 0;
}

// An INT8 conv with few input channels (an RGB stem) as GML's patch GEMM (native/im2col_int8.h:
// exact with weights in [-64, 64], for CPUs without VNNI): own_int8_conv_io's eligibility, a u8 source, at most
// kIm2colMaxChannels input channels, a window of more than one tap, weights within 7 bits (else the
// direct conv). ``force`` skips the timing (GML_WINOGRAD=1, which forces GML's own INT8 convs).
constexpr int64_t kIm2colMaxChannels = 8;  // oneDNN's AVX2 INT8 conv blocks channels by 4 and more
inline bool try_im2col_int8(Plan& p, const ConvStep& desc, bool force, const dnnl::primitive& direct,
                            const std::function<Consts()>& direct_consts, const memory::desc& direct_scratch) {
  gml_winograd::Epilogue epi;
  gml_winograd::QuantOut q;
  std::string key;
  if (!own_int8_conv_io(p, desc, epi, q, key)) return false;
  const Dims& wd = desc.wdims;
  const memory::dims sd = p.md_in(desc.src).get_dims(), dd = p.md_in(desc.dst).get_dims();
  if (p.md_in(desc.src).get_data_type() != dt::u8 || sd[1] > kIm2colMaxChannels || wd[2] * wd[3] < 2) return false;
  const int64_t count = wd[0] * wd[1] * wd[2] * wd[3];
  const int8_t* w = reinterpret_cast<const int8_t*>(desc.weight);
  if (std::any_of(w, w + count, [](int8_t v) { return v < -64 || v > 64; })) return false;
  key = "im2col:" + key;
  if (!force && WinogradChoices::get().known(key) == 0) return false;
  std::shared_ptr<const gml_im2col::Int8Conv> conv;
  try {
    conv = std::make_shared<const gml_im2col::Int8Conv>(
        sd[0], sd[1], sd[2], sd[3], wd[0], wd[2], wd[3], desc.strides[0], desc.strides[1], desc.pad_l[0],
        desc.pad_l[1], dd[2], dd[3], desc.src_q->first, desc.src_q->second, w,
        desc.w_scales, reinterpret_cast<const float*>(desc.bias), epi, q,
        desc.nthreads > 0 ? desc.nthreads : omp_get_max_threads());
  } catch (const std::invalid_argument&) {
    return false;  // outside what the kernel computes exactly: the direct conv
  }
  return take_own_int8_conv(p, desc, force, key, conv, direct, direct_consts, direct_scratch);
}

// A depthwise INT8 conv (groups = channels, one filter each) as GML's tap-pair kernel
// (native/dw_int8.h: exact for any s8 weights, for CPUs without VNNI): own_int8_conv_io's depthwise
// eligibility and a square 3x3, 5x5 or 7x7 window (else the direct conv). ``force`` skips the timing
// (GML_WINOGRAD=1, which forces GML's own INT8 convs).
inline bool try_dw_int8(Plan& p, const ConvStep& desc, bool force, const dnnl::primitive& direct,
                        const std::function<Consts()>& direct_consts, const memory::desc& direct_scratch) {
  gml_winograd::Epilogue epi;
  gml_winograd::QuantOut q;
  std::string key;
  if (!own_int8_conv_io(p, desc, epi, q, key, true)) return false;
  const Dims& wd = desc.wdims;
  if (!gml_dw::supported(wd[2], wd[3], desc.strides[0], desc.strides[1])) return false;
  const memory::dims sd = p.md_in(desc.src).get_dims(), dd = p.md_in(desc.dst).get_dims();
  key = "dw:" + key;
  if (!force && WinogradChoices::get().known(key) == 0) return false;
  std::shared_ptr<const gml_dw::Int8Conv> conv;
  try {
    conv = std::make_shared<const gml_dw::Int8Conv>(
        sd[0], sd[1], sd[2], sd[3], wd[2], wd[3], desc.strides[0], desc.strides[1], desc.pad_l[0], desc.pad_l[1],
        dd[2], dd[3], p.md_in(desc.src).get_data_type(), desc.src_q->first, desc.src_q->second,
        reinterpret_cast<const int8_t*>(desc.weight), desc.w_scales, reinterpret_cast<const float*>(desc.bias), epi,
        q, desc.nthreads > 0 ? desc.nthreads : omp_get_max_threads());
  } catch (const std::invalid_argument&) {
    return false;  // outside what the kernel computes: the direct conv
  }
  return take_own_int8_conv(p, desc, force, key, conv, direct, direct_consts, direct_scratch);
}

// oneDNN 3.2's AMX 1x1 convolution (``jit_1x1:avx512_core_amx``) writes past the end of its destination
// for some output sizes: an INT8 64 -> 128 conv on a 6x6 map wrote 0.5-1.5 KB past the 4.6 KB u8 NHWC
// output (33, 36, 42 or 48 output pixels did; 9, 16, 20, 40, 64, 100 and 144 did not), corrupting the
// heap (timm resnet10t INT8 at its 176 px default crashed; found by a batch sweep, session 21). The
// pattern is not a simple tail rule, so the kernel is never taken: the next implementation oneDNN
// offers is (another AMX kernel). ``next_impl`` keeps the descriptor when there is no other.
inline bool broken_impl(const std::string& impl) { return impl.rfind("jit_1x1:avx512_core_amx", 0) == 0; }

inline void skip_broken_impls(dnnl::convolution_forward::primitive_desc& pd) {
  while (broken_impl(pd.impl_info_str()) && pd.next_impl()) {
  }
}

// Convolution, INT8 (u8 src, s8 weights, per-channel or per-tensor weight scales) or fp32.
// ``weight`` points at a contiguous [O, I/groups, k...] tensor copied (reordered) here, never kept.
inline void build(Plan& p, const ConvStep& desc) {
  const int src = desc.src, dst = desc.dst, nthreads = desc.nthreads, winograd = desc.winograd;
  const uintptr_t weight = desc.weight, bias = desc.bias;
  const Dims &wdims = desc.wdims, &strides = desc.strides, &dilation = desc.dilation, &pad_l = desc.pad_l,
             &pad_r = desc.pad_r;
  const std::string &wdtype = desc.wdtype, &name = desc.name;
  const std::vector<float>& w_scales = desc.w_scales;
  const int64_t groups = desc.groups;
  const QP &src_q = desc.src_q, &dst_q = desc.dst_q, &sum = desc.sum;
  const Eltwise& eltwise = desc.eltwise;
  const bool native_bf16 = desc.native_bf16;
  const memory::desc src_md = p.md_in(src);
  const memory::desc dst_md = p.md_out(dst);
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
  skip_broken_impls(pd);
  p.resolve(dst, pd.dst_desc());
  // The direct conv's reordered weights are made only once it is known to run, or to time it against
  // Winograd: made first and dropped when Winograd won, they left their size as a hole in the heap
  // for every Winograd conv (ResNet18 fp32 with GML_WINOGRAD=1: the build's peak 136 MB, 88 once
  // trimmed; issue #28)
  auto add_weights = [&](Consts& c) {
    c.emplace_back(DNNL_ARG_WEIGHTS, reorder_constant(weight, user_w, pd.weights_desc()));
    if (bias) c.emplace_back(DNNL_ARG_BIAS, copy_constant(bias, bias_md));
  };
  dnnl::convolution_forward prim(pd);
  if (!quant && winograd > 0) {
    auto direct_consts = [&]() {
      Consts c = consts;
      add_weights(c);
      return c;
    };
    if (try_winograd(p, src, dst, weight, wdims, wdtype, bias, strides, dilation, pad_l, pad_r, groups, sum,
                     eltwise, name, nthreads, winograd == 1 || winograd == 3, native_bf16, prim, direct_consts, pd.scratchpad_desc()))
      return;
  }
  if (quant && (winograd == 1 || winograd == 3 || (winograd == 2 && desc.int8_winograd))) {
    auto direct_consts = [&]() {
      Consts c = consts;
      add_weights(c);
      return c;
    };
    const bool force = winograd == 1 || winograd == 3;
    if (try_winograd_int8(p, desc, force, winograd != 3, prim, direct_consts, pd.scratchpad_desc())) return;
    if (try_im2col_int8(p, desc, force, prim, direct_consts, pd.scratchpad_desc())) return;
    if (try_dw_int8(p, desc, force, prim, direct_consts, pd.scratchpad_desc())) return;
  }
  add_weights(consts);
  p.push(prim, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}, std::move(consts), pd.scratchpad_desc(), name);
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(ConvStep,
        src, dst, weight, wdims, wdtype, w_scales, bias, strides, dilation, pad_l, pad_r, groups, src_q, dst_q, sum,
        eltwise, name, nthreads, winograd, native_bf16, int8_winograd)

}  // namespace gml_engine
