// GML engine: fused fp32 attention for CPUs with AVX2 + FMA (docs/adr/009-fused-bf16-attention.md,
// the session-22 amendment). The problem is attention.h's (attention_problem.h):
//
//   O = softmax(scale * Q Kᵀ + mask_1 + ... + mask_m) V        per batch index, fp32 throughout
//
// Why: below AVX-512 oneDNN 3.2's f32 matmul is gemm:jit, which takes no binary post-op, so the
// three-primitive path of an attention layer is five or more steps (Q·Kᵀ, the mask add, softmax, P·V,
// dense copies of heads read from the merged QKV output). With a short sentence (11 tokens) each of
// them is a few microseconds of work behind a primitive call, and a transformer's plan is mostly such
// steps. Here one step per layer reads Q / K / V in place (any row and batch strides, unit columns),
// keeps a block of 4 query rows' scores in L1 from Q·Kᵀ through softmax to P·V, and writes O.
//
// The math is the primitive path's: scores accumulated in fp32 (FMA), scale and masks added in fp32,
// softmax with its max subtracted (exp: gml_avx2::exp_neg, ~1e-7 relative), O = (Σ_j e_j V_j) / Σ_j e_j
// (the division after the product: one multiply per output, not one per key). A row whose every key
// is masked weighs its keys equally, or comes out as zeros where SDPA gives zeros (attention_problem.h,
// zero_row). A NaN in a score makes its row NaN.
//
// Layout: Kᵀ [E][Sp] is packed once per batch index (Sp: S rounded up to 8, the padding zero and never
// read past S); Q rows are broadcast one element at a time, Kᵀ and V rows read as 8-float vectors.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_problem.h"
#include "avx2_math.h"

#define GML_ATTN_AVX2 __attribute__((target("avx2,fma")))
// The tile helpers are always inlined: a call would keep the accumulators in memory.
#define GML_ATTN_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

namespace gml_attention_avx2 {

using gml_attention::Problem;

// True when this CPU runs the kernel.
inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

constexpr int kRows = 4;  // query rows per block (4 x 2 vectors of accumulators + 2 loads + 1 broadcast <= 16 ymm)

// Scores of NR query rows x NJ vectors of 8 keys from key j0: sc[r][j0 + 8 j + lane] = Q[r] · K[j0 + 8 j + lane].
template <int NR, int NJ>
GML_ATTN_AVX2_INLINE void scores_tile(const float* q, int64_t q_row, const float* kt, int64_t sp, int64_t e, int64_t j0,
                                      float* sc) {
  __m256 acc[NR][NJ];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < e; ++d) {
    __m256 b[NJ];
#pragma GCC unroll 2
    for (int j = 0; j < NJ; ++j) b[j] = _mm256_loadu_ps(kt + d * sp + j0 + 8 * j);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m256 a = _mm256_broadcast_ss(q + r * q_row + d);
#pragma GCC unroll 2
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NJ; ++j) _mm256_storeu_ps(sc + r * sp + j0 + 8 * j, acc[r][j]);
}

template <int NR>
GML_ATTN_AVX2 void scores_rows(const float* q, int64_t q_row, const float* kt, int64_t sp, int64_t e, float* sc) {
  int64_t j0 = 0;
  for (; j0 + 16 <= sp; j0 += 16) scores_tile<NR, 2>(q, q_row, kt, sp, e, j0, sc);
  if (j0 < sp) scores_tile<NR, 1>(q, q_row, kt, sp, e, j0, sc);
}

// O rows (NR) x ND vectors of 8 output columns from column d0: (Σ_j P[r, j] V[j, d0..]) * row_scale[r],
// V read in place; columns at or past ``ev`` are neither read nor written.
template <int NR, int ND>
GML_ATTN_AVX2_INLINE void pv_tile(const float* p, int64_t p_row, const float* v, int64_t v_row, int64_t keys, int64_t ev,
                                  int64_t d0, const float* row_scale, float* o, int64_t o_row) {
  __m256i m[ND];
#pragma GCC unroll 2
  for (int d = 0; d < ND; ++d) m[d] = gml_avx2::lanes_below(ev - d0 - 8 * d);
  const bool whole = ev - d0 >= 8 * ND;
  __m256 acc[NR][ND];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int d = 0; d < ND; ++d) acc[r][d] = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m256 b[ND];
    const float* vj = v + j * v_row + d0;
