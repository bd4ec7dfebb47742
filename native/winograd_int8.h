// INT8 Winograd F(2x2, 3x3) for CPUs without VNNI (AVX2; issue #23, docs/adr/010-winograd-conv.md).
//
// Why. Without a VNNI-class dot product, a direct INT8 conv multiplies bytes with vpmaddubsw and
// vpmaddwd: 32 products per two multiply-port instructions. ResNet18's INT8 convs already run at that
// floor in oneDNN (jit_uni_int8:avx2), as in OpenVINO; being faster needs fewer multiplications.
// Winograd F(2x2, 3x3) does 16 per 2x2 outputs instead of 36. Its transformed values do not fit in
// bytes, but they fit in int16, and vpmaddwd multiplies int16 pairs into int32 at 16 products per
// multiply-port instruction: the same rate per instruction, 2.25x fewer instructions.
//
// The arithmetic is exact: every output equals the direct conv's int32 sum, so the result is the
// exact-integer INT8 conv (whatever the weights' bit width). With d the 4x4 input patch minus the
// source zero point (|d| <= 255; padding is the zero point, i.e. d = 0) and g the 3x3 s8 kernel:
//
//   V  = B^T d B        B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]: each entry a +-1 sum of
//                       4 values of d, |V| <= 1020 (int16)
//   U' = G' g G'^T      G' = 2 G = [2 0 0; 1 1 1; 1 -1 1; 0 0 2]: integers, U' = 4 U, |U'| <= 9 * 128
//                       = 1152 (int16); computed once at plan build
//   M[xi] = sum_c V[xi, c] U'[xi, c]   16 GEMMs [tiles, C] x [C, K] in int16 -> int32 (vpmaddwd:
//                       one pair |.| <= 2 * 1020 * 1152, never the one overflowing case -32768^2 x 2)
//   Y  = A^T M A = 4 S  A^T = [1 1 1 0; 0 1 -1 -1]; S the direct conv's sum over (C, 3, 3)
//
// Every step is an integer add, subtract or multiply, computed modulo 2^32 (vpaddd wraps): the result
// is 4 S mod 2^32, which is 4 S itself when |4 S| < 2^31. |S| <= 9 C 255 128, so the conv is exact
// for C <= kMaxChannels (1,827); Int8Conv refuses more (the caller keeps the direct conv).
//
// The output stage is oneDNN's for an INT8 conv (common.h add_quant_attrs), in fp32:
//   f = float(Y) * (src_scale * w_scale[k] / 4) + bias[k]     (= float(S) * scale: the /4 is exact)
//   f += sum_scale * (old_dst - sum_zp)                        (the residual, if any)
//   f = eltwise(f)                                             (linear, relu (leaky), clip: Epilogue)
//   dst = saturate(round_half_even(f * (1 / dst_scale) + dst_zp))   (u8 / s8), or f (f32)
// A different fp32 operation order than oneDNN's own can move a rounding tie by one step; the tests
// allow one step on a few elements, as for every INT8 kernel pair.
//
// Work layout (as winograd.h): chunks of tiles sized to stay in cache; per chunk an input transform
// (V[16][tiles][Cp], Cp = C rounded up to even: channel pairs), the 16 GEMMs (M[16][tiles][Kp] int32,
// Kp = K rounded up to 16), and the output transform. U' is packed as [16][Kp/16][Cp/2][16][2]: for
// one channel pair and 16 output channels, two ymm of (k, c pair) int16 - vpmaddwd's operand. A
// micro-kernel holds 6 tiles x 16 outputs in 12 accumulators; per channel pair it broadcasts each
// tile's two V values (one 32-bit load) against the two U' vectors.
//
// F(4x4, 3x3) (Int8ConvT<4>): the same scheme on 6x6 patches, 36 GEMMs per 4x4 outputs (2.25 products
// per output instead of F(2x2, 3x3)'s 4 and the direct conv's 9). With the points 0, +-1, +-2, inf:
//
//   V   = B^T d B     B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
//                     0 4 0 -5 0 1]: row sums of |.| <= 10, so |V| <= 100 * 255 = 25,500 (int16)
//   U'' = G'' g G''^T G'' = D G = [1 0 0; -1 -1 -1; -1 1 -1; 1 2 4; 1 -2 4; 0 0 1], D = diag(4, 6, 6,
//                     24, 24, 1) (each row of G scaled to integers): |U''| <= 7 * 7 * 128 = 6,272 (int16)
//   M'' = sum_c V U''  36 GEMMs, as above (a vpmaddwd pair <= 2 * 25,500 * 6,272 < 2^31)
//   Y'  = A'^T M'' A' = 576 S   A'^T = A^T diag(e) = [6 4 4 1 1 0; 0 4 -4 2 -2 0; 0 4 4 4 4 0;
//                     0 4 -4 8 -8 24], e = 24 / D (U = U'' / (D D^T), so 576 U = e e^T U'')
//
// Modulo 2^32, Y' times 9^-1 (954,437,177: 9 x it = 1 mod 2^32) is 64 S, which is 64 S itself while
// |64 S| < 2^31; an arithmetic shift by 6 then gives S, the direct conv's sum, bit for bit. So F(4x4,
// 3x3) is exact while |S| < 2^25 for every output: Int8ConvT<4>::exact checks max_k sum |w_k| times
// the largest |x - zp| the source type allows against that bound (ResNet-like 3x3 convs: 64-512
// channels of 7-bit weights, far inside it; conv.h keeps F(2x2, 3x3) or the direct conv otherwise).
// Its transformed weights are 36 * 2 / 9 = 8x the int8 weight bytes (F(2x2, 3x3): 3.6x).
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
#include <type_traits>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "winograd.h"

