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

#define GML_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// gcc 12's AVX-512 headers start some intrinsics from an "undefined" register (`__Y = __Y`), which
// -Wall at -O3 reports as maybe-uninitialized (a known false positive); silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace gml_attention {

// One operand: element pointer, strides (elements) per batch dim (0 broadcast), row stride, column
// stride (1 for Q / K / V / O; a mask may have 0: one value per row).
struct Operand {
  const void* data = nullptr;
  std::vector<int64_t> batch_strides;
  int64_t row = 0, col = 1;
};

struct Problem {
  std::vector<int64_t> batch;  // batch dims (the output's)
  int64_t L = 0, S = 0, E = 0, Ev = 0;
  float scale = 1.0f;
  Operand q, k, v, out;
  std::vector<Operand> masks;  // fp32
};

// True when this CPU runs the kernel (AVX512-BF16 and the AVX-512 subsets above).
inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// The shapes the kernel takes (the caller falls back to the primitive path otherwise).
inline bool shape_supported(int64_t E, int64_t Ev) { return E > 0 && E % 2 == 0 && Ev > 0; }

// exp(x - m) for x <= m (a score minus its row max), given m·log2(e), accurate to 2.9e-6 relative:
// the probabilities are rounded to bf16 (2^-9 relative) next, so a degree-4 polynomial is enough.
// t = x log2(e) - m log2(e) (one FMA) = n + f, n = round(t), |f| <= 1/2; 2^f by a polynomial, 2^n
// by vscalefps. t is clamped at -160 first (a masked score is -FLT_MAX, whose product with log2(e)
// would overflow): below t = -149, p 2^n rounds to 0 in fp32; between -126 and -149 it is an fp32
// denormal, which the bf16 conversion (vcvtneps2bf16 reads denormals as 0) makes 0 too — a masked
// key weighs exactly 0.
GML_AVX512BF16 inline __m512 exp_minus_max(__m512 x, __m512 m_log2e) {
  __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), m_log2e);
  t = _mm512_max_ps(t, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  // relative minimax fit (Lawson) of 2^f with p(0) = 1: max relative error 2.9e-6 on |f| <= 1/2
  __m512 p = _mm512_set1_ps(0.009582853f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055906426f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312418f));
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

// Scores of NR query rows x NJ key vectors (16 keys each) starting at key j0:
//   sc[r][j0 + 16 jv + lane] = sum_p dot2(Q[r, 2p..2p+1], Kp[p][j0 + 16 jv + lane]).
template <int NR, int NJ>
GML_AVX512BF16 inline void scores_tile(const uint16_t* q, int64_t q_row, const uint32_t* kp, int64_t sp, int64_t pairs,
                                       int64_t j0, float* sc, int64_t sc_row, Epilogue& ep) {
  __m512 acc[NR][NJ];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) b[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + p * sp + j0 + 16 * j));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(load_pair(q + r * q_row + 2 * p))));
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
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

// O rows (NR) x ND output vectors starting at column d0: sum over key pairs of P's pair x Vp.
// ``evp``: Vp's row stride (the value head size rounded up to 16, zero padded); ``ev``: the head size
// (the last vector's lanes past it are not stored).
template <int NR, int ND>
GML_AVX512BF16 inline void pv_tile(const uint16_t* pr, int64_t p_row, const uint32_t* vp, int64_t evp, int64_t ev,
                                   int64_t kpairs, int64_t d0, const float* row_scale, uint16_t* o, int64_t o_row) {
  __m512 acc[NR][ND];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d) acc[r][d] = _mm512_setzero_ps();
  for (int64_t q = 0; q < kpairs; ++q) {
    __m512bh b[ND];
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d) b[d] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + q * evp + d0 + 16 * d));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(load_pair(pr + r * p_row + 2 * q))));
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], a, b[d]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int d = 0; d < ND; ++d) {
      const int64_t left = ev - (d0 + 16 * d);
      const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      store_bf16(o + r * o_row + d0 + 16 * d, _mm512_mul_ps(acc[r][d], _mm512_set1_ps(row_scale[r])), m);
    }
}

template <int NR>
GML_AVX512BF16 void scores_rows(const uint16_t* q, int64_t q_row, const uint32_t* kp, int64_t sp, int64_t pairs,
                                float* sc, Epilogue& ep) {
  int64_t j0 = 0;
  for (; j0 + 64 <= sp; j0 += 64) scores_tile<NR, 4>(q, q_row, kp, sp, pairs, j0, sc, sp, ep);
  switch ((sp - j0) / 16) {
    case 3: scores_tile<NR, 3>(q, q_row, kp, sp, pairs, j0, sc, sp, ep); break;
    case 2: scores_tile<NR, 2>(q, q_row, kp, sp, pairs, j0, sc, sp, ep); break;
    case 1: scores_tile<NR, 1>(q, q_row, kp, sp, pairs, j0, sc, sp, ep); break;
    default: break;
  }
}

