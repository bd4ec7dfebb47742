"""Dynamic INT8 GEMM: the one definition of ``gml::dynamic_linear``'s math, and its Python kernel.

``gml::dynamic_linear(x, weight, weight_scale, bias, smooth_inv, post_op, ...)`` (docs/ir.md) is a
linear layer with int8 weights (symmetric, one scale per output channel, quantized once by
:func:`quantize_weight`) and int8 activations quantized **per row** (token) at run time by
:func:`quantize_rows`; ``x`` fp32 ``[..., K]`` → fp32 ``[..., N]``:

* ``v = x * smooth_inv`` (SmoothQuant; ``v = x`` without it), one row ``t`` at a time:
  ``amax[t] = max(max_k |v[t, k]|, AMAX_FLOOR)``, ``q_x[t, k] = round_half_even(v[t, k] * (127 / amax[t]))``
  (``127 / amax`` one IEEE fp32 division; ``|q_x| <= 127`` by construction, no clamp);
* ``acc[t, o] = sum_k q_x[t, k] * weight[o, k]`` exactly, in int32;
* ``y[t, o] = post_op(((float(acc) * (weight_scale[o] / 127)) * amax[t]) + bias[o])``, each operation
  one fp32 rounding, in that order — the order oneDNN's matmul applies a per-output-channel weight
  scale, a binary-mul post-op and a binary-add post-op, so the native engine
  (native/dynamic_linear.h, ``DynamicLinearStep``) computes the same integers and the same fp32
  operations. (``weight_scale[o] / 127 * amax[t]`` is ``s_w[o] * s_x[t]`` with
  ``s_x[t] = amax[t] / 127``.)

A row's rounding error is relative to that row's own largest value, never the batch's.
``AMAX_FLOOR`` only matters for an all-zero row (``127 / 0`` would be ``inf`` and ``0 * inf`` NaN):
its ``q_x`` is 0 and its output the bias.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

QMAX = 127
#: Smallest per-row abs-max used as a divisor: ``127 / AMAX_FLOOR`` is finite in fp32.
AMAX_FLOOR = 1e-30
_TINY = torch.finfo(torch.float32).tiny


def quantize_weight(
    weight: torch.Tensor, smooth: torch.Tensor | None = None, qmax: int = QMAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``weight`` ``[N, K]`` (times ``smooth[k]`` per input channel, SmoothQuant) as
    contiguous int8 ``[N, K]``, symmetric, ``scale[o] = max_k |w[o, k]| / qmax`` (fp32 ``[N]``).
    ``qmax``: 127, or 64 on a target without VNNI (``Target.int8``: s8 activations shifted to u8
    then pair with the weights in a saturating int16; ``|w| <= 64`` cannot saturate it, ADR 011)."""
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth[None, :]
    scale = (w.abs().amax(dim=1) / qmax).clamp_min(_TINY)
    q = torch.round(w / scale[:, None]).clamp(-qmax, qmax).to(torch.int8).contiguous()
    return q, scale.contiguous()


def quantize_rows(rows: torch.Tensor, smooth_inv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_x, amax)`` of fp32 ``rows`` ``[M, K]``: int8 ``[M, K]`` and fp32 ``[M, 1]`` (module docstring)."""
    if smooth_inv is not None:
        rows = rows * smooth_inv
    amax = rows.abs().amax(dim=1, keepdim=True).clamp_min_(AMAX_FLOOR)
    inv = torch.full_like(amax, float(QMAX)).div_(amax)  # one fp32 division (not reciprocal() * 127)
    return torch.round(rows * inv).to(torch.int8), amax


#: K-chunk of :func:`int8_matmul`: ``KCHUNK * 127**2 < 2**24``, so every partial sum of a chunk is an
#: integer fp32 holds exactly.
KCHUNK = 1024


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` exactly, int32 ``[M, N]``, for int8 ``a`` ``[M, K]`` (any value) and ``b`` ``[N, K]``
    with every value in ``[-127, 127]`` (what :func:`quantize_rows` / :func:`quantize_weight` produce;
    ``a`` may also be a static linear's ``x − 128``, :mod:`gml.kernels.exact_int8`).

    As fp32 matmuls over chunks of ``KCHUNK`` columns, each chunk's result converted to int32 and the
    chunks summed in int32: a product is at most ``128 * 127`` and a chunk's partial sums at most
    ``1024 * 128 * 127 < 2**24``, so every fp32 value on the way is an integer represented exactly,
    whatever the summation order, FMA or blocking of the matmul kernel — and also in a reduced-precision
    matmul mode (``torch.set_float32_matmul_precision``): int8 values are exact in bf16 / tf32 inputs,
    whose products accumulate in fp32. Not ``torch._int_mm``: on CPUs without VNNI its oneDNN kernel
    adds pairs of products into saturating int16 (wrong sums, issue #23), and it returns wrong sums
    for ``K = 1``."""
    k = a.shape[1]
    bt = b.t()
    acc = None
    for k0 in range(0, k, KCHUNK):
        part = torch.mm(a[:, k0 : k0 + KCHUNK].float(), bt[k0 : k0 + KCHUNK].float()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    return acc


def apply_post_op(y: torch.Tensor, post_op: str, algorithm: str) -> torch.Tensor:
    """The fused activation of a ``dynamic_linear`` (in place on ``y``): ``none``, ``relu``, ``gelu``."""
    if post_op == "none":
        return y
    if post_op == "relu":
        return y.relu_()
    if post_op == "gelu":
        return F.gelu(y, approximate="tanh" if algorithm == "tanh" else "none")
    raise ValueError(f"dynamic_linear: post_op {post_op!r} is not one of none, relu, gelu")


POST_OPS = ("none", "relu", "gelu")


def float_linear(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``gml::dynamic_linear`` without its run-time rounding (:func:`dynamic_linear` with float
    activations): the int8 weights dequantized (``w · s_w``). A stand-in for the fp32 model a loaded
    INT8 file no longer has: both INT8 paths are an activation rounding away from it (gml.io.load)."""
    return dynamic_linear(*args, **kwargs, round_activations=False)


def dynamic_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    smooth_inv: torch.Tensor | None,
    post_op: str = "none",
    post_op_scalars: list[float] | tuple[float, ...] = (),
    post_op_algorithm: str = "",
    *,
    round_activations: bool = True,
) -> torch.Tensor:
    """The Python kernel of ``gml::dynamic_linear`` (module docstring): :func:`int8_matmul` on the int8
    rows. ``round_activations=False``: the rows stay float (:func:`float_linear`)."""
    shape = x.shape
    n, k = weight.shape
    if shape[-1] != k:
        raise ValueError(f"dynamic_linear: input has {shape[-1]} features, the weight {k}")
    if round_activations:
        q_x, amax = quantize_rows(x.reshape(-1, k).float(), smooth_inv)
        acc = int8_matmul(q_x, weight)
        y = torch.mul(acc, weight_scale / QMAX).mul_(amax)  # float(acc) * (s_w / 127), then * amax: two roundings
    else:
        rows = x.reshape(-1, k).float()
        rows = rows * smooth_inv if smooth_inv is not None else rows
        y = rows @ (weight.float() * weight_scale.reshape(-1, 1)).T
    if bias is not None:
        y.add_(bias)
    return apply_post_op(y, post_op, post_op_algorithm).reshape(*shape[:-1], n)