namespace gml_winograd {

// |4 S| < 2^31 with |S| <= 9 C 255 128 (see above)
constexpr int64_t kMaxChannels = (int64_t{1} << 31) / (4 * 9 * 255 * 128);
constexpr int kTileRows = 6;
  // tiles per micro-kernel (12 ymm accumulators + 2 weights + 1 broadcast)

// The INT8 conv's output stage beyond Epilogue's fp32 post-ops (sum_scale there is the residual's
// real-valued scale).
struct QuantOut {
  float sum_zp = 0.0f;       // the residual's zero point (old dst is an integer in dst's type)
  float dst_inv_scale = 1.0f;  // u8 / s8 destination: f * (1 / dst_scale) + dst_zp, rounded (as oneDNN)
  float dst_zp = 0.0f;
  dt dst_type = dt::u8;      // u8, s8 or f32
};

// Whether this CPU can run the AVX2 kernels below (the caller decides whether they should).
inline bool int8_winograd_cpu() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

namespace int8_avx2 {

#define GML_AVX2 __attribute__((target("avx2,fma")))

// V of one tile: ``p[16]`` the 4x4 patch's pixel rows (C channels each, src type T; a row outside the
// image is the zero-point row), written to v[xi * stride + c] for xi = 0..15, c < C; c = C (odd C)
// gets 0, so channel pairs never read past the data.
template <typename T>
GML_AVX2 inline void input_tile(const T* const* p, int16_t* v, int64_t stride, int64_t c, int zp) {
  const __m256i z = _mm256_set1_epi16(static_cast<int16_t>(zp));
  int64_t i = 0;
  for (; i + 16 <= c; i += 16) {
    __m256i d[16];
    for (int j = 0; j < 16; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j] + i));
      d[j] = _mm256_sub_epi16(std::is_same_v<T, uint8_t> ? _mm256_cvtepu8_epi16(b) : _mm256_cvtepi8_epi16(b), z);
    }
    __m256i t[16];
    for (int j = 0; j < 4; ++j) {  // t = B^T d (rows)
      t[0 + j] = _mm256_sub_epi16(d[0 + j], d[8 + j]);
      t[4 + j] = _mm256_add_epi16(d[4 + j], d[8 + j]);
      t[8 + j] = _mm256_sub_epi16(d[8 + j], d[4 + j]);
      t[12 + j] = _mm256_sub_epi16(d[4 + j], d[12 + j]);
    }
    for (int r = 0; r < 4; ++r) {  // V = t B (columns)
      const __m256i* tr = t + 4 * r;
      const __m256i out[4] = {_mm256_sub_epi16(tr[0], tr[2]), _mm256_add_epi16(tr[1], tr[2]),
                              _mm256_sub_epi16(tr[2], tr[1]), _mm256_sub_epi16(tr[1], tr[3])};
      for (int j = 0; j < 4; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + (r * 4 + j) * stride + i), out[j]);
    }
  }
  for (; i < c; ++i) {  // the channels past the last 16, scalar
    int d[16], t[16];
    for (int j = 0; j < 16; ++j) d[j] = static_cast<int>(p[j][i]) - zp;
    for (int j = 0; j < 4; ++j) {
      t[0 + j] = d[0 + j] - d[8 + j];
      t[4 + j] = d[4 + j] + d[8 + j];
      t[8 + j] = d[8 + j] - d[4 + j];
      t[12 + j] = d[4 + j] - d[12 + j];
    }
    for (int r = 0; r < 4; ++r) {
      const int* tr = t + 4 * r;
      const int out[4] = {tr[0] - tr[2], tr[1] + tr[2], tr[2] - tr[1], tr[1] - tr[3]};
      for (int j = 0; j < 4; ++j) v[(r * 4 + j) * stride + i] = static_cast<int16_t>(out[j]);
    }
  }
  if (c % 2)
    for (int xi = 0; xi < 16; ++xi) v[xi * stride + c] = 0;
  _mm256_zeroupper();  // GCC emits no vzeroupper at the end of target("avx2") functions
}

// M[t, 0..15] = sum over channel pairs of V[t, pair] . U'[pair, 0..15] for R <= kTileRows tiles:
// ``v`` the first tile's row (``vstride`` int16 apart), ``u`` the 16-output block's [pairs][16][2]
// slab, ``m`` the first tile's 16 outputs (``mstride`` int32 apart). R < kTileRows serves a chunk's
// last tiles, so that no chunk multiplies padding (a 7x7 map has 16 tiles: 6 + 6 + 4, not 18).
template <int R>
GML_AVX2 inline void gemm_tile(const int16_t* v, int64_t vstride, const int16_t* u, int64_t pairs, int32_t* m,
                               int64_t mstride) {
  static_assert(R >= 1 && R <= kTileRows);
  // twelve named accumulators (those of rows >= R are never used, and compiled away): in an array
  // GCC kept most of them on the stack (a load and a store per vpmaddwd)
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
          a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const int32_t* v0 = reinterpret_cast<const int32_t*>(v);  // channel pairs as 32-bit words
  const int64_t vs = vstride / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(u + 32 * p));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(u + 32 * p + 16));
