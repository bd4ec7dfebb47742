// INT8 conv as a GEMM over gathered patches, for convs with few input channels on CPUs without VNNI
// (AVX2; issue #23). The case it is for: an RGB stem (ResNet's 7x7 / stride 2 on 3 channels).
//
// Why. oneDNN's jit_uni_int8:avx2 conv blocks input channels by 4 and walks the kernel window tap by
// tap; with 3 channels it runs at about half the multiply-port rate of its 3x3 / 64-channel convs
// (ResNet18's stem under the AVX2 cap: 0.92 ms of a 7.9 ms model, 61 GMAC/s per core where those
// reach ~120). A 7x7x3 window is 147 contiguous-in-rows bytes of an NHWC image: gathered into one
// row per output pixel, the conv is a [pixels, 148] x [148, K] GEMM with a long reduction, which the
// exact AVX2 GEMM's vpmaddubsw / vpmaddwd micro-kernel runs near its rate.
//
// The arithmetic is exact. Patches hold the u8 source, and padding holds its zero point zp: padding
// is real 0, as oneDNN's and torch's INT8 convs pad. With weights in [-64, 64] (the 7-bit rule of
// docs/adr/011-int8-on-every-isa.md; 8-bit weights are refused and stay direct):
//
//   vpmaddubsw(x, w): x0 w0 + x1 w1, |.| <= 2 * 255 * 64 = 32,640 < 32,767: exact in int16
//   vpmaddwd(., 1):   pairs summed into int32, added into int32 accumulators (exact)
//   acc = sum_k x w  =  sum_k (x - zp) w + zp * colsum(w)   ->   S = acc - zp * colsum(w)
//
// |acc| <= 255 * 64 * K4 < 2^31 for K4 < 131,592 (refused beyond); S is the direct conv's int32 sum.
// The output stage is the INT8 Winograd's (winograd_int8.h finish8 / finish1: oneDNN's order) with
// scale src_scale * w_scale[k].
//
// Layout. Weights packed once as [K/16 blocks][K4/4 quads][16][4] (K4 = C kh kw rounded up to 4,
// column (i kw + j) C + c: the patch's order; padding columns and channels 0): the blocks of the
// exact AVX2 GEMM (int8_gemm_avx2.h), whose micro-kernel (dot_block, u8 path) multiplies them.
// Per call, chunks of kChunkRows output pixels on the OpenMP team, each thread gathering its chunk's
// patches into its own scratch slot (kChunkRows x K4 bytes) and multiplying them kRows rows x 16
// outputs at a time.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "int8_gemm_avx2.h"
#include "winograd_int8.h"

namespace gml_im2col {

using gml_winograd::Epilogue;
using gml_winograd::QuantOut;
using dt = dnnl::memory::data_type;

using gml_int8_gemm::kRows;           // output pixels per micro-kernel tile (int8_gemm_avx2.h dot_block)
constexpr int64_t kChunkRows = 64;    // output pixels per gathered chunk
constexpr int64_t kMaxK4 = (int64_t{1} << 31) / (255 * 64) - 1;  // |acc| < 2^31
constexpr int64_t kMaxKh = 16;        // kernel rows (gather's table of input rows)

#define GML_AVX2 __attribute__((target("avx2,fma")))

class Int8Conv {
 public:
  // src: [N, C, H, W] dense NHWC u8 (``src_zp``, ``src_scale``); ``weight``: the caller's
  // contiguous [K, C, kh, kw] s8 tensor, every value in [-64, 64] (else std::invalid_argument: the
  // caller keeps the direct conv); ``w_scales`` one or K scales; ``bias`` K fp32 values or null (all
  // copied, never kept); stride, left padding (``ph``, ``pw``: the window of output (oy, ox) starts
  // at input (oy sh - ph, ox sw - pw)); dst: [N, K, OH, OW] dense NHWC of q.dst_type; ``threads``:
  // the plan's OpenMP team.
  Int8Conv(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
           int64_t ph, int64_t pw, int64_t oh, int64_t ow, float src_scale, int src_zp,
           const int8_t* weight, const std::vector<float>& w_scales, const float* bias, const Epilogue& epi,
           const QuantOut& q, int threads)
      : n_(n), c_(c), h_(h), w_(w), k_(k), kh_(kh), kw_(kw), sh_(sh), sw_(sw), ph_(ph), pw_(pw), oh_(oh), ow_(ow),
        epi_(epi), q_(q) {
    if (!gml_winograd::int8_winograd_cpu()) throw std::invalid_argument("gml engine: the im2col INT8 conv needs AVX2");
    if (n <= 0 || c <= 0 || h <= 0 || w <= 0 || k <= 0 || kh <= 0 || kw <= 0 || oh <= 0 || ow <= 0 || sh <= 0 || sw <= 0)
      throw std::invalid_argument("gml engine: im2col conv of an empty tensor");
    if (q.dst_type != dt::u8 && q.dst_type != dt::s8 && q.dst_type != dt::f32)
      throw std::invalid_argument("gml engine: im2col conv writes u8, s8 or f32");
    if (w_scales.size() != 1 && static_cast<int64_t>(w_scales.size()) != k)
      throw std::invalid_argument("gml engine: im2col conv needs one or K weight scales");
    const int64_t taps = c * kh * kw;
    k4_ = (taps + 3) / 4 * 4;
    if (k4_ > kMaxK4) throw std::invalid_argument("gml engine: im2col conv window too large for int32");
    if (kh > kMaxKh) throw std::invalid_argument("gml engine: im2col conv of more than 16 kernel rows");
    kb_ = (k + 15) / 16;
    if (src_zp < 0 || src_zp > 255) throw std::invalid_argument("gml engine: im2col conv zero point outside u8");
    zp_ = src_zp;

    w_buf_ = gml_engine::aligned_buffer(static_cast<size_t>(kb_ * k4_ * 16));
    int8_t* packed = static_cast<int8_t*>(w_buf_.get());
    std::memset(packed, 0, static_cast<size_t>(kb_ * k4_ * 16));
    colsum_.assign(static_cast<size_t>(kb_ * 16), 0);
    for (int64_t o = 0; o < k; ++o)
      for (int64_t i = 0; i < c; ++i)
        for (int64_t y = 0; y < kh; ++y)
          for (int64_t x = 0; x < kw; ++x) {
            const int8_t v = weight[((o * c + i) * kh + y) * kw + x];
            if (v < -64 || v > 64) throw std::invalid_argument("gml engine: im2col conv needs weights in [-64, 64]");
            const int64_t col = (y * kw + x) * c + i;  // the patch's order: taps, then channels
            packed[((o / 16) * k4_ + col / 4 * 4) * 16 + (o % 16) * 4 + col % 4] = v;
            colsum_[o] += v;
          }
    // S = acc - zp colsum(w): |zp colsum| <= 255 * 64 * taps < 2^31
    for (auto& s : colsum_) s *= zp_;
    scale_.assign(static_cast<size_t>(k), 0.0f);
    for (int64_t o = 0; o < k; ++o) scale_[o] = src_scale * w_scales[w_scales.size() == 1 ? 0 : o];
    bias_.assign(static_cast<size_t>(k), 0.0f);
    if (bias) std::copy(bias, bias + k, bias_.begin());
    zp_line_.assign(static_cast<size_t>((kw * c + 31) / 32 * 32), static_cast<uint8_t>(zp_));
    threads_ = std::max(1, threads);
    slot_bytes_ = gml_winograd::align_up(static_cast<size_t>(kChunkRows * k4_ + 32));  // + gather's slack
  }

