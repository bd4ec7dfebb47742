// GML engine, the data-movement step family: reorders (layout changes, quantize / dequantize /
// requantize), concatenation, nn.Embedding's row gather and a padding mask's integer / bool ops (the
// last two GML kernel steps). Python fills a ReorderStep / ConcatStep / EmbeddingStep / MaskOpStep
// (gml/runtime/plan_steps.py) and calls Plan.add(step).
#pragma once

#include "bind.h"
#include "plan.h"

namespace gml_engine {

struct ReorderStep {
  int src = -1, dst = -1;
  QP src_q, dst_q;  // (scale, zero point) of a u8 side, or none (fp32)
  std::string name;
};

// Reorder: layout change, quantize (f32 -> u8, dst_q), dequantize (u8 -> f32, src_q) or
// requantize (both). real = (q - zp) * scale on either side.
inline void build(Plan& p, const ReorderStep& desc) {
  const int src = desc.src, dst = desc.dst;
  const QP &src_q = desc.src_q, &dst_q = desc.dst_q;
  const std::string& name = desc.name;
  dnnl::primitive_attr attr;
  std::vector<std::pair<int, memory>> consts;
  if (src_q) add_qparams(attr, consts, DNNL_ARG_SRC, *src_q);
  if (dst_q) add_qparams(attr, consts, DNNL_ARG_DST, *dst_q);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (!p.resolved(dst)) p.resolve(dst, p.md_in(src));  // a free destination takes the source's layout
  auto pd = dnnl::reorder::primitive_desc(cpu_engine(), p.md_in(src), cpu_engine(), p.md_in(dst), attr);
  p.push(dnnl::reorder(pd), {{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, dst}}, std::move(consts), pd.scratchpad_desc(),
         name);
}

struct ConcatStep {
  std::vector<int> srcs;
  int dst = -1, axis = 0;
  std::string name;
};

// Concatenation along ``axis`` (same dtype and qparams on every input: the caller requantizes).
inline void build(Plan& p, const ConcatStep& desc) {
  const std::vector<int>& srcs = desc.srcs;
  const int dst = desc.dst, axis = desc.axis;
  const std::string& name = desc.name;
  std::vector<memory::desc> mds;
  std::vector<std::pair<int, int>> args{{DNNL_ARG_DST, dst}};
  for (size_t i = 0; i < srcs.size(); ++i) {
    mds.push_back(p.md_in(srcs[i]));
    args.emplace_back(DNNL_ARG_MULTIPLE_SRC + static_cast<int>(i), srcs[i]);
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto pd = dnnl::concat::primitive_desc(cpu_engine(), p.md_out(dst), axis, mds, attr);
  p.resolve(dst, pd.dst_desc());
  p.push(dnnl::concat(pd), std::move(args), {}, pd.scratchpad_desc(), name);
}

// ids: an int64 value; table: the caller's [num, dim] rows, ``ld`` elements apart (kept alive by the
// Python side: Plan.keep).
struct EmbeddingStep {
  int ids = -1, dst = -1;
  uintptr_t table = 0;
  int64_t num = 0, dim = 0, ld = 0;
  std::string name;
};

// nn.Embedding's lookup, a Kernel step: dst[i, :] = table[ids[i], :] for every id (int64, any
// rank and strides) into a dense [..., dim] dst (f32 or bf16, the table's dtype). ``table`` points
// at the caller's [num, dim] rows (``ld`` elements apart). It is NOT copied (a vocabulary is tens
// of MB and a segment keeps up to 8 plans): the Python side keeps the tensor alive with the plan
// (Plan.keep). An id outside [0, num) throws std::out_of_range (an IndexError in Python).
inline void build(Plan& p, const EmbeddingStep& desc) {
  const int ids = desc.ids, dst = desc.dst;
  const uintptr_t table = desc.table;
  const int64_t num = desc.num, dim = desc.dim, ld = desc.ld;
  const std::string& name = desc.name;
  const memory::desc ids_md = p.md_in(ids), dst_md = p.md_out(dst);
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
  p.push_kernel(std::move(gather), {{DNNL_ARG_SRC, ids}, {DNNL_ARG_DST, dst}}, memory::desc(), name,
                "gml:embedding_gather");
}

// op "ne0", "and" or "index" (below); strides: per source, dst's rank, in elements (0: broadcast).
struct MaskOpStep {
  std::string op;
  std::vector<int> srcs;
  int dst = -1;
  std::vector<Dims> strides;
  Dims index_dims, index_strides;
  std::string name;
};

// The small integer / bool ops of a padding mask's arithmetic (transformers' mask builder), as Kernel
// steps: strided loops over the dense destination ``dst`` (rank R). Each source is read through
// ``strides[i]`` (R entries, in elements, 0 along a broadcast dim), computed by the Python side.
//   "ne0":   dst = (src0 != 0)                       int64 -> bool (u8)
//   "and":   dst = src0 & src1                       bool
//   "index": dst[j.., r..] = src0[i1[j..], .., ik[j..], r..]   (aten.index with k int64 index
//            tensors src1..srck on src0's leading dims; ``index_dims`` / ``index_strides``: src0's
//            sizes / strides of those dims; an index outside [-size, size) throws)
inline void build(Plan& p, const MaskOpStep& desc) {
  const std::string &op = desc.op, &name = desc.name;
  const std::vector<int>& srcs = desc.srcs;
  const int dst = desc.dst;
  const std::vector<Dims>& strides = desc.strides;
  const Dims &index_dims = desc.index_dims, &index_strides = desc.index_strides;
  const memory::desc dst_md = p.md_out(dst);
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
  const size_t item0 = memory::data_type_size(p.md_in(srcs[0]).get_data_type());  // index: any dtype
  if (kind == 2 ? dst_md.get_data_type() != p.md_in(srcs[0]).get_data_type() : dst_md.get_data_type() != dt::u8)
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
  std::vector<std::pair<int, int>> value_args{{DNNL_ARG_DST, dst}};
  for (int i = 0; i < ns; ++i) value_args.emplace_back(DNNL_ARG_MULTIPLE_SRC + i, srcs[i]);
  p.push_kernel(std::move(k), std::move(value_args), memory::desc(), name, "gml:mask_" + op);
}

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(ReorderStep, src, dst, src_q, dst_q, name)
GML_STEP(ConcatStep, srcs, dst, axis, name)
GML_STEP(EmbeddingStep, ids, dst, table, num, dim, ld, name)
GML_STEP(MaskOpStep, op, srcs, dst, strides, index_dims, index_strides, name)

}  // namespace gml_engine