#define GML_WINO_ROW(r)                                            \
  if constexpr (R > (r)) {                                         \
    const __m256i b = _mm256_set1_epi32(v0[(r) * vs + p]);         \
    a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(b, w0)); \
    a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(b, w1)); \
  }
    GML_WINO_ROW(0) GML_WINO_ROW(1) GML_WINO_ROW(2) GML_WINO_ROW(3) GML_WINO_ROW(4) GML_WINO_ROW(5)
#undef GML_WINO_ROW
  }
  const __m256i out[kTileRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + r * mstride), out[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + r * mstride + 8), out[r][1]);
  }
  _mm256_zeroupper();
}

// gemm_tile for ``rows`` (1..kTileRows) tiles.
inline void gemm_rows(int rows, const int16_t* v, int64_t vstride, const int16_t* u, int64_t pairs, int32_t* m,
                      int64_t mstride) {
  switch (rows) {
    case 6: return gemm_tile<6>(v, vstride, u, pairs, m, mstride);
    case 5: return gemm_tile<5>(v, vstride, u, pairs, m, mstride);
    case 4: return gemm_tile<4>(v, vstride, u, pairs, m, mstride);
    case 3: return gemm_tile<3>(v, vstride, u, pairs, m, mstride);
    case 2: return gemm_tile<2>(v, vstride, u, pairs, m, mstride);
    default: return gemm_tile<1>(v, vstride, u, pairs, m, mstride);
  }
}

// The act stage of Epilogue (hardswish, swish), 8 values and one, with the same fp32 operations in
// the same order (the engine is built with -ffp-contract=off): finish8 and finish1 agree bit for bit.
// exp is Cephes' expf (a degree-7 polynomial on [-ln2 / 2, ln2 / 2] after x = n ln2 + r, within 2 ulp),
// x clamped to [-87.3, 88] so that 2^n stays a normal float; swish is y / (1 + exp(-alpha y)) as
// oneDNN's logistic, so it is 0 (not NaN) for large negative y.
namespace act_consts {
constexpr float kLo = -87.3f, kHi = 88.0f, kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace act_consts

GML_AVX2 inline __m256 exp8(__m256 x) {
  using namespace act_consts;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLo)), _mm256_set1_ps(kHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kC1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kC2)));
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP[i]));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {
  using namespace act_consts;
  x = std::min(std::max(x, kLo), kHi);
  const float n = std::nearbyint(x * kLog2e);  // round half to even, as _MM_FROUND_TO_NEAREST_INT
  float r = x - n * kC1;
  r = r - n * kC2;
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kP[i];
  p = (p * (r * r) + r) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

GML_AVX2 inline __m256 act8(__m256 f, int act, float alpha, float beta) {
  if (act == 1) {
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(f, _mm256_set1_ps(alpha)), _mm256_set1_ps(beta));
    return _mm256_mul_ps(f, _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), _mm256_set1_ps(1.0f)));
  }
  const __m256 e = exp8(_mm256_mul_ps(f, _mm256_set1_ps(-alpha)));
  return _mm256_mul_ps(f, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

inline float act1(float f, int act, float alpha, float beta) {
  if (act == 1) return f * std::min(std::max(f * alpha + beta, 0.0f), 1.0f);
  return f * (1.0f / (1.0f + exp1(f * -alpha)));
}

// The output stage (file comment) on 8 outputs of one pixel: ``acc`` = Y (= 4 S), ``k`` the first
// output channel; ``o`` the pixel's destination row of K channels (old dst for the sum read there).
GML_AVX2 inline void finish8(__m256i acc, const float* scale4, const float* bias, const Epilogue& e, const QuantOut& q,
                             void* o, int64_t k) {
  __m256 f = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(scale4 + k)), _mm256_loadu_ps(bias + k));
  if (e.sum) {
    __m256 old;
    if (q.dst_type == dt::f32) old = _mm256_loadu_ps(static_cast<const float*>(o) + k);
    else {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(o) + k));
      old = _mm256_cvtepi32_ps(q.dst_type == dt::u8 ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
    }
    f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_set1_ps(e.sum_scale), _mm256_sub_ps(old, _mm256_set1_ps(q.sum_zp))));
  }
  // each eltwise stage only where the plan has it (the branches are the same on every call)
  if (e.lin_a != 1.0f || e.lin_b != 0.0f)
    f = _mm256_add_ps(_mm256_mul_ps(f, _mm256_set1_ps(e.lin_a)), _mm256_set1_ps(e.lin_b));
  if (e.slope == 0.0f && q.dst_type != dt::f32) {
    // ReLU before an INT8 store: max(f, 0) (one op for three; -0 or +0 store the same integer)
    f = _mm256_max_ps(f, _mm256_setzero_ps());
  } else if (e.slope != 1.0f) {
    const __m256 neg = _mm256_mul_ps(f, _mm256_set1_ps(e.slope));
    f = _mm256_blendv_ps(f, neg, _mm256_cmp_ps(f, _mm256_setzero_ps(), _CMP_LT_OQ));
  }
  if (e.lo != -std::numeric_limits<float>::infinity() || e.hi != std::numeric_limits<float>::infinity())
    f = _mm256_min_ps(_mm256_max_ps(f, _mm256_set1_ps(e.lo)), _mm256_set1_ps(e.hi));
  if (e.act) f = act8(f, e.act, e.act_alpha, e.act_beta);
  if (q.dst_type == dt::f32) {
    _mm256_storeu_ps(static_cast<float*>(o) + k, f);
    return;
  }
  const bool u8 = q.dst_type == dt::u8;
  f = _mm256_add_ps(_mm256_mul_ps(f, _mm256_set1_ps(q.dst_inv_scale)), _mm256_set1_ps(q.dst_zp));
  // Only the top needs a clamp: below the type's range the int32 (INT_MIN past -2^31) saturates to
  // its minimum in the packs below, above it the conversion would give INT_MIN (and NaN, kept by
  // min(hi, f), goes to the minimum too, as the lower clamp did).
  f = _mm256_min_ps(_mm256_set1_ps(u8 ? 255.0f : 127.0f), f);
  const __m256i i32 = _mm256_cvtps_epi32(f);  // round half to even (MXCSR default)
  const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<int8_t*>(o) + k), u8 ? _mm_packus_epi16(i16, i16) : _mm_packs_epi16(i16, i16));
}

