// INT8 depthwise conv for CPUs without VNNI (AVX2; issue #23): MobileNet / EfficientNet / MNASNet /
// ConvNeXt-style convs with one filter per channel (groups = channels, a channel multiplier of 1).
//
// Why. oneDNN's AVX2 INT8 conv runs depthwise convs at 9-13 GMAC/s per core here (MobileNetV2 under
// the AVX2 cap: its 17 depthwise convs are 1.2 ms of a 3.8 ms plan, 32%, for 3% of the MACs): it
// widens bytes to int32 and multiplies them 8 at a time. A depthwise conv has no reduction over
// channels, so the vpmaddubsw / vpmaddwd pair sums that make GEMMs fast must run over *taps*: two
// taps of one channel side by side.
//
// Formulation. Per input row, a row of tap pairs is built once (int16, 8 channels per 32 bytes):
//
//   Y[cb][p] = ( d(p - pw, c), d(p + 1 - pw, c) )  for the 8 channels c of block cb,
//   d(x, c)  = src(x, c) - zp  inside the row, 0 in the padding (padding is real 0)
//
// and the window's taps (y, 2j) and (y, 2j + 1) of output column ox are one vpmaddwd of
// Y[row iy = oy sh - ph + y][cb][ox sw + 2j] with the pair (w[c][y][2j], w[c][y][2j + 1]) (0 past an
// odd kw): kh * ceil(kw / 2) vpmaddwd per 8 outputs (a 3x3: 6 for 72 products), added into int32.
//
// The arithmetic is exact for any s8 weights and u8 / s8 source: |d| <= 255, |w| <= 128, a pair
// <= 65,280, |S| <= 255 * 128 * kh * kw < 2^31 for windows up to kMaxTaps. S is the direct conv's
// int32 sum; the output stage is the INT8 Winograd's (winograd_int8.h finish8 / finish1, oneDNN's
// order) with scale src_scale * w_scale[c].
//
// Work. Units are (image, output row, channel group) on the OpenMP team, a group's rows contiguous
// per thread so that each thread's ring of kh tap-pair rows is built once per input row (plus its
// band's halo). Few rows (a 7x7 map on 2 threads) split the channels into groups instead.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "winograd_int8.h"

