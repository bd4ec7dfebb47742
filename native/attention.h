// GML engine: fused bf16 attention for CPUs with AVX512-BF16 (docs/adr/009-fused-bf16-attention.md).
//
//   O = softmax(scale * Q Kᵀ + mask_1 + ... + mask_m) V        per batch index (batch dims broadcast)
//
// Q [L, E], K [S, E], V [S, Ev] and O [L, Ev] are bf16 with unit last-dim stride and any row / batch
// strides (heads read in place from the merged QKV projection: no head copies); masks are additive
// fp32 with any strides (0 along a broadcast dim). The math is the one the three-primitive path
// (matmul → softmax → matmul, transformer_rules.emit_attention) does: scores accumulated in fp32 by
// vdpbf16ps, scale and masks added in fp32, softmax in fp32 (max subtracted), the probabilities
// rounded to bf16 (round to nearest even), P·V accumulated in fp32 and rounded to bf16 once.
//
// Why a kernel of our own: at 128 tokens and head size 32 the three primitives spend as long in
// oneDNN's softmax pass (110 µs per MiniLM layer, a round trip of the fp32 scores through memory) and
// in three head copies as in the two matmuls; here a block of 4 query rows keeps its scores in L1
// from Q·Kᵀ through softmax to P·V.
//
// Layout. vdpbf16ps multiplies pairs along the reduction dim, so each operand read as a vector is
// packed once per (batch index) into "VNNI" pairs, 32-bit words:
//   Kp[p][j]  = (K[j, 2p], K[j, 2p+1])           S·Qᵀ: vector over keys j, Q's pair broadcast
//   Vp[q][d]  = (V[2q, d], V[2q+1, d])           P·V:  vector over d, P's pair broadcast
// Keys are padded with zeros to a multiple of 16 (Sp); padded keys are masked out of the softmax.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_problem.h"  // Problem, Operand, for_each_batch

#define GML_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// gcc 12's AVX-512 headers start some intrinsics from an "undefined" register (`__Y = __Y`), which
// -Wall at -O3 reports as maybe-uninitialized (a known false positive); silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace gml_attention {

// True when this CPU runs the kernel (AVX512-BF16 and the AVX-512 subsets above).
inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// The shapes the kernel takes (the caller falls back to the primitive path otherwise).
inline bool shape_supported(int64_t E, int64_t Ev, bool f32) { return E > 0 && (f32 || E % 2 == 0) && Ev > 0; }

// exp(x - m) for x <= m (a score minus its row max), given m·log2(e). bf16: accurate to 2.9e-6
// relative, the probabilities are rounded to bf16 (2^-8 relative) next, so a degree-4 polynomial is
// enough; fp32: degree 5, 1.9e-7.
// t = x log2(e) - m log2(e) (one FMA) = n + f, n = round(t), |f| <= 1/2; 2^f by a polynomial, 2^n
// by vscalefps. t is clamped at -160 first (a masked score is -FLT_MAX, whose product with log2(e)
// would overflow): below t = -149, p 2^n rounds to 0 in fp32; between -126 and -149 it is an fp32
// denormal, which the bf16 conversion (vcvtneps2bf16 reads denormals as 0) makes 0 too — a masked
// key weighs exactly 0.
template <bool kBf16>
GML_AVX512BF16 inline __m512 exp_minus_max(__m512 x, __m512 m_log2e) {
  __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), m_log2e);
  t = _mm512_max_ps(t, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (kBf16) {  // relative minimax fit (Lawson) of 2^f, p(0) = 1: 2.9e-6 on |f| <= 1/2
    p = _mm512_set1_ps(0.009582853f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055906426f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312418f));
  } else {  // fp32 attention: degree 5, 1.9e-7 (about 3 fp32 ulps)
    p = _mm512_set1_ps(0.0013264727f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009671513f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055507336f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022242f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

GML_AVX512BF16 inline void store_bf16(uint16_t* dst, __m512 x, __mmask16 m = 0xFFFF) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));  // round to nearest even
  _mm256_mask_storeu_epi16(dst, m, h);
}

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// What a scores tile does to its fp32 accumulators before storing them. With ``prepared``, the
// common case (no mask, or one mask whose rows are contiguous), x = scale * s + mask is computed
// here, while the scores are in registers, and each row's running max is kept (lanes of ``vmax``);
// otherwise the raw scores are stored and softmax_row() applies scale and masks.
struct Epilogue {
  bool prepared = false;
  float scale = 1.0f;
  const float* mask[4] = {};  // per row: the mask row (unit stride), or nullptr
  __m512 vmax[4];
  int64_t S = 0;  // keys; padded keys are left out of the max
};