// finish8's arithmetic for one output (the channels past the last 8), the same fp32 operations.
inline void finish1(int32_t acc, const float* scale4, const float* bias, const Epilogue& e, const QuantOut& q, void* o,
                    int64_t k) {
  float f = static_cast<float>(acc) * scale4[k] + bias[k];
  if (e.sum) {
    const float old = q.dst_type == dt::f32  ? static_cast<const float*>(o)[k]
                      : q.dst_type == dt::u8 ? static_cast<float>(static_cast<const uint8_t*>(o)[k])
                                             : static_cast<float>(static_cast<const int8_t*>(o)[k]);
    f = f + e.sum_scale * (old - q.sum_zp);
  }
  if (e.lin_a != 1.0f || e.lin_b != 0.0f) f = f * e.lin_a + e.lin_b;
  if (e.slope != 1.0f && f < 0.0f) f = f * e.slope;
  if (e.lo != -std::numeric_limits<float>::infinity() || e.hi != std::numeric_limits<float>::infinity())
    f = std::min(std::max(f, e.lo), e.hi);
  if (e.act) f = act1(f, e.act, e.act_alpha, e.act_beta);
  if (q.dst_type == dt::f32) {
    static_cast<float*>(o)[k] = f;
    return;
  }
  const bool u8 = q.dst_type == dt::u8;
  f = std::min(std::max(f * q.dst_inv_scale + q.dst_zp, u8 ? 0.0f : -128.0f), u8 ? 255.0f : 127.0f);
  const int r = static_cast<int>(std::nearbyint(f));  // round half to even (the default rounding mode)
  if (u8) static_cast<uint8_t*>(o)[k] = static_cast<uint8_t>(r);
  else static_cast<int8_t*>(o)[k] = static_cast<int8_t>(r);
}

// Y = A^T M A for one tile and its up-to-4 output pixels (``o[i]`` null past an odd edge), every
// output channel: ``m`` the tile's row of M (position xi at m + xi * stride).
GML_AVX2 inline void output_tile(const int32_t* m, int64_t stride, char* const* o, const float* scale4,
                                 const float* bias, const Epilogue& e, const QuantOut& q, int64_t kc) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256i x[16], s[8];
    for (int xi = 0; xi < 16; ++xi) x[xi] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + xi * stride + k));
    for (int j = 0; j < 4; ++j) {  // s = A^T M (rows): 2 x 4
      s[j] = _mm256_add_epi32(_mm256_add_epi32(x[j], x[4 + j]), x[8 + j]);
      s[4 + j] = _mm256_sub_epi32(_mm256_sub_epi32(x[4 + j], x[8 + j]), x[12 + j]);
    }
    for (int i = 0; i < 2; ++i) {  // y = s A (columns): 2 x 2
      const __m256i* si = s + 4 * i;
      const __m256i y0 = _mm256_add_epi32(_mm256_add_epi32(si[0], si[1]), si[2]);
      const __m256i y1 = _mm256_sub_epi32(_mm256_sub_epi32(si[1], si[2]), si[3]);
      if (o[2 * i]) finish8(y0, scale4, bias, e, q, o[2 * i], k);
      if (o[2 * i + 1]) finish8(y1, scale4, bias, e, q, o[2 * i + 1], k);
    }
  }
  for (; k < kc; ++k) {
    uint32_t x[16], s[8];  // unsigned: the same wrapping int32 arithmetic, defined in C++
    for (int xi = 0; xi < 16; ++xi) x[xi] = static_cast<uint32_t>(m[xi * stride + k]);
    for (int j = 0; j < 4; ++j) {
      s[j] = x[j] + x[4 + j] + x[8 + j];
      s[4 + j] = x[4 + j] - x[8 + j] - x[12 + j];
    }
    for (int i = 0; i < 2; ++i) {
      const uint32_t* si = s + 4 * i;
      const int32_t y[2] = {static_cast<int32_t>(si[0] + si[1] + si[2]), static_cast<int32_t>(si[1] - si[2] - si[3])};
      for (int j = 0; j < 2; ++j)
        if (o[2 * i + j]) finish1(y[j], scale4, bias, e, q, o[2 * i + j], k);
    }
  }
  _mm256_zeroupper();
}

