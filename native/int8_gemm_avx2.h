// An exact s8 x s8 -> s32 GEMM for CPUs without VNNI (AVX2; issue #23, docs/adr/008-dynamic-int8-gemm.md),
// used by gml::dynamic_linear where oneDNN's int8 matmul would saturate or run its reference kernel.
//
// The problem: without VNNI, x86 multiplies bytes with vpmaddubsw (u8 x s8, adjacent pairs summed into
// a *saturating* int16). oneDNN feeds it src + 128 (u8) against s8 weights: 255 * 127 * 2 = 64,770 >
// 32,767, so a pair can saturate and the int32 sum is wrong (oneDNN's "Nuances of int8 computations").
//
// The formulation here cannot saturate: gml::dynamic_linear's operands are both in [-127, 127] (the
// row quantization and the weight quantization never produce -128), and a s8 x s8 product is written
// as |x| * (w * sign(x)):
//
//   a = vpsignb(x, x) = |x|          in [0, 127], read as u8
//   b = vpsignb(w, x) = w * sign(x)  in [-127, 127] (w never -128, so the negation never wraps)
//   vpmaddubsw(a, b): a0 b0 + a1 b1, |.| <= 2 * 127 * 127 = 32,258 < 32,767: exact in int16
//   vpmaddwd(., 1):   the int16 pairs summed into int32 (exact), added into int32 accumulators
//
// (the dot product llama.cpp's AVX2 Q8_0 kernels use). An accumulator lane adds 4 products per 4-deep
// step of K, |acc| <= K * 127^2: exact in int32 for K <= 133,143 (checked by the caller).
//
// 7-bit weights (every |w| <= 64, e.g. gml.dynamic_linear's weights quantized to [-64, 64]) take a
// shorter path, chosen when the weights are packed: the activations are shifted to u8, x + 128 in
// [1, 255], and fed to vpmaddubsw directly, with no per-row sign step:
//
//   vpmaddubsw(x + 128, w): |.| <= 2 * 255 * 64 = 32,640 < 32,767: exact in int16
//   sum_k (x + 128) w = sum_k x w + 128 * colsum(w)   -> the epilogue subtracts 128 * colsum(w) (int32)
//
// Two multiply-port instructions per 32 products instead of three (vpsignb, vpmaddubsw, vpmaddwd all
// issue on the same two ports on Intel cores), and one broadcast per row instead of two; the integer
// sums are the same, so the outputs are bit for bit those of the sign path.
//
// Layout. The weights ([N, K] int8, the caller's rows) are packed once into blocks of kCols = 16
// output columns: block b, K-quad j holds w[16b + c][4j + t] at byte 64 j + 4 c + t (two 32-byte
// vectors per quad, columns 0-7 and 8-15), K zero-padded to a multiple of 4 and N to 16. The
// activations (q, [M, K] int8 rows) are copied per call into a scratch of K4-padded rows with |q|
// next to them. A micro-kernel computes a tile of up to 4 rows x 16 columns: per quad it broadcasts
// each row's 4 bytes of q and of |q| and updates 8 int32 accumulators (4 x 2 vectors).
//
// The epilogue is gml::dynamic_linear's fp32 math in oneDNN's order (ADR 008), each operation one
// fp32 rounding (the engine is built with -ffp-contract=off; only separate mul / add intrinsics here):
//   y = ((float(acc) * w_scale[n]) * amax[m]) + bias[n];  y = relu(y) (if asked);  y = y + residual[m, n]
// float(acc) rounds to nearest even, as torch's int32 -> float32 conversion.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include <immintrin.h>