// Stores a tile's scores: raw, or (``prepared``) scaled and masked with the running row max kept.
template <int NR, int NJ>
GML_AVX512BF16 inline void tile_epilogue(__m512 (&acc)[NR][NJ], int64_t j0, float* sc, int64_t sc_row, Epilogue& ep) {
  if (!ep.prepared) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(sc + r * sc_row + j0 + 16 * j, acc[r][j]);
    return;
  }
  const __m512 vs = _mm512_set1_ps(ep.scale);
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j) {
    const int64_t k0 = j0 + 16 * j;
    const __mmask16 valid = ep.S - k0 >= 16 ? 0xFFFF : (ep.S > k0 ? static_cast<__mmask16>((1u << (ep.S - k0)) - 1) : 0);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m512 x = _mm512_mul_ps(acc[r][j], vs);
      if (ep.mask[r]) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(valid, ep.mask[r] + k0));
      _mm512_storeu_ps(sc + r * sc_row + k0, x);
      ep.vmax[r] = _mm512_mask_max_ps(ep.vmax[r], valid, ep.vmax[r], x);
    }
  }
}

// The tile helpers below are always inlined: a call would keep the accumulators in memory.
#define GML_ATTN_INLINE __attribute__((always_inline)) inline

template <int NR, int NJ>
GML_AVX512BF16 GML_ATTN_INLINE void zero_tile(__m512 (&acc)[NR][NJ]) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
}

// The products' one inner loop, for both S = Q Kᵀ (A = Q, B = Kp) and O = P V (A = P, B = Vp):
//   acc[r][j] = sum over steps p of dot2(A[r, 2p..2p+1], B[p][c0 + 16 j .. c0 + 16 j + 15]),
// A bf16 rows ``a_row`` apart, B VNNI-packed bf16 pairs ``b_row`` apart; fp32 accumulation.
template <int NR, int NJ>
GML_AVX512BF16 GML_ATTN_INLINE void dot_tile(const uint16_t* a, int64_t a_row, const uint32_t* b, int64_t b_row,
                                             int64_t steps, int64_t c0, __m512 (&acc)[NR][NJ]) {
  zero_tile<NR, NJ>(acc);
  for (int64_t p = 0; p < steps; ++p) {
    __m512bh bv[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) bv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * b_row + c0 + 16 * j));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(load_pair(a + r * a_row + 2 * p))));
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
}

// Scores of NR query rows x NJ key vectors (16 keys each) starting at key j0:
//   sc[r][j0 + 16 jv + lane] = sum_p dot2(Q[r, 2p..2p+1], Kp[p][j0 + 16 jv + lane]).
template <int NR, int NJ>
GML_AVX512BF16 inline void scores_tile(const uint16_t* q, int64_t q_row, const uint32_t* kp, int64_t sp, int64_t pairs,
                                       int64_t j0, float* sc, int64_t sc_row, Epilogue& ep) {
  __m512 acc[NR][NJ];
  dot_tile<NR, NJ>(q, q_row, kp, sp, pairs, j0, acc);
  tile_epilogue<NR, NJ>(acc, j0, sc, sc_row, ep);
}