#pragma GCC unroll 2
    for (int d = 0; d < ND; ++d) b[d] = whole ? _mm256_loadu_ps(vj + 8 * d) : _mm256_maskload_ps(vj + 8 * d, m[d]);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m256 a = _mm256_broadcast_ss(p + r * p_row + j);
#pragma GCC unroll 2
      for (int d = 0; d < ND; ++d) acc[r][d] = _mm256_fmadd_ps(a, b[d], acc[r][d]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const __m256 s = _mm256_set1_ps(row_scale[r]);
#pragma GCC unroll 2
    for (int d = 0; d < ND; ++d) {
      const __m256 y = _mm256_mul_ps(acc[r][d], s);
      if (whole) _mm256_storeu_ps(o + r * o_row + d0 + 8 * d, y);
      else _mm256_maskstore_ps(o + r * o_row + d0 + 8 * d, m[d], y);
    }
  }
}

template <int NR>
GML_ATTN_AVX2 void pv_rows(const float* p, int64_t p_row, const float* v, int64_t v_row, int64_t keys, int64_t ev,
                           const float* row_scale, float* o, int64_t o_row) {
  int64_t d0 = 0;
  for (; d0 + 16 <= ev; d0 += 16) pv_tile<NR, 2>(p, p_row, v, v_row, keys, ev, d0, row_scale, o, o_row);
  if (d0 < ev) {
    if (ev - d0 > 8) pv_tile<NR, 2>(p, p_row, v, v_row, keys, ev, d0, row_scale, o, o_row);
    else pv_tile<NR, 1>(p, p_row, v, v_row, keys, ev, d0, row_scale, o, o_row);
  }
}

// One score row: x = scale * s + masks over its S keys (in place), then e = exp(x - max x) in place;
// returns 1 / Σ e. ``mrow[i]`` is mask i's row for this query row, ``mcol[i]`` its column stride.
GML_ATTN_AVX2 inline float softmax_row(float* sc, int64_t S, float scale, const float* const* mrow, const int64_t* mcol,
                                       int nmask, bool zero_masked) {
  const __m256 vs = _mm256_set1_ps(scale);
  const float inf = std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(-inf), vnan = _mm256_setzero_ps();
  for (int64_t j = 0; j < S; j += 8) {
    const int64_t n = std::min<int64_t>(8, S - j);
    const __m256i lanes = gml_avx2::lanes_below(n);
    __m256 x = _mm256_mul_ps(_mm256_maskload_ps(sc + j, lanes), vs);
    for (int i = 0; i < nmask; ++i) {
      if (mcol[i] == 1) {
        x = _mm256_add_ps(x, _mm256_maskload_ps(mrow[i] + j, lanes));
      } else if (mcol[i] == 0) {
        x = _mm256_add_ps(x, _mm256_set1_ps(mrow[i][0]));
      } else {
        alignas(32) float t[8] = {};
        for (int64_t l = 0; l < n; ++l) t[l] = mrow[i][(j + l) * mcol[i]];
        x = _mm256_add_ps(x, _mm256_load_ps(t));
      }
    }
    x = _mm256_blendv_ps(_mm256_set1_ps(-inf), x, _mm256_castsi256_ps(lanes));  // lanes past S: -inf
    _mm256_maskstore_ps(sc + j, lanes, x);
    vmax = _mm256_max_ps(vmax, x);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // vmaxps drops a NaN operand
  }
  float mx = _mm256_movemask_ps(vnan) ? std::numeric_limits<float>::quiet_NaN() : gml_avx2::hmax(vmax);
  const bool zero = gml_attention::zero_row(mx, zero_masked);
  if (mx <= gml_attention::kFullyMasked) {  // every key masked: uniform weights (attention_problem.h)
    for (int64_t j = 0; j < S; ++j) sc[j] = 0.0f;
    mx = 0.0f;
  }
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < S; j += 8) {
    const __m256i lanes = gml_avx2::lanes_below(S - j);
    // lanes past S read -inf (exp: 0), so they add nothing to the sum
    const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(-inf), _mm256_maskload_ps(sc + j, lanes), _mm256_castsi256_ps(lanes));
    const __m256 e = gml_avx2::exp_neg(_mm256_sub_ps(x, vm));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_maskstore_ps(sc + j, lanes, e);
  }
  return zero ? 0.0f : 1.0f / gml_avx2::hsum(vsum);
}