namespace gml_int8_gemm {

constexpr int64_t kCols = 16;                // output columns per packed block (two AVX2 vectors)
constexpr int kRows = 4;                     // rows per micro-kernel tile
constexpr int64_t kMaxK = 2147483647LL / (127 * 127);  // |acc| <= K * 127^2 stays in int32

#define GML_AVX2 __attribute__((target("avx2,fma")))

inline bool cpu_supported() { return __builtin_cpu_supports("avx2"); }

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The micro-kernel: acc[r][h] (r < R, h = columns 0-7 / 8-15) = the int32 dot products of R rows
// (``ldx`` bytes apart, K4 bytes each) with one packed block's 16 columns (``wb``: K4 / 4 quads of
// [16 columns][4 bytes]). Per K-quad:
//   8-bit weights (U8 false): each row's 4 bytes of q and of |q| (``a``, the same layout) broadcast,
//     acc[r][h] += vpmaddwd(vpmaddubsw(|q|, w * sign(q)), 1)       (pairs <= 32,258)
//   7-bit weights (U8 true): each row's 4 bytes of u8 x broadcast (``a`` unused), then
//     acc[r][h] += vpmaddwd(vpmaddubsw(x, w), 1)                    (pairs <= 2 * 255 * 64 = 32,640)
// Also the patch GEMM's kernel (im2col_int8.h: u8 patches against 7-bit conv weights).
template <int R, bool U8>
GML_AVX2 inline void dot_block(const int8_t* x, const int8_t* a, int64_t ldx, int64_t k4, const int8_t* wb,
                               __m256i (&acc)[kRows][2]) {
  __m256i s[R][2];  // the accumulators, kept in registers (the row loops unrolled)
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < k4; j += 4) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + 16 * j));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + 16 * j + 32));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t xv;
      std::memcpy(&xv, x + r * ldx + j, 4);
      const __m256i xb = _mm256_set1_epi32(xv);
      __m256i p0, p1;
      if constexpr (U8) {
        p0 = _mm256_maddubs_epi16(xb, w0);
        p1 = _mm256_maddubs_epi16(xb, w1);
      } else {
        int32_t av;
        std::memcpy(&av, a + r * ldx + j, 4);
        const __m256i ab = _mm256_set1_epi32(av);
        p0 = _mm256_maddubs_epi16(ab, _mm256_sign_epi8(w0, xb));
        p1 = _mm256_maddubs_epi16(ab, _mm256_sign_epi8(w1, xb));
      }
      s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(p0, ones));
      s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(p1, ones));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = s[r][0], acc[r][1] = s[r][1];
}

