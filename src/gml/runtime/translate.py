"""Graph → engine translation: ONE table, one entry per lowered op (how to read its arguments).

:func:`read_call` reads a node of the lowered graph — a ``torch.ops.gml.*`` call (docs/ir.md: every
qparam and attribute is an argument, weights are ``get_attr`` constants), a ``torch.flatten`` of an
INT8 value, or an fp32 fused module (``gml.kernels.fp32``) — as a :class:`Call`. Each entry of
:data:`RULES` maps a :attr:`Call.op` to

* ``check(call) -> reason | None``: shape-independent; a reason keeps the node in torch (the
  runtime report prints it);
* ``emit(builder, call, inputs, output)``: the engine steps for one input shape, written with the
  :class:`~gml.runtime.plan.Builder` calls (conv, inner_product, reorder, pool, binary, concat, alias,
  share). It may raise :class:`Unsupported` for a shape the engine cannot take (the segment then runs
  in torch for that shape).

Quantization convention (the IR's): ``real = (q - zero_point) * scale`` on uint8.
This is the one file of the runtime that knows the graph's vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx

from gml.ir.library import gml_op_name, op_args
from gml.ir.values import PostOp, QParams
from gml.kernels import fp32
from gml.kernels.backend import clamp_bounds
from gml.runtime.plan import QP, Builder, Eltwise, Unsupported, Val


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


# ---------------------------------------------------------------- reading a node
@dataclass(frozen=True)
class Call:
    """One node as a rule reads it: what it computes, and its arguments.

    ``op`` is the gml op name (``qconv``, ``quantize``, ... — docs/ir.md), ``flatten`` for a
    ``torch.flatten`` of an INT8 value, or the fp32 fused module's class name; ``a`` holds the
    arguments by schema name with ``get_attr`` constants resolved to tensors (for an fp32 fused
    module, the module itself); ``inputs`` are the activation values, in schema order.
    """

    op: str
    a: Any
    inputs: tuple[fx.Node, ...]


def _flat(v: Any) -> list[Any]:
    return [x for item in v for x in _flat(item)] if isinstance(v, list | tuple) else [v]


def _constant(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value


def read_call(gm: fx.GraphModule, node: fx.Node) -> Call | None:
    """The :class:`Call` of ``node``, or ``None`` for a node no rule reads."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return Call(type(mod).__name__, mod, tuple(a for a in node.args if isinstance(a, fx.Node)))
    if node.op != "call_function":
        return None
    if node.target is torch.flatten and isinstance(node.args[0], fx.Node):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return Call("flatten", SimpleNamespace(start_dim=start, end_dim=end), (node.args[0],))
    name = gml_op_name(node)
    if name is None:
        return None
    args = op_args(node)
    inputs = tuple(v for v in _flat(list(args.values())) if isinstance(v, fx.Node) and v.op != "get_attr")
    resolved = {
        k: (_constant(gm, v) if isinstance(v, fx.Node) and v.op == "get_attr" else v) for k, v in args.items()
    }
    return Call(name, SimpleNamespace(**resolved), inputs)


def _q(scale: float, zero_point: int) -> QParams:
    return QParams(float(scale), int(zero_point))


def _x(a: Any) -> QParams:
    return _q(a.x_scale, a.x_zero_point)


def _out(a: Any) -> QParams | None:
    """The output qparams; ``None`` where the op writes fp32 (``out_dtype=torch.float32``)."""
    if getattr(a, "out_dtype", torch.uint8) != torch.uint8:
        return None
    return _q(a.out_scale, a.out_zero_point)


def _post_op(a: Any) -> PostOp:
    return PostOp(a.post_op, tuple(a.post_op_scalars), a.post_op_algorithm or "")


# ---------------------------------------------------------------- conv / linear
def _check_conv(c: Call) -> str | None:
    if c.a.weight.dim() != 4:
        return f"{c.a.weight.dim() - 2}-D INT8 conv (the engine plans 2-D convs)"
    return None


