"""Graph → engine translation: ONE table, one entry per lowered op (how to read its attributes).

Each entry of :data:`RULES` maps a lowered module type (``src/gml/quant/modules.py``) to

* ``check(module) -> reason | None``: shape-independent; a reason keeps the node in torch (the
  runtime report prints it);
* ``emit(builder, module, inputs, output)``: the engine steps for one input shape, written with the
  :class:`~gml.runtime.plan.Builder` calls (conv, inner_product, reorder, pool, binary, concat, alias,
  share). It may raise :class:`Unsupported` for a shape the engine cannot take (the segment then runs
  in torch for that shape).

Quantization convention (the Python executor's): ``real = (q - zero_point) * scale`` on uint8.
When the lowered graph becomes ``torch.ops.gml.*`` calls (issue #12), only this file changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gml.kernels import fp32
from gml.kernels.backend import QParams, clamp_bounds
from gml.kernels.fp32 import PostOp
from gml.quant import modules as qm

if TYPE_CHECKING:
    from gml.runtime.plan import Builder, Val

QP = tuple[float, int] | None
Eltwise = list[tuple[str, float, float]]


class Unsupported(Exception):
    """The engine has no kernel for this node (or this shape of it); the message says why."""


def qp(q: QParams | None) -> QP:
    return None if q is None else (float(q.scale), int(q.zero_point))


def eltwise_of(post_op: PostOp) -> Eltwise:
    """A fused post-op as oneDNN eltwise ``(algorithm, alpha, beta)`` entries."""
    a, s = post_op.attr, post_op.scalars
    if a == "none":
        return []
    if a == "relu":
        return [("relu", 0.0, 0.0)]
    if a == "hardtanh":
        return [("clip", float(s[0]), float(s[1]))]
    if a == "hardswish":
        return [("hardswish", 1.0 / 6.0, 0.5)]
    if a == "swish":
        return [("swish", 1.0, 0.0)]
    if a == "sigmoid":
        return [("logistic", 0.0, 0.0)]
    if a == "tanh":
        return [("tanh", 0.0, 0.0)]
    if a == "leaky_relu":
        return [("relu", float(s[0]), 0.0)]
    if a == "gelu":
        return [("gelu_tanh" if post_op.algorithm == "tanh" else "gelu_erf", 0.0, 0.0)]
    raise Unsupported(f"post-op {post_op} has no oneDNN eltwise form")


def requant_eltwise(src: QParams, dst: QParams) -> Eltwise:
    """``q_dst = (q_src - z_src) * s_src / s_dst + z_dst`` as one ``linear`` post-op ([] if equal)."""
    if src.close_to(dst):
        return []
    alpha = src.scale / dst.scale
    return [("linear", alpha, dst.zero_point - src.zero_point * alpha)]


def _pad_right(size: int, out: int, kernel: int, stride: int, dilation: int, pad_left: int) -> int:
    """oneDNN's right padding that makes ``out`` outputs (PyTorch floors / ceils, oneDNN is explicit)."""
    return (out - 1) * stride + (kernel - 1) * dilation + 1 - size - pad_left


def _spatial(v: Val) -> tuple[int, ...]:
    return v.shape[2:]


# ---------------------------------------------------------------- conv / linear
def _check_conv(mod: nn.Module) -> str | None:
    if type(mod) is qm.QConv1d:
        return "1-D INT8 conv (unsqueezed to 2-D in the Python executor) is not planned yet"
    if mod.weight.dim() != 4:
        return f"{mod.weight.dim()}-D conv weight (the engine plans 2-D convs)"
    return None


