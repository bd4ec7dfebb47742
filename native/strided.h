// GML engine: an fp32 add or mul over arbitrary strided plain layouts (with broadcasting), for the
// layouts oneDNN has only its reference binary for (issue #23, item 6: no reference kernel in any plan).
//
// Why. oneDNN's jitted binary kernels want src0 and dst in one layout and src1 in it or in one of a
// few broadcast patterns. Anything else gets "ref:any": plain C++ that recomputes every element's
// offsets from its logical index. timm's BotNet computes its relative-position logits as two
// permuted views of padded buffers added with a broadcast (src0 acbde, src1 [4,16,16,1,16] with
// strides 8432x527x31x16x1): 16 ms per call for 262k elements under ONEDNN_MAX_CPU_ISA=AVX2, which
// made GML fp32 slower than eager on that model.
//
// How. The dims are ordered by the destination's strides (outermost first, a dim of size 1 dropped);
// each source's stride in a broadcast dim is 0. The innermost dim is one loop with three constant
// strides, specialised for the dense cases (dst and src0 stride 1, src1 stride 1 or 0: loops GCC
// vectorises; the engine's binaries put the full-shape operand first); the outer dims are a flat
// index split over the OpenMP team. Every element is one fp32 add or multiply, as oneDNN's. Only what
// the engine's fp32 binaries use: no input scales, no post-ops (the caller keeps oneDNN's binary
// otherwise; its INT8 adds and muls have u8 / s8 sources). The mul is a squeeze-excite gate
// (x * sigmoid(...), a per-channel broadcast) whose operands' layouts oneDNN has no jit kernel for.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include <dnnl.hpp>

namespace gml_strided {

using memory = dnnl::memory;

// ``md``'s strides if it is a plain strided layout (no inner blocks, no offset), else nullopt.
inline std::optional<memory::dims> plain_strides(const memory::desc& md) {
  if (md.get_format_kind() != memory::format_kind::blocked) return std::nullopt;
  int nblks = 0;
  int64_t offset0 = 0;
  dnnl::error::wrap_c_api(dnnl_memory_desc_query(md.get(), dnnl_query_inner_nblks_s32, &nblks), "layout");
  dnnl::error::wrap_c_api(dnnl_memory_desc_query(md.get(), dnnl_query_submemory_offset_s64, &offset0), "layout");
  if (nblks != 0 || offset0 != 0) return std::nullopt;
  return md.get_strides();
}

enum class Op { add, sub, mul };

inline const char* impl_name(Op op) {
  return op == Op::add ? "gml:strided_add" : op == Op::sub ? "gml:strided_sub" : "gml:strided_mul";
}

class Binary {
 public:
  // dst = src0 <op> src1 for these layouts, if plain strided f32 everywhere with the sources' dims
  // equal to dst's or 1 (a broadcast); nullopt otherwise (the caller keeps oneDNN's binary).
  static std::optional<Binary> make(Op op, const memory::desc& src0, const memory::desc& src1,
                                    const memory::desc& dst) {
    const auto s0 = plain_strides(src0), s1 = plain_strides(src1), sd = plain_strides(dst);
    if (!s0 || !s1 || !sd) return std::nullopt;
    for (const auto* md : {&src0, &src1, &dst})
      if (md->get_data_type() != memory::data_type::f32) return std::nullopt;
    const memory::dims d0 = src0.get_dims(), d1 = src1.get_dims(), dd = dst.get_dims();
    const size_t n = dd.size();
    if (n == 0 || d0.size() != n || d1.size() != n) return std::nullopt;
    Binary b;
    b.op_ = op;
    std::vector<size_t> order;
    for (size_t i = 0; i < n; ++i) {
      if (dd[i] <= 0) return std::nullopt;  // an empty tensor: oneDNN's primitive (a no-op) stays
      if ((d0[i] != dd[i] && d0[i] != 1) || (d1[i] != dd[i] && d1[i] != 1)) return std::nullopt;
      if (dd[i] > 1) order.push_back(i);
    }
    // outermost first: the destination's largest stride (ties: the logical order)
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t c) { return (*sd)[a] > (*sd)[c]; });
    for (size_t i : order) {
      b.dims_.push_back(dd[i]);
      b.strides_[0].push_back(d0[i] == 1 ? 0 : (*s0)[i]);
      b.strides_[1].push_back(d1[i] == 1 ? 0 : (*s1)[i]);
      b.strides_[2].push_back((*sd)[i]);
    }
    if (b.dims_.empty()) {  // a single element
      b.dims_.push_back(1);
      for (auto& s : b.strides_) s.push_back(0);
    }
    return b;
  }

  void run(const float* a, const float* c, float* d) const {
    const int64_t inner = dims_.back();
    const int64_t outer = std::accumulate(dims_.begin(), dims_.end() - 1, int64_t{1}, std::multiplies<int64_t>());
    const size_t nd = dims_.size();
#pragma omp parallel for schedule(static) if (outer * inner >= (int64_t{1} << 15))
    for (int64_t o = 0; o < outer; ++o) {
      int64_t off[3] = {0, 0, 0}, rest = o;
      for (size_t i = nd - 1; i-- > 0;) {  // the outer dims' index from the flat one, innermost first
        const int64_t idx = rest % dims_[i];
        rest /= dims_[i];
        for (int t = 0; t < 3; ++t) off[t] += idx * strides_[t][i];
      }
      row(a + off[0], c + off[1], d + off[2], inner);
    }
  }

 private:
  void row(const float* a, const float* c, float* d, int64_t len) const {
    if (op_ == Op::add)
      row_of(a, c, d, len, [](float x, float y) { return x + y; });
    else if (op_ == Op::sub)
      row_of(a, c, d, len, [](float x, float y) { return x - y; });
    else
      row_of(a, c, d, len, [](float x, float y) { return x * y; });
  }

  // One innermost row: the dense cases as loops with constant unit strides (vectorised).
  template <class F>
  void row_of(const float* a, const float* c, float* d, int64_t len, F f) const {
    const int64_t sa = strides_[0].back(), sc = strides_[1].back(), sd = strides_[2].back();
    if (sd == 1 && sa == 1 && sc == 1) {
      for (int64_t i = 0; i < len; ++i) d[i] = f(a[i], c[i]);
    } else if (sd == 1 && sa == 1 && sc == 0) {
      const float y = c[0];
      for (int64_t i = 0; i < len; ++i) d[i] = f(a[i], y);
    } else {
      for (int64_t i = 0; i < len; ++i) d[i * sd] = f(a[i * sa], c[i * sc]);
    }
  }

  Op op_ = Op::add;
  std::vector<int64_t> dims_;
  std::vector<int64_t> strides_[3];  // src0, src1, dst, per ordered dim (elements; 0: broadcast)
};

}  // namespace gml_strided