def _nhwc_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _is_nhwc(v: Val) -> bool:
    """Dense channels-last (strides of size-1 dims do not matter)."""
    want = _nhwc_strides(v.shape)
    return all(d == 1 or s == t for d, s, t in zip(v.shape, v.stride, want))


def _as_nhwc(b: Builder, v: Val) -> Val:
    """``v``, or a channels-last copy of it: oneDNN's INT8 convs are jitted for NHWC only; any other
    layout (e.g. a quantized permute of LayerNorm's output in ConvNeXt) falls to its reference
    kernel, hundreds of times slower (issue #16: convnext_atto, resnest14d)."""
    if _is_nhwc(v):
        return v
    t = b.temp(v.shape, _nhwc_strides(v.shape), v.dtype_name)
    b.reorder(v, t, src_q=None, dst_q=None)
    return t


def _emit_conv(b: Builder, c: Call, ins: list[Val], out: Val, *, sum_with: Val | None = None) -> None:
    a, x = c.a, ins[0]
    if x.dtype_name != "u8" or len(x.shape) != 4:
        raise Unsupported(f"conv input {x.dtype_name} rank {len(x.shape)} (expects uint8 NHWC)")
    x = _as_nhwc(b, x)
    if sum_with is None and not _is_nhwc(out):  # compute NHWC, then copy into the layout wanted
        t = b.temp(out.shape, _nhwc_strides(out.shape), out.dtype_name)
        _emit_conv(b, c, [x], t)
        b.reorder(t, out, src_q=None, dst_q=None)
        return
    k = tuple(a.weight.shape[2:])
    stride, padding, dilation = tuple(a.stride), tuple(a.padding), tuple(a.dilation)
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], stride[i], dilation[i], padding[i]) for i in range(2)]
    if sum_with is None:
        eltwise, out_q = eltwise_of(_post_op(a)), _out(a)
    else:  # qconv_add: post_op is none or relu, the output uint8
        eltwise, out_q = ([("relu", 0.0, 0.0)] if a.post_op == "relu" else []), _out(a)
    b.conv(
        x,
        out,
        weight=a.weight,
        w_scales=a.weight_scale,
        bias=a.bias,
        stride=stride,
        dilation=tuple(d - 1 for d in dilation),
        pad_l=padding,
        pad_r=pad_r,
        groups=a.groups,
        src_q=qp(_x(a)),
        dst_q=qp(out_q),
        sum_q=None if sum_with is None else qp(_q(a.other_scale, a.other_zero_point)),
        eltwise=eltwise,
    )


def _emit_conv_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # post_op(conv(x) + other) with oneDNN's ``sum`` post-op, accumulated in place into the skip
    # buffer: the output shares other's memory (the builder copies other first only if it is still
    # read later or belongs to the caller).
    b.share(out, ins[1], also_read=ins[0])
    _emit_conv(b, c, ins[:1], out, sum_with=ins[1])


def _emit_linear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    a, x = c.a, ins[0]
    if len(x.shape) != 2:
        raise Unsupported(f"INT8 linear on a rank-{len(x.shape)} input (the engine plans 2-D inner products)")
    # oneDNN 3.2's inner product takes no source zero point: fold it into the bias,
    # s_x * s_w[o] * sum_i (x_i - z) w[o, i] = s_x * s_w[o] * sum_i x_i w[o, i] - s_x * s_w[o] * z * sum_i w[o, i].
    in_q, out_q = _x(a), _out(a)
    eltwise = eltwise_of(_post_op(a))
    if out_q is not None and out_q.zero_point:  # nor a destination one: add z * s_out before the division
        eltwise.append(("linear", 1.0, out_q.zero_point * out_q.scale))
    bias = a.bias.double() if a.bias is not None else torch.zeros(a.weight.shape[0], dtype=torch.float64)
    if in_q.zero_point:
        w_sum = a.weight.double().sum(1)
        bias = bias - in_q.scale * a.weight_scale.double() * in_q.zero_point * w_sum
    b.inner_product(
        x,
        out,
        weight=a.weight,
        w_scales=a.weight_scale,
        bias=bias.float(),
        src_q=(float(in_q.scale), 0),
        dst_q=None if out_q is None else (float(out_q.scale), 0),
        eltwise=eltwise,
    )


