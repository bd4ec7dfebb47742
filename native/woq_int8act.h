// GML engine: woq_linear with int8 activations (act_bits = 8; the math is the Python reference
// _woq_linear_act8 in src/gml/ir/llm_ops.py — llama.cpp's Q8_0 activations against INT8 / INT4 weights).
//
//   x is quantized once per call, per row in blocks of 32 along K (the last block may be shorter):
//     s_x[m, b] = amax_b |x| / 127,   qx[m, k] = round_half_even(x / s_x) in [-127, 127]  (0 when s_x = 0)
//   and every dot product runs in integers:
//     y[m, n] = sum_b (s_x[m, b] * s_w[n, g(b)]) * isum[m, n, b] + bias[n],
//     isum[m, n, b] = sum_{k in block b} qx[m, k] * (q[n, k] - z[n, g(k)])    (exact in int32)
//   (INT8 weights per output channel, group = K: one s_w per row, so the kernels scale by s_w once at
//   the end of the row. INT8 and INT4 groups are 32, 64 or 128: a block of 32 never straddles two
//   groups, and each block is scaled by its own s_x * s_w — with INT8 groups of 32, llama.cpp's
//   Q8_0 x Q8_0 dot product.)
//
// Weights are read in place, in woq.h's layout (no repacking). Instead, the activations are laid out
// per call to meet them: INT8 weights pair with qx in natural order; INT4 weights (two nibbles per byte,
// low = even k) pair with qx permuted within each block of 32 as [16 even k, 16 odd k], so that the
// low nibbles of a block's 16 bytes followed by its high nibbles line up with qx byte for byte.
//
// No int16 step can saturate (docs/adr/011-int8-on-every-isa.md):
//   * INT4: the nibble q in 0..15 is the unsigned operand, qx the signed one:
//       vpmaddubsw pairs |.| <= 2 * 15 * 127 = 3,810; the zero point enters as a second product
//       z (u8, <= 15) x (-qx) (precomputed per call), |.| <= 3,810: their int16 sum <= 7,620.
//   * INT8: q may be -128, qx never is (|qx| <= 127). The sign trick puts the magnitude on the weight:
//       |q| as u8 (0..128) x qx * sign(q) as s8 (never wraps: |qx| <= 127);
//       vpmaddubsw pairs |.| <= 2 * 128 * 127 = 32,512 < 32,767.
//   * VNNI (vpdpbusd, zmm; AVX-VNNI on ymm) sums four u8 x s8 products straight into int32: the same
//     operands, no int16 step at all.
// A lane of isum adds at most 32 products (one block): |isum| <= 32 * 128 * 127 < 2^24, exact in int32
// and in its conversion to fp32; with s_x = 1 and power-of-two s_w the kernels equal an integer dot.
//
// Kernels (`isa`): "vnni" (AVX-512 VNNI: 64 weights per vpdpbusd, lanes 0-7 block b, 8-15 block b + 1),
// "avxvnni" (AVX-VNNI, ymm vpdpbusd, one block per step), "avx2" and "avx512" (AVX2 vpmaddubsw +
// vpmaddwd, one block per step; AVX-512 without VNNI runs this AVX2 code: no zmm vpmaddubsw version is
// written), "scalar".
// Four output rows per block share every activation load, as in woq.h.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "woq.h"

#define GML_WOQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define GML_WOQ_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))

namespace gml_woq {

constexpr int64_t kActBlock = 32;

// x quantized per call (see the file comment). Rows of kp = nb * 32 bytes, zero-padded.
struct Acts {
  int64_t nb = 0, kp = 0;
  std::vector<int8_t> q;    // [M, kp] qx (INT4: each block permuted [even k, odd k])
  std::vector<int8_t> nq;   // [M, kp] -qx (INT4 only: the zero point's operand)
  std::vector<float> sx;    // [M, nb]
  std::vector<float> lane;  // [M, nb * 8] s_x[b] repeated 8 times: the scale of each int32 lane
  std::vector<int32_t> corr;  // [M, nb * 8] (INT8, vector kernels) -128 * the sum of each lane's 4 qx
};

// One block of n <= 32 values: s = amax / 127 and qx (natural order) into q[0, 32); the definition.
inline float quantize_block_scalar(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax / 127.f;  // as torch: one correctly rounded division
  for (int64_t k = 0; k < n && s > 0.f; ++k) {
    // round half to even as torch.round: adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to an
    // integer in the default rounding mode (the engine is built without -ffast-math)
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, (x[k] / s + 12582912.f) - 12582912.f)));
  }
  return s;
}