namespace gml_dw {

using gml_winograd::Epilogue;
using gml_winograd::QuantOut;
using dt = dnnl::memory::data_type;

constexpr int64_t kBlock = 8;     // channels per tap-pair vector (8 x 2 int16)
constexpr int kCols = 4;          // output columns per micro-kernel call (4 int32 accumulators)
constexpr int64_t kMaxTaps = (int64_t{1} << 31) / (255 * 128) - 1;  // |S| < 2^31
constexpr int64_t kMaxKernel = 16;  // kernel rows / columns (a kh-slot ring, a kw-long window)

#define GML_AVX2 __attribute__((target("avx2,fma")))

// Kernel sizes and strides with a compiled micro-kernel (the taps unrolled, every address a constant
// offset: with a runtime column step GCC ran out of registers and reloaded offsets from the stack per
// vpmaddwd); other convs are refused (direct).
inline bool supported(int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
  return kh == kw && (kh == 3 || kh == 5 || kh == 7) && sh >= 1 && (sw == 1 || sw == 2);
}

class Int8Conv {
 public:
  // src: [N, C, H, W] dense NHWC of ``src_type`` (u8 / s8; ``src_zp``, ``src_scale``); ``weight``:
  // the caller's contiguous [C, 1, kh, kw] s8 tensor; ``w_scales`` one or C scales; ``bias`` C fp32
  // values or null (all copied, never kept); stride and left padding (the window of output (oy, ox)
  // starts at input (oy sh - ph, ox sw - pw)); dst: [N, C, OH, OW] dense NHWC of q.dst_type;
  // ``threads``: the plan's OpenMP team. A problem outside the kernel: std::invalid_argument (the
  // caller keeps the direct conv).
  Int8Conv(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
           int64_t pw, int64_t oh, int64_t ow, dt src_type, float src_scale, int src_zp, const int8_t* weight,
           const std::vector<float>& w_scales, const float* bias, const Epilogue& epi, const QuantOut& q, int threads)
      : n_(n), c_(c), h_(h), w_(w), kh_(kh), kw_(kw), sh_(sh), sw_(sw), ph_(ph), pw_(pw), oh_(oh), ow_(ow),
        u8_(src_type == dt::u8), zp_(src_zp), epi_(epi), q_(q) {
    if (!gml_winograd::int8_winograd_cpu()) throw std::invalid_argument("gml engine: the depthwise INT8 conv needs AVX2");
    if (n <= 0 || c <= 0 || h <= 0 || w <= 0 || oh <= 0 || ow <= 0 || sh <= 0 || sw <= 0 || ph < 0 || pw < 0)
      throw std::invalid_argument("gml engine: depthwise conv of an empty tensor");
    if (!supported(kh, kw, sh, sw) || kh * kw > kMaxTaps)
      throw std::invalid_argument("gml engine: depthwise conv window or stride without a kernel");
    if (src_type != dt::u8 && src_type != dt::s8)
      throw std::invalid_argument("gml engine: depthwise conv reads u8 or s8");
    if ((u8_ && (src_zp < 0 || src_zp > 255)) || (!u8_ && (src_zp < -128 || src_zp > 127)))
      throw std::invalid_argument("gml engine: depthwise conv zero point outside the source type");
    if (q.dst_type != dt::u8 && q.dst_type != dt::s8 && q.dst_type != dt::f32)
      throw std::invalid_argument("gml engine: depthwise conv writes u8, s8 or f32");
    if (w_scales.size() != 1 && static_cast<int64_t>(w_scales.size()) != c)
      throw std::invalid_argument("gml engine: depthwise conv needs one or C weight scales");
    cb_ = (c + kBlock - 1) / kBlock;
    pairs_ = (kw + 1) / 2;
    // The pair positions an output row reads are ox sw + 2j: with an even stride only even ones (a
    // stride-2 conv built every position and ran 1.4x slower than the direct conv), so positions are
    // stored every ``pstep_``: position p at index p / pstep_.
    pstep_ = sw;  // 1 or 2 (supported())
    wp_ = ((ow - 1) * sw + 2 * pairs_ + pstep_ - 1) / pstep_;  // stored positions per row and block

    // weights: [cb][y][j][8 channels][2 taps] int16, 0 for channels >= C and the tap past an odd kw
    const size_t wcount = static_cast<size_t>(cb_ * kh * pairs_ * kBlock * 2);
    w_buf_ = gml_engine::aligned_buffer(wcount * sizeof(int16_t));
    int16_t* packed = static_cast<int16_t*>(w_buf_.get());
    std::memset(packed, 0, wcount * sizeof(int16_t));
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t y = 0; y < kh; ++y)
        for (int64_t x = 0; x < kw; ++x)
          packed[(((ch / kBlock) * kh + y) * pairs_ + x / 2) * kBlock * 2 + (ch % kBlock) * 2 + x % 2] =
              weight[(ch * kh + y) * kw + x];
    scale_.assign(static_cast<size_t>(cb_ * kBlock), 0.0f);
    for (int64_t ch = 0; ch < c; ++ch) scale_[ch] = src_scale * w_scales[w_scales.size() == 1 ? 0 : ch];
    bias_.assign(static_cast<size_t>(cb_ * kBlock), 0.0f);
    if (bias) std::copy(bias, bias + c, bias_.begin());

    // Work units: rows x groups of channel blocks, enough of them to share out (>= 4 per thread).
    threads_ = std::max(1, threads);
    const int64_t rows = n * oh;
    groups_ = std::min<int64_t>(cb_, std::max<int64_t>(1, (4 * threads_ + rows - 1) / rows));
    group_blocks_ = (cb_ + groups_ - 1) / groups_;
    groups_ = (cb_ + group_blocks_ - 1) / group_blocks_;
    row_bytes_ = static_cast<size_t>(group_blocks_ * wp_ * kBlock * 2) * sizeof(int16_t);
    slot_bytes_ = gml_winograd::align_up(row_bytes_ * static_cast<size_t>(kh) + 64);
  }

  size_t scratch_bytes() const { return slot_bytes_ * static_cast<size_t>(threads_); }
  // the packed weights, the bytes every call reads (conv.h times calls with them out of the caches)
  std::pair<const void*, size_t> weights() const {
    return {w_buf_.get(), static_cast<size_t>(cb_ * kh_ * pairs_ * kBlock * 2) * sizeof(int16_t)};
  }
  static std::string impl() { return "gml:dw+s16:avx2"; }

