// GML engine: the Python module gml._engine (nanobind). Binds the Plan core (plan.h), the decode /
// WOQ kernels the LLM runtime calls by address, and every step family: each family header ends with
// its own binder (native/bind.h), and this file includes every header of native/ through the list
// CMakeLists.txt generates, so a new family header needs no edit here. Python creates e.g.
// ``_engine.ConvStep()``, sets its fields by name (gml/runtime/plan_steps.py) and calls
// ``plan.add(step)``; the description's type picks the builder. See docs/architecture.md, "How to add an op".
#include "gml_native_headers.h"  // generated: every native/*.h

using namespace gml_engine;  // and its nb (nanobind) alias, native/bind.h

namespace {

// The WOQ GEMV / GEMM problem of contiguous tensors the Python side gives by address (woq_linear, woq_gemm).
gml_woq::Problem woq_problem(uintptr_t x, int64_t M, int64_t K, uintptr_t q, int bits, int64_t group,
                             uintptr_t scales, uintptr_t zeros, uintptr_t bias, uintptr_t y, int64_t N) {
  gml_woq::Problem p;
  p.x = reinterpret_cast<const float*>(x);
  p.M = M, p.K = K, p.N = N, p.bits = bits, p.group = group;
  p.q = reinterpret_cast<const void*>(q);
  p.scales = reinterpret_cast<const float*>(scales);
  p.zeros = reinterpret_cast<const uint8_t*>(zeros);
  p.bias = reinterpret_cast<const float*>(bias);
  p.y = reinterpret_cast<float*>(y);
  return p;
}

}  // namespace