// ---------------------------------------------------------------- F(4x4, 3x3) (file comment)
// GCC vector types: + and - on them are AVX2's vpaddw / vpsubw (vpaddd / vpsubd), so each transform
// below is one template for 16 (8) channels at once and for the scalar channel tail alike.
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));  // unsigned: wrapping arithmetic, defined in C++
typedef int32_t i32x8 __attribute__((vector_size(32)));

template <typename X>
GML_AVX2 inline X x4(X v) {
  v = v + v;
  return v + v;
}

// B^T of F(4, 3) on one line of 6 values x[i * xs], into o[i * os] (int16 or int).
template <typename X>
GML_AVX2 inline void bt4(const X* x, int xs, X* o, int os) {
  const X a = x[4 * xs] - x[2 * xs];  // d4 - d2
  X b = x[3 * xs] - x[xs];            // 2 (d3 - d1)
  b = b + b;
  o[0] = a + x4(x[0] - x[2 * xs]);                    // 4 d0 - 5 d2 + d4
  o[os] = (x[3 * xs] + x[4 * xs]) - x4(x[xs] + x[2 * xs]);  // -4 d1 - 4 d2 + d3 + d4
  o[2 * os] = (x[4 * xs] - x[3 * xs]) + x4(x[xs] - x[2 * xs]);  // 4 d1 - 4 d2 - d3 + d4
  o[3 * os] = a + b;                                  // -2 d1 - d2 + 2 d3 + d4
  o[4 * os] = a - b;                                  // 2 d1 - d2 - 2 d3 + d4
  o[5 * os] = (x[5 * xs] - x[3 * xs]) + x4(x[xs] - x[3 * xs]);  // 4 d1 - 5 d3 + d5
}

// A'^T of F(4, 3) on one line of 6 int32 values (modulo 2^32), into 4.
template <typename X>
GML_AVX2 inline void at4(const X* x, int xs, X* o, int os) {
  const X s = x[xs] + x[2 * xs], d = x[xs] - x[2 * xs], s2 = x[3 * xs] + x[4 * xs], d2 = x[3 * xs] - x[4 * xs];
  o[0] = x[0] * 6u + s * 4u + s2;
  o[os] = d * 4u + d2 * 2u;
  o[2 * os] = (s + s2) * 4u;
  o[3 * os] = d * 4u + d2 * 8u + x[5 * xs] * 24u;
}

// S from Y' = 576 S modulo 2^32 (exact while |S| < 2^25; file comment).
constexpr uint32_t kInv9 = 954437177u;
static_assert(static_cast<uint32_t>(9u * kInv9) == 1u);
GML_AVX2 inline __m256i sum_of(u32x8 y) { return reinterpret_cast<__m256i>(reinterpret_cast<i32x8>(y * kInv9) >> 6); }
inline int32_t sum_of(uint32_t y) {
  const uint32_t s64 = y * kInv9;  // 64 S modulo 2^32, in int32's range
  return static_cast<int32_t>(s64) >> 6;  // arithmetic (C++20; GCC's right shift of a negative value)
}

// V of one 6x6 patch (input_tile's contract, 36 positions).
template <typename T>
GML_AVX2 inline void input_tile4(const T* const* p, int16_t* v, int64_t stride, int64_t c, int zp) {
  const i16x16 z = reinterpret_cast<i16x16>(_mm256_set1_epi16(static_cast<int16_t>(zp)));
  int64_t i = 0;
  for (; i + 16 <= c; i += 16) {
    i16x16 d[36], t[36], o[36];
    for (int j = 0; j < 36; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j] + i));
      d[j] = reinterpret_cast<i16x16>(std::is_same_v<T, uint8_t> ? _mm256_cvtepu8_epi16(b) : _mm256_cvtepi8_epi16(b)) - z;
    }
    for (int j = 0; j < 6; ++j) bt4(d + j, 6, t + j, 6);  // t = B^T d (down each column)
    for (int r = 0; r < 6; ++r) bt4(t + 6 * r, 1, o + 6 * r, 1);  // V = t B (along each row)
    for (int j = 0; j < 36; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + j * stride + i), reinterpret_cast<__m256i>(o[j]));
  }
  for (; i < c; ++i) {  // the channels past the last 16, scalar
    int d[36], t[36], o[36];
    for (int j = 0; j < 36; ++j) d[j] = static_cast<int>(p[j][i]) - zp;
    for (int j = 0; j < 6; ++j) bt4(d + j, 6, t + j, 6);
    for (int r = 0; r < 6; ++r) bt4(t + 6 * r, 1, o + 6 * r, 1);
    for (int j = 0; j < 36; ++j) v[j * stride + i] = static_cast<int16_t>(o[j]);
  }
  if (c % 2)
    for (int xi = 0; xi < 36; ++xi) v[xi * stride + c] = 0;
  _mm256_zeroupper();
}