// The same for a whole block of 32 on AVX2 (vdivps is correctly rounded, vroundps rounds half to even:
// equal to the scalar definition bit for bit); the int8 packing is llama.cpp's quantize_row_q8_0.
// nq non-null (INT4): q is stored permuted [16 even k, 16 odd k] and its negation into nq, as
// permute_block below.
GML_WOQ_AVX2 inline float quantize_block_avx2(const float* x, int8_t* q, int8_t* nq) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float s = _mm_cvtss_f32(h) / 127.f;
  if (!(s > 0.f)) {  // q (and nq) stay 0
    _mm256_zeroupper();
    return s;
  }
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v[j], vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    i[j] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
  }
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  __m256i out = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (nq) {  // per 128-bit lane [evens, odds], then the 64-bit quads as [0, 2, 1, 3]
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    out = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(out, evens_odds), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(nq), _mm256_sub_epi8(_mm256_setzero_si256(), out));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), out);
  _mm256_zeroupper();  // GCC does not insert it in target("avx...") functions: SSE code follows
  return s;
}

// INT4: a block's qx reordered [16 even k, 16 odd k] in place, and its negation into nq. (Local
// copies: int8 stores may alias anything, so the compiler would reload every pointer per byte.)
inline void permute_block(int8_t* __restrict q, int8_t* __restrict nq) {
  int8_t t[kActBlock];
  std::copy(q, q + kActBlock, t);
  for (int j = 0; j < kActBlock / 2; ++j) q[j] = t[2 * j], q[16 + j] = t[2 * j + 1];
  for (int j = 0; j < kActBlock; ++j) nq[j] = static_cast<int8_t>(-q[j]);
}

// x quantized for the kernel `vector` (AVX2 or better) or the scalar one; see the file comment.
inline Acts quantize_acts(const Problem& p, bool vector) {
  Acts a;
  a.nb = (p.K + kActBlock - 1) / kActBlock;
  a.kp = a.nb * kActBlock;
  a.q.assign(static_cast<size_t>(p.M * a.kp), 0);
  a.sx.assign(static_cast<size_t>(p.M * a.nb), 0.f);
  a.lane.assign(static_cast<size_t>(p.M * a.nb * 8), 0.f);
  if (p.bits == 4) a.nq.assign(a.q.size(), 0);
  // the VNNI kernels' accumulator start: -128 * each lane's qx sum (INT8: weights offset by 128), -8 *
  // (symmetric INT4: the zero point 8)
  const int32_t offset = p.bits == 8 ? 128 : p.zeros ? 0 : 8;
  if (vector && offset) a.corr.assign(a.lane.size(), 0);
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t k0 = b * kActBlock, n = std::min(kActBlock, p.K - k0);
      const float* x = p.x + m * p.K + k0;
      int8_t* q = a.q.data() + m * a.kp + k0;
      int8_t* nq = p.bits == 4 ? a.nq.data() + m * a.kp + k0 : nullptr;  // INT4 blocks are always whole
      float s;
      if (vector && n == kActBlock) {
        s = quantize_block_avx2(x, q, nq);
      } else {
        s = quantize_block_scalar(x, n, q);
        if (nq) permute_block(q, nq);
      }
      a.sx[m * a.nb + b] = s;
      for (int j = 0; j < 8; ++j) a.lane[(m * a.nb + b) * 8 + j] = s;
      if (!a.corr.empty())  // (INT4: of the stored, permuted qx, as the kernel reads it)
        for (int j = 0; j < 8; ++j)
          a.corr[(m * a.nb + b) * 8 + j] = -offset * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
    }
  }
  return a;
}

