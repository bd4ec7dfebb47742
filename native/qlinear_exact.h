// GML engine, gml::qlinear with backend "gml" (docs/adr/011-int8-on-every-isa.md, 2026-11-29): a static
// INT8 linear layer whose 8-bit weights run on GML's exact AVX2 GEMM (int8_gemm_avx2.h) on CPUs without a
// VNNI-class dot product, where oneDNN's u8 x s8 kernels add pairs of products into a saturating int16.
// The math is defined once, in gml/kernels/exact_int8.py (the Python executor); this step computes the
// same integers and the same fp32 operations in the same order:
//
//   acc[m, n] = sum_k (x[m, k] - 128) * w[n, k]                  exact int32 (|x - 128| <= 128, |w| <= 127)
//   y[m, n]   = (float(acc) * scale[n]) + bias[n]                 two fp32 roundings (scale, bias: Python's)
//   y         = max(y, 0)                                        (post-op relu only)
//   dst       = y                                                 (fp32 output), or
//   dst       = uint8(clamp(round_half_even(y * out_inv) + out_zp, 0, 255))   (uint8 output)
//
// ``scale[n] = s_x * s_w[n]`` and ``bias[n] = b[n] + s_x * s_w[n] * (128 - z_x) * sum_k w[n, k]`` (the
// source zero point folded, in float64, then rounded to fp32 once) are computed by the Python executor's
// helper and passed here, so both executors start from the same fp32 constants.
// Python fills an ExactQLinearStep (gml/runtime/rules/linear.py, Builder.kernel) and calls Plan.add(step).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "bind.h"
#include "int8_gemm_avx2.h"
#include "plan.h"

namespace gml_engine {

// |acc| <= K * 128 * 127 must fit int32 (u8 rows shifted to [-128, 127] against |w| <= 127)
constexpr int64_t kExactQLinearMaxK = 2147483647LL / (128 * 127);

struct ExactQLinearStep {
  int src = -1, dst = -1;         // uint8 [M, K] rows (dense columns) -> uint8 or fp32 [M, N] (dense columns)
  uintptr_t weight = 0;           // the caller's int8 [N, K] rows, every value in [-127, 127]; copied (packed)
  Dims wdims;
  std::vector<float> scale, bias;  // N fp32 values each: the epilogue's constants (file comment)
  bool relu = false;
  float out_inv = 1.0f;           // 1 / s_out as fp32 (uint8 output only)
  int out_zp = 0;
  std::string name;
};

// y (fp32) -> uint8 as the Python executor's torch ops: t = y * inv (fp32); r = round half to even;
// q = clamp(r + zp, 0, 255) in fp32, then converted (an integer in [0, 255]: exact). 32 values per
// step with AVX2 (_mm256_round_ps to nearest: half to even, as nearbyint in the default mode).
__attribute__((target("avx2"))) inline void quantize_u8(const float* y, int64_t n, float inv, float zp, uint8_t* q) {
  const __m256 vi = _mm256_set1_ps(inv), vz = _mm256_set1_ps(zp), lo = _mm256_setzero_ps(), hi = _mm256_set1_ps(255.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packus' 128-bit lane interleave
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) {
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(y + c + 8 * i), vi);
      t = _mm256_add_ps(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
      v[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
    }
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(v[0], v[1]), _mm256_packus_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c), _mm256_permutevar8x32_epi32(w, order));
  }
  for (; c < n; ++c) {
    const float r = std::nearbyint(y[c] * inv) + zp;
    q[c] = static_cast<uint8_t>(std::min(255.0f, std::max(0.0f, r)));
  }
}

// The layer: the packed weights and the epilogue's constants, and one call on rows given by address.
// Shared by the plan step (build below) and the Python executor's kernel (gml/kernels/exact_int8.py:
// the ``ExactLinear`` binding, so the fallback path of a shape the engine refuses runs the same code).
class ExactLinear {
 public:
  // ``w``: int8 [n, k] rows (copied and packed); ``scale``, ``bias``: n fp32 values each.
  ExactLinear(const int8_t* w, int64_t n, int64_t k, const std::vector<float>& scale, const std::vector<float>& bias)
      : n_(n), k_(k) {
    if (k > kExactQLinearMaxK) throw std::invalid_argument("gml engine: exact qlinear with K > 132,104 could overflow int32");
    if (static_cast<int64_t>(scale.size()) != n || static_cast<int64_t>(bias.size()) != n)
      throw std::invalid_argument("gml engine: exact qlinear needs N scales and N biases");
    if (!w) throw std::invalid_argument("gml engine: exact qlinear without a weight");
    // the Gemm checks every weight is in [-127, 127] (it throws otherwise: the caller falls back)
    gemm_ = std::make_shared<const gml_int8_gemm::Gemm>(w, n, k, k, scale, bias.data());
  }

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  bool seven_bit() const { return gemm_->seven_bit(); }
  size_t gemm_bytes(int64_t m) const { return (gemm_->scratch_bytes(m) + kAlign - 1) / kAlign * kAlign; }
  size_t scratch_bytes(int64_t m, bool to_u8) const {
    return gemm_bytes(m) + (to_u8 ? static_cast<size_t>(m * n_) * sizeof(float) : 0);
  }