// Y' = A'^T M'' A' for one tile, S recovered from it, and its up-to-16 output pixels (output_tile's
// contract; ``scale`` is src_scale * w_scale: S is the direct conv's sum itself).
GML_AVX2 inline void output_tile4(const int32_t* m, int64_t stride, char* const* o, const float* scale,
                                  const float* bias, const Epilogue& e, const QuantOut& q, int64_t kc) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    u32x8 x[36], s[24], y[16];
    for (int xi = 0; xi < 36; ++xi) x[xi] = reinterpret_cast<u32x8>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + xi * stride + k)));
    for (int j = 0; j < 6; ++j) at4(x + j, 6, s + j, 6);  // s = A'^T M'' (4 x 6)
    for (int r = 0; r < 4; ++r) at4(s + 6 * r, 1, y + 4 * r, 1);  // y = s A' (4 x 4)
    for (int j = 0; j < 16; ++j)
      if (o[j]) finish8(sum_of(y[j]), scale, bias, e, q, o[j], k);
  }
  for (; k < kc; ++k) {
    uint32_t x[36], s[24], y[16];
    for (int xi = 0; xi < 36; ++xi) x[xi] = static_cast<uint32_t>(m[xi * stride + k]);
    for (int j = 0; j < 6; ++j) at4(x + j, 6, s + j, 6);
    for (int r = 0; r < 4; ++r) at4(s + 6 * r, 1, y + 4 * r, 1);
    for (int j = 0; j < 16; ++j)
      if (o[j]) finish1(sum_of(y[j]), scale, bias, e, q, o[j], k);
  }
  _mm256_zeroupper();
}

#undef GML_AVX2
}  // namespace int8_avx2

// U'' of one 3x3 kernel g (row-major ints) into u[(M+2)^2]: G' g G'^T of F(2x2, 3x3) (= 4 U) or
// G'' g G''^T of F(4x4, 3x3) (file comment).
template <int M>
inline void weight_tile(const int* g, int* u) {
  if constexpr (M == 2) {
    int t[12];
    for (int j = 0; j < 3; ++j) {  // t = G' g (4 x 3)
      t[0 + j] = 2 * g[j];
      t[3 + j] = g[j] + g[3 + j] + g[6 + j];
      t[6 + j] = g[j] - g[3 + j] + g[6 + j];
      t[9 + j] = 2 * g[6 + j];
    }
    for (int r = 0; r < 4; ++r) {  // U' = t G'^T (4 x 4)
      const int* tr = t + 3 * r;
      const int row[4] = {2 * tr[0], tr[0] + tr[1] + tr[2], tr[0] - tr[1] + tr[2], 2 * tr[2]};
      for (int j = 0; j < 4; ++j) u[r * 4 + j] = row[j];
    }
  } else {
    static_assert(M == 4);
    const auto line = [](int a, int b, int c, int* o, int os) {  // G'' on (a, b, c)
      o[0] = a, o[os] = -a - b - c, o[2 * os] = -a + b - c, o[3 * os] = a + 2 * b + 4 * c,
      o[4 * os] = a - 2 * b + 4 * c, o[5 * os] = c;
    };
    int t[18];
    for (int j = 0; j < 3; ++j) line(g[j], g[3 + j], g[6 + j], t + j, 3);  // t = G'' g (6 x 3)
    for (int r = 0; r < 6; ++r) line(t[3 * r], t[3 * r + 1], t[3 * r + 2], u + 6 * r, 1);  // U'' = t G''^T
  }
}

// GML's INT8 Winograd F(MxM, 3x3), M = 2 or 4 (file comment); Int8Conv is F(2x2, 3x3).
template <int M>
class Int8ConvT {
  static_assert(M == 2 || M == 4);
  static constexpr int kA = M + 2, kP = kA * kA;  // patch side, transformed positions

 public:
  // F(4x4, 3x3) is exact while |S| < 2^25 (file comment): whether max_k sum |w_k| times the largest
  // |x - zp| of the source type keeps under it, for [K, C, 3, 3] s8 ``weight``. F(2x2, 3x3): C <=
  // kMaxChannels.
  static bool exact(const int8_t* weight, int64_t k, int64_t c, dt src_type, int src_zp) {
    if (M == 2) return c <= kMaxChannels;
    const int64_t d = src_type == dt::u8 ? std::max(src_zp, 255 - src_zp) : std::max(src_zp + 128, 127 - src_zp);
    int64_t most = 0;
    for (int64_t o = 0; o < k; ++o) {
      int64_t sum = 0;
      for (int64_t j = 0; j < c * 9; ++j) sum += std::abs(static_cast<int>(weight[o * c * 9 + j]));
      most = std::max(most, sum);
    }
    return d * most < (int64_t{1} << 25);
  }

