// GML engine core: a Plan is a graph segment's values and its list of steps, for one input shape.
//
// The Python side (src/gml/runtime/) does all graph work: it translates each lowered node into
// steps, infers every value's shape and strides, and plans an activation arena from value
// lifetimes. Each step family's header (conv.h, linear.h, dynamic_linear.h, pool.h, eltwise.h,
// attention_step.h, shape.h) declares a typed step description (a struct the Python side fills,
// gml/runtime/plan_steps.py) and its builder, which turns it into oneDNN primitives (or a GML
// kernel step) through the builder interface of Plan below; module.cpp binds it all. oneDNN is
// used the way its own examples do (examples/primitives/convolution.cpp, cnn_inference_int8.cpp):
//
//   * a primitive descriptor per op, weights described with format_tag::any and reordered once
//     into the layout the primitive picks; scales / zero points / bias kept as constant memories;
//   * activations are plain strided memories (u8 NHWC as the Python executor keeps them), placed
//     at planned offsets in one arena or in the caller's input / output tensors; a value added
//     with no strides is "free": its producer's primitive picks its layout (format_tag::any, e.g.
//     fp32 nChw16c on AVX-512), and the Python side plans its bytes after the steps exist
//     (value_bytes / set_offset, see gml/runtime/plan.py); tie() gives a value another's layout
//     (the residual sum accumulates in the skip value's memory and layout);
//   * run() executes the step list on a stream with the GIL released.
//
// Concurrency: primitives are immutable after creation and may run from several threads at once.
// Everything a run writes (arena, scratchpad, memory objects whose data handle changes per call)
// lives in a Context; a run takes a free Context from a pool (or makes one), so concurrent calls
// never share one.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "common.h"

namespace gml_engine {

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
  Consts const_args;
  memory::desc scratchpad_md;
  std::string name;
  std::string impl;  // what step_impls() reports for a Kernel step (push_kernel)
};

// Per-call mutable state (see the file comment).
struct Context {
  std::shared_ptr<void> arena, scratch;
  std::vector<memory> values;
  std::vector<std::unordered_map<int, memory>> args;
  dnnl::stream stream;
};

using ValueArgs = std::vector<std::pair<int, int>>;  // (DNNL_ARG_*, value id)

class Plan {
 public:
  Plan() = default;

  // ---------------------------------------------------------------- values (segment I/O, arena)
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

  // ---------------------------------------------------------------- the builders' interface
  // A value a step reads: its layout must be known by now.
  memory::desc md_in(int id) const {
    if (!resolved(id)) throw std::invalid_argument("gml engine: a free-layout value is read before it is written");
    return values_[layout_root(id)].md;
  }

  // A value a step writes: its layout, or format_tag::any for a free value not yet resolved.
  memory::desc md_out(int id) const { return values_[layout_root(id)].md; }

  bool resolved(int id) const {
    return values_[layout_root(id)].md.get_format_kind() != memory::format_kind::any;
  }

  // A free value (and what is tied to it) takes the layout its writer's primitive picked.
  void resolve(int id, const memory::desc& md) {
    Value& root = values_[layout_root(id)];
    if (root.md.get_format_kind() == memory::format_kind::any) root.md = md;
    if (id != layout_root(id)) values_[id].md = root.md;
  }

  // A oneDNN primitive step.
  void push(dnnl::primitive prim, ValueArgs value_args, Consts consts, memory::desc scratch, const std::string& name) {
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    steps_.push_back(Step{std::move(prim), {}, std::move(value_args), std::move(consts), std::move(scratch), name});
  }

  // A GML kernel step: ``kernel`` reads and writes the memories of ``value_args`` (and a
  // scratchpad of ``scratch``, per Context); step_impls() reports it as ``impl``.
  void push_kernel(Kernel kernel, ValueArgs value_args, memory::desc scratch, const std::string& name,
                   const std::string& impl) {
    if (finalized_) throw std::runtime_error("gml engine: plan already finalized");
    Step step{dnnl::primitive(), std::move(kernel), std::move(value_args), {}, std::move(scratch), name};
    step.impl = impl;
    steps_.push_back(std::move(step));
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
      // a step that declared a scratchpad gets one even when it is empty (a GML kernel on an empty
      // batch asks for 0 bytes and still looks its argument up); oneDNN's "none" has no dims
      if (s.scratchpad_md.get_size() > 0 || s.scratchpad_md.get_ndims() > 0)
        args.emplace(DNNL_ARG_SCRATCHPAD, memory(s.scratchpad_md, cpu_engine(), ctx->scratch.get()));
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

}  // namespace gml_engine