# ---------------------------------------------------------------- element-wise / pooling / movement
def _check_add(c: Call) -> str | None:
    return None if c.a.post_op in ("none", "relu") else f"INT8 add with post-op {c.a.post_op}"


def _emit_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    qa, qb, o = _q(c.a.a_scale, c.a.a_zero_point), _q(c.a.b_scale, c.a.b_zero_point), _out(c.a)
    if ins[0].shape != ins[1].shape:
        raise Unsupported("broadcasting INT8 add")
    # binary computes s_a*a + s_b*b; the zero points and the output quantization are a linear
    # post-op, relu the clip at the output zero point.
    shift = -(qa.scale * qa.zero_point + qb.scale * qb.zero_point)
    eltwise: Eltwise = [("linear", 1.0 / o.scale, shift / o.scale + o.zero_point)]
    if c.a.post_op == "relu":
        eltwise.append(("clip", float(o.zero_point), 255.0))
    b.binary(ins[0], ins[1], out, "add", scale0=qa.scale, scale1=qb.scale, eltwise=eltwise)


def _check_activation(c: Call) -> str | None:
    return None if c.a.op in ("relu", "hardtanh") else f"INT8 {c.a.op} (no integer clamp form)"


def _emit_activation(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # relu / hardtanh are a clamp of the integers (exact: quantization is monotone, see
    # gml.kernels.backend.clamp_bounds), then the requantization, as post-ops of max(x, x): the one
    # primitive that takes any rank
    in_q = _x(c.a)
    lo, hi = (in_q.zero_point, 255) if c.a.op == "relu" else clamp_bounds(in_q, *c.a.scalars)
    eltwise: Eltwise = [("clip", float(lo), float(hi)), *requant_eltwise(in_q, _out(c.a))]
    b.binary(ins[0], ins[0], out, "max", scale0=None, scale1=None, eltwise=eltwise)


def _check_maxpool(c: Call) -> str | None:
    return None if len(c.a.kernel_size) == 2 else f"{len(c.a.kernel_size)}-D max pool"


def _emit_maxpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, a = ins[0], c.a
    k, s, p, d = (tuple(v) for v in (a.kernel_size, a.stride, a.padding, a.dilation))
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], s[i], d[i], p[i]) for i in range(2)]
    b.pool(x, out, "max", k, s, tuple(v - 1 for v in d), p, pad_r, [])  # the output keeps x's qparams


def _check_avgpool(c: Call) -> str | None:
    a = c.a
    if a.divisor_override is not None:
        return "avg pool with divisor_override"
    if a.ceil_mode:
        return "avg pool with ceil_mode"
    if a.count_include_pad and any(a.padding) and a.x_zero_point != 0:
        return "avg pool counting padding with a non-zero input zero point (padding is the zero point there)"
    return None


def _emit_avgpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, a = ins[0], c.a
    k, s, p = (tuple(v) for v in (a.kernel_size, a.stride, a.padding))
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], s[i], 1, p[i]) for i in range(2)]
    alg = "avg_include" if a.count_include_pad else "avg_exclude"
    b.pool(x, out, alg, k, s, (0, 0), p, pad_r, requant_eltwise(_x(a), _out(a)))