  // src: [N, C, H, W] dense NHWC, u8 or s8 (``src_zp``, ``src_scale``); ``weight``: the caller's
  // contiguous [K, C, 3, 3] s8 tensor, ``w_scales`` one or K scales, ``bias`` K fp32 values or null
  // (all copied here, never kept); dst: [N, K, H, W] dense NHWC of q.dst_type; ``threads``: the
  // OpenMP team the plan runs with.
  Int8ConvT(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, dt src_type, float src_scale, int src_zp,
           const int8_t* weight, const std::vector<float>& w_scales, const float* bias, const Epilogue& epi,
           const QuantOut& q, int threads)
      : n_(n), c_(c), h_(h), w_(w), k_(k), src_type_(src_type), src_zp_(src_zp), epi_(epi), q_(q) {
    if (n <= 0 || c <= 0 || h <= 0 || w <= 0 || k <= 0)
      throw std::invalid_argument("gml engine: winograd of an empty tensor");
    if (!exact(weight, k, c, src_type, src_zp))
      throw std::invalid_argument(M == 2 ? "gml engine: INT8 winograd is exact up to 1,827 input channels"
                                         : "gml engine: these weights could leave INT8 winograd F(4x4, 3x3)'s exact range");
    if (src_type != dt::u8 && src_type != dt::s8) throw std::invalid_argument("gml engine: INT8 winograd of u8 / s8 sources");
    if (q.dst_type != dt::u8 && q.dst_type != dt::s8 && q.dst_type != dt::f32)
      throw std::invalid_argument("gml engine: INT8 winograd writes u8, s8 or f32");
    if (w_scales.size() != 1 && static_cast<int64_t>(w_scales.size()) != k)
      throw std::invalid_argument("gml engine: INT8 winograd needs one or K weight scales");
    cp_ = (c + 1) / 2 * 2;
    kp_ = (k + 15) / 16 * 16;
    th_ = (h + M - 1) / M;
    tw_ = (w + M - 1) / M;
    total_ = n * th_ * tw_;
    // Chunks as winograd.h's (V + M about kChunkBytes, at least kMinChunkTiles tiles), and at least
    // K tiles each: every chunk reads all of U' (32 C K bytes: 2 MB at 256 channels, more than a
    // core's L2), so a chunk's own V (32 C bytes per tile) should be at least that big. With enough
    // tiles for a chunk per thread, each thread transforms, multiplies and writes whole chunks of its
    // own (its V and M stay in its core's cache, one parallel region per call); with fewer, the team
    // shares each chunk's three phases, each thread reading half of U'. Measured in ResNet18 INT8
    // under the AVX2 cap, 2 threads: 64 channels @ 56² 406 µs per-thread vs 411-426 shared; 256 @ 14²
    // 422 µs as one shared chunk vs 498 as one chunk per thread.
    const int64_t per_tile = kP * (cp_ * 2 + kp_ * 4);
    const int64_t want = std::max({kMinChunkTiles, kChunkBytes / per_tile, k});
    int64_t chunks = (total_ + want - 1) / want;
    threads_ = std::max(1, threads);
    if (chunks < threads_ && total_ >= threads_ * std::max(kMinChunkTiles, k)) chunks = threads_;
    per_thread_ = threads_ > 1 && chunks >= threads_;
    if (per_thread_) chunks = (chunks + threads_ - 1) / threads_ * threads_;  // as many per thread
    tiles_ = (total_ + chunks - 1) / chunks;

    // U' (U''), integers, packed [kP][Kp/16][Cp/2][16][2]; padded channels 0
    const int64_t pairs = cp_ / 2, kb = kp_ / 16;
    // (its own pages, 64-byte aligned for the micro-kernel's loads; common.h aligned_buffer)
    u_buf_ = gml_engine::aligned_buffer(static_cast<size_t>(kP * kp_ * cp_) * sizeof(int16_t));
    int16_t* u = static_cast<int16_t*>(u_buf_.get());
    std::memset(u, 0, static_cast<size_t>(kP * kp_ * cp_) * sizeof(int16_t));
    for (int64_t o = 0; o < k; ++o)
      for (int64_t i = 0; i < c; ++i) {
        int g[9], ut[kP];
        for (int j = 0; j < 9; ++j) g[j] = weight[(o * c + i) * 9 + j];
        weight_tile<M>(g, ut);
        for (int64_t xi = 0; xi < kP; ++xi)
          u[static_cast<size_t>((((xi * kb + o / 16) * pairs + i / 2) * 16 + o % 16) * 2 + i % 2)] =
              static_cast<int16_t>(ut[xi]);
      }
    // the output stage's scale: F(2x2, 3x3) hands it 4 S (the / 4 is exact), F(4x4, 3x3) S itself
    scale_.resize(static_cast<size_t>(k));
    for (int64_t o = 0; o < k; ++o) scale_[o] = src_scale * w_scales[w_scales.size() == 1 ? 0 : o] * (M == 2 ? 0.25f : 1.0f);
    bias_.assign(static_cast<size_t>(k), 0.0f);
    if (bias) std::copy(bias, bias + k, bias_.begin());
    zp_row_.assign(static_cast<size_t>(c), static_cast<unsigned char>(static_cast<int8_t>(src_zp)));
    v_bytes_ = align_up(static_cast<size_t>(kP * tiles_ * cp_ * 2));
    slot_bytes_ = v_bytes_ + align_up(static_cast<size_t>(kP * tiles_ * kp_ * 4));
    scratch_bytes_ = slot_bytes_ * static_cast<size_t>(per_thread_ ? threads_ : 1);
  }