// Per-thread work buffers (grown, never shrunk).
struct Scratch {
  std::vector<float> kt;  // Kᵀ [E][sp]
  std::vector<float> sc;  // kRows score rows of sp, overwritten by their exp
};

// One batch index: pointers already offset to it.
GML_ATTN_AVX2 inline void attend_one(const Problem& pb, const float* q, const float* k, const float* v, float* o,
                                     const std::vector<const float*>& mask_base, Scratch& w) {
  const int64_t L = pb.L, S = pb.S, E = pb.E, Ev = pb.Ev, sp = (S + 7) / 8 * 8;
  w.kt.assign(static_cast<size_t>(E * sp), 0.0f);
  for (int64_t j = 0; j < S; ++j) {  // Kᵀ: key rows are contiguous, so the reads stream
    const float* kj = k + j * pb.k.row;
    for (int64_t d = 0; d < E; ++d) w.kt[static_cast<size_t>(d * sp + j)] = kj[d];
  }
  w.sc.resize(static_cast<size_t>(kRows * sp));
  const int nmask = static_cast<int>(pb.masks.size());
  std::vector<const float*> mrow(nmask);
  std::vector<int64_t> mcol(nmask);
  for (int i = 0; i < nmask; ++i) mcol[i] = pb.masks[i].col;
  float* sc = w.sc.data();
  for (int64_t r0 = 0; r0 < L; r0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, L - r0));
    const float* qr = q + r0 * pb.q.row;
    switch (nr) {
      case 4: scores_rows<4>(qr, pb.q.row, w.kt.data(), sp, E, sc); break;
      case 3: scores_rows<3>(qr, pb.q.row, w.kt.data(), sp, E, sc); break;
      case 2: scores_rows<2>(qr, pb.q.row, w.kt.data(), sp, E, sc); break;
      default: scores_rows<1>(qr, pb.q.row, w.kt.data(), sp, E, sc); break;
    }
    float inv[kRows];
    for (int r = 0; r < nr; ++r) {
      for (int i = 0; i < nmask; ++i) mrow[i] = mask_base[i] + (r0 + r) * pb.masks[i].row;
      inv[r] = softmax_row(sc + r * sp, S, pb.scale, mrow.data(), mcol.data(), nmask, pb.zero_masked_rows);
    }
    float* orow = o + r0 * pb.out.row;
    switch (nr) {
      case 4: pv_rows<4>(sc, sp, v, pb.v.row, S, Ev, inv, orow, pb.out.row); break;
      case 3: pv_rows<3>(sc, sp, v, pb.v.row, S, Ev, inv, orow, pb.out.row); break;
      case 2: pv_rows<2>(sc, sp, v, pb.v.row, S, Ev, inv, orow, pb.out.row); break;
      default: pv_rows<1>(sc, sp, v, pb.v.row, S, Ev, inv, orow, pb.out.row); break;
    }
  }
  _mm256_zeroupper();  // GCC emits no vzeroupper at the end of target("avx2") functions
}

// The whole problem (fp32 q / k / v / out): batch indices split over the OpenMP team.
inline void run(const Problem& pb) {
  gml_attention::for_each_batch(pb, [&](const char* q, const char* k, const char* v, char* o,
                                        const std::vector<const float*>& mb) {
    thread_local Scratch w;
    attend_one(pb, reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),
               reinterpret_cast<const float*>(v), reinterpret_cast<float*>(o), mb, w);
  });
}

}  // namespace gml_attention_avx2