  size_t scratch_bytes() const { return slot_bytes_ * static_cast<size_t>(threads_); }
  // the packed weights, the bytes every call reads (conv.h times calls with them out of the caches)
  std::pair<const void*, size_t> weights() const { return {w_buf_.get(), static_cast<size_t>(kb_ * k4_ * 16)}; }
  static std::string impl() { return "gml:im2col+u8s7:avx2"; }

  // One call: src / dst as described at construction; ``scratch``: scratch_bytes() (64-byte aligned).
  void run(const void* src, void* dst, void* scratch) const {
    const int64_t total = n_ * oh_ * ow_, chunks = (total + kChunkRows - 1) / kChunkRows;
#pragma omp parallel num_threads(threads_)
    {
      // a thread's chunks gather into its own slot (the team may be smaller, never larger)
      uint8_t* x = static_cast<uint8_t*>(scratch) + slot_bytes_ * static_cast<size_t>(omp_get_thread_num());
#pragma omp for schedule(static)
      for (int64_t i = 0; i < chunks; ++i) {
        const int64_t r0 = i * kChunkRows, rows = std::min(kChunkRows, total - r0);
        gather(static_cast<const uint8_t*>(src), x, r0, rows);
        multiply(x, static_cast<char*>(dst), r0, rows);
      }
    }
  }