  size_t scratch_bytes() const { return scratch_bytes_; }
  // U', the bytes every call reads (conv.h times calls with them out of the caches)
  std::pair<const void*, size_t> weights() const { return {u_buf_.get(), static_cast<size_t>(kP * kp_ * cp_) * 2}; }
  static std::string impl() { return M == 2 ? "gml:winograd_f2x3+s16:avx2" : "gml:winograd_f4x3+s16:avx2"; }

  // One call: src / dst as described at construction; ``scratch``: scratch_bytes() (64-byte aligned).
  void run(const void* src, void* dst, void* scratch) const {
    const int64_t chunks = (total_ + tiles_ - 1) / tiles_;
    if (!per_thread_) {
      for (int64_t i = 0; i < chunks; ++i) chunk(src, dst, static_cast<char*>(scratch), i * tiles_, true);
      return;
    }
#pragma omp parallel num_threads(threads_)
    {
      // a thread's chunks use its own slot of the scratchpad (the team may be smaller, never larger)
      char* slot = static_cast<char*>(scratch) + slot_bytes_ * static_cast<size_t>(omp_get_thread_num());
#pragma omp for schedule(static)
      for (int64_t i = 0; i < chunks; ++i) chunk(src, dst, slot, i * tiles_, false);
    }
  }

 private:
  // Tiles [t0, min(t0 + tiles_, total_)): input transform, the kP GEMMs,
  // output transform, with ``slot``'s V and M; each phase on the OpenMP team when ``team``.
  void chunk(const void* src, void* dst, char* slot, int64_t t0, bool team) const {
    auto* v = reinterpret_cast<int16_t*>(slot);
    auto* m = reinterpret_cast<int32_t*>(slot + v_bytes_);
    const int64_t count = std::min(tiles_, total_ - t0);
    if (src_type_ == dt::u8) input_transform(static_cast<const uint8_t*>(src), v, t0, count, team);
    else input_transform(static_cast<const int8_t*>(src), v, t0, count, team);
    gemm(v, m, count, team);
    output_transform(m, static_cast<char*>(dst), t0, count, team);
  }

  template <typename T>
  void input_transform(const T* src, int16_t* v, int64_t t0, int64_t count, bool team) const {
    const int64_t stride = tiles_ * cp_;
    const T* zero = reinterpret_cast<const T*>(zp_row_.data());
#pragma omp parallel for schedule(static) if (team && count * c_ >= kParallelWork)
    for (int64_t t = 0; t < count; ++t) {
      const T* p[kP];
      patch_rows<M>(src, zero, t0 + t, th_, tw_, h_, w_, c_, p);
      if constexpr (M == 2) int8_avx2::input_tile(p, v + t * cp_, stride, c_, src_zp_);
      else int8_avx2::input_tile4(p, v + t * cp_, stride, c_, src_zp_);
    }
  }

  // The kP GEMMs of one chunk: (position, 16-output block) pairs on the OpenMP team, each over the
  // chunk's tiles kTileRows at a time with the block's U' slab (Cp x 16 int16) hot in L1.
  void gemm(const int16_t* v, int32_t* m, int64_t count, bool team) const {
    const int64_t kb = kp_ / 16, pairs = cp_ / 2;
#pragma omp parallel for schedule(static) collapse(2) if (team)
    for (int64_t xi = 0; xi < kP; ++xi)
      for (int64_t b = 0; b < kb; ++b) {
        const int16_t* u = static_cast<const int16_t*>(u_buf_.get()) + (xi * kb + b) * pairs * 32;
        for (int64_t t = 0; t < count; t += kTileRows)
          int8_avx2::gemm_rows(static_cast<int>(std::min<int64_t>(kTileRows, count - t)), v + (xi * tiles_ + t) * cp_,
                               cp_, u, pairs, m + (xi * tiles_ + t) * kp_ + 16 * b, kp_);
      }
  }

  void output_transform(const int32_t* m, char* dst, int64_t t0, int64_t count, bool team) const {
    const int64_t es = q_.dst_type == dt::f32 ? 4 : 1;
#pragma omp parallel for schedule(static) if (team && count * k_ >= kParallelWork)
    for (int64_t t = 0; t < count; ++t) {
      char* o[M * M];
      tile_outputs<M>(dst, t0 + t, th_, tw_, h_, w_, k_ * es, o);
      if constexpr (M == 2) int8_avx2::output_tile(m + t * kp_, tiles_ * kp_, o, scale_.data(), bias_.data(), epi_, q_, k_);
      else int8_avx2::output_tile4(m + t * kp_, tiles_ * kp_, o, scale_.data(), bias_.data(), epi_, q_, k_);
    }
  }

  int64_t n_, c_, h_, w_, k_;
  dt src_type_;
  int src_zp_;
  Epilogue epi_;
  QuantOut q_;
  int64_t cp_ = 0, kp_ = 0, th_ = 0, tw_ = 0, total_ = 0, tiles_ = 0;
  std::shared_ptr<void> u_buf_;  // U', packed
  std::vector<float> scale_, bias_;
  std::vector<unsigned char> zp_row_;
  int threads_ = 1;           // the OpenMP team a call runs with (the plan's)
  bool per_thread_ = false;   // each thread runs whole chunks (else the team shares each chunk)
  size_t v_bytes_ = 0, slot_bytes_ = 0, scratch_bytes_ = 0;
};

using Int8Conv = Int8ConvT<2>;

}  // namespace gml_winograd
