// Winograd F(2x2, 3x3) convolution for the GML engine (docs/adr/010-winograd-conv.md, issue #14).
//
// For a 2-D 3x3 conv with stride 1, dilation 1, groups 1 and padding 1 on NHWC dense f32 or bf16
// activations, each 2x2 block of outputs (a "tile") is computed from the 4x4 input patch around it
// with 16 multiplications per (input channel, output channel) pair instead of 36 (Lavin & Gray 2015):
//
//   V = B^T d B   (per tile and input channel; d: the 4x4 patch, zero outside the image)
//   U = G g G^T   (per output / input channel pair; g: the 3x3 kernel; once, at plan build)
//   M[xi] = V[xi] x U[xi]   for each of the 16 positions xi of the 4x4 transform domain: 16 GEMMs
//                           [tiles, Cin] x [Cin, Cout], one oneDNN batched matmul (fp32 accumulate)
//   Y = A^T M A   (per tile and output channel: the 2x2 outputs), + bias, + sum_scale * old dst,
//                 eltwise, rounded to the dst type (round to nearest even for bf16)
//
// with B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1], G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1],
// A^T = [1 1 1 0; 0 1 -1 -1]. The transforms run in fp32; V and U are stored in the conv's type
// (bf16: each rounded once, to within 2^-8 relative: bf16 keeps 8 significant bits), M in fp32.
//
// The work is done in chunks of tiles (kChunkBytes): one chunk's V and M stay cache-resident instead
// of streaming 10s of MB through memory at batch 8; each chunk is one input transform, one matmul
// call and one output transform. A Conv is immutable once built and may run from several threads at
// once: all per-call state (V, M, the matmul's own scratchpad) is in the ``scratch`` buffer the
// caller passes (the engine's per-Context scratchpad).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "common.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace gml_winograd {

using dnnl::memory;
using dt = dnnl::memory::data_type;

// ---------------------------------------------------------------- element access (f32 / bf16)
inline __attribute__((always_inline)) float to_f32(float x) { return x; }
inline __attribute__((always_inline)) float to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// fp32 -> bf16, round to nearest even (as oneDNN's conversions); a NaN stays a (quiet) NaN.
inline __attribute__((always_inline)) void store(float* p, float x) { *p = x; }
inline __attribute__((always_inline)) void store(uint16_t* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *p = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
}

// The post-ops the output transform applies exactly, in oneDNN's order after the bias:
// y = acc + bias; y += sum_scale * old_dst (if sum); then y = lin_a * y + lin_b; y = y >= 0 ? y :
// slope * y; y = min(max(y, lo), hi); then (GML's own INT8 convs only: winograd_int8.h finish8 /
// finish1) act 1, hardswish: y = y * min(max(act_alpha * y + act_beta, 0), 1), or act 2, swish:
// y = y * 1 / (1 + exp(-act_alpha * y)) (EfficientNet's SiLU, MobileNetV3's hardswish). An eltwise
// chain fits when it is a subsequence of (linear, relu, clip, act) (identity parameters for the
// stages it does not use).
struct Epilogue {
  bool sum = false;
  float sum_scale = 1.0f;
  float lin_a = 1.0f, lin_b = 0.0f, slope = 1.0f;
  float lo = -std::numeric_limits<float>::infinity(), hi = std::numeric_limits<float>::infinity();
  int act = 0;  // 0 none, 1 hardswish, 2 swish
  float act_alpha = 0.0f, act_beta = 0.0f;
};

// Whether ``eltwise`` ((algorithm, alpha, beta) each, as the engine receives them) fits Epilogue;
// the act stage only where the caller applies it (``act_ok``: the INT8 output stage; the fp32 /
// bf16 Winograd has no such stage).
inline bool parse_eltwise(const std::vector<std::tuple<std::string, float, float>>& eltwise, Epilogue& e,
                          bool act_ok = false) {
  int stage = 0;  // 1 linear, 2 relu, 3 clip, 4 act: each at most once, in this order
  for (const auto& [alg, alpha, beta] : eltwise) {
    int s;
    if (alg == "linear") s = 1, e.lin_a = alpha, e.lin_b = beta;
    else if (alg == "relu") s = 2, e.slope = alpha;
    else if (alg == "clip") s = 3, e.lo = alpha, e.hi = beta;
    else if (act_ok && alg == "hardswish") s = 4, e.act = 1, e.act_alpha = alpha, e.act_beta = beta;
    else if (act_ok && alg == "swish") s = 4, e.act = 2, e.act_alpha = alpha;
    else return false;
    if (s <= stage) return false;
    stage = s;
  }
  return true;
}