template <int NR>
GML_AVX512BF16 void pv_rows(const uint16_t* p, int64_t p_row, const uint32_t* vp, int64_t evp, int64_t ev,
                            int64_t kpairs, const float* row_scale, uint16_t* o, int64_t o_row) {
  int64_t d0 = 0;
  for (; d0 + 64 <= evp; d0 += 64) pv_tile<NR, 4>(p, p_row, vp, evp, ev, kpairs, d0, row_scale, o, o_row);
  switch ((evp - d0) / 16) {
    case 3: pv_tile<NR, 3>(p, p_row, vp, evp, ev, kpairs, d0, row_scale, o, o_row); break;
    case 2: pv_tile<NR, 2>(p, p_row, vp, evp, ev, kpairs, d0, row_scale, o, o_row); break;
    case 1: pv_tile<NR, 1>(p, p_row, vp, evp, ev, kpairs, d0, row_scale, o, o_row); break;
    default: break;
  }
}

// Softmax of one score row, unnormalized: x = scale * s + masks over the first S keys (already
// in ``sc`` with its max ``prepared_max`` when the scores tile's epilogue computed them);
// p[j] = exp(x - max) rounded to bf16 (keys S..Sp-1 get 0); returns 1 / sum_j exp(x - max) (the fp32
// values), by which P·V's row is multiplied: O = (e V) / sum equals (e / sum) V with the division
// moved after the matrix product (one multiply per output instead of one per key). A row whose max
// is at or below -1e30 has every key masked (-FLT_MAX, or -inf for two masks summed): at that
// magnitude a score no longer changes the sum (an fp32 ulp of 1e30 is 7e22), so the row's values
// are equal and its weights uniform, as the primitive path gives for a fully masked row.
GML_AVX512BF16 inline float softmax_row(float* sc, int64_t S, int64_t sp, const float* prepared_max, float scale,
                                        const float* const* mrow, const int64_t* mcol, int nmask, uint16_t* p) {
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
  if (mx <= -1e30f) {  // every key masked: the scores are below the mask's resolution, all equal
    for (int64_t j = 0; j < S; ++j) sc[j] = 0.0f;  // (and mx * log2(e) would overflow): uniform
    mx = 0.0f;
  }
  const __m512 vm = _mm512_set1_ps(mx * 1.44269504088896341f);
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= S; j += 16) {
    const __m512 e = exp_minus_max(_mm512_loadu_ps(sc + j), vm);
    vsum = _mm512_add_ps(vsum, e);
    store_bf16(p + j, e);
  }
  for (; j < sp; j += 16) {  // the last keys and the zero padding
    const __mmask16 m = S > j ? static_cast<__mmask16>((1u << (S - j)) - 1) : 0;
    const __m512 e = _mm512_maskz_mov_ps(m, exp_minus_max(_mm512_loadu_ps(sc + j), vm));
    vsum = _mm512_add_ps(vsum, e);
    store_bf16(p + j, e);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// Per-thread work buffers (grown, never shrunk).
struct Scratch {
  std::vector<uint32_t> kp, vp;
  std::vector<float> sc;
  std::vector<uint16_t> p;
};

// One batch index: pointers already offset to it.
GML_AVX512BF16 inline void attend_one(const Problem& pb, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      uint16_t* o, const std::vector<const float*>& mask_base, Scratch& w) {
  constexpr int kRows = 4;
  const int64_t L = pb.L, S = pb.S, E = pb.E, Ev = pb.Ev;
  const int64_t sp = (S + 15) / 16 * 16, pairs = E / 2, kpairs = sp / 2, evp = (Ev + 15) / 16 * 16;
  w.kp.resize(static_cast<size_t>(pairs * sp));
  w.vp.resize(static_cast<size_t>(kpairs * evp));
  w.sc.resize(static_cast<size_t>(kRows * sp));
  w.p.resize(static_cast<size_t>(kRows * sp));
  // pack K (pairs along E) and V (pairs along keys), zero padding to sp keys
  // K: 16 keys' pair p in one gather (byte offsets j * row * 2 fit int32: checked by the caller)
  const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(2 * pb.k.row)));
  for (int64_t j = 0; j < sp; j += 16) {
    const __mmask16 m = S - j >= 16 ? 0xFFFF : (S > j ? static_cast<__mmask16>((1u << (S - j)) - 1) : 0);
    const uint16_t* kj = k + j * pb.k.row;
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(w.kp.data() + p * sp + j,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, lane, kj + 2 * p, 1));
  }
  for (int64_t qq = 0; qq < kpairs; ++qq) {
    const int64_t j = 2 * qq;
    const uint16_t* v0 = j < S ? v + j * pb.v.row : nullptr;
    const uint16_t* v1 = j + 1 < S ? v + (j + 1) * pb.v.row : nullptr;
    uint32_t* dst = w.vp.data() + qq * evp;
    for (int64_t d = 0; d < evp; d += 16) {  // the head size's tail is read masked, zero padded
      const __mmask16 m = Ev - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (Ev - d)) - 1);
      const __m256i a = v0 ? _mm256_maskz_loadu_epi16(m, v0 + d) : _mm256_setzero_si256();
      const __m256i b = v1 ? _mm256_maskz_loadu_epi16(m, v1 + d) : _mm256_setzero_si256();
      // interleave 16 + 16 bf16 into 16 pairs (a[i], b[i])
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(idx, ab));
    }
  }
  const int nmask = static_cast<int>(pb.masks.size());
  std::vector<const float*> mrow(nmask);
  std::vector<int64_t> mcol(nmask);
  for (int i = 0; i < nmask; ++i) mcol[i] = pb.masks[i].col;
  for (int64_t r0 = 0; r0 < L; r0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, L - r0));
    const uint16_t* qr = q + r0 * pb.q.row;
    Epilogue ep;
    ep.prepared = nmask == 0 || (nmask == 1 && mcol[0] == 1);
    ep.scale = pb.scale;
    ep.S = S;
    for (int r = 0; r < kRows; ++r) {
      ep.vmax[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      ep.mask[r] = nmask == 1 && r < nr ? mask_base[0] + (r0 + r) * pb.masks[0].row : nullptr;
    }
    switch (nr) {
      case 4: scores_rows<4>(qr, pb.q.row, w.kp.data(), sp, pairs, w.sc.data(), ep); break;
      case 3: scores_rows<3>(qr, pb.q.row, w.kp.data(), sp, pairs, w.sc.data(), ep); break;
      case 2: scores_rows<2>(qr, pb.q.row, w.kp.data(), sp, pairs, w.sc.data(), ep); break;
      default: scores_rows<1>(qr, pb.q.row, w.kp.data(), sp, pairs, w.sc.data(), ep); break;
    }
    float inv[kRows];
    for (int r = 0; r < nr; ++r) {
      for (int i = 0; i < nmask; ++i) mrow[i] = mask_base[i] + (r0 + r) * pb.masks[i].row;
      const float mx = ep.prepared ? _mm512_reduce_max_ps(ep.vmax[r]) : 0.0f;
      inv[r] = softmax_row(w.sc.data() + r * sp, S, sp, ep.prepared ? &mx : nullptr, pb.scale, mrow.data(), mcol.data(),
                           nmask, w.p.data() + r * sp);
    }
    uint16_t* orow = o + r0 * pb.out.row;
    switch (nr) {
      case 4: pv_rows<4>(w.p.data(), sp, w.vp.data(), evp, Ev, kpairs, inv, orow, pb.out.row); break;
      case 3: pv_rows<3>(w.p.data(), sp, w.vp.data(), evp, Ev, kpairs, inv, orow, pb.out.row); break;
      case 2: pv_rows<2>(w.p.data(), sp, w.vp.data(), evp, Ev, kpairs, inv, orow, pb.out.row); break;
      default: pv_rows<1>(w.p.data(), sp, w.vp.data(), evp, Ev, kpairs, inv, orow, pb.out.row); break;
    }
  }
}