// qx of row m at the position of natural k (undoes the INT4 permutation).
inline int32_t qx_at(const Problem& p, const Acts& a, int64_t m, int64_t k) {
  const int64_t j = k % kActBlock;
  const int64_t at = p.bits == 4 ? (j % 2 ? 16 + j / 2 : j / 2) : j;
  return a.q[m * a.kp + (k - j) + at];
}

// sum over blocks b >= b0 of (s_x[b] * s_w[g(b)]) * isum_b for row n, x row m: the scalar definition
// (every block of the scalar kernel; the tail blocks of the vector kernels, whose sum is then
// scaled by s_w at the end for INT8 per output channel: `per_row` leaves s_w = 1 here).
inline float blocks_scalar(const Problem& p, const Acts& a, int64_t m, int64_t n, int64_t b0, bool per_row) {
  const int64_t G = p.K / p.group;
  float total = 0.f;
  for (int64_t b = b0; b < a.nb; ++b) {
    const int64_t k0 = b * kActBlock, k1 = std::min(k0 + kActBlock, p.K);
    int32_t isum = 0;
    for (int64_t k = k0; k < k1; ++k) isum += qx_at(p, a, m, k) * weight_int(p, n, k);
    const float sw = per_row ? 1.f : p.scales[n * G + k0 / p.group];
    total += (a.sx[m * a.nb + b] * sw) * static_cast<float>(isum);
  }
  return total;
}

// ---------------------------------------------------------------- vector kernels
// Each computes, for R consecutive weight rows (q: row 0 of them, ldq bytes apart) and one row of
// quantized x, out[r] = sum over the blocks of [0, kv) of lane-scaled integer sums: INT8 per channel
// scaled by s_x only (s_w once per row by the caller; GS = 0), INT8 in groups of GS (32 | 64 | 128, a
// compile-time constant) and INT4 by s_x * s_w. Locals only, so the R accumulators stay in registers.
// The caller adds the blocks past kv (blocks_scalar) and the bias. scales: row 0's [G] (rows ldg
// apart), read only when grouped.

// The 8 sums of acc[0..8) in one ymm (row r in lane r): the horizontal reductions of 8 rows deferred
// into one shuffle tree (24 ops instead of 8 separate reductions of ~8 each).
GML_WOQ_VNNI inline __m256 reduce8_vnni(const __m512* a) {
  __m512 t[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [A0+A2, B0+B2, A1+A3, B1+B3] of rows A = 2i, B = 2i + 1
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 u[2];
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: rows 4i .. 4i + 3
    const __m512d l = _mm512_castps_pd(t[2 * i]), h = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(l, h)), _mm512_castpd_ps(_mm512_unpackhi_pd(l, h)));
  }
  // the four 128-bit lanes of each u added: [u0 L0+L1, u0 L2+L3, u1 L0+L1, u1 L2+L3], then once more
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_castps512_ps256(w);
}

// The end of an R-row AVX-512 VNNI kernel: out[r] = the sum of acc[r]'s lanes (R = 8: one deferred
// reduction, reduce8_vnni), then the upper halves cleared (GCC does not insert vzeroupper in
// target("avx...") functions: SSE code follows).
template <int R>
GML_WOQ_VNNI __attribute__((always_inline)) inline void store_row_sums_vnni(const __m512* acc, float* out) {
  if constexpr (R == 8) {
    _mm256_storeu_ps(out, reduce8_vnni(acc));
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
  }
  _mm256_zeroupper();
}

// AVX-512 VNNI, INT8 weights: 64 weights (blocks b, b + 1) per vpdpbusd. The weight is the unsigned
// operand offset by 128 (q ^ 0x80 = q + 128 in 0..255, so -128 is exact too) and the accumulator
// starts at corr = -128 * (the lane's 4 qx) instead of 0: corr + sum (q + 128) qx = sum q qx, exact
// in int32 (|lane| <= 4 * 255 * 127). One xor per 64 weights instead of the sign trick's abs + mask +
// masked negate. Scales: per channel, the lane's s_x (s_w by the caller); groups of 64 / 128, s_x
// times the group's s_w; groups of 32, s_x * s_w of 16 blocks multiplied once per row and per 512
// weights, each step's two blocks picked by one vpermps. R = 8: one deferred reduction (reduce8_vnni).
// The weight line kPrefetchRows rows ahead of each line read is prefetched (woq.h).

