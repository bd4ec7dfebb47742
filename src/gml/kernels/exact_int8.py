"""GML's exact static INT8 linear: the one definition of ``gml::qlinear(..., backend="gml")``'s math,
and its Python kernel (docs/adr/011-int8-on-every-isa.md, 2026-11-29 amendment).

On a CPU without a VNNI-class dot product oneDNN's (and fbgemm's) u8×s8 kernels add pairs of
products into a saturating int16, so 8-bit weights give wrong sums there; the static scheme's
convs take 7-bit weights instead (``Target.int8``). A linear layer keeps its 8-bit weights (in
``[-127, 127]``) and runs on GML's own exact AVX2 GEMM (native/int8_gemm_avx2.h, the step in
native/qlinear_exact.h), which multiplies ``|x − 128|`` by ``w·sign(x − 128)``: a pair is at most
``2·128·127 = 32,512``, exact in int16. Its math, ``x`` uint8 ``[..., K]`` with ``(s_x, z_x)``,
``weight`` int8 ``[N, K]``, ``s_w`` one scale per output channel (or one), ``b`` the bias:

* ``acc[m, n] = Σ_k (x[m, k] − 128) · w[n, k]``, exactly (int32);
* ``y = (float(acc) · scale[n]) + bias[n]``, two fp32 roundings, with the constants of
  :func:`epilogue` (float64, rounded to fp32 once): ``scale[n] = s_x · s_w[n]`` and
  ``bias[n] = b[n] + s_x · s_w[n] · (128 − z_x) · Σ_k w[n, k]`` (the source zero point folded:
  ``Σ (x − z_x) w = Σ (x − 128) w + (128 − z_x) Σ w``);
* ``y = max(y, 0)`` for ``post_op="relu"`` (the only post-op it takes);
* fp32 output ``y``, or uint8 ``clamp(round_half_even(y · inv) + z_out, 0, 255)`` with
  ``inv = fp32(1 / s_out)``, each operation in fp32.

The engine computes the same integers and the same fp32 operations in the same order, so the two
executors agree bit for bit (``tests/runtime/test_exact_qlinear.py``); against exact integer
arithmetic the only differences are the fp32 roundings of the epilogue.
"""

from __future__ import annotations

import torch

from gml.kernels.dynamic_int8 import int8_matmul

#: The post-ops the exact linear fuses (others keep the oneDNN kernel at 7-bit weights).
POST_OPS = ("none", "relu")
#: Its weight range: symmetric 8 bits without -128 (``|w| <= 127``: ``w·sign`` never wraps).
WEIGHT_QMAX = 127


def epilogue(
    x_scale: float, x_zero_point: int, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, bias)``: the fp32 ``[N]`` constants of the epilogue (module docstring), computed in
    float64 and rounded once. The engine is given these very values."""
    n = weight.shape[0]
    s = float(x_scale) * weight_scale.detach().double().reshape(-1).expand(n)
    colsum = weight.detach().to(torch.float64).sum(1)
    b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.detach().double().reshape(n)
    folded = b + s * (128 - int(x_zero_point)) * colsum
    return s.float().contiguous(), folded.float().contiguous()


def out_inverse(out_scale: float) -> float:
    """``fp32(1 / s_out)``: the uint8 output's multiplier (one float64 division, rounded once)."""
    return float(torch.tensor(1.0 / float(out_scale), dtype=torch.float64).float())


def check_weight(weight: torch.Tensor) -> None:
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"gml.qlinear (backend gml): a {weight.dtype} {weight.dim()}-D weight, not int8 [N, K]")
    if weight.numel() and int(weight.min()) < -WEIGHT_QMAX:
        raise ValueError("gml.qlinear (backend gml): weights must lie in [-127, 127] (a -128 was found)")


def qlinear(
    x: torch.Tensor,
    x_scale: float,
    x_zero_point: int,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_scale: float,
    out_zero_point: int,
    out_dtype: torch.dtype,
    post_op: str,
) -> torch.Tensor:
    """The Python kernel of ``gml::qlinear(..., backend="gml")`` (module docstring)."""
    check_weight(weight)
    if post_op not in POST_OPS:
        raise ValueError(f"gml.qlinear (backend gml): post_op {post_op!r} is not one of {', '.join(POST_OPS)}")
    n, k = weight.shape
    if x.dtype != torch.uint8 or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"gml.qlinear: a {x.dtype} input of shape {tuple(x.shape)} for a [{n}, {k}] weight")
    shifted = (x.reshape(-1, k).to(torch.int16) - 128).to(torch.int8)  # x − 128 in [-128, 127]
    acc = int8_matmul(shifted, weight)
    scale, folded = epilogue(x_scale, x_zero_point, weight, weight_scale, bias)
    y = acc.to(torch.float32).mul_(scale).add_(folded)  # two fp32 roundings, as the engine's
    if post_op == "relu":
        y.clamp_min_(0.0)
    y = y.reshape(*x.shape[:-1], n)
    if out_dtype == torch.float32:
        return y
    q = torch.round(y.mul_(out_inverse(out_scale))).add_(float(out_zero_point)).clamp_(0.0, 255.0)
    return q.to(torch.uint8)


__all__ = ["POST_OPS", "WEIGHT_QMAX", "check_weight", "epilogue", "out_inverse", "qlinear"]