 private:
  // Patch rows of output pixels [r0, r0 + rows): for each tap row y, the kw C bytes of one input row
  // (contiguous in NHWC), the zero point where the window leaves the image. The input rows of the window are looked up
  // once per output row; inside the image a tap row is whole 32-byte copies (a variable-size memcpy
  // per tap row took 4x longer than the GEMM's share): the bytes past ``run`` land where the next tap
  // row, or the next patch row, is written after, the slot has 32 bytes of slack, and the source is
  // read past ``run`` only inside its buffer.
  void gather(const uint8_t* src, uint8_t* x, int64_t r0, int64_t rows) const {
    const int64_t run = kw_ * c_, taps = kh_ * run, run32 = (run + 31) / 32 * 32;
    const uint8_t* src_end = src + n_ * h_ * w_ * c_;
    const uint8_t* zp_line = zp_line_.data();  // run32 bytes of the zero point (a row above / below)
    const uint8_t* line[kMaxKh];               // the window's input rows (null: outside the image)
    int64_t b = r0 / (oh_ * ow_), oy = r0 / ow_ % oh_, ox = r0 % ow_;  // of row r, stepped below
    for (int64_t r = 0; r < rows; ++r, ++ox) {
      if (ox == ow_) {
        ox = 0;
        if (++oy == oh_) oy = 0, ++b;
      }
      if (r == 0 || ox == 0)
        for (int64_t y = 0; y < kh_; ++y) {
          const int64_t iy = oy * sh_ - ph_ + y;
          line[y] = iy < 0 || iy >= h_ ? nullptr : src + (b * h_ + iy) * w_ * c_;
        }
      const int64_t ix0 = ox * sw_ - pw_;
      uint8_t* row = x + r * k4_;
      if (ix0 >= 0 && ix0 + kw_ <= w_) {
        for (int64_t y = 0; y < kh_; ++y) {
          uint8_t* out = row + y * run;
          const uint8_t* from = line[y] ? line[y] + ix0 * c_ : zp_line;
          if (!line[y] || from + run32 <= src_end) {
            for (int64_t off = 0; off < run; off += 32) std::memcpy(out + off, from + off, 32);
          } else {
            std::memcpy(out, from, static_cast<size_t>(run));
          }
        }
      } else {  // the window crosses the left or right edge
        for (int64_t y = 0; y < kh_; ++y)
          for (int64_t xx = 0; xx < kw_; ++xx) {
            const int64_t ix = ix0 + xx;
            uint8_t* out = row + y * run + xx * c_;
            if (!line[y] || ix < 0 || ix >= w_) std::memcpy(out, zp_line, static_cast<size_t>(c_));
            else std::memcpy(out, line[y] + ix * c_, static_cast<size_t>(c_));
          }
      }
      for (int64_t i = taps; i < k4_; ++i) row[i] = 0;  // (at most 3 bytes) meets zero weights
    }
  }

  // The chunk's rows kRows at a time, every 16-output block, then the output stage into dst. (The
  // output stage's parameters are copied to locals: stores through ``dst`` could alias the members,
  // which made the compiler reload and re-broadcast every one of them per 8 outputs.)
  GML_AVX2 void multiply(const uint8_t* x, char* dst, int64_t r0, int64_t rows) const {
    const Epilogue e = epi_;
    const QuantOut q = q_;
    const int64_t es = q.dst_type == dt::f32 ? 4 : 1;
    for (int64_t t = 0; t < rows; t += kRows) {
      const int rr = static_cast<int>(std::min<int64_t>(kRows, rows - t));
      for (int64_t b = 0; b < kb_; ++b) {
        __m256i acc[kRows][2];
        const int8_t* wb = static_cast<const int8_t*>(w_buf_.get()) + b * k4_ * 16;
        // the exact AVX2 GEMM's micro-kernel on its u8 path (the weights are packed as its blocks)
        const int8_t* xr = reinterpret_cast<const int8_t*>(x + t * k4_);
        switch (rr) {
          case 4: gml_int8_gemm::dot_block<4, true>(xr, nullptr, k4_, k4_, wb, acc); break;
          case 3: gml_int8_gemm::dot_block<3, true>(xr, nullptr, k4_, k4_, wb, acc); break;
          case 2: gml_int8_gemm::dot_block<2, true>(xr, nullptr, k4_, k4_, wb, acc); break;
          default: gml_int8_gemm::dot_block<1, true>(xr, nullptr, k4_, k4_, wb, acc); break;
        }
        for (int r = 0; r < rr; ++r) finish(acc[r], dst + (r0 + t + r) * k_ * es, b * 16, e, q);
      }
    }
    _mm256_zeroupper();
  }

  // S = acc - zp colsum for 16 outputs from k0 (those < K), through the Winograd's output stage.
  GML_AVX2 inline void finish(const __m256i (&acc)[2], char* o, int64_t k0, const Epilogue& e, const QuantOut& q) const {
    alignas(32) int32_t s[16];
    for (int hh = 0; hh < 2; ++hh) {
      const __m256i cs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum_.data() + k0 + 8 * hh));
      _mm256_store_si256(reinterpret_cast<__m256i*>(s + 8 * hh), _mm256_sub_epi32(acc[hh], cs));
    }
    const int64_t valid = std::min<int64_t>(16, k_ - k0);
    int64_t i = 0;
    for (; i + 8 <= valid; i += 8)
      gml_winograd::int8_avx2::finish8(_mm256_load_si256(reinterpret_cast<const __m256i*>(s + i)), scale_.data(),
                                       bias_.data(), e, q, o, k0 + i);
    for (; i < valid; ++i) gml_winograd::int8_avx2::finish1(s[i], scale_.data(), bias_.data(), e, q, o, k0 + i);
  }

  int64_t n_, c_, h_, w_, k_, kh_, kw_, sh_, sw_, ph_, pw_, oh_, ow_;
  Epilogue epi_;
  QuantOut q_;
  int64_t k4_ = 0, kb_ = 0;
  int zp_ = 0;
  std::shared_ptr<void> w_buf_;  // the packed weights
  std::vector<int32_t> colsum_;  // zp * colsum(w) per output, padded to whole blocks
  std::vector<uint8_t> zp_line_;  // the zero point, a tap row's worth of bytes (32-padded)
  std::vector<float> scale_, bias_;
  int threads_ = 1;
  size_t slot_bytes_ = 0;
};

#undef GML_AVX2
}  // namespace gml_im2col
