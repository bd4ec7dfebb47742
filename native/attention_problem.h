// GML engine: one attention problem as GML's fused attention kernels take it (attention.h: AVX-512,
// bf16 or fp32; attention_avx2.h: AVX2 + FMA, fp32), and the loop over its batch indices.
//
//   O = softmax(scale * Q Kᵀ + mask_1 + ... + mask_m) V        per batch index (batch dims broadcast)
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace gml_attention {

// One operand: element pointer, strides (elements) per batch dim (0 broadcast), row stride, column
// stride (1 for Q / K / V / O; a mask may have 0: one value per row).
struct Operand {
  const void* data = nullptr;
  std::vector<int64_t> batch_strides;
  int64_t row = 0, col = 1;
};

struct Problem {
  bool f32 = false;            // fp32 q / k / v / out (else bf16)
  std::vector<int64_t> batch;  // batch dims (the output's)
  int64_t L = 0, S = 0, E = 0, Ev = 0;
  float scale = 1.0f;
  Operand q, k, v, out;
  std::vector<Operand> masks;  // fp32
  bool zero_masked_rows = false;  // a fully masked row is zeros for every mask (a bool mask's rule)
};

// A query row whose every key is masked: its score max is at or below kFullyMasked (-FLT_MAX from a
// bool mask, torch.finfo.min from a transformers float mask, -inf). At that magnitude a score no
// longer changes the sum (an fp32 ulp of 1e30 is 7e22), so softmax's weights are uniform and P·V is
// the mean of the values: what SDPA gives for a finite additive mask. SDPA (torch >= 2.5) gives
// zeros for a row masked by a bool mask or by -inf: the kernels then scale the row's P·V by 0
// (zero_row). The bool mask is converted to -FLT_MAX before the kernel sees it, so the step says so
// (Problem::zero_masked_rows, set by the Python side for a bool mask).
constexpr float kFullyMasked = -1e30f;

inline bool zero_row(float row_max, bool zero_masked_rows) {
  return row_max <= kFullyMasked && (zero_masked_rows || row_max == -std::numeric_limits<float>::infinity());
}

// Calls fn(q, k, v, o, masks) once per batch index with the pointers offset to it; the indices are
// split over the OpenMP team when there are several and each is big enough to be worth a thread.
// ``fn`` keeps its own per-thread buffers.
template <class Fn>
void for_each_batch(const Problem& pb, Fn&& fn) {
  int64_t nb = 1;
  for (int64_t d : pb.batch) nb *= d;
  const int rank = static_cast<int>(pb.batch.size());
  const int64_t item = pb.f32 ? 4 : 2;
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
    std::vector<const float*> mb(pb.masks.size());
    for (size_t m = 0; m < pb.masks.size(); ++m)
      mb[m] = static_cast<const float*>(pb.masks[m].data) + offset(pb.masks[m], i);
    const char* q = static_cast<const char*>(pb.q.data) + offset(pb.q, i) * item;
    const char* k = static_cast<const char*>(pb.k.data) + offset(pb.k, i) * item;
    const char* v = static_cast<const char*>(pb.v.data) + offset(pb.v, i) * item;
    char* o = static_cast<char*>(const_cast<void*>(pb.out.data)) + offset(pb.out, i) * item;
    fn(q, k, v, o, mb);
  }
}

}  // namespace gml_attention