def _emit_conv(b: Builder, mod: Any, ins: list[Val], out: Val, *, sum_with: Val | None = None) -> None:
    x = ins[0]
    if x.dtype_name != "u8" or len(x.shape) != 4:
        raise Unsupported(f"conv input {x.dtype_name} rank {len(x.shape)} (expects uint8 NHWC)")
    spec = mod.spec
    k = tuple(mod.weight.shape[2:])
    pad_r = [
        _pad_right(_spatial(x)[i], _spatial(out)[i], k[i], spec.stride[i], spec.dilation[i], spec.padding[i])
        for i in range(2)
    ]
    post = mod.post_op if hasattr(mod, "post_op") else qm.NO_POST_OP
    eltwise = eltwise_of(post) if not isinstance(mod, qm.QConv2dAdd) else ([("relu", 0.0, 0.0)] if mod.relu else [])
    b.conv(
        x,
        out,
        weight=mod.weight,
        w_scales=mod.weight_scale,
        bias=mod.bias,
        stride=spec.stride,
        dilation=tuple(d - 1 for d in spec.dilation),
        pad_l=spec.padding,
        pad_r=pad_r,
        groups=spec.groups,
        src_q=qp(mod.input_qparams),
        dst_q=qp(mod.output_qparams),
        sum_q=None if sum_with is None else qp(mod.other_qparams),
        eltwise=eltwise,
    )


