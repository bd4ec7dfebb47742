// GML engine: what every step family shares: the value types a step description is made of
// (Dims, QP, Eltwise), dtype / eltwise names, aligned buffers, the oneDNN attribute helpers
// (scales, zero points, eltwise post-ops) and a few layout predicates. No Plan here (plan.h).
#pragma once

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace gml_engine {

using dnnl::memory;
using dt = dnnl::memory::data_type;
using Dims = std::vector<int64_t>;
using QP = std::optional<std::pair<float, int>>;                  // (scale, zero point) or none
using Eltwise = std::vector<std::tuple<std::string, float, float>>;  // (algorithm, alpha, beta)
using Consts = std::vector<std::pair<int, memory>>;               // (DNNL_ARG_*, plan-owned memory)

constexpr size_t kAlign = 64;

inline dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

inline dt parse_dtype(const std::string& s) {
  if (s == "u8") return dt::u8;
  if (s == "s8") return dt::s8;
  if (s == "f32") return dt::f32;
  if (s == "bf16") return dt::bf16;  // bf16 conv / inner product / reorder (gml.kernels.bf16)
  if (s == "s32") return dt::s32;
  // int64 (token ids, read only by the embedding kernel): oneDNN has no s64, so the values are
  // described with the other 8-byte type; no primitive ever reads them
  if (s == "s64") return dt::f64;
  throw std::invalid_argument("gml engine: unsupported dtype '" + s + "'");
}

inline dnnl::algorithm parse_eltwise(const std::string& s) {
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

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// Buffers from this size up are mapped pages of their own: freed, they go back to the system at
// once. From the heap (glibc raises its mmap threshold after the first large free), a plan's
// transient buffers — Winograd's fp32 weight transform, timing buffers — left holes of their size
// that stayed resident beside the plan (issue #28). Not under AddressSanitizer (make sanitize): its
// redzones guard heap blocks, not mapped pages, and a step writing past its buffer must be caught.
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kMapBytes = SIZE_MAX;
#else
constexpr size_t kMapBytes = size_t{1} << 20;
#endif

inline std::shared_ptr<void> aligned_buffer(size_t bytes) {
  size_t n = (bytes + kAlign - 1) / kAlign * kAlign;
  if (n >= kMapBytes) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);  // page aligned
    if (p == MAP_FAILED) throw std::bad_alloc();
    return std::shared_ptr<void>(p, [n](void* q) { munmap(q, n); });
  }
  void* p = std::aligned_alloc(kAlign, n == 0 ? kAlign : n);
  if (p == nullptr) throw std::bad_alloc();
  return std::shared_ptr<void>(p, AlignedFree());
}

inline memory::dims plain_strides(const memory::dims& d) {
  memory::dims s(d.size(), 1);
  for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * d[i + 1];
  return s;
}

// A 4-D plain layout with dense NHWC strides (the strides of size-1 dims aside).
inline bool nhwc_dense(const memory::desc& md) {
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

// Dense channels-last strides of [N, C, *S] (NWC / NHWC / NDHWC): channels innermost.
inline memory::dims channels_last_strides(const memory::dims& d) {
  memory::dims st(d.size(), 1);
  int64_t inner = d.size() > 1 ? d[1] : 1;
  for (size_t i = d.size(); i-- > 2;) {
    st[i] = inner;
    inner *= d[i];
  }
  if (!d.empty()) st[0] = inner;
  return st;
}

// Whether md (plain strides) is dense channels-last (true) or dense row-major (false), the strides
// of size-1 dims aside; any other layout throws, naming `what` (GML's gather-style kernel steps:
// group_norm.h, resize.h).
inline bool channels_last_or_plain(const memory::desc& md, const std::string& what) {
  const memory::dims d = md.get_dims(), st = md.get_strides();
  auto matches = [&](const memory::dims& want) {
    if (st.size() != d.size()) return false;
    for (size_t i = 0; i < d.size(); ++i)
      if (d[i] != 1 && st[i] != want[i]) return false;
    return true;
  };
  if (matches(plain_strides(d))) return false;
  if (d.size() >= 3 && matches(channels_last_strides(d))) return true;
  throw std::invalid_argument("gml engine: " + what + " is neither plain nor channels-last");
}

inline void append_eltwise(dnnl::post_ops& po, const Eltwise& eltwise) {
  for (const auto& [alg, alpha, beta] : eltwise) po.append_eltwise(parse_eltwise(alg), alpha, beta);
}

// The oneDNN algorithm a step's string names, from its table; an unknown name is an error naming `what`.
inline dnnl::algorithm algorithm_of(const std::string& name,
                                    std::initializer_list<std::pair<const char*, dnnl::algorithm>> table,
                                    const char* what) {
  for (const auto& [n, a] : table)
    if (name == n) return a;
  throw std::invalid_argument(std::string("gml engine: unknown ") + what + " '" + name + "'");
}

// The attributes most steps start from: `eltwise` as the post-ops, and the scratchpad the plan
// provides (user mode: one arena for every step, see Plan).
inline dnnl::primitive_attr eltwise_attr(const Eltwise& eltwise) {
  dnnl::primitive_attr attr;
  dnnl::post_ops po;
  append_eltwise(po, eltwise);
  attr.set_post_ops(po);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

inline memory f32_constant(Consts& consts, const std::vector<float>& v, int arg) {
  memory m(memory::desc({static_cast<int64_t>(v.size())}, dt::f32, memory::format_tag::a), cpu_engine());
  std::memcpy(m.get_data_handle(), v.data(), v.size() * sizeof(float));
  consts.emplace_back(arg, m);
  return m;
}

inline void add_scale(dnnl::primitive_attr& attr, Consts& consts, int arg, float s) {
  attr.set_scales_mask(arg, 0);
  f32_constant(consts, {s}, DNNL_ARG_ATTR_SCALES | arg);
}

inline void add_qparams(dnnl::primitive_attr& attr, Consts& consts, int arg, std::pair<float, int> qp) {
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
inline void add_quant_attrs(dnnl::primitive_attr& attr, Consts& consts, QP src_q, QP dst_q,
                            const std::vector<float>& w_scales, int per_channel_mask) {
  if (!src_q) throw std::invalid_argument("gml engine: an INT8 op needs the input's qparams");
  add_qparams(attr, consts, DNNL_ARG_SRC, *src_q);
  if (dst_q) add_qparams(attr, consts, DNNL_ARG_DST, *dst_q);
  attr.set_scales_mask(DNNL_ARG_WEIGHTS, w_scales.size() > 1 ? per_channel_mask : 0);
  f32_constant(consts, w_scales, DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS);
}

// Copies the caller's bytes at ``ptr`` (layout ``user``) into plan-owned memory of layout ``want``.
inline memory reorder_constant(uintptr_t ptr, const memory::desc& user, const memory::desc& want) {
  memory src(user, cpu_engine(), reinterpret_cast<void*>(ptr));
  memory dst(want, cpu_engine());
  dnnl::stream s(cpu_engine());
  dnnl::reorder(src, dst).execute(s, src, dst);
  s.wait();
  return dst;
}

inline memory copy_constant(uintptr_t ptr, const memory::desc& md) {
  memory m(md, cpu_engine());
  std::memcpy(m.get_data_handle(), reinterpret_cast<void*>(ptr), md.get_size());
  return m;
}

inline std::string isa_name() {
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

}  // namespace gml_engine
