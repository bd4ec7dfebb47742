"""The ``gml`` INT8 ops without activation rounding: a float stand-in for the fp32 model.

A lowered INT8 graph computes ``fp32 model + weight rounding + activation rounding + saturation``.
Two executors of it (the Python kernels of :mod:`gml.kernels.int8_ops` and the native engine) may
disagree beyond one quantization step: a value that lands near a rounding boundary after float
operations that round differently (a requantize multiplier applied in another order, a fused
epilogue) flips by one step, and a deep graph carries the flip on. ``gml.quantize`` accepts such an
engine when it is as close to the fp32 model as the Python executor (:mod:`gml.runtime.select`); a
saved INT8 file has no fp32 model, so :mod:`gml.io` measures both against this stand-in instead.

Each function here takes the arguments of its op (docs/ir.md) and computes the op's math on real
values, with the weights dequantized (``w · s_w``, exactly as the kernels read them) and **no
rounding of activations**: a tensor the INT8 graph carries as ``q`` with ``(scale, zp)`` is carried
here as ``(q - zp) · scale`` in float. A uint8 output is clamped to what its qparams can hold
(``[(0 - zp) · s, (255 - zp) · s]``): saturation is part of the INT8 graph's math, rounding is not.
So ``quantize`` is a clamp, ``dequantize`` the identity, and every plain op between them (reshape,
flatten, getitem, cat of float values) runs on the float values unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gml.ir.library import SCHEMAS
from gml.ir.values import PostOp
from gml.kernels.dynamic_int8 import float_linear


def _clamp(y: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """``y`` limited to the real values a uint8 tensor with ``(scale, zero_point)`` can hold."""
    return y.clamp((0 - zero_point) * scale, (255 - zero_point) * scale)


def _out(y: torch.Tensor, scale: float, zero_point: int, out_dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return _clamp(y, scale, zero_point) if out_dtype == torch.uint8 else y


def _weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The int8 weight dequantized: ``w[o, ...] · s_w[o]`` (one scale per output channel, or one)."""
    scale = weight_scale.float().reshape(-1, *([1] * (weight.dim() - 1)))
    return weight.float() * scale


def _conv(x, weight, weight_scale, bias, stride, padding, dilation, groups) -> torch.Tensor:
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[weight.dim()]
    w = _weight(weight, weight_scale)
    return conv(x.float(), w, bias, list(stride), list(padding), list(dilation), groups)


def quantize(x, out_scale, out_zero_point):
    return _clamp(x.float(), out_scale, out_zero_point)


def dequantize(x, x_scale, x_zero_point):
    return x


def requantize(x, x_scale, x_zero_point, out_scale, out_zero_point):
    return _clamp(x, out_scale, out_zero_point)


def qconv(
    x, x_scale, x_zero_point, weight, weight_scale, bias, stride, padding, dilation, groups,
    out_scale, out_zero_point, out_dtype, post_op, post_op_scalars, post_op_algorithm, backend="onednn",
):  # fmt: skip
    y = _conv(x, weight, weight_scale, bias, stride, padding, dilation, groups)
    y = PostOp(post_op, tuple(s for s in post_op_scalars if s is not None), post_op_algorithm).apply(y)
    return _out(y, out_scale, out_zero_point, out_dtype)


def qconv_add(
    x, x_scale, x_zero_point, weight, weight_scale, bias, stride, padding, dilation, groups,
    other, other_scale, other_zero_point, out_scale, out_zero_point, post_op, backend="onednn",
):  # fmt: skip
    y = _conv(x, weight, weight_scale, bias, stride, padding, dilation, groups) + other
    return _clamp(y.relu() if post_op == "relu" else y, out_scale, out_zero_point)


def qlinear(
    x, x_scale, x_zero_point, weight, weight_scale, bias, out_scale, out_zero_point, out_dtype,
    post_op, post_op_scalars, post_op_algorithm, backend="onednn",
):  # fmt: skip
    y = F.linear(x.float(), _weight(weight, weight_scale), bias)
    y = PostOp(post_op, tuple(s for s in post_op_scalars if s is not None), post_op_algorithm).apply(y)
    return _out(y, out_scale, out_zero_point, out_dtype)


def qadd(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale, out_zero_point, post_op, backend="onednn"):
    y = a + b
    return _clamp(y.relu() if post_op == "relu" else y, out_scale, out_zero_point)


def qmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale, out_zero_point, backend="onednn"):
    return _clamp(a * b, out_scale, out_zero_point)


def qactivation(x, x_scale, x_zero_point, op, scalars, out_scale, out_zero_point, backend="onednn"):
    y = PostOp(op, tuple(s for s in scalars if s is not None)).apply(x)
    return _clamp(y, out_scale, out_zero_point)


def qmax_pool(x, x_scale, x_zero_point, kernel_size, stride, padding, dilation, ceil_mode, backend="onednn"):
    pool = F.max_pool3d if len(kernel_size) == 3 else F.max_pool2d
    return pool(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode)


def qavg_pool2d(
    x, x_scale, x_zero_point, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
    out_scale, out_zero_point, backend="onednn",
):  # fmt: skip
    y = F.avg_pool2d(x, list(kernel_size), list(stride), list(padding), ceil_mode, count_include_pad, divisor_override)
    return _clamp(y, out_scale, out_zero_point)


def qadaptive_avg_pool(x, x_scale, x_zero_point, output_size, out_scale, out_zero_point, backend="onednn"):
    pool = F.adaptive_avg_pool3d if len(output_size) == 3 else F.adaptive_avg_pool2d
    return _clamp(pool(x, list(output_size)), out_scale, out_zero_point)


def qbatch_norm(
    x, x_scale, x_zero_point, weight, bias, running_mean, running_var, eps, out_scale, out_zero_point, post_op,
    backend="onednn",
):  # fmt: skip
    y = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
    return _clamp(y.relu() if post_op == "relu" else y, out_scale, out_zero_point)


def qmean(x, x_scale, x_zero_point, dim, keepdim, out_scale, out_zero_point, backend="onednn"):
    return _clamp(x.mean(list(dim), keepdim), out_scale, out_zero_point)


def qcat(xs, x_scales, x_zero_points, dim, out_scale, out_zero_point, backend="onednn"):
    return _clamp(torch.cat(list(xs), dim), out_scale, out_zero_point)


#: op name -> its float stand-in: the function of this module named after the op (the INT8 table of
#: gml.ir.library), and ``float_linear`` for the dynamic GEMM (its math lives in gml.kernels.dynamic_int8)
FLOAT: dict[str, Callable[..., Any]] = {
    name: float_linear if name == "dynamic_linear" else globals()[name] for name in SCHEMAS
}