NB_MODULE(_engine, m) {
  m.doc() = "GML engine: planned graph segments executed as oneDNN primitives (see native/plan.h).";
  m.def("onednn_version", [] {
    const dnnl_version_t* v = dnnl_version();
    return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  });
  m.def("cpu_isa", &isa_name, "The instruction set oneDNN dispatches to on this CPU.");
  m.def("fused_attention_kernels", &gml_engine::fused_attention_kernels,
        "The fused attention kernels this CPU runs: 'avx512' (AVX512-BF16; native/attention.h), 'avx2' "
        "(AVX2 + FMA, fp32; native/attention_avx2.h).");
  m.def(
      "woq_linear",
      [](uintptr_t x, int64_t M, int64_t K, uintptr_t q, int bits, int64_t group, uintptr_t scales, uintptr_t zeros,
         uintptr_t bias, uintptr_t y, int64_t N, const std::string& isa, int nthreads, int act_bits) {
        const gml_woq::Problem p = woq_problem(x, M, K, q, bits, group, scales, zeros, bias, y, N);
        if (M == 1)  // a decode step: helpers that are not scheduled in time cost nothing (woq_pool.h)
          gml_woq::linear_pooled(p, isa, nthreads, act_bits);
        else if (act_bits == 8)
          gml_woq::linear_act8(p, isa, nthreads);
        else if (act_bits == 0)
          gml_woq::linear(p, isa, nthreads);
        else
          throw std::invalid_argument("woq_linear: act_bits is 0 (fp32 activations) or 8");
      },
      nb::arg("x"), nb::arg("M"), nb::arg("K"), nb::arg("q"), nb::arg("bits"), nb::arg("group"), nb::arg("scales"),
      nb::arg("zeros"), nb::arg("bias"), nb::arg("y"), nb::arg("N"), nb::arg("isa"), nb::arg("nthreads") = 0,
      nb::arg("act_bits") = 0, nb::call_guard<nb::gil_scoped_release>(),
      "torch.ops.gml.woq_linear on contiguous tensors given by address (native/woq.h; act_bits 8: "
      "native/woq_int8act.h; M = 1: rows split by native/woq_pool.h); isa: vnni | avx512 | avxvnni | avx2 | "
      "scalar.");
  m.def(
      "woq_gemm",
      [](uintptr_t x, int64_t M, int64_t K, uintptr_t q, int bits, int64_t group, uintptr_t scales, uintptr_t zeros,
         uintptr_t bias, uintptr_t y, int64_t N, const std::string& isa, int nthreads) {
        gml_woq::gemm(woq_problem(x, M, K, q, bits, group, scales, zeros, bias, y, N), isa, nthreads);
      },
      nb::arg("x"), nb::arg("M"), nb::arg("K"), nb::arg("q"), nb::arg("bits"), nb::arg("group"), nb::arg("scales"),
      nb::arg("zeros"), nb::arg("bias"), nb::arg("y"), nb::arg("N"), nb::arg("isa"), nb::arg("nthreads") = 0,
      nb::call_guard<nb::gil_scoped_release>(),
      "woq_linear for many rows (prefill): dequantized weight tiles into oneDNN's fp32 GEMM (native/woq_gemm.h).");
  // The decode-step glue (native/decode.h): one row, fp32, addresses of contiguous buffers.
  m.def(
      "decode_norm",
      [](uintptr_t x, int64_t n, uintptr_t w, uintptr_t b, int kind, float eps, uintptr_t y) {
        gml_decode::norm_row(reinterpret_cast<const float*>(x), n, reinterpret_cast<const float*>(w),
                             reinterpret_cast<const float*>(b), kind, eps, reinterpret_cast<float*>(y));
      },
      nb::arg("x"), nb::arg("n"), nb::arg("w"), nb::arg("b"), nb::arg("kind"), nb::arg("eps"), nb::arg("y"),
      "y = norm(x) of one row (kind 0: RMS, 1: layer norm; w / b 0: none); native/decode.h.");
  m.def(
      "decode_residual_norm",
      [](uintptr_t h, uintptr_t delta, int64_t n, bool delta_norm, uintptr_t dw, uintptr_t db, uintptr_t w,
         uintptr_t b, int kind, float eps, uintptr_t y) {
        gml_decode::residual_norm(reinterpret_cast<float*>(h), reinterpret_cast<float*>(delta), n, delta_norm,
                                  reinterpret_cast<const float*>(dw), reinterpret_cast<const float*>(db),
                                  reinterpret_cast<const float*>(w), reinterpret_cast<const float*>(b), kind, eps,
                                  reinterpret_cast<float*>(y));
      },
      nb::arg("h"), nb::arg("delta"), nb::arg("n"), nb::arg("delta_norm"), nb::arg("dw"), nb::arg("db"), nb::arg("w"),
      nb::arg("b"), nb::arg("kind"), nb::arg("eps"), nb::arg("y"),
      "h += delta (normed first when delta_norm), y = norm(h); native/decode.h.");
  m.def(
      "decode_qk_norm_rope",
      [](uintptr_t qkv, int64_t heads, int64_t kv, int64_t d, uintptr_t qw, uintptr_t kw, int kind, float eps,
         int64_t r, uintptr_t cos, uintptr_t sin) {
        gml_decode::qk_norm_rope(reinterpret_cast<float*>(qkv), heads, kv, d, reinterpret_cast<const float*>(qw),
                                 reinterpret_cast<const float*>(kw), kind, eps, r, reinterpret_cast<const float*>(cos),
                                 reinterpret_cast<const float*>(sin));
      },
      nb::arg("qkv"), nb::arg("heads"), nb::arg("kv"), nb::arg("d"), nb::arg("qw"), nb::arg("kw"), nb::arg("kind"),
      nb::arg("eps"), nb::arg("r"), nb::arg("cos"), nb::arg("sin"),
      "q / k heads of a fused QKV row normed (qw / kw 0: no norm) and rotated (r dims); native/decode.h.");
  m.def(
      "decode_attention",
      [](uintptr_t qkv, int64_t heads, int64_t kv, int64_t d, uintptr_t kc, uintptr_t vc, int64_t max_len, int64_t lo,
         int64_t pos, float scale, int kv_type, int tier, int nthreads, uintptr_t out) {
        nb::gil_scoped_release nogil;
        gml_decode::attention_row(reinterpret_cast<const float*>(qkv), heads, kv, d, reinterpret_cast<void*>(kc),
                                  reinterpret_cast<void*>(vc), max_len, lo, pos, scale, kv_type, tier, nthreads,
                                  reinterpret_cast<float*>(out));
      },
      nb::arg("qkv"), nb::arg("heads"), nb::arg("kv"), nb::arg("d"), nb::arg("kc"), nb::arg("vc"), nb::arg("max_len"),
      nb::arg("lo"), nb::arg("pos"), nb::arg("scale"), nb::arg("kv_type"), nb::arg("tier"), nb::arg("nthreads"),
      nb::arg("out"),
      "One position's attention over a KV cache (kv_type 0 fp32, 1 bf16, 2 fp16), its k / v written at pos "
      "first; tier 0 scalar, 1 AVX2, 2 AVX-512; positions split over nthreads (the decode pool); "
      "native/decode_attention.h.");
  m.def("woq_isa_supported", &gml_woq::cpu_has, "Whether this CPU runs woq_linear's kernel for `isa`.");
  nb::class_<Plan> plan(m, "Plan", nb::dynamic_attr());  // dynamic attributes: ``keep`` (embedding tables)
  plan.def(nb::init<>())
      .def("add_value", &Plan::add_value, nb::arg("dims"), nb::arg("strides"), nb::arg("dtype"), nb::arg("where"),
           nb::arg("index"), nb::arg("offset"))
      .def("add_constant", &Plan::add_constant, nb::arg("dims"), nb::arg("strides"), nb::arg("dtype"), nb::arg("data"))
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

  for (Binder bind : binders()) bind(m, plan);  // each family header's step description(s)
}