  // x: m uint8 rows ``ldx`` bytes apart -> out: m rows ``ldy`` elements apart, uint8 (``to_u8``) or fp32.
  void run(const uint8_t* x, int64_t m, int64_t ldx, void* out, int64_t ldy, bool to_u8, bool relu, float inv, float zp,
           char* scratch) const {
    const bool parallel = m * n_ * k_ >= (int64_t{1} << 18);  // below: an OpenMP fork costs more than it saves
    const int8_t* xs = reinterpret_cast<const int8_t*>(x);
    if (!to_u8) {
      gemm_->run(xs, m, ldx, nullptr, static_cast<float*>(out), ldy, relu, nullptr, 0, scratch, parallel, true);
      return;
    }
    float* y = reinterpret_cast<float*>(scratch + gemm_bytes(m));  // dense [M, N] fp32, then quantized out
    gemm_->run(xs, m, ldx, nullptr, y, n_, relu, nullptr, 0, scratch, parallel, true);
    uint8_t* q = static_cast<uint8_t*>(out);
    for (int64_t r = 0; r < m; ++r) quantize_u8(y + r * n_, n_, inv, zp, q + r * ldy);
  }

 private:
  int64_t n_, k_;
  std::shared_ptr<const gml_int8_gemm::Gemm> gemm_;
};

inline void build(Plan& p, const ExactQLinearStep& desc) {
  const memory::desc s_md = p.md_in(desc.src), d_md = p.md_out(desc.dst);
  if (s_md.get_ndims() != 2 || s_md.get_data_type() != dt::u8)
    throw std::invalid_argument("gml engine: exact qlinear takes a 2-D uint8 source");
  const memory::dims sd = s_md.get_dims(), ss = s_md.get_strides();
  const int64_t m = sd[0], k = sd[1];
  if (desc.wdims.size() != 2 || desc.wdims[1] != k) throw std::invalid_argument("gml engine: exact qlinear weight is not [N, K]");
  const int64_t n = desc.wdims[0];
  if (k > 1 && ss[1] != 1) throw std::invalid_argument("gml engine: exact qlinear source columns must be dense");
  const dt out_dt = d_md.get_data_type();
  if (d_md.get_ndims() != 2 || d_md.get_dims() != memory::dims{m, n} || (out_dt != dt::u8 && out_dt != dt::f32))
    throw std::invalid_argument("gml engine: exact qlinear writes a uint8 or fp32 [M, N] destination");
  const memory::dims ds = d_md.get_strides();
  if (n > 1 && ds[1] != 1) throw std::invalid_argument("gml engine: exact qlinear destination columns must be dense");
  auto layer = std::make_shared<const ExactLinear>(reinterpret_cast<const int8_t*>(desc.weight), n, k, desc.scale, desc.bias);
  const int64_t ldx = m > 1 ? ss[0] : k, ldy = m > 1 ? ds[0] : n;
  const bool to_u8 = out_dt == dt::u8, relu = desc.relu;
  const float inv = desc.out_inv, zp = static_cast<float>(desc.out_zp);
  Kernel kernel = [layer, m, ldx, ldy, to_u8, relu, inv, zp](const std::unordered_map<int, memory>& args) {
    layer->run(static_cast<const uint8_t*>(args.at(DNNL_ARG_SRC).get_data_handle()), m, ldx,
               args.at(DNNL_ARG_DST).get_data_handle(), ldy, to_u8, relu, inv, zp,
               static_cast<char*>(args.at(DNNL_ARG_SCRATCHPAD).get_data_handle()));
  };
  const std::string impl = layer->seven_bit() ? "gml:int8_gemm_avx2_u8s7" : "gml:int8_gemm_avx2";
  const size_t scratch = layer->scratch_bytes(m, to_u8);
  p.push_kernel(std::move(kernel), {{DNNL_ARG_SRC, desc.src}, {DNNL_ARG_DST, desc.dst}},
                memory::desc({static_cast<int64_t>(scratch)}, dt::u8, memory::format_tag::a), desc.name, impl);
}

// The layer for the Python executor: ExactLinear(weight address, n, k, scale, bias) and
// run(x address, m, y address, to_u8, relu, out_inv, out_zp) on dense rows (gml/kernels/exact_int8.py).
inline void bind_exact_linear(Module& m, PlanClass&) {
  nb::class_<ExactLinear>(m, "ExactLinear")
      .def("__init__",
           [](ExactLinear* self, uintptr_t w, int64_t n, int64_t k, const std::vector<float>& scale,
              const std::vector<float>& bias) {
             new (self) ExactLinear(reinterpret_cast<const int8_t*>(w), n, k, scale, bias);
           })
      .def("run", [](const ExactLinear& layer, uintptr_t x, int64_t rows, uintptr_t y, bool to_u8, bool relu, float inv,
                     int zp) {
        std::vector<char> scratch(layer.scratch_bytes(rows, to_u8) + kAlign);
        char* s = scratch.data() + (kAlign - reinterpret_cast<uintptr_t>(scratch.data()) % kAlign) % kAlign;
        nb::gil_scoped_release release;
        layer.run(reinterpret_cast<const uint8_t*>(x), rows, layer.k(), reinterpret_cast<void*>(y), layer.n(), to_u8,
                  relu, inv, static_cast<float>(zp), s);
      });
}
GML_BIND(bind_exact_linear)

// Python bindings of this family's step descriptions (native/bind.h).
GML_STEP(ExactQLinearStep, src, dst, weight, wdims, scale, bias, relu, out_inv, out_zp, name)

}  // namespace gml_engine
