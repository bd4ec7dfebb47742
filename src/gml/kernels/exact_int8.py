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
arithmetic the only differences are the fp32 roundings of the epilogue. Where the native engine is
built, this kernel runs the engine's own layer code (:class:`Prepared`): the torch formulation
below (exact fp32 chunks) took 6.9 ms for a 4096 → 1000 head and 481 ms for 25088 → 4096 at batch 1,
oneDNN's 7-bit kernel 0.26 / 7.6 ms; the tests hold both formulations to the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Prepared:
    """A layer's derived state for given input qparams: the epilogue constants and, where the native
    engine is built and the CPU has AVX2, its packed ``ExactLinear`` (native/qlinear_exact.h: the
    engine step's own code, so a shape the engine refuses runs as fast in the Python executor).
    Without it, the integer sums are :func:`int8_matmul`'s exact fp32 chunks: the same integers."""

    scale: torch.Tensor
    bias: torch.Tensor
    native: Any | None


def _native_layer(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> Any | None:
    from gml.runtime.native import _load

    engine, _ = _load()
    cls = getattr(engine, "ExactLinear", None) if engine is not None else None
    if cls is None:
        return None
    w = weight.contiguous()
    try:
        return cls(w.data_ptr(), w.shape[0], w.shape[1], scale.tolist(), bias.tolist())
    except ValueError:  # no AVX2 on this CPU, or K beyond int32's bound: the torch path
        return None


def prepare(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_scale: float,
    x_zero_point: int,
    *,
    native: bool = True,
) -> Prepared:
    """The layer's :class:`Prepared` state (``native=False``: the torch path only, as tests compare)."""
    check_weight(weight)
    scale, folded = epilogue(x_scale, x_zero_point, weight, weight_scale, bias)
    return Prepared(scale, folded, _native_layer(weight, scale, folded) if native else None)


def run(
    prep: Prepared,
    weight: torch.Tensor,
    x: torch.Tensor,
    out_scale: float,
    out_zero_point: int,
    out_dtype: torch.dtype,
    post_op: str,
) -> torch.Tensor:
    """The layer on ``x`` (module docstring) with ``prep`` made for this weight and ``x``'s qparams."""
    if post_op not in POST_OPS:
        raise ValueError(f"gml.qlinear (backend gml): post_op {post_op!r} is not one of {', '.join(POST_OPS)}")
    n, k = weight.shape
    if x.dtype != torch.uint8 or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"gml.qlinear: a {x.dtype} input of shape {tuple(x.shape)} for a [{n}, {k}] weight")
    rows = x.reshape(-1, k).contiguous()
    to_u8 = out_dtype != torch.float32
    if prep.native is not None:
        out = torch.empty(rows.shape[0], n, dtype=torch.uint8 if to_u8 else torch.float32)
        inv = out_inverse(out_scale) if to_u8 else 1.0
        prep.native.run(
            rows.data_ptr(), rows.shape[0], out.data_ptr(), to_u8, post_op == "relu", inv, int(out_zero_point)
        )
        return out.reshape(*x.shape[:-1], n)
    shifted = (rows.to(torch.int16) - 128).to(torch.int8)  # x − 128 in [-128, 127]
    acc = int8_matmul(shifted, weight)
    y = acc.to(torch.float32).mul_(prep.scale).add_(prep.bias)  # two fp32 roundings, as the engine's
    if post_op == "relu":
        y.clamp_min_(0.0)
    y = y.reshape(*x.shape[:-1], n)
    if not to_u8:
        return y
    q = torch.round(y.mul_(out_inverse(out_scale))).add_(float(out_zero_point)).clamp_(0.0, 255.0)
    return q.to(torch.uint8)


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
    *,
    native: bool = True,
) -> torch.Tensor:
    """The Python kernel of ``gml::qlinear(..., backend="gml")`` (module docstring), unprepared (the
    op's registered kernel caches :func:`prepare` per weight: gml.kernels.int8_ops)."""
    prep = prepare(weight, weight_scale, bias, x_scale, x_zero_point, native=native)
    return run(prep, weight, x, out_scale, out_zero_point, out_dtype, post_op)


__all__ = [
    "POST_OPS",
    "WEIGHT_QMAX",
    "Prepared",
    "check_weight",
    "epilogue",
    "out_inverse",
    "prepare",
    "qlinear",
    "run",
]