  // One call: src / dst as described at construction; ``scratch``: scratch_bytes() (64-byte aligned).
  void run(const void* src, void* dst, void* scratch) const {
    const int64_t rows = n_ * oh_, units = rows * groups_;
#pragma omp parallel num_threads(threads_)
    {
      // a thread's ring of kh tap-pair rows, each tagged with the (image and group, input row) it holds
      // (an input row outside the image is a row of padding, built like the others)
      char* ring = static_cast<char*>(scratch) + slot_bytes_ * static_cast<size_t>(omp_get_thread_num());
      int64_t tag_bg[kMaxKernel], tag_iy[kMaxKernel];
      std::fill(tag_bg, tag_bg + kMaxKernel, int64_t{-1});
      std::fill(tag_iy, tag_iy + kMaxKernel, int64_t{0});
#pragma omp for schedule(static)
      for (int64_t u = 0; u < units; ++u) {
        const int64_t g = u / rows, row = u % rows, b = row / oh_, oy = row % oh_;
        const int64_t blk0 = g * group_blocks_, blk1 = std::min(cb_, blk0 + group_blocks_);
        const int16_t* lines[kMaxKernel];
        for (int64_t y = 0; y < kh_; ++y) {
          const int64_t iy = oy * sh_ - ph_ + y;
          const int64_t slot = ((iy % kh_) + kh_) % kh_;
          int16_t* line = reinterpret_cast<int16_t*>(ring + row_bytes_ * static_cast<size_t>(slot));
          if (tag_bg[slot] != b * groups_ + g || tag_iy[slot] != iy) {
            build_row(static_cast<const uint8_t*>(src), b, iy, blk0, blk1, line);
            tag_bg[slot] = b * groups_ + g, tag_iy[slot] = iy;
          }
          lines[y] = line;
        }
        compute_row(lines, static_cast<char*>(dst), b, oy, blk0, blk1);
      }
    }
  }