// ---------------------------------------------------------------- per-tile kernels
// 16 channels at a time in GCC vector types (one zmm register in the AVX-512 clones, two ymm in the
// AVX2 one, four xmm in the baseline); the last C % 16 channels scalar (winograd_kernels.inc).
// (-Wpsabi: the helpers are always inlined, no vector crosses a call boundary)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

namespace portable {  // AVX-512, AVX2 and baseline bodies, picked when the library loads
#define GML_WINO_ENTRY __attribute__((target_clones("avx512f", "avx2", "default")))
#include "winograd_kernels.inc"
#undef GML_WINO_ENTRY
}  // namespace portable

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define GML_WINO_HAVE_NATIVE_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace native_bf16 {  // used when the CPU has AVX512_BF16 (Conv::native_)
#define GML_WINO_ENTRY
#define GML_WINO_NATIVE_BF16 1
#include "winograd_kernels.inc"
#undef GML_WINO_NATIVE_BF16
#undef GML_WINO_ENTRY
}  // namespace native_bf16
#pragma GCC pop_options
#else
namespace native_bf16 = portable;  // never called (native_bf16_cpu() is false)
#endif
#pragma GCC diagnostic pop

// Whether this CPU *can* run native_bf16's kernels (the instructions exist). Whether they *should*
// run is the caller's decision (Conv's ``native_bf16``: gml.ir.target.Target.native_bf16, so
// ONEDNN_MAX_CPU_ISA=AVX512_CORE selects the portable kernels too: tests/runtime/test_winograd.py).
inline bool native_bf16_cpu() {
#ifdef GML_WINO_HAVE_NATIVE_BF16
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// ---------------------------------------------------------------- tile geometry (every Winograd conv)
// Tile ``t`` of the batch's MxM output tiles (``tw`` per row, ``th`` per column; image t / (th tw);
// M = 2 for F(2x2, 3x3), 4 for the INT8 F(4x4, 3x3)): the (M+2)^2 pixel rows (``c`` elements each,
// NHWC ``src`` of [N, H, W]) of its (M+2)x(M+2) input patch, row-major, ``zero`` for a pixel outside
// the image (the conv's padding).
template <int M = 2, typename T>
inline void patch_rows(const T* src, const T* zero, int64_t t, int64_t th, int64_t tw, int64_t h, int64_t w,
                       int64_t c, const T** p) {
  constexpr int kA = M + 2;
  const int64_t img = t / (th * tw), ty = (t % (th * tw)) / tw, tx = t % tw;
  for (int i = 0; i < kA; ++i)
    for (int j = 0; j < kA; ++j) {
      const int64_t y = M * ty - 1 + i, x = M * tx - 1 + j;
      const bool in = y >= 0 && y < h && x >= 0 && x < w;
      p[i * kA + j] = in ? src + ((img * h + y) * w + x) * c : zero;
    }
}

// ... and its up-to-M^2 output pixel rows (``row`` elements of T apart in NHWC ``dst``), row-major,
// null past the image's bottom / right edge (never written).
template <int M = 2, typename T>
inline void tile_outputs(T* dst, int64_t t, int64_t th, int64_t tw, int64_t h, int64_t w, int64_t row, T** o) {
  const int64_t img = t / (th * tw), y = M * ((t % (th * tw)) / tw), x = M * (t % tw);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < M; ++j)
      o[i * M + j] = y + i < h && x + j < w ? dst + ((img * h + y + i) * w + x + j) * row : nullptr;
}

// ---------------------------------------------------------------- the convolution
// One chunk's V + M take about this many bytes (a chunk is at least kMinChunkTiles tiles, so that
// each pass over U, up to 16 x 512 x 512 bf16 = 8 MB, serves enough GEMM rows): cache-resident on
// the CPUs this was measured on (Zen 4: 1 MB L2 per core, 32 MB L3).
constexpr int64_t kChunkBytes = int64_t{1} << 20;
constexpr int64_t kMinChunkTiles = 32;
// A transform runs on the OpenMP team when it has at least this many (tile, channel) pairs (about
// 10 µs of work on one Zen 4 core; a parallel region costs ~1 µs).
constexpr int64_t kParallelWork = 4096;
constexpr size_t kAlign = 64;

inline size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