// Weights packed for the micro-kernel (see the file comment), with the epilogue's per-column constants.
class Gemm {
 public:
  // ``w``: int8 [n, k] rows (``ldw`` bytes apart), every value in [-127, 127]; ``w_scale``: 1 or n
  // values; ``bias``: n values or null. All are copied.
  Gemm(const int8_t* w, int64_t n, int64_t k, int64_t ldw, const std::vector<float>& w_scale, const float* bias)
      : n_(n), k_(k), k4_(round_up(k, 4)), nb_(round_up(n, kCols) / kCols) {
    if (!cpu_supported()) throw std::invalid_argument("gml engine: the exact int8 GEMM needs AVX2");
    if (n <= 0 || k <= 0) throw std::invalid_argument("gml engine: int8 GEMM of an empty matrix");
    if (k > kMaxK) throw std::invalid_argument("gml engine: int8 GEMM with K > 133,143 could overflow int32");
    if (w_scale.size() != 1 && static_cast<int64_t>(w_scale.size()) != n)
      throw std::invalid_argument("gml engine: int8 GEMM needs 1 or N weight scales");
    packed_.reset(static_cast<int8_t*>(std::aligned_alloc(64, static_cast<size_t>(nb_ * k4_ * kCols))));
    if (!packed_) throw std::bad_alloc();
    std::memset(packed_.get(), 0, static_cast<size_t>(nb_ * k4_ * kCols));
    for (int64_t c = 0; c < n; ++c) {
      const int64_t b = c / kCols, cc = c % kCols;
      int8_t* blk = packed_.get() + b * k4_ * kCols;
      for (int64_t kk = 0; kk < k; ++kk) {
        const int8_t v = w[c * ldw + kk];
        if (v == -128) throw std::invalid_argument("gml engine: int8 GEMM weights must lie in [-127, 127]");
        blk[(kk / 4) * 64 + cc * 4 + kk % 4] = v;
      }
    }
    // per-column constants padded to whole blocks (padding columns are never stored)
    scale_.assign(static_cast<size_t>(nb_ * kCols), 0.0f);
    bias_.assign(static_cast<size_t>(nb_ * kCols), 0.0f);
    shift_.assign(static_cast<size_t>(nb_ * kCols), 0);
    seven_bit_ = true;
    for (int64_t c = 0; c < n; ++c) {
      scale_[c] = w_scale.size() == 1 ? w_scale[0] : w_scale[c];
      if (bias) bias_[c] = bias[c];
      int64_t colsum = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const int8_t v = w[c * ldw + kk];
        colsum += v;
        seven_bit_ = seven_bit_ && v >= -64 && v <= 64;
      }
      // |128 colsum| <= 128 * 64 * K < 2^31 for K <= kMaxK. The accumulator itself (<= 255 * 64 * K) may
      // wrap near kMaxK; vpaddd / vpsubd are modular and the result |sum x w| <= 127 * 64 * K fits, so
      // acc - shift is still exact.
      shift_[c] = static_cast<int32_t>(128 * colsum);
    }
    has_bias_ = bias != nullptr;
  }

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  // Whether every weight lies in [-64, 64], so run() takes the u8 path (the file comment).
  bool seven_bit() const { return seven_bit_; }

  // Scratch bytes run() needs for ``m`` rows (q and |q| rows, K4-padded; the 7-bit path uses the first).
  size_t scratch_bytes(int64_t m) const { return static_cast<size_t>(2 * m * k4_); }

  // y[r, c] (``ldy`` floats apart) for r < m, c < n: the file comment's epilogue of q[r, :] . w[c, :].
  // ``q``: int8 [m, k] rows ``ldq`` bytes apart, values in [-128, 127] (|q| <= 128 against |w| <= 127:
  // a pair is at most 2 * 128 * 127 = 32,512, still exact); ``amax``: m floats, or null for 1 (the
  // multiply by 1 is exact); ``residual``: null or [m, n] floats ``ldr`` apart. ``parallel``: split
  // column blocks over the OpenMP team.
  // ``u8``: the rows are uint8 x instead (gml::qlinear's activations, qlinear_exact.h), read as
  // q = x - 128 (the bit pattern of x with its top bit flipped): acc = sum_k (x - 128) w, exactly.
  GML_AVX2 void run(const int8_t* q, int64_t m, int64_t ldq, const float* amax, float* y, int64_t ldy, bool relu,
                    const float* residual, int64_t ldr, void* scratch, bool parallel, bool u8 = false) const {
    int8_t* xs = static_cast<int8_t*>(scratch);  // m rows of q (7-bit path: q + 128), then m rows of |q|
    int8_t* xa = xs + m * k4_;
    // q + 128 = (the s8 value's top bit flipped) for s8 rows; u8 rows are q + 128 already
    const uint8_t to_u8 = u8 ? 0x00 : 0x80, to_s8 = u8 ? 0x80 : 0x00;
    for (int64_t r = 0; r < m; ++r) {
      int8_t* dst = xs + r * k4_;
      const int8_t* src = q + r * ldq;
      // 7-bit path: u8 q + 128 (x itself for u8 rows); 8-bit path: s8 q, and |q| as u8 next to it
      // (vpabsb: |-128| keeps the bit pattern 0x80 = 128); the sign of q flips w in the micro-kernel.
      // Padding meets zero weights.
      copy_row(src, dst, seven_bit_ ? nullptr : xa + r * k4_, seven_bit_ ? to_u8 : to_s8);
    }
    const int64_t row_tiles = (m + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t b = 0; b < nb_; ++b) {
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t r0 = t * kRows;
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
        tile(b, r0, rows, xs, xa, amax, y, ldy, relu, residual, ldr);
      }
    }
  }

 private:
  struct Free {
    void operator()(int8_t* p) const { std::free(p); }
  };

  // One row of the activation scratch: dst[i] = src[i] ^ flip for i < k (zero up to k4), and, when
  // ``abs_out`` is given, abs_out[i] = |dst[i]| (as u8). 32 bytes per step (the scalar loops cost ~15%
  // of a 2048 x 512 x 256 GEMM).
  GML_AVX2 void copy_row(const int8_t* src, int8_t* dst, int8_t* abs_out, uint8_t flip) const {
    const __m256i f = _mm256_set1_epi8(static_cast<char>(flip));
    int64_t i = 0;
    for (; i + 32 <= k_; i += 32) {
      const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), f);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), v);
      if (abs_out) _mm256_storeu_si256(reinterpret_cast<__m256i*>(abs_out + i), _mm256_abs_epi8(v));
    }
    for (; i < k_; ++i) {
      dst[i] = static_cast<int8_t>(src[i] ^ flip);
      if (abs_out) abs_out[i] = static_cast<int8_t>(dst[i] < 0 ? -static_cast<int>(dst[i]) : dst[i]);
    }
    for (; i < k4_; ++i) {
      dst[i] = 0;
      if (abs_out) abs_out[i] = 0;
    }
  }

  // One tile: rows r0 .. r0 + rows - 1, columns 16 b .. 16 b + 15 (those < n stored).
  GML_AVX2 void tile(int64_t b, int64_t r0, int rows, const int8_t* xs, const int8_t* xa, const float* amax, float* y,
                     int64_t ldy, bool relu, const float* residual, int64_t ldr) const {
    __m256i acc[kRows][2];
    const int64_t c0 = b * kCols;
    if (seven_bit_) {
      dots<true>(b, r0, rows, xs, xa, acc);
      for (int h = 0; h < 2; ++h) {  // sum (x + 128) w - 128 colsum(w) = sum x w, exactly
        const __m256i sh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(shift_.data() + c0 + 8 * h));
        for (int r = 0; r < rows; ++r) acc[r][h] = _mm256_sub_epi32(acc[r][h], sh);
      }
    } else {
      dots<false>(b, r0, rows, xs, xa, acc);
    }
    const int64_t valid = std::min<int64_t>(kCols, n_ - c0);
    for (int r = 0; r < rows; ++r) {
      const __m256 am = _mm256_set1_ps(amax ? amax[r0 + r] : 1.0f);
      __m256 v[2];
      for (int h = 0; h < 2; ++h) {
        v[h] = _mm256_cvtepi32_ps(acc[r][h]);
        v[h] = _mm256_mul_ps(v[h], _mm256_loadu_ps(scale_.data() + c0 + 8 * h));
        v[h] = _mm256_mul_ps(v[h], am);
        if (has_bias_) v[h] = _mm256_add_ps(v[h], _mm256_loadu_ps(bias_.data() + c0 + 8 * h));
        if (relu) v[h] = _mm256_max_ps(_mm256_setzero_ps(), v[h]);  // NaN stays NaN (max returns its 2nd operand)
      }
      float* yr = y + (r0 + r) * ldy + c0;
      const float* rr = residual ? residual + (r0 + r) * ldr + c0 : nullptr;
      if (valid == kCols) {  // a whole block: two stores (a memcpy call per row cost ~9% of the GEMM)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(yr + 8 * h, rr ? _mm256_add_ps(v[h], _mm256_loadu_ps(rr + 8 * h)) : v[h]);
        continue;
      }
      alignas(32) float out[kCols];  // the last block's columns < n
      _mm256_store_ps(out, v[0]);
      _mm256_store_ps(out + 8, v[1]);
      for (int64_t c = 0; c < valid; ++c) yr[c] = rr ? out[c] + rr[c] : out[c];
    }
  }

  // dot<R, U8> for a tile of ``rows`` (1-4) rows: the row count a compile-time constant.
  template <bool U8>
  GML_AVX2 void dots(int64_t b, int64_t r0, int rows, const int8_t* xs, const int8_t* xa,
                     __m256i (&acc)[kRows][2]) const {
    switch (rows) {
      case 4: dot<4, U8>(b, r0, xs, xa, acc); break;
      case 3: dot<3, U8>(b, r0, xs, xa, acc); break;
      case 2: dot<2, U8>(b, r0, xs, xa, acc); break;
      default: dot<1, U8>(b, r0, xs, xa, acc); break;
    }
  }

  // The int32 dot products of R rows (from r0) with block b's 16 columns, over all of K (dot_block).
  template <int R, bool U8>
  GML_AVX2 void dot(int64_t b, int64_t r0, const int8_t* xs, const int8_t* xa, __m256i (&acc)[kRows][2]) const {
    dot_block<R, U8>(xs + r0 * k4_, xa + r0 * k4_, k4_, k4_, packed_.get() + b * k4_ * kCols, acc);
  }

  int64_t n_, k_, k4_, nb_;
  std::unique_ptr<int8_t, Free> packed_;
  std::vector<float> scale_, bias_;
  std::vector<int32_t> shift_;  // 128 * colsum(w) per column (the 7-bit path's zero-point compensation)
  bool has_bias_ = false;
  bool seven_bit_ = false;
};

}  // namespace gml_int8_gemm

#undef GML_AVX2