 private:
  // One tap-pair vector: 8 channels of two pixels (8 bytes each) interleaved, widened, less zp.
  GML_AVX2 static inline void put_pair(int16_t* out, __m128i a, __m128i b, __m256i zp, bool u8) {
    const __m128i pair = _mm_unpacklo_epi8(a, b);  // c0 at x, c0 at x + 1, c1 at x, ...
    const __m256i wide = u8 ? _mm256_cvtepu8_epi16(pair) : _mm256_cvtepi8_epi16(pair);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), _mm256_sub_epi16(wide, zp));
  }

  // The tap-pair row Y (file comment) of input row ``iy`` of image ``b`` for channel blocks
  // [blk0, blk1): [block][p][8][2] int16. A row outside the image is padding (all 0).
  GML_AVX2 void build_row(const uint8_t* src, int64_t b, int64_t iy, int64_t blk0, int64_t blk1, int16_t* y) const {
    const int64_t nb = blk1 - blk0;
    if (iy < 0 || iy >= h_) {
      std::memset(y, 0, static_cast<size_t>(nb * wp_ * kBlock * 2) * sizeof(int16_t));
      return;
    }
    const uint8_t* line = src + (b * h_ + iy) * w_ * c_;
    const __m256i zp = _mm256_set1_epi16(static_cast<int16_t>(zp_));
    alignas(16) uint8_t zero_px[kBlock];  // a pixel of padding: the zero point (d = 0)
    std::memset(zero_px, static_cast<uint8_t>(zp_), kBlock);
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      const int64_t c0 = blk * kBlock, valid = std::min<int64_t>(kBlock, c_ - c0);
      int16_t* out = y + (blk - blk0) * wp_ * kBlock * 2;
      // 8 channels of pixel x as 8 bytes (the zero point outside the row and past C)
      auto load8 = [&](int64_t x) -> __m128i {
        if (x < 0 || x >= w_) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zero_px));
        const uint8_t* p = line + x * c_ + c0;
        if (valid == kBlock) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
        alignas(16) uint8_t t[kBlock];
        std::memcpy(t, zero_px, kBlock);
        std::memcpy(t, p, static_cast<size_t>(valid));
        return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t));
      };
      // positions whose two pixels are inside the row and whose 8 channels are all real: plain loads
      // (x = i pstep - pw >= 0 and x + 1 <= W - 1)
      const int64_t inner0 = valid == kBlock ? std::min(wp_, (pw_ + pstep_ - 1) / pstep_) : wp_;
      const int64_t inner1 = w_ + pw_ - 2 < 0 ? inner0 : std::clamp((w_ + pw_ - 2) / pstep_ + 1, inner0, wp_);
      const bool u8 = u8_;
      auto put = [&](int64_t i, __m128i a, __m128i b) { put_pair(out + i * kBlock * 2, a, b, zp, u8); };
      int64_t i = 0;
      for (; i < inner0; ++i) put(i, load8(i * pstep_ - pw_), load8(i * pstep_ + 1 - pw_));
      for (; i < inner1; ++i) {
        const uint8_t* px = line + (i * pstep_ - pw_) * c_ + c0;
        put(i, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(px)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(px + c_)));
      }
      for (; i < wp_; ++i) put(i, load8(i * pstep_ - pw_), load8(i * pstep_ + 1 - pw_));
    }
    _mm256_zeroupper();
  }

  // The output stage of one channel block for INT8 destinations whose post-ops are at most a ReLU, a
  // clip and an act (MobileNetV2's ReLU6, EfficientNet's SiLU, MobileNetV3's hardswish, or none),
  // hoisted out of the column loop: finish8's operations in its order, ReLU's max(f, 0) and the clip
  // merged into one max / min (max is associative: max(max(f, 0), lo) = max(f, max(lo, 0))). Other
  // output stages (a residual, linear, leaky ReLU, an fp32 destination) take finish8.
  struct Out8 {
    __m256 scale, bias, lo, hi, inv, zp, top;
    int act;  // Epilogue's act stage (after the clip): 0 none, 1 hardswish, 2 swish
    float act_alpha, act_beta;
  };
  static bool fast_stage(const Epilogue& e, const QuantOut& q) {
    return q.dst_type != dt::f32 && !e.sum && e.lin_a == 1.0f && e.lin_b == 0.0f && (e.slope == 0.0f || e.slope == 1.0f);
  }
  GML_AVX2 static inline __m256 stage(__m256i acc, const Out8& s) {
    __m256 f = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), s.scale), s.bias);
    f = _mm256_min_ps(_mm256_max_ps(f, s.lo), s.hi);
    if (s.act) f = gml_winograd::int8_avx2::act8(f, s.act, s.act_alpha, s.act_beta);
    f = _mm256_add_ps(_mm256_mul_ps(f, s.inv), s.zp);
    return _mm256_min_ps(s.top, f);  // only the top needs a clamp (finish8)
  }
  template <bool U8>
  GML_AVX2 static inline __m128i narrow(__m128i i16) {
    return U8 ? _mm_packus_epi16(i16, i16) : _mm_packs_epi16(i16, i16);
  }
  // One column's 8 outputs.
  template <bool U8>
  GML_AVX2 static inline void store8(__m256i acc, const Out8& s, char* o) {
    const __m256i i32 = _mm256_cvtps_epi32(stage(acc, s));  // round half to even (MXCSR default)
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o), narrow<U8>(i16));
  }
  // Four columns' outputs narrowed together: 5 shuffles instead of 12 (the output stage's shuffles
  // were the kernel's bottleneck on Zen 4). The packs interleave 4-channel groups per 128-bit lane;
  // one vpermd puts each column's 8 bytes together.
  template <bool U8>
  GML_AVX2 static inline void store32(__m256i a0, __m256i a1, __m256i a2, __m256i a3, const Out8& s, char* o,
                                      int64_t pix_bytes) {
    const __m256i i0 = _mm256_cvtps_epi32(stage(a0, s)), i1 = _mm256_cvtps_epi32(stage(a1, s));
    const __m256i i2 = _mm256_cvtps_epi32(stage(a2, s)), i3 = _mm256_cvtps_epi32(stage(a3, s));
    const __m256i w01 = _mm256_packs_epi32(i0, i1), w23 = _mm256_packs_epi32(i2, i3);  // [a0-3 b0-3 | a4-7 b4-7]
    const __m256i b = U8 ? _mm256_packus_epi16(w01, w23) : _mm256_packs_epi16(w01, w23);  // dwords: a b c d | a b c d
    const __m256i cols = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m128i lo = _mm256_castsi256_si128(cols), hi = _mm256_extracti128_si256(cols, 1);
    // (the high halves stored through memcpy: movhps through a double* is a misaligned access in C++)
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o), lo);
    std::memcpy(o + pix_bytes, reinterpret_cast<const char*>(&lo) + 8, 8);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(o + 2 * pix_bytes), hi);
    std::memcpy(o + 3 * pix_bytes, reinterpret_cast<const char*>(&hi) + 8, 8);
  }

  // Stride 1 stores every pair position, stride 2 every other one (pstep_): either way the next column
  // is the next stored position, and the next tap pair 2 (stride 1) or 1 (stride 2) positions on.
  template <int KH, int R, int SW, bool U8>
  GML_AVX2 inline void columns(const int16_t* const* lines, const int16_t* wb, int64_t ox, char* o,
                               int64_t valid, int64_t pix_bytes, const Out8* fast, const float* scale,
                               const float* bias, int64_t k, const Epilogue& e, const QuantOut& q) const {
    constexpr int P = (KH + 1) / 2;  // square windows: tap pairs per kernel row
    constexpr int64_t step = kBlock * 2, pair_step = (SW == 1 ? 2 : 1) * kBlock * 2;  // int16 per column, per pair
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int y = 0; y < KH; ++y) {
      const int16_t* l = lines[y] + ox * step;
      for (int j = 0; j < P; ++j) {
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + (y * P + j) * kBlock * 2));
        const int16_t* t = l + j * pair_step;  // taps 2j, 2j + 1: pair position ox sw + 2j