// Scores of NR query rows x NJ key vectors for fp32: Kt[d][j] = K[j, d], q[r, d] broadcast.
template <int NR, int NJ>
GML_AVX512BF16 inline void scores_tile_f32(const float* q, int64_t q_row, const float* kt, int64_t sp, int64_t e,
                                           int64_t j0, float* sc, int64_t sc_row, Epilogue& ep) {
  __m512 acc[NR][NJ];
  zero_tile<NR, NJ>(acc);
  for (int64_t d = 0; d < e; ++d) {
    __m512 b[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) b[j] = _mm512_loadu_ps(kt + d * sp + j0 + 16 * j);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 a = _mm512_set1_ps(q[r * q_row + d]);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  tile_epilogue<NR, NJ>(acc, j0, sc, sc_row, ep);
}

// The lanes of an output row's vector d (columns d0 + 16 d ..) that lie before its end ``ev``.
inline __mmask16 row_tail_mask(int64_t ev, int64_t d0, int d) {
  const int64_t left = ev - (d0 + 16 * d);
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// O rows (NR) x ND output vectors starting at column d0: sum over key pairs of P's pair x Vp.
// ``evp``: Vp's row stride (the value head size rounded up to 16, zero padded); ``ev``: the head size
// (the last vector's lanes past it are not stored).
template <int NR, int ND>
GML_AVX512BF16 inline void pv_tile(const uint16_t* pr, int64_t p_row, const uint32_t* vp, int64_t evp, int64_t ev,
                                   int64_t kpairs, int64_t d0, const float* row_scale, uint16_t* o, int64_t o_row) {
  __m512 acc[NR][ND];
  dot_tile<NR, ND>(pr, p_row, vp, evp, kpairs, d0, acc);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d)
      store_bf16(o + r * o_row + d0 + 16 * d, _mm512_mul_ps(acc[r][d], _mm512_set1_ps(row_scale[r])),
                 row_tail_mask(ev, d0, d));
}

// O rows (NR) x ND output vectors for fp32: sum over keys j of P[r, j] (broadcast) x V[j, d0..]
// (V read in place, its row's tail masked past ``ev``).
template <int NR, int ND>
GML_AVX512BF16 inline void pv_tile_f32(const float* pr, int64_t p_row, const float* v, int64_t v_row, int64_t keys,
                                       int64_t ev, int64_t d0, const float* row_scale, float* o, int64_t o_row) {
  __m512 acc[NR][ND];
  __mmask16 m[ND];
#pragma GCC unroll 4
  for (int d = 0; d < ND; ++d) m[d] = row_tail_mask(ev, d0, d);
  zero_tile<NR, ND>(acc);
  for (int64_t j = 0; j < keys; ++j) {
    __m512 b[ND];
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d) b[d] = _mm512_maskz_loadu_ps(m[d], v + j * v_row + d0 + 16 * d);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 a = _mm512_set1_ps(pr[r * p_row + j]);
#pragma GCC unroll 4
      for (int d = 0; d < ND; ++d) acc[r][d] = _mm512_fmadd_ps(a, b[d], acc[r][d]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d)
      _mm512_mask_storeu_ps(o + r * o_row + d0 + 16 * d, m[d], _mm512_mul_ps(acc[r][d], _mm512_set1_ps(row_scale[r])));
}

// The operands one dtype's tiles read (bf16: VNNI-packed pairs; fp32: Kᵀ and V in place).
struct Packed {
  const void* q;
  int64_t q_row;
  const void* k;  // bf16: Kp [E/2][sp] pairs; fp32: Kt [E][sp]
  int64_t depth;  // bf16: E/2 pairs; fp32: E
  const void* v;  // bf16: Vp [sp/2][evp] pairs; fp32: V rows in place
  int64_t v_row;  // bf16: evp; fp32: V's row stride
  int64_t keys;   // bf16: sp/2 key pairs; fp32: S keys
};

template <int NR, int NJ, bool kF32>
GML_AVX512BF16 inline void any_scores_tile(const Packed& pk, int64_t sp, int64_t j0, float* sc, Epilogue& ep) {
  if constexpr (kF32)
    scores_tile_f32<NR, NJ>(static_cast<const float*>(pk.q), pk.q_row, static_cast<const float*>(pk.k), sp, pk.depth,
                            j0, sc, sp, ep);
  else
    scores_tile<NR, NJ>(static_cast<const uint16_t*>(pk.q), pk.q_row, static_cast<const uint32_t*>(pk.k), sp,
                        pk.depth, j0, sc, sp, ep);
}

template <int NR, bool kF32>
GML_AVX512BF16 void scores_rows(const Packed& pk, int64_t sp, float* sc, Epilogue& ep) {
  int64_t j0 = 0;
  for (; j0 + 64 <= sp; j0 += 64) any_scores_tile<NR, 4, kF32>(pk, sp, j0, sc, ep);
  switch ((sp - j0) / 16) {
    case 3: any_scores_tile<NR, 3, kF32>(pk, sp, j0, sc, ep); break;
    case 2: any_scores_tile<NR, 2, kF32>(pk, sp, j0, sc, ep); break;
    case 1: any_scores_tile<NR, 1, kF32>(pk, sp, j0, sc, ep); break;
    default: break;
  }
}

template <int NR, int ND, bool kF32>
GML_AVX512BF16 inline void any_pv_tile(const Packed& pk, const void* p, int64_t p_row, int64_t ev, int64_t d0,
                                       const float* row_scale, void* o, int64_t o_row) {
  if constexpr (kF32)
    pv_tile_f32<NR, ND>(static_cast<const float*>(p), p_row, static_cast<const float*>(pk.v), pk.v_row, pk.keys, ev, d0,
                        row_scale, static_cast<float*>(o), o_row);
  else
    pv_tile<NR, ND>(static_cast<const uint16_t*>(p), p_row, static_cast<const uint32_t*>(pk.v), pk.v_row, ev, pk.keys,
                    d0, row_scale, static_cast<uint16_t*>(o), o_row);
}

template <int NR, bool kF32>
GML_AVX512BF16 void pv_rows(const Packed& pk, const void* p, int64_t p_row, int64_t ev, const float* row_scale, void* o,
                            int64_t o_row) {
  const int64_t evp = (ev + 15) / 16 * 16;
  int64_t d0 = 0;
  for (; d0 + 64 <= evp; d0 += 64) any_pv_tile<NR, 4, kF32>(pk, p, p_row, ev, d0, row_scale, o, o_row);
  switch ((evp - d0) / 16) {
    case 3: any_pv_tile<NR, 3, kF32>(pk, p, p_row, ev, d0, row_scale, o, o_row); break;
    case 2: any_pv_tile<NR, 2, kF32>(pk, p, p_row, ev, d0, row_scale, o, o_row); break;
    case 1: any_pv_tile<NR, 1, kF32>(pk, p, p_row, ev, d0, row_scale, o, o_row); break;
    default: break;
  }
}

// Softmax of one score row, unnormalized: x = scale * s + masks over the first S keys (already
// in ``sc`` with its max ``prepared_max`` when the scores tile's epilogue computed them);
// p[j] = exp(x - max) (bf16: rounded; fp32: ``p`` may be ``sc`` itself), keys S..Sp-1 get 0; returns
// 1 / sum_j exp(x - max) (the fp32 values), by which P·V's row is multiplied: O = (e V) / sum equals
// (e / sum) V with the division moved after the matrix product (one multiply per output instead of
// one per key). A row whose every key is masked (attention_problem.h, zero_row) gets uniform
// weights, and returns 0 where SDPA gives zeros (``zero_masked``: a bool mask, or an all -inf row).
template <bool kF32>
GML_AVX512BF16 inline float softmax_row(float* sc, int64_t S, int64_t sp, const float* prepared_max, float scale,
                                        const float* const* mrow, const int64_t* mcol, int nmask, void* p,
                                        bool zero_masked) {
  float mx;
  if (prepared_max) {
    mx = *prepared_max;
  } else {
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 m = S - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (S - j)) - 1);
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc + j), vs);
      for (int i = 0; i < nmask; ++i) {
        if (mcol[i] == 1) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, mrow[i] + j));
        else if (mcol[i] == 0) x = _mm512_add_ps(x, _mm512_set1_ps(mrow[i][0]));
        else {
          alignas(64) float t[16] = {};
          for (int64_t l = 0; l < std::min<int64_t>(16, S - j); ++l) t[l] = mrow[i][(j + l) * mcol[i]];
          x = _mm512_add_ps(x, _mm512_load_ps(t));
        }
      }
      _mm512_storeu_ps(sc + j, x);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, x);
    }
    mx = _mm512_reduce_max_ps(vmax);
  }
  const bool zero = zero_row(mx, zero_masked);
  if (mx <= kFullyMasked) {  // every key masked (see above): uniform weights
    for (int64_t j = 0; j < S; ++j) sc[j] = 0.0f;
    mx = 0.0f;
  }
  const __m512 vm = _mm512_set1_ps(mx * 1.44269504088896341f);
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= S; j += 16) {
    const __m512 e = exp_minus_max<!kF32>(_mm512_loadu_ps(sc + j), vm);
    vsum = _mm512_add_ps(vsum, e);
    if constexpr (kF32) _mm512_storeu_ps(static_cast<float*>(p) + j, e);
    else store_bf16(static_cast<uint16_t*>(p) + j, e);
  }
  for (; j < sp; j += 16) {  // the last keys and the zero padding
    const __mmask16 m = S > j ? static_cast<__mmask16>((1u << (S - j)) - 1) : 0;
    const __m512 e = _mm512_maskz_mov_ps(m, exp_minus_max<!kF32>(_mm512_loadu_ps(sc + j), vm));
    vsum = _mm512_add_ps(vsum, e);
    if constexpr (kF32) _mm512_storeu_ps(static_cast<float*>(p) + j, e);
    else store_bf16(static_cast<uint16_t*>(p) + j, e);
  }
  return zero ? 0.0f : 1.0f / _mm512_reduce_add_ps(vsum);
}