// The whole problem: batch indices split over the OpenMP team.
GML_AVX512BF16 inline void run(const Problem& pb) {
  int64_t nb = 1;
  for (int64_t d : pb.batch) nb *= d;
  const int rank = static_cast<int>(pb.batch.size());
  auto offset = [&](const Operand& op, int64_t i) {  // batch index i -> element offset
    int64_t off = 0;
    for (int d = rank - 1; d >= 0; --d) {
      off += (i % pb.batch[d]) * op.batch_strides[d];
      i /= pb.batch[d];
    }
    return off;
  };
#pragma omp parallel for schedule(static) if (nb > 1 && pb.L * pb.S >= 4096)
  for (int64_t i = 0; i < nb; ++i) {
    thread_local Scratch w;
    std::vector<const float*> mb(pb.masks.size());
    for (size_t m = 0; m < pb.masks.size(); ++m)
      mb[m] = static_cast<const float*>(pb.masks[m].data) + offset(pb.masks[m], i);
    attend_one(pb, static_cast<const uint16_t*>(pb.q.data) + offset(pb.q, i),
               static_cast<const uint16_t*>(pb.k.data) + offset(pb.k, i),
               static_cast<const uint16_t*>(pb.v.data) + offset(pb.v, i),
               static_cast<uint16_t*>(const_cast<void*>(pb.out.data)) + offset(pb.out, i), mb, w);
  }
}

}  // namespace gml_attention

#pragma GCC diagnostic pop