def _emit_conv_add(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    # relu?(conv(x) + other) with oneDNN's ``sum`` post-op, accumulated in place into the skip
    # buffer: the output shares other's memory (the builder copies other first only if it is still
    # read later or belongs to the caller).
    b.share(out, ins[1])
    _emit_conv(b, mod, ins[:1], out, sum_with=ins[1])


def _emit_linear(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if len(x.shape) != 2:
        raise Unsupported(f"INT8 linear on a rank-{len(x.shape)} input (the engine plans 2-D inner products)")
    # oneDNN 3.2's inner product takes no source zero point: fold it into the bias,
    # s_x * s_w[o] * sum_i (x_i - z) w[o, i] = s_x * s_w[o] * sum_i x_i w[o, i] - s_x * s_w[o] * z * sum_i w[o, i].
    in_q, out_q = mod.input_qparams, mod.output_qparams
    eltwise = eltwise_of(mod.post_op)
    if out_q is not None and out_q.zero_point:  # nor a destination one: add z * s_out before the division
        eltwise.append(("linear", 1.0, out_q.zero_point * out_q.scale))
    bias = mod.bias.double() if mod.bias is not None else torch.zeros(mod.weight.shape[0], dtype=torch.float64)
    if in_q.zero_point:
        w_sum = mod.weight.double().sum(1)
        bias = bias - in_q.scale * mod.weight_scale.double() * in_q.zero_point * w_sum
    b.inner_product(
        x,
        out,
        weight=mod.weight,
        w_scales=mod.weight_scale,
        bias=bias.float(),
        src_q=(float(in_q.scale), 0),
        dst_q=None if out_q is None else (float(out_q.scale), 0),
        eltwise=eltwise,
    )


# ---------------------------------------------------------------- element-wise / pooling / movement
def _emit_add(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    a, c = mod.input_qparams, mod.other_qparams
    o = mod.output_qparams
    if ins[0].shape != ins[1].shape:
        raise Unsupported("broadcasting INT8 add")
    # binary computes s_a*a + s_c*c; the zero points and the output quantization are a linear
    # post-op, relu the clip at the output zero point.
    shift = -(a.scale * a.zero_point + c.scale * c.zero_point)
    eltwise: Eltwise = [("linear", 1.0 / o.scale, shift / o.scale + o.zero_point)]
    if mod.relu:
        eltwise.append(("clip", float(o.zero_point), 255.0))
    b.binary(ins[0], ins[1], out, "add", scale0=a.scale, scale1=c.scale, eltwise=eltwise)


def _emit_clamp(b: Builder, mod: Any, ins: list[Val], out: Val, lo: int, hi: int) -> None:
    # a clamp of the integers (exact: quantization is monotone, see gml.kernels.backend.clamp_bounds),
    # then the requantization, as post-ops of max(x, x): the one primitive that takes any rank
    eltwise: Eltwise = [("clip", float(lo), float(hi)), *requant_eltwise(mod.input_qparams, mod.output_qparams)]
    b.binary(ins[0], ins[0], out, "max", scale0=None, scale1=None, eltwise=eltwise)


def _emit_relu(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    _emit_clamp(b, mod, ins, out, mod.input_qparams.zero_point, 255)


def _emit_hardtanh(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    _emit_clamp(b, mod, ins, out, *clamp_bounds(mod.input_qparams, mod.min_val, mod.max_val))


def _check_maxpool(mod: nn.Module) -> str | None:
    return None if type(mod) is qm.QMaxPool2d else "3-D max pool"


def _emit_maxpool(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    x = ins[0]
    k, s, p, d = (tuple(v) for v in (mod.kernel_size, mod.stride, mod.padding, mod.dilation))
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], s[i], d[i], p[i]) for i in range(2)]
    eltwise = requant_eltwise(mod.input_qparams, mod.output_qparams)
    b.pool(x, out, "max", k, s, tuple(v - 1 for v in d), p, pad_r, eltwise)


def _check_avgpool(mod: Any) -> str | None:
    if mod.divisor_override is not None:
        return "avg pool with divisor_override"
    if mod.ceil_mode:
        return "avg pool with ceil_mode"
    if mod.count_include_pad and any(mod.padding) and mod.input_qparams.zero_point != 0:
        return "avg pool counting padding with a non-zero input zero point (padding is the zero point there)"
    return None


def _emit_avgpool(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    x = ins[0]
    k, s, p = (tuple(v) for v in (mod.kernel_size, mod.stride, mod.padding))
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], s[i], 1, p[i]) for i in range(2)]
    alg = "avg_include" if mod.count_include_pad else "avg_exclude"
    b.pool(x, out, alg, k, s, (0, 0), p, pad_r, requant_eltwise(mod.input_qparams, mod.output_qparams))


def _check_adaptive(mod: nn.Module) -> str | None:
    return None if type(mod) is qm.QAdaptiveAvgPool2d else "3-D adaptive avg pool"


def _emit_adaptive(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    x = ins[0]
    size, osize = _spatial(x), _spatial(out)
    if len(size) != 2 or any(i % o for i, o in zip(size, osize)):
        raise Unsupported(f"adaptive pool {tuple(size)} -> {tuple(osize)} is not a regular pooling window")
    k = tuple(i // o for i, o in zip(size, osize))
    eltwise = requant_eltwise(mod.input_qparams, mod.output_qparams)
    b.pool(x, out, "avg_exclude", k, k, (0, 0), (0, 0), (0, 0), eltwise)


def _emit_flatten(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if mod.input_qparams.close_to(mod.output_qparams) and b.is_view_of(out, x):
        b.alias(out, x)  # a view: no step at all
        return
    # a copy in the flattened order: reorder x into out's memory seen with x's dims
    target = b.view(out, x.shape, _contiguous_strides(x.shape))
    b.reorder(x, target, src_q=qp(mod.input_qparams), dst_q=qp(mod.output_qparams))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _emit_cat(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    o = mod.output_qparams
    srcs = []
    for v, q in zip(ins, mod._in_qps):
        if not q.close_to(o):  # requantize onto the output grid first
            t = b.temp(v.shape, v.stride, v.dtype_name)
            b.reorder(v, t, src_q=qp(q), dst_q=qp(o))
            v = t
        srcs.append(v)
    b.concat(srcs, out, mod.dim % len(out.shape))


def _emit_quantize(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    if ins[0].dtype_name != "f32":
        raise Unsupported(f"quantize of a {ins[0].dtype_name} tensor")
    b.reorder(ins[0], out, src_q=None, dst_q=qp(mod.output_qparams))


def _emit_dequantize(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=qp(mod.input_qparams), dst_q=None)


# ---------------------------------------------------------------- fp32 fused kernels (gml.kernels.fp32)
def _check_fconv(mod: Any) -> str | None:
    if mod.weight.dim() != 4:
        return f"{mod.weight.dim() - 2}-D fp32 conv (the engine plans 2-D convs)"
    if not mod.fused:
        return "the fp32 kernels are unavailable (the module runs its ATen fallback)"
    return None


def _emit_fconv(b: Builder, mod: Any, ins: list[Val], out: Val, *, sum_with: Val | None = None) -> None:
    x = ins[0]
    if x.dtype_name != "f32" or len(x.shape) != 4:
        raise Unsupported(f"fp32 conv input {x.dtype_name} rank {len(x.shape)}")
    k = tuple(mod.weight.shape[2:])
    pad_r = [
        _pad_right(_spatial(x)[i], _spatial(out)[i], k[i], mod.stride[i], mod.dilation[i], mod.padding[i])
        for i in range(2)
    ]
    relu: Eltwise = [("relu", 0.0, 0.0)] if getattr(mod, "relu", False) else []
    eltwise = eltwise_of(mod.post_op) if sum_with is None else relu
    b.conv(
        x,
        out,
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        stride=mod.stride,
        dilation=tuple(d - 1 for d in mod.dilation),
        pad_l=mod.padding,
        pad_r=pad_r,
        groups=mod.groups,
        src_q=None,
        dst_q=None,
        sum_q=None if sum_with is None else (1.0, 0),
        eltwise=eltwise,
    )


def _emit_fconv_add(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    b.share(out, ins[1])  # conv(x) + other accumulated in other's memory (a copy if other lives on)
    _emit_fconv(b, mod, ins[:1], out, sum_with=ins[1])


def _emit_flinear(b: Builder, mod: Any, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if len(x.shape) != 2 or x.dtype_name != "f32":
        raise Unsupported(f"fp32 linear on a rank-{len(x.shape)} {x.dtype_name} input (the engine plans 2-D)")
    b.inner_product(
        x,
        out,
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        src_q=None,
        dst_q=None,
        eltwise=eltwise_of(mod.post_op),
    )


def _always(mod: nn.Module) -> str | None:
    return None


@dataclass(frozen=True)
class Rule:
    check: Callable[[Any], str | None]
    emit: Callable[..., None]
    #: number of tensor inputs the node must have
    arity: int | None = 1


#: The translation table (see the module docstring). A lowered module type not listed here stays in
#: torch, reported as "no engine kernel".
RULES: dict[type[nn.Module], Rule] = {
    qm.QConv2d: Rule(_check_conv, _emit_conv),
    qm.QConv2dAdd: Rule(_check_conv, _emit_conv_add, 2),
    qm.QLinear: Rule(_always, _emit_linear),
    qm.QAdd: Rule(_always, _emit_add, 2),
    qm.QReLU: Rule(_always, _emit_relu),
    qm.QHardtanh: Rule(_always, _emit_hardtanh),
    qm.QMaxPool2d: Rule(_check_maxpool, _emit_maxpool),
    qm.QAvgPool2d: Rule(_check_avgpool, _emit_avgpool),
    qm.QAdaptiveAvgPool2d: Rule(_check_adaptive, _emit_adaptive),
    qm.QFlatten: Rule(_always, _emit_flatten),
    qm.QCat: Rule(_always, _emit_cat, None),
    qm.Quantize: Rule(_always, _emit_quantize),
    qm.Dequantize: Rule(_always, _emit_dequantize),
    fp32.FusedConv: Rule(_check_fconv, _emit_fconv),
    fp32.FusedConvAdd: Rule(_check_fconv, _emit_fconv_add, 2),
    fp32.FusedLinear: Rule(_always, _emit_flinear),
}


def rule_for(mod: nn.Module) -> tuple[Rule | None, str | None]:
    """``(rule, None)`` when the engine runs ``mod``, else ``(None, reason)``."""
    rule = RULES.get(type(mod))
    if rule is None:
        for base in type(mod).__mro__[1:]:  # a subclass (QConv1d, QMaxPool3d) asks its base's check
            if base in RULES:
                rule = RULES[base]
                break
    if rule is None:
        return None, f"no engine kernel for {type(mod).__name__}"
    backend = getattr(mod, "backend", None)
    if backend is not None and getattr(backend, "name", "onednn") != "onednn":
        return None, f"{type(mod).__name__} uses the {backend.name} backend (the engine runs oneDNN's math)"
    reason = rule.check(mod)
    return (None, reason) if reason else (rule, None)