// Per-thread work buffers (grown, never shrunk).
struct Scratch {
  std::vector<uint32_t> kp, vp;  // bf16 pairs
  std::vector<float> kt;         // fp32 Kᵀ
  std::vector<float> sc;
  std::vector<uint16_t> p;  // bf16 probabilities (fp32 ones are written over the scores)
};

// K / V of one batch index in the layout the tiles read, zero padded to sp keys.
// bf16: Kp by one masked gather per 16 keys and pair (byte offsets j * row * 2 fit int32: checked
// by the caller), Vp by one permute per 16 values; fp32: Kᵀ by one gather per 16 keys and dim.
template <bool kF32>
GML_AVX512BF16 inline Packed pack(const Problem& pb, const void* q, const void* k, const void* v, Scratch& w) {
  const int64_t S = pb.S, E = pb.E, Ev = pb.Ev, sp = (S + 15) / 16 * 16;
  const int64_t item = kF32 ? 4 : 2;
  const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(item * pb.k.row)));
  const int64_t depth = kF32 ? E : E / 2;  // 32-bit words per key row that the scores read
  uint32_t* kw = nullptr;
  if constexpr (kF32) {
    w.kt.resize(static_cast<size_t>(depth * sp));
    kw = reinterpret_cast<uint32_t*>(w.kt.data());
  } else {
    w.kp.resize(static_cast<size_t>(depth * sp));
    kw = w.kp.data();
  }
  for (int64_t j = 0; j < sp; j += 16) {
    const __mmask16 m = S - j >= 16 ? 0xFFFF : (S > j ? static_cast<__mmask16>((1u << (S - j)) - 1) : 0);
    const char* kj = static_cast<const char*>(k) + j * pb.k.row * item;
    for (int64_t d = 0; d < depth; ++d)
      _mm512_storeu_si512(kw + d * sp + j, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, lane, kj + 4 * d, 1));
  }
  if constexpr (kF32) {
    return Packed{q, pb.q.row, w.kt.data(), depth, v, pb.v.row, S};
  } else {
    const int64_t kpairs = sp / 2, evp = (Ev + 15) / 16 * 16;
    w.vp.resize(static_cast<size_t>(kpairs * evp));
    const uint16_t* vb = static_cast<const uint16_t*>(v);
    for (int64_t qq = 0; qq < kpairs; ++qq) {
      const int64_t j = 2 * qq;
      const uint16_t* v0 = j < S ? vb + j * pb.v.row : nullptr;
      const uint16_t* v1 = j + 1 < S ? vb + (j + 1) * pb.v.row : nullptr;
      uint32_t* dst = w.vp.data() + qq * evp;
      for (int64_t d = 0; d < evp; d += 16) {  // the head size's tail is read masked, zero padded
        const __mmask16 m = Ev - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (Ev - d)) - 1);
        const __m256i a = v0 ? _mm256_maskz_loadu_epi16(m, v0 + d) : _mm256_setzero_si256();
        const __m256i b = v1 ? _mm256_maskz_loadu_epi16(m, v1 + d) : _mm256_setzero_si256();
        // interleave 16 + 16 bf16 into 16 pairs (a[i], b[i])
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                             6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(idx, ab));
      }
    }
    return Packed{q, pb.q.row, w.kp.data(), depth, w.vp.data(), evp, kpairs};
  }
}