class Conv {
 public:
  // src / dst: [N, C, H, W] / [N, K, H, W] dense NHWC of type ``type`` (f32 or bf16); ``weight``: the
  // caller's contiguous [K, C, 3, 3] f32 or bf16 tensor, ``bias``: K fp32 values or null (both
  // copied here, never kept); ``use_native_bf16``: the target has native bf16 (the Python Target says;
  // honoured only where the CPU has the instructions).
  Conv(const dnnl::engine& eng, int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, dt type, const void* weight,
       dt wtype, const float* bias, const Epilogue& epi, bool use_native_bf16)
      : eng_(eng), n_(n), c_(c), h_(h), w_(w), k_(k), type_(type), epi_(epi) {
    if (type != dt::f32 && type != dt::bf16) throw std::invalid_argument("gml engine: winograd of f32 / bf16 only");
    // an empty batch (n = 0) would make zero chunks and divide by zero below (SIGFPE, issue #24)
    if (n <= 0 || c <= 0 || h <= 0 || w <= 0 || k <= 0) throw std::invalid_argument("gml engine: winograd of an empty tensor");
    es_ = type == dt::f32 ? 4 : 2;
    native_ = type == dt::bf16 && use_native_bf16 && native_bf16_cpu();
    th_ = (h + 1) / 2;
    tw_ = (w + 1) / 2;
    // Chunks of whole tiles over the batch (tile t: image t / (th * tw), row, column): as many
    // chunks as kChunkBytes asks for, all of one size (the last one padded with zero tiles).
    total_ = n * th_ * tw_;
    const int64_t per_tile = 16 * (c * es_ + k * 4);
    const int64_t want = std::max(kMinChunkTiles, kChunkBytes / per_tile);
    const int64_t chunks = (total_ + want - 1) / want;
    tiles_ = (total_ + chunks - 1) / chunks;
    // The batched matmul V[16, tiles, C] x U[16, C, K] -> M[16, tiles, K], U prepacked (format any).
    const memory::desc v_md({16, tiles_, c}, type, memory::dims{tiles_ * c, c, 1});
    const memory::desc u_any({16, c, k}, type, memory::format_tag::any);
    const memory::desc m_md({16, tiles_, k}, dt::f32, memory::dims{tiles_ * k, k, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    pd_ = dnnl::matmul::primitive_desc(eng_, v_md, u_any, m_md, attr);
    mm_ = dnnl::matmul(pd_);

    // U = G g G^T in fp32, from the caller's weights, then reordered (bf16: rounded) into U's layout.
    // (the fp32 U is a buffer of its own pages: from the heap, it left a hole of its size beside the
    // plan for every Winograd conv; common.h, aligned_buffer)
    const std::shared_ptr<void> u_buffer = gml_engine::aligned_buffer(static_cast<size_t>(16 * c * k) * sizeof(float));
    float* u = static_cast<float*>(u_buffer.get());
    for (int64_t o = 0; o < k; ++o)
      for (int64_t i = 0; i < c; ++i) {
        float g[9], t[12];
        for (int j = 0; j < 9; ++j) {
          const int64_t at = (o * c + i) * 9 + j;
          g[j] = wtype == dt::f32 ? static_cast<const float*>(weight)[at]
                                  : to_f32(static_cast<const uint16_t*>(weight)[at]);
        }
        for (int j = 0; j < 3; ++j) {  // t = G g (4 x 3)
          t[0 + j] = g[j];
          t[3 + j] = 0.5f * (g[j] + g[3 + j] + g[6 + j]);
          t[6 + j] = 0.5f * (g[j] - g[3 + j] + g[6 + j]);
          t[9 + j] = g[6 + j];
        }
        for (int r = 0; r < 4; ++r) {  // U = t G^T (4 x 4)
          const float* tr = t + 3 * r;
          const float row[4] = {tr[0], 0.5f * (tr[0] + tr[1] + tr[2]), 0.5f * (tr[0] - tr[1] + tr[2]), tr[2]};
          for (int j = 0; j < 4; ++j) u[static_cast<size_t>(((r * 4 + j) * c + i) * k + o)] = row[j];
        }
      }
    memory user(memory::desc({16, c, k}, dt::f32, memory::dims{c * k, k, 1}), eng_, u);
    u_ = memory(pd_.weights_desc(), eng_);
    dnnl::stream s(eng_);
    dnnl::reorder(user, u_).execute(s, user, u_);
    s.wait();

    bias_.assign(static_cast<size_t>(k), 0.0f);
    if (bias) std::copy(bias, bias + k, bias_.begin());
    zeros_.assign(static_cast<size_t>(c) * es_, 0);
    v_bytes_ = align_up(static_cast<size_t>(16 * tiles_ * c * es_));
    m_bytes_ = align_up(static_cast<size_t>(16 * tiles_ * k * 4));
    scratch_bytes_ = v_bytes_ + m_bytes_ + pd_.scratchpad_desc().get_size();
  }

  size_t scratch_bytes() const { return scratch_bytes_; }
  // U in the matmul's layout, the bytes every call reads (conv.h may time calls with them uncached)
  std::pair<const void*, size_t> weights() const { return {u_.get_data_handle(), u_.get_desc().get_size()}; }
  std::string impl() const {
    const char* s = nullptr;
    dnnl::error::wrap_c_api(dnnl_primitive_desc_query(pd_.get(), dnnl_query_impl_info_str, 0, &s), "no impl");
    return std::string("gml:winograd_f2x3+") + (s ? s : "?");
  }

  // One call: src / dst as described at construction; ``scratch``: scratch_bytes() (64-byte aligned).
  void run(const void* src, void* dst, void* scratch) const {
    char* v = static_cast<char*>(scratch);
    char* m = v + v_bytes_;
    char* mm_scratch = m + m_bytes_;
    dnnl::stream stream(eng_);  // CPU primitives run synchronously on the calling thread
    memory v_mem(pd_.src_desc(), eng_, v), m_mem(pd_.dst_desc(), eng_, m);
    memory s_mem(pd_.scratchpad_desc(), eng_, mm_scratch);
    for (int64_t t0 = 0; t0 < total_; t0 += tiles_) {
      const int64_t count = std::min(tiles_, total_ - t0);
      input_transform(static_cast<const char*>(src), v, t0, count);
      mm_.execute(stream, {{DNNL_ARG_SRC, v_mem}, {DNNL_ARG_WEIGHTS, u_}, {DNNL_ARG_DST, m_mem},
                           {DNNL_ARG_SCRATCHPAD, s_mem}});
      output_transform(reinterpret_cast<const float*>(m), static_cast<char*>(dst), t0, count);
    }
  }

 private:
  // V of tiles [t0, t0 + count) (rows past ``count`` zero: the padded last chunk).
  void input_transform(const char* src, char* v, int64_t t0, int64_t count) const {
    if (type_ == dt::f32)
      input_transform_t(reinterpret_cast<const float*>(src), reinterpret_cast<float*>(v), t0, count);
    else input_transform_t(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(v), t0, count);
  }

  template <typename T>
  void input_transform_t(const T* src, T* v, int64_t t0, int64_t count) const {
    const T* zero = reinterpret_cast<const T*>(zeros_.data());
    for (int xi = 0; xi < 16 && count < tiles_; ++xi)
      std::memset(v + (xi * tiles_ + count) * c_, 0, static_cast<size_t>((tiles_ - count) * c_) * sizeof(T));
#pragma omp parallel for schedule(static) if (count * c_ >= kParallelWork)
    for (int64_t t = 0; t < count; ++t) {
      const T* p[16];
      patch_rows(src, zero, t0 + t, th_, tw_, h_, w_, c_, p);
      if constexpr (std::is_same_v<T, float>) portable::input_tile_f32(p, v + t * c_, tiles_ * c_, c_);
      else if (native_) native_bf16::input_tile_bf16(p, v + t * c_, tiles_ * c_, c_);
      else portable::input_tile_bf16(p, v + t * c_, tiles_ * c_, c_);
    }
  }

  // The outputs of tiles [t0, t0 + count) from M.
  void output_transform(const float* m, char* dst, int64_t t0, int64_t count) const {
    if (type_ == dt::f32) output_transform_t(m, reinterpret_cast<float*>(dst), t0, count);
    else output_transform_t(m, reinterpret_cast<uint16_t*>(dst), t0, count);
  }

  template <typename T>
  void output_transform_t(const float* m, T* dst, int64_t t0, int64_t count) const {
#pragma omp parallel for schedule(static) if (count * k_ >= kParallelWork)
    for (int64_t t = 0; t < count; ++t) {
      T* o[4];
      tile_outputs(dst, t0 + t, th_, tw_, h_, w_, k_, o);
      const bool right = o[1] != nullptr, bottom = o[2] != nullptr;
      if constexpr (std::is_same_v<T, float>)
        portable::output_tile_f32(m + t * k_, tiles_ * k_, o, right, bottom, bias_.data(), epi_, k_);
      else if (native_)
        native_bf16::output_tile_bf16(m + t * k_, tiles_ * k_, o, right, bottom, bias_.data(), epi_, k_);
      else
        portable::output_tile_bf16(m + t * k_, tiles_ * k_, o, right, bottom, bias_.data(), epi_, k_);
    }
  }

  dnnl::engine eng_;
  int64_t n_, c_, h_, w_, k_;
  dt type_;
  Epilogue epi_;
  bool native_ = false;  // bf16 with native_bf16's kernels
  int64_t es_, th_, tw_, total_, tiles_;  // tiles: of the batch, of one chunk
  dnnl::matmul::primitive_desc pd_;
  dnnl::matmul mm_;
  memory u_;
  std::vector<float> bias_;
  std::vector<unsigned char> zeros_;
  size_t v_bytes_ = 0, m_bytes_ = 0, scratch_bytes_ = 0;
};

}  // namespace gml_winograd