def _emit_adaptive(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    size, osize = _spatial(x), _spatial(out)
    if len(size) != 2 or any(i % o for i, o in zip(size, osize)):
        raise Unsupported(f"adaptive pool {tuple(size)} -> {tuple(osize)} is not a regular pooling window")
    k = tuple(i // o for i, o in zip(size, osize))
    b.pool(x, out, "avg_exclude", k, k, (0, 0), (0, 0), (0, 0), requant_eltwise(_x(c.a), _out(c.a)))


def _emit_flatten(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if b.is_view_of(out, x):
        b.alias(out, x)  # a view: no step at all
        return
    # a copy in the flattened order: reorder x into out's memory seen with x's dims
    b.reorder(x, b.view(out, x.shape, _contiguous_strides(x.shape)), src_q=None, dst_q=None)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _emit_cat(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    o = _out(c.a)
    srcs = []
    for v, s, z in zip(ins, c.a.x_scales, c.a.x_zero_points):
        q = _q(s, z)
        if not q.close_to(o):  # requantize onto the output grid first
            t = b.temp(v.shape, v.stride, v.dtype_name)
            b.reorder(v, t, src_q=qp(q), dst_q=qp(o))
            v = t
        srcs.append(v)
    b.concat(srcs, out, c.a.dim % len(out.shape))


def _emit_quantize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    if ins[0].dtype_name != "f32":
        raise Unsupported(f"quantize of a {ins[0].dtype_name} tensor")
    b.reorder(ins[0], out, src_q=None, dst_q=qp(_out(c.a)))


def _emit_dequantize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=qp(_x(c.a)), dst_q=None)


def _emit_requantize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=qp(_x(c.a)), dst_q=qp(_out(c.a)))


# ---------------------------------------------------------------- fp32 fused kernels (gml.kernels.fp32)
def _check_fconv(c: Call) -> str | None:
    mod = c.a
    if mod.weight.dim() != 4:
        return f"{mod.weight.dim() - 2}-D fp32 conv (the engine plans 2-D convs)"
    if not mod.fused:
        return "the fp32 kernels are unavailable (the module runs its ATen fallback)"
    return None


def _emit_fconv(b: Builder, c: Call, ins: list[Val], out: Val, *, sum_with: Val | None = None) -> None:
    mod, x = c.a, ins[0]
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


def _emit_fconv_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # conv(x) + other accumulated in other's memory (a copy if other lives on or is x itself)
    b.share(out, ins[1], also_read=ins[0])
    _emit_fconv(b, c, ins[:1], out, sum_with=ins[1])


def _emit_flinear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    mod, x = c.a, ins[0]
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


def _always(c: Call) -> str | None:
    return None


@dataclass(frozen=True)
class Rule:
    check: Callable[[Any], str | None]
    emit: Callable[..., None]
    #: number of tensor inputs the node must have
    arity: int | None = 1


#: The translation table (see the module docstring), keyed by :attr:`Call.op`. A node whose op is not
#: listed here stays in torch, reported as "no engine kernel".
RULES: dict[str, Rule] = {
    "qconv": Rule(_check_conv, _emit_conv),
    "qconv_add": Rule(_check_conv, _emit_conv_add, 2),
    "qlinear": Rule(_always, _emit_linear),
    "qadd": Rule(_check_add, _emit_add, 2),
    "qactivation": Rule(_check_activation, _emit_activation),
    "qmax_pool": Rule(_check_maxpool, _emit_maxpool),
    "qavg_pool2d": Rule(_check_avgpool, _emit_avgpool),
    "qadaptive_avg_pool": Rule(_always, _emit_adaptive),
    "qcat": Rule(_always, _emit_cat, None),
    "quantize": Rule(_always, _emit_quantize),
    "dequantize": Rule(_always, _emit_dequantize),
    "requantize": Rule(_always, _emit_requantize),
    "flatten": Rule(_always, _emit_flatten),
    fp32.FusedConv.__name__: Rule(_check_fconv, _emit_fconv),
    fp32.FusedConvAdd.__name__: Rule(_check_fconv, _emit_fconv_add, 2),
    fp32.FusedLinear.__name__: Rule(_always, _emit_flinear),
}


def rule_for(call: Call | None) -> tuple[Rule | None, str | None]:
    """``(rule, None)`` when the engine runs ``call``, else ``(None, reason)``."""
    if call is None:
        return None, "not a lowered GML op (runs in torch)"
    rule = RULES.get(call.op)
    if rule is None:
        return None, f"no engine kernel for {call.op}"
    backend = getattr(call.a, "backend", "onednn")
    backend = getattr(backend, "name", backend)
    if backend != "onednn":
        return None, f"{call.op} uses the {backend} backend (the engine runs oneDNN's math)"
    reason = rule.check(call)
    return (None, reason) if reason else (rule, None)