// (the empty asm keeps each sum in its register in program order: GCC otherwise reassociated the
// adds into a tree and spilled the products to the stack)
#define GML_DW_COL(i, a)                                                                                      \
  if constexpr (R > (i)) {                                                                                    \
    a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(t + (i) * step)), wv)); \
    asm("" : "+x"(a));                                                                                        \
  }
        GML_DW_COL(0, a0) GML_DW_COL(1, a1) GML_DW_COL(2, a2) GML_DW_COL(3, a3)
#undef GML_DW_COL
      }
    }
    if (fast && valid == kBlock) {
      if constexpr (R == 4) return store32<U8>(a0, a1, a2, a3, *fast, o, pix_bytes);
      store8<U8>(a0, *fast, o);
      if constexpr (R > 1) store8<U8>(a1, *fast, o + pix_bytes);
      if constexpr (R > 2) store8<U8>(a2, *fast, o + 2 * pix_bytes);
      return;
    }
    finish(a0, o, valid, scale, bias, k, e, q);
    if constexpr (R > 1) finish(a1, o + pix_bytes, valid, scale, bias, k, e, q);
    if constexpr (R > 2) finish(a2, o + 2 * pix_bytes, valid, scale, bias, k, e, q);
    if constexpr (R > 3) finish(a3, o + 3 * pix_bytes, valid, scale, bias, k, e, q);
  }

  // Any output stage, for ``valid`` channels from ``k`` of one pixel (``o`` its channel k): finish8 /
  // finish1, which index the pixel's row by channel.
  GML_AVX2 static void finish(__m256i acc, char* o, int64_t valid, const float* scale, const float* bias, int64_t k,
                              const Epilogue& e, const QuantOut& q) {
    char* px = o - k * (q.dst_type == dt::f32 ? 4 : 1);
    if (valid == kBlock) return gml_winograd::int8_avx2::finish8(acc, scale, bias, e, q, px, k);
    alignas(32) int32_t s[kBlock];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s), acc);
    for (int64_t ch = 0; ch < valid; ++ch) gml_winograd::int8_avx2::finish1(s[ch], scale, bias, e, q, px, k + ch);
  }

  // Output row ``oy`` of image ``b``, channel blocks [blk0, blk1). (The output stage's parameters are
  // copied to locals: stores through ``dst`` could alias the members.)
  template <int KH, int SW, bool U8>
  GML_AVX2 void compute_row_k(const int16_t* const* lines, char* dst, int64_t b, int64_t oy, int64_t blk0,
                              int64_t blk1) const {
    const Epilogue e = epi_;
    const QuantOut q = q_;
    const float* scale = scale_.data();
    const float* bias = bias_.data();
    const bool fast = fast_stage(e, q);
    const int64_t es = q.dst_type == dt::f32 ? 4 : 1, pix_bytes = c_ * es, ow = ow_;
    const int64_t wp = wp_;
    const int16_t* weights = static_cast<const int16_t*>(w_buf_.get());
    char* row = dst + (b * oh_ + oy) * ow * pix_bytes;
    const float lo = std::max(e.lo, e.slope == 0.0f ? 0.0f : -std::numeric_limits<float>::infinity());
    const int16_t* ls[KH];
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      const int64_t k = blk * kBlock, valid = std::min<int64_t>(kBlock, c_ - k);
      const int16_t* wb = weights + blk * KH * ((KH + 1) / 2) * kBlock * 2;
      for (int y = 0; y < KH; ++y) ls[y] = lines[y] + (blk - blk0) * wp * kBlock * 2;
      Out8 block_stage;
      if (fast)
        block_stage = {_mm256_loadu_ps(scale + k), _mm256_loadu_ps(bias + k), _mm256_set1_ps(lo), _mm256_set1_ps(e.hi),
                       _mm256_set1_ps(q.dst_inv_scale), _mm256_set1_ps(q.dst_zp), _mm256_set1_ps(U8 ? 255.0f : 127.0f),
                       e.act, e.act_alpha, e.act_beta};
      const Out8* f = fast ? &block_stage : nullptr;
      char* o = row + k * es;
      int64_t ox = 0;
      for (; ox + kCols <= ow; ox += kCols)
        columns<KH, kCols, SW, U8>(ls, wb, ox, o + ox * pix_bytes, valid, pix_bytes, f, scale, bias, k, e, q);
      switch (ow - ox) {
        case 3: columns<KH, 3, SW, U8>(ls, wb, ox, o + ox * pix_bytes, valid, pix_bytes, f, scale, bias, k, e, q); break;
        case 2: columns<KH, 2, SW, U8>(ls, wb, ox, o + ox * pix_bytes, valid, pix_bytes, f, scale, bias, k, e, q); break;
        case 1: columns<KH, 1, SW, U8>(ls, wb, ox, o + ox * pix_bytes, valid, pix_bytes, f, scale, bias, k, e, q); break;
        default: break;
      }
    }
    _mm256_zeroupper();
  }

  void compute_row(const int16_t* const* lines, char* dst, int64_t b, int64_t oy, int64_t blk0, int64_t blk1) const {
    // (U8: the narrowing's signedness; f32 destinations never take the fast stage that uses it)
    const bool s1 = sw_ == 1, u8 = q_.dst_type == dt::u8;
#define GML_DW_ROW(KH) \
  return s1 ? (u8 ? compute_row_k<KH, 1, true>(lines, dst, b, oy, blk0, blk1)    \
                  : compute_row_k<KH, 1, false>(lines, dst, b, oy, blk0, blk1))  \
            : (u8 ? compute_row_k<KH, 2, true>(lines, dst, b, oy, blk0, blk1)    \
                  : compute_row_k<KH, 2, false>(lines, dst, b, oy, blk0, blk1))
    switch (kh_) {
      case 3: GML_DW_ROW(3);
      case 5: GML_DW_ROW(5);
      default: GML_DW_ROW(7);
    }
#undef GML_DW_ROW
  }

  int64_t n_, c_, h_, w_, kh_, kw_, sh_, sw_, ph_, pw_, oh_, ow_;
  bool u8_;
  int zp_;
  Epilogue epi_;
  QuantOut q_;
  int64_t cb_ = 0, pairs_ = 0, pstep_ = 1, wp_ = 0, groups_ = 1, group_blocks_ = 1;
  std::shared_ptr<void> w_buf_;   // the packed weight pairs
  std::vector<float> scale_, bias_;  // per channel, padded to whole blocks
  int threads_ = 1;
  size_t row_bytes_ = 0, slot_bytes_ = 0;
};

#undef GML_AVX2
}  // namespace gml_dw