// One batch index: pointers already offset to it.
template <bool kF32>
GML_AVX512BF16 inline void attend_one(const Problem& pb, const void* q, const void* k, const void* v, void* o,
                                      const std::vector<const float*>& mask_base, Scratch& w) {
  constexpr int kRows = 4;
  const int64_t L = pb.L, S = pb.S, Ev = pb.Ev, sp = (S + 15) / 16 * 16;
  const int64_t item = kF32 ? 4 : 2;
  Packed pk = pack<kF32>(pb, q, k, v, w);
  w.sc.resize(static_cast<size_t>(kRows * sp));
  if constexpr (!kF32) w.p.resize(static_cast<size_t>(kRows * sp));
  const int nmask = static_cast<int>(pb.masks.size());
  std::vector<const float*> mrow(nmask);
  std::vector<int64_t> mcol(nmask);
  for (int i = 0; i < nmask; ++i) mcol[i] = pb.masks[i].col;
  for (int64_t r0 = 0; r0 < L; r0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, L - r0));
    Packed rows = pk;
    rows.q = static_cast<const char*>(q) + r0 * pb.q.row * item;
    Epilogue ep;
    ep.prepared = nmask == 0 || (nmask == 1 && mcol[0] == 1);
    ep.scale = pb.scale;
    ep.S = S;
    for (int r = 0; r < kRows; ++r) {
      ep.vmax[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      ep.mask[r] = nmask == 1 && r < nr ? mask_base[0] + (r0 + r) * pb.masks[0].row : nullptr;
    }
    switch (nr) {
      case 4: scores_rows<4, kF32>(rows, sp, w.sc.data(), ep); break;
      case 3: scores_rows<3, kF32>(rows, sp, w.sc.data(), ep); break;
      case 2: scores_rows<2, kF32>(rows, sp, w.sc.data(), ep); break;
      default: scores_rows<1, kF32>(rows, sp, w.sc.data(), ep); break;
    }
    void* probs = kF32 ? static_cast<void*>(w.sc.data()) : static_cast<void*>(w.p.data());
    float inv[kRows];
    for (int r = 0; r < nr; ++r) {
      for (int i = 0; i < nmask; ++i) mrow[i] = mask_base[i] + (r0 + r) * pb.masks[i].row;
      const float mx = ep.prepared ? _mm512_reduce_max_ps(ep.vmax[r]) : 0.0f;
      inv[r] = softmax_row<kF32>(w.sc.data() + r * sp, S, sp, ep.prepared ? &mx : nullptr, pb.scale, mrow.data(),
                                 mcol.data(), nmask, static_cast<char*>(probs) + r * sp * item, pb.zero_masked_rows);
    }
    void* orow = static_cast<char*>(o) + r0 * pb.out.row * item;
    switch (nr) {
      case 4: pv_rows<4, kF32>(pk, probs, sp, Ev, inv, orow, pb.out.row); break;
      case 3: pv_rows<3, kF32>(pk, probs, sp, Ev, inv, orow, pb.out.row); break;
      case 2: pv_rows<2, kF32>(pk, probs, sp, Ev, inv, orow, pb.out.row); break;
      default: pv_rows<1, kF32>(pk, probs, sp, Ev, inv, orow, pb.out.row); break;
    }
  }
}

// The whole problem: batch indices split over the OpenMP team.
GML_AVX512BF16 inline void run(const Problem& pb) {
  for_each_batch(pb, [&](const char* q, const char* k, const char* v, char* o, const std::vector<const float*>& mb) {
    thread_local Scratch w;
    if (pb.f32) attend_one<true>(pb, q, k, v, o, mb, w);
    else attend_one<false>(pb, q, k, v, o, mb, w);
  });
}

}  // namespace gml_attention

#pragma GCC diagnostic pop