template <int R, int GS>
GML_WOQ_VNNI void dot8_vnni(const int8_t* q, int64_t ldq, const int8_t* qx, const int32_t* corr, const float* lane,
                            const float* sx, const float* scales, int64_t ldg, int64_t kv, float* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // one 64-weight step of row r: the lane sums of blocks b, b + 1 as fp32
  auto isum = [&](int r, int64_t k, __m512i x, __m512i c) GML_WOQ_VNNI {
    const int8_t* w = q + r * ldq + k;
    prefetch_row_ahead(w, ldq);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, _mm512_xor_si512(_mm512_loadu_si512(w), flip), x));
  };
  if constexpr (GS == 32) {
    const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t k0 = 0; k0 < kv; k0 += 512) {  // 16 blocks: their s_x * s_w, once per row
      const int64_t b0 = k0 / 32, k1 = std::min(kv, k0 + 512);
      const __mmask16 some = static_cast<__mmask16>((1u << ((k1 - k0) / 32)) - 1);
      const __m512 sxv = _mm512_maskz_loadu_ps(some, sx + b0);
      __m512 prod[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) prod[r] = _mm512_mul_ps(sxv, _mm512_maskz_loadu_ps(some, scales + r * ldg + b0));
      __m512i pick = first;  // lanes 0-7: block 2j of the 16, 8-15: 2j + 1
      for (int64_t k = k0; k < k1; k += 64) {
        const __m512i x = _mm512_loadu_si512(qx + k), c = _mm512_loadu_si512(corr + k / 4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(isum(r, k, x, c), _mm512_permutexvar_ps(pick, prod[r]), acc[r]);
        pick = _mm512_add_epi32(pick, _mm512_set1_epi32(2));
      }
    }
  } else {
    for (int64_t k = 0; k < kv; k += 64) {
      const __m512i x = _mm512_loadu_si512(qx + k), c = _mm512_loadu_si512(corr + k / 4);
      const __m512 s = _mm512_loadu_ps(lane + k / 4);  // lanes 0-7: s_x[b], 8-15: s_x[b + 1]
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (GS > 0) {  // 64 | GS: both blocks in one group
          acc[r] = _mm512_fmadd_ps(isum(r, k, x, c), _mm512_mul_ps(s, _mm512_set1_ps(scales[r * ldg + k / GS])), acc[r]);
        } else {
          acc[r] = _mm512_fmadd_ps(isum(r, k, x, c), s, acc[r]);
        }
      }
    }
  }
  store_row_sums_vnni<R>(acc, out);
}

// AVX-512 VNNI, INT4 weights: 32 bytes = 64 weights (blocks b, b + 1) per step. scales / zeros: row
// 0's [G] (rows ldg apart). Symmetric (zeros null, z = 8): the accumulator starts at corr = -8 * (the
// lane's 4 qx) — the zero point's product, the same for every row — so one vpdpbusd per step;
// asymmetric: a second vpdpbusd of z x (-qx). Groups of 32 scale as dot8_vnni (s_x * s_w of 16 blocks
// per row, one vpermps per step); 64 | group: the lanes' s_x times the group's s_w. R = 8: one
// deferred reduction.
template <int R>
GML_WOQ_VNNI void dot4_vnni(const uint8_t* q, int64_t ldq, const int8_t* qx, const int8_t* nqx, const int32_t* corr,
                            const float* lane, const float* sx, const float* scales, const uint8_t* zeros, int64_t ldg,
                            int64_t group, int64_t kv, float* out) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i nibble = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);  // 128-bit lanes: low, high, low, high
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < kv; k0 += 512) {  // windows of 16 blocks (groups of 32: s_x * s_w once per row)
    const int64_t b0 = k0 / 32, k1 = std::min(kv, k0 + 512);
    __m512 prod[R];
    if (group == 32) {
      const __mmask16 some = static_cast<__mmask16>((1u << ((k1 - k0) / 32)) - 1);
      const __m512 sxv = _mm512_maskz_loadu_ps(some, sx + b0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) prod[r] = _mm512_mul_ps(sxv, _mm512_maskz_loadu_ps(some, scales + r * ldg + b0));
    }
    __m512i pick = first;  // lanes 0-7: block 2j of the window, 8-15: 2j + 1
    for (int64_t k = k0; k < k1; k += 64) {
      const __m512i x = _mm512_loadu_si512(qx + k);
      const __m512i c = zeros ? zero : _mm512_loadu_si512(corr + k / 4);
      const __m512 s = _mm512_loadu_ps(lane + k / 4);
      const int64_t g0 = k / group, g1 = (k + 32) / group;  // the groups of blocks b and b + 1
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (k % 128 == 0) prefetch_row_ahead(q + r * ldq + k / 2, ldq);
        // block b's 16 bytes in 128-bit lanes 0-1, block b + 1's in 2-3 (broadcast loads: no shuffle-port
        // instruction), then lanes 1 and 3 shifted by 4 bits: [lo b, hi b, lo b+1, hi b+1] = block b's
        // [even k, odd k], then b + 1's, as qx is stored
        const uint8_t* qb = q + r * ldq + k / 2;
        const __m512i both = _mm512_mask_broadcast_i32x4(
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb))), 0xFF00,
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)));
        const __m512i w = _mm512_and_si512(_mm512_srlv_epi64(both, nibble), low);
        __m512i isum = _mm512_dpbusd_epi32(c, w, x);  // q.qx (+ corr: -8.qx)
        if (zeros) {  // + z.(-qx)
          const __m512i z = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(static_cast<char>(zeros[r * ldg + g0])),
                                                    _mm512_set1_epi8(static_cast<char>(zeros[r * ldg + g1])));
          isum = _mm512_dpbusd_epi32(isum, z, _mm512_loadu_si512(nqx + k));
        }
        const __m512 sc = group == 32 ? _mm512_permutexvar_ps(pick, prod[r])
                                      : _mm512_mul_ps(s, _mm512_set1_ps(scales[r * ldg + g0]));  // g0 == g1
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[r]);
      }
      pick = _mm512_add_epi32(pick, _mm512_set1_epi32(2));
    }
  }
  store_row_sums_vnni<R>(acc, out);
}

// AVX2 and AVX-VNNI: one block of 32 per step. The same bodies are compiled twice (a target attribute
// cannot be a template argument): DOT(u, s) is the int32 lane sums of u8 x s8 products; DOT2 adds a
// second pair.
#define GML_WOQ_DOT8_YMM(ATTR, NAME, DOT)                                                                        \
  template <int R, int GS>                                                                                       \
  ATTR void NAME(const int8_t* q, int64_t ldq, const int8_t* qx, const float* sx, const float* scales,           \
                 int64_t ldg, int64_t kv, float* out) {                                                          \
    __m256 acc[R];                                                                                               \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();                            \
    for (int64_t k = 0; k < kv; k += 32) {                                                                       \
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + k));                            \
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                                      \
        if (k % 64 == 0) prefetch_row_ahead(q + r * ldq + k, ldq);                                                \
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * ldq + k));                 \
        /* grouped: the block's s_x * s_w; per channel: s_x (s_w by the caller) */                               \
        const __m256 s = _mm256_set1_ps(GS ? sx[k / 32] * scales[r * ldg + k / (GS ? GS : 1)] : sx[k / 32]);     \
        /* |q| (u8) x qx * sign(q) (s8): pairs <= 2 * 128 * 127 = 32,512, never saturate (file comment) */       \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))), s, acc[r]); \
      }                                                                                                          \
    }                                                                                                            \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);                                \
    _mm256_zeroupper();                                                                                          \
  }

#define GML_WOQ_DOT4_YMM(ATTR, NAME, DOT2)                                                                        \
  template <int R>                                                                                                \
  ATTR void NAME(const uint8_t* q, int64_t ldq, const int8_t* qx, const int8_t* nqx, const float* sx,             \
                 const float* scales, const uint8_t* zeros, int64_t ldg, int64_t group, int64_t kv, float* out) { \
    const __m128i low = _mm_set1_epi8(0x0F);                                                                      \
    __m256 acc[R];                                                                                                \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();                             \
    for (int64_t k = 0; k < kv; k += 32) {                                                                        \
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + k));                             \
      const __m256i nx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nqx + k));                           \
      const int64_t g = k / group;                                                                                \
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                                       \
        if (k % 128 == 0) prefetch_row_ahead(q + r * ldq + k / 2, ldq);                                           \
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * ldq + k / 2));                 \
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);                  \
        const __m256i w = _mm256_set_m128i(hi, lo); /* [even k, odd k], as qx */                                  \
        const __m256i z = _mm256_set1_epi8(static_cast<char>(zeros ? zeros[r * ldg + g] : 8));                    \
        const __m256 s = _mm256_set1_ps(sx[k / 32] * scales[r * ldg + g]);                                        \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT2(w, x, z, nx)), s, acc[r]); /* q.qx + z.(-qx) */          \
      }                                                                                                           \
    }                                                                                                             \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);                                 \
    _mm256_zeroupper();                                                                                           \
  }

#define GML_WOQ_DOT_AVX2(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
// q.qx and z.(-qx) pairs (each |.| <= 3,810) add in int16 (|.| <= 7,620) before vpmaddwd
#define GML_WOQ_DOT2_AVX2(w, x, z, nx) \
  _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w, x), _mm256_maddubs_epi16(z, nx)), _mm256_set1_epi16(1))
#define GML_WOQ_DOT_AVXVNNI(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
#define GML_WOQ_DOT2_AVXVNNI(w, x, z, nx) \
  _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x), z, nx)

GML_WOQ_DOT8_YMM(GML_WOQ_AVX2, dot8_avx2, GML_WOQ_DOT_AVX2)
GML_WOQ_DOT8_YMM(GML_WOQ_AVXVNNI, dot8_avxvnni, GML_WOQ_DOT_AVXVNNI)
GML_WOQ_DOT4_YMM(GML_WOQ_AVX2, dot4_avx2, GML_WOQ_DOT2_AVX2)
GML_WOQ_DOT4_YMM(GML_WOQ_AVXVNNI, dot4_avxvnni, GML_WOQ_DOT2_AVXVNNI)

// ---------------------------------------------------------------- driver
enum class Act8Kernel { kScalar, kAvx2, kAvxVnni, kVnni };

inline Act8Kernel act8_kernel(const std::string& isa) {
  if (isa == "vnni") return Act8Kernel::kVnni;
  if (isa == "avxvnni") return Act8Kernel::kAvxVnni;
  if (isa == "avx2" || isa == "avx512") return Act8Kernel::kAvx2;  // AVX-512 without VNNI: the AVX2 code
  return Act8Kernel::kScalar;
}

// The INT8 dot product of `kern` (not the scalar one) for GS (0: per output channel).
template <int R, int GS>
void dot8(Act8Kernel kern, const int8_t* q, int64_t ldq, const int8_t* qx, const int32_t* corr, const float* sx,
          const float* lane, const float* sc, int64_t ldg, int64_t kv, float* out) {
  if (kern == Act8Kernel::kVnni) dot8_vnni<R, GS>(q, ldq, qx, corr, lane, sx, sc, ldg, kv, out);
  if (kern == Act8Kernel::kAvxVnni) dot8_avxvnni<R, GS>(q, ldq, qx, sx, sc, ldg, kv, out);
  if (kern == Act8Kernel::kAvx2) dot8_avx2<R, GS>(q, ldq, qx, sx, sc, ldg, kv, out);
}

// Rows [n0, n0 + R) for every row of x.
template <int R>
void rows_act8(const Problem& p, const Acts& a, int64_t n0, Act8Kernel kern) {
  const int64_t G = p.K / p.group;
  const int64_t step = kern == Act8Kernel::kVnni ? 64 : 32;
  const int64_t kv = kern == Act8Kernel::kScalar ? 0 : p.K / step * step;  // the vector part of K
  const bool per_row = p.bits == 8 && p.group == p.K;  // INT8 per output channel: s_w once per row
  for (int64_t m = 0; m < p.M; ++m) {
    const int8_t* qx = a.q.data() + m * a.kp;
    const int8_t* nqx = p.bits == 4 ? a.nq.data() + m * a.kp : nullptr;
    const float* sx = a.sx.data() + m * a.nb;
    const float* lane = a.lane.data() + m * a.nb * 8;
    const int32_t* corr = a.corr.empty() ? nullptr : a.corr.data() + m * a.nb * 8;
    float out[R] = {};
    if (p.bits == 8) {
      const int8_t* q = static_cast<const int8_t*>(p.q) + n0 * p.K;
      const float* sc = p.scales + n0 * G;
      if (per_row) {
        dot8<R, 0>(kern, q, p.K, qx, corr, sx, lane, sc, G, kv, out);
      } else if (p.group == 32) {
        dot8<R, 32>(kern, q, p.K, qx, corr, sx, lane, sc, G, kv, out);
      } else if (p.group == 64) {
        dot8<R, 64>(kern, q, p.K, qx, corr, sx, lane, sc, G, kv, out);
      } else {
        dot8<R, 128>(kern, q, p.K, qx, corr, sx, lane, sc, G, kv, out);  // check(): 32, 64, 128 or K
      }
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(p.q) + n0 * (p.K / 2);
      const float* sc = p.scales + n0 * G;
      const uint8_t* z = p.zeros ? p.zeros + n0 * G : nullptr;
      if (kern == Act8Kernel::kVnni) dot4_vnni<R>(q, p.K / 2, qx, nqx, corr, lane, sx, sc, z, G, p.group, kv, out);
      if (kern == Act8Kernel::kAvxVnni) dot4_avxvnni<R>(q, p.K / 2, qx, nqx, sx, sc, z, G, p.group, kv, out);
      if (kern == Act8Kernel::kAvx2) dot4_avx2<R>(q, p.K / 2, qx, nqx, sx, sc, z, G, p.group, kv, out);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      const float sum = out[r] + blocks_scalar(p, a, m, n, kv / kActBlock, per_row);
      p.y[m * p.N + n] = (per_row ? sum * p.scales[n] : sum) + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

// Rows per block of the int8-activation GEMV: 8 (the VNNI kernels' rows at once: one deferred
// reduction; the others run two blocks of 4, woq.h's kRowBlock).
constexpr int64_t kAct8Rows = 8;

// Block `blk` (rows blk * kAct8Rows ..) of the int8-activation GEMV: every activation load feeds
// 8 or 4 rows; a short last block in 4s, then row by row. Shared by linear_act8 and the decode pool.
inline void act8_block(const Problem& p, const Acts& a, int64_t blk, Act8Kernel kern) {
  int64_t n = blk * kAct8Rows;
  const int64_t end = std::min(p.N, n + kAct8Rows);
  if (end - n == 8 && kern == Act8Kernel::kVnni) {
    rows_act8<8>(p, a, n, kern);
    return;
  }
  for (; n + kRowBlock <= end; n += kRowBlock) rows_act8<kRowBlock>(p, a, n, kern);
  for (; n < end; ++n) rows_act8<1>(p, a, n, kern);
}

// woq_linear with act_bits = 8 on `isa`'s kernel, `nthreads` threads (0: OpenMP's default).
inline void linear_act8(const Problem& p, const std::string& isa, int nthreads) {
  check(p, isa);
  const Act8Kernel kern = act8_kernel(isa);
  const Acts a = quantize_acts(p, kern != Act8Kernel::kScalar);
  const int threads = nthreads > 0 ? nthreads : omp_get_max_threads();
  const int64_t blocks = (p.N + kAct8Rows - 1) / kAct8Rows;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) act8_block(p, a, blk, kern);
}

}  // namespace gml_woq
