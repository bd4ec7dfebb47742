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

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx

from gml.ir.library import gml_op_name, op_args
from gml.ir.values import PostOp, QParams
from gml.kernels import bf16, fp32
from gml.kernels.backend import clamp_bounds
from gml.runtime.plan import QP, Builder, Eltwise, Unsupported, Val
from gml.runtime.plan import _contiguous as _contiguous_strides
from gml.runtime.plan import is_nhwc as _is_nhwc
from gml.runtime.plan import nhwc_strides as _nhwc_strides
from gml.runtime.transformer_rules import (
    check_attention,
    check_eltwise,
    check_embedding,
    check_expand_mask,
    check_float_add,
    check_index,
    check_layer_norm,
    check_mask_and,
    check_split,
    check_split_item,
    check_to_bool,
    emit_attention,
    emit_eltwise,
    emit_embedding,
    emit_expand_mask,
    emit_float_add,
    emit_index,
    emit_layer_norm,
    emit_mask_and,
    emit_split_item,
    emit_to_bool,
    read_mask_op,
    read_split,
)


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
    if a == "hardsigmoid":  # relu6(x + 3) / 6 = clamp(x / 6 + 1 / 2, 0, 1)
        return [("hardsigmoid", 1.0 / 6.0, 0.5)]
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


_FLATTENS = (torch.flatten, torch.ops.aten.flatten.using_ints)
#: shape-only ops (Tensor methods, their torch functions and aten overloads) the engine runs as views
MOVES = frozenset(
    {"reshape", "view", "_unsafe_view", "squeeze", "unsqueeze", "permute", "transpose", "contiguous", "select", "slice"}
)


def move_name(node: fx.Node) -> str | None:
    """``"permute"`` for ``x.permute(...)`` / ``torch.permute`` / ``aten.permute.default``, else None."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__ if node.target.namespace == "aten" else ""
    elif node.op == "call_function":  # torch.reshape, torch.permute, ...
        fn = str(getattr(node.target, "__name__", ""))
        name = fn if fn and getattr(torch, fn, None) is node.target else ""
    else:
        return None
    return name if name in MOVES and node.args and isinstance(node.args[0], fx.Node) else None


def read_call(gm: fx.GraphModule, node: fx.Node) -> Call | None:
    """The :class:`Call` of ``node``, or ``None`` for a node no rule reads."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return Call(type(mod).__name__, mod, tuple(a for a in node.args if isinstance(a, fx.Node)))
    move = move_name(node)
    if move is not None:
        # sizes computed at run time (a dynamic batch in an exported program) are graph values
        run_time = any(isinstance(a, fx.Node) for a in _flat([*node.args[1:], *node.kwargs.values()]))
        return Call(move, SimpleNamespace(run_time_sizes=run_time), (node.args[0],))
    split = read_split(node)  # torch.split's pieces (the QKV merge's q, k, v): views
    if split is not None:
        return split
    mask = read_mask_op(node)  # a padding mask's arithmetic (transformers' mask builder)
    if mask is not None:
        return mask
    if node.op != "call_function":
        return None
    if node.target in _CASTS and isinstance(node.args[0], fx.Node):  # gml.kernels.bf16 dtype conversions
        return Call(_CASTS[node.target], SimpleNamespace(), (node.args[0],))
    # torch.flatten in a traced graph; aten.flatten.using_ints in a torch.export program (gml.io)
    if node.target in _FLATTENS and isinstance(node.args[0], fx.Node):
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
    if c.a.weight.dim() not in (3, 4, 5):
        return f"INT8 conv with a {c.a.weight.dim()}-D weight (the engine plans 1-D, 2-D and 3-D convs)"
    return None


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
    if x.dtype_name != "u8" or len(x.shape) != a.weight.dim():
        raise Unsupported(f"conv input {x.dtype_name} rank {len(x.shape)} (expects uint8 of the weight's rank)")
    x = _as_nhwc(b, x)
    if sum_with is None and not _is_nhwc(out):  # compute channels-last, then copy into the layout wanted
        t = b.temp(out.shape, _nhwc_strides(out.shape), out.dtype_name)
        _emit_conv(b, c, [x], t)
        b.reorder(t, out, src_q=None, dst_q=None)
        return
    k = tuple(a.weight.shape[2:])
    stride, padding, dilation = tuple(a.stride), tuple(a.padding), tuple(a.dilation)
    pad_r = [
        _pad_right(_spatial(x)[i], _spatial(out)[i], k[i], stride[i], dilation[i], padding[i]) for i in range(len(k))
    ]
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


def _rows_strides(v: Val) -> tuple[int, int] | None:
    """``(row stride, feature stride)`` when ``v``'s leading dims collapse into one (a view), else None."""
    dims = [(d, s) for d, s in zip(v.shape[:-1], v.stride[:-1]) if d != 1]
    for (_, outer), (d, inner) in itertools.pairwise(dims):
        if outer != inner * d:
            return None
    return (dims[-1][1] if dims else v.shape[-1] * v.stride[-1]), v.stride[-1]


def _as_rows(b: Builder, v: Val, *, output: bool = False) -> Val:
    """``v`` ([..., features], rank >= 2) as the 2-D ``[rows, features]`` matrix an inner product
    takes: a view of the same bytes, or (an input whose dims do not collapse, or whose features are
    not contiguous) a contiguous copy."""
    if not output and v.shape[-1] > 1 and v.stride[-1] != 1:
        # features strided (a transposed token matrix: timm XCiT's attention output): oneDNN's inner
        # product has only its reference kernel for such a source (xcit_nano fp32: 28x the executor)
        t = b.temp(v.shape, _contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        v = t
    if len(v.shape) == 2:
        if v.shape[0] == 1 and v.stride[0] != v.shape[1] * v.stride[1]:
            # one row picked out of a bigger tensor (BERT's pooler: hidden[:, 0]): its row stride
            # is irrelevant, but oneDNN reads it and falls to its reference inner product
            return b.view(v, v.shape, (v.shape[1] * v.stride[1], v.stride[1]))
        return v
    rows = 1
    for d in v.shape[:-1]:
        rows *= d
    strides = _rows_strides(v)
    if strides is None:
        if output:
            raise Unsupported(f"linear output layout {v.stride} does not collapse to rows")
        t = b.temp(v.shape, _contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        v, strides = t, (v.shape[-1], 1)
    return b.view(v, (rows, v.shape[-1]), strides)


def _emit_linear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    a = c.a
    if len(ins[0].shape) < 2:
        raise Unsupported(f"INT8 linear on a rank-{len(ins[0].shape)} input")
    # rank > 2 ([batch, tokens, features]): the same inner product over the rows
    x, out = _as_rows(b, ins[0]), _as_rows(b, out, output=True)
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


def _check_dynamic_linear(c: Call) -> str | None:
    from gml.kernels.dynamic_int8 import POST_OPS

    if c.a.post_op not in POST_OPS:
        return f"dynamic INT8 linear with post-op {c.a.post_op}"
    if c.a.weight.dtype != torch.int8 or c.a.weight.dim() != 2:
        return f"dynamic INT8 linear with a {c.a.weight.dtype} {c.a.weight.dim()}-D weight"
    return None


def _emit_dynamic_linear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``gml.dynamic_linear`` (fp32 → fp32; per-row INT8 inside: ADR 008): the rows of ``x``
    (leading dims collapsed, a view where they collapse), the engine's row quantization, then one
    oneDNN matmul with the per-row scale and bias as post-ops."""
    from gml.kernels.dynamic_int8 import QMAX

    a, x = c.a, ins[0]
    if len(x.shape) < 2 or x.dtype_name != "f32":
        raise Unsupported(f"dynamic INT8 linear on a rank-{len(x.shape)} {x.dtype_name} input")
    x, out = _as_rows(b, x), _as_rows(b, out, output=True)
    if x.stride[1] != 1 and x.shape[1] > 1:  # the row quantization reads dense rows
        t = b.temp(x.shape, _contiguous_strides(x.shape), "f32")
        b.reorder(x, t, src_q=None, dst_q=None)
        x = t
    b.dynamic_linear(
        x,
        out,
        weight=a.weight,
        w_scales=(a.weight_scale.float() / QMAX).contiguous(),  # exactly the Python kernel's s_w / 127
        bias=None if a.bias is None else a.bias.detach().float().contiguous(),
        smooth_inv=None if a.smooth_inv is None else a.smooth_inv.detach().float(),
        eltwise=eltwise_of(_post_op(a)),
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


def _activation_post_op(c: Call) -> PostOp:
    return PostOp(c.a.op, tuple(c.a.scalars), "")


def _check_activation(c: Call) -> str | None:
    if c.a.op in ("relu", "hardtanh"):
        return None
    try:
        eltwise_of(_activation_post_op(c))
    except (Unsupported, ValueError) as e:
        return f"INT8 {c.a.op}: {e}"
    return None


def _emit_activation(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # All as post-ops of max(x, x), the one primitive that takes any rank and layout.
    in_q, out_q = _x(c.a), _out(c.a)
    if c.a.op in ("relu", "hardtanh"):
        # a clamp of the integers (exact: quantization is monotone, see
        # gml.kernels.backend.clamp_bounds), then the requantization
        lo, hi = (in_q.zero_point, 255) if c.a.op == "relu" else clamp_bounds(in_q, *c.a.scalars)
        eltwise: Eltwise = [("clip", float(lo), float(hi)), *requant_eltwise(in_q, out_q)]
    else:
        # hardswish, sigmoid, hardsigmoid, ...: dequantize (s * (q - z)), the function on real
        # values, quantize (y / s_out + z_out; the u8 destination rounds to nearest and saturates)
        eltwise = [
            ("linear", in_q.scale, -in_q.scale * in_q.zero_point),
            *eltwise_of(_activation_post_op(c)),
            ("linear", 1.0 / out_q.scale, float(out_q.zero_point)),
        ]
    b.binary(ins[0], ins[0], out, "max", scale0=None, scale1=None, eltwise=eltwise)


def _emit_mul(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # s_a (a - z_a) * s_b (b - z_b) / s_out + z_out. The binary primitive scales its sources but
    # takes no zero points: an operand with one is dequantized to fp32 first (a zero-point-free
    # operand, e.g. a ReLU output or a sigmoid gate, is read as uint8 directly).
    a, bq, o = _q(c.a.a_scale, c.a.a_zero_point), _q(c.a.b_scale, c.a.b_zero_point), _out(c.a)
    srcs: list[tuple[Val, float | None]] = []
    for v, q in zip(ins, (a, bq)):
        if q.zero_point:
            t = b.temp(v.shape, v.stride, "f32")
            b.reorder(v, t, src_q=qp(q), dst_q=None)
            srcs.append((t, None))
        else:
            srcs.append((v, q.scale))
    if srcs[0][0].shape != out.shape:  # oneDNN 3.2 broadcasts the second source only
        srcs.reverse()
    (x, sx), (y, sy) = srcs
    if x.shape != out.shape:
        raise Unsupported(f"INT8 mul with both inputs broadcast ({x.shape} * {y.shape})")
    if len(y.shape) < len(out.shape):  # numpy broadcasting: leading 1s
        pad = len(out.shape) - len(y.shape)
        outer = y.shape[0] * y.stride[0] if y.shape else 1
        y = b.view(y, (1,) * pad + y.shape, (outer,) * pad + y.stride)
    eltwise: Eltwise = [("linear", 1.0 / o.scale, float(o.zero_point))]
    b.binary(x, y, out, "mul", scale0=sx, scale1=sy, eltwise=eltwise)


def _check_maxpool(c: Call) -> str | None:
    n = len(c.a.kernel_size)
    return None if n in (1, 2, 3) else f"{n}-D max pool (the engine plans 1-D to 3-D pools)"


def _emit_maxpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, a = ins[0], c.a
    k, s, p, d = (tuple(v) for v in (a.kernel_size, a.stride, a.padding, a.dilation))
    if len(x.shape) != len(k) + 2:
        raise Unsupported(f"{len(k)}-D max pool of a rank-{len(x.shape)} input")
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], s[i], d[i], p[i]) for i in range(len(k))]
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
    _emit_adaptive_pool(b, ins[0], out, requant_eltwise(_x(c.a), _out(c.a)))


def _check_qmean(c: Call) -> str | None:
    dims = sorted(int(d) for d in c.a.dim)
    meta = c.inputs[0].meta.get("val", c.inputs[0].meta.get("tensor_meta")) if c.inputs else None
    rank = len(meta.shape) if getattr(meta, "shape", None) is not None else None
    if dims == [2, 3] or (dims == [-2, -1] and rank == 4):
        return None
    return f"qmean over dims {list(c.a.dim)} (the engine takes the spatial mean of an NCHW tensor)"


def _emit_qmean(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """The spatial mean (squeeze-excite's) as the global average pool it is (the Python kernel runs
    the same pool): one pooling primitive with the requantization as its post-op. In torch it split
    every mixnet / efficientnet INT8 block's engine segment in two (issue #16, tf_mixnet_s)."""
    x = ins[0]
    if len(x.shape) != 4:
        raise Unsupported(f"qmean of a rank-{len(x.shape)} tensor")
    if len(out.shape) == 2:  # keepdim=False: the pool writes [N, C, 1, 1] into out's bytes
        out = b.view(out, (*out.shape, 1, 1), (*out.stride, 1, 1))
    _emit_adaptive_pool(b, x, out, requant_eltwise(_x(c.a), _out(c.a)))


def _emit_flatten(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    # a view: no step at all (a conv's NHWC output flattened to [N, C, H*W], then transposed into
    # tokens: timm pvt_v2's MLP, which fell back to the Python executor for the whole segment)
    if b.is_view_of(out, x) and b.settle(x):
        b.alias(out, x)
        return
    if out.stride != _contiguous_strides(out.shape):
        raise Unsupported(f"flatten to a non-contiguous {out.shape} (strides {out.stride})")
    # a copy in the flattened order: reorder x into out's memory seen with x's dims
    b.reorder(x, b.view(out, x.shape, _contiguous_strides(x.shape)), src_q=None, dst_q=None)


def _check_move(c: Call) -> str | None:
    # sizes computed at run time (sym_size of a dynamic dim) are ints the segment takes as inputs
    return check_move_source(c.inputs[0], c.op)


def check_move_source(src: fx.Node, op: str) -> str | None:
    """Why a move (or split) of ``src`` stays in torch, or None: the value must come from a node the
    engine runs (through other moves / split pieces) or be an input of a dtype the engine takes."""
    while src.op in ("call_method", "call_function") and (
        move_name(src) or src.target in _FLATTENS or read_split(src) is not None
    ):
        src = src.args[0]  # type: ignore[assignment]
    if src.op == "placeholder":
        # a model input (or, in a segment's own graph, a value the partition already vetted): the
        # engine takes uint8, fp32 and bf16 tensors
        meta = src.meta.get("val", src.meta.get("tensor_meta"))
        dtype = getattr(meta, "dtype", None)
        if dtype is not None and dtype not in (torch.uint8, torch.float32, torch.bfloat16):
            return f"{op} of a {dtype} input"
        return None
    if gml_op_name(src) is None and not _engine_runs(src):
        return f"{op} of a value no lowered GML op made (an fp32 torch op's output: runs in torch)"
    return None


def _engine_runs(node: fx.Node) -> bool:
    """Whether the engine runs ``node`` (an fp32 / bf16 kernel module, a cast, LayerNorm, ...)."""
    gm = node.graph.owning_module
    if gm is None or node.op not in ("call_module", "call_function"):
        return False
    return rule_for(read_call(gm, node))[0] is not None


def _check_contiguous(c: Call) -> str | None:
    """``.contiguous()`` of an engine module's output (fp32 / bf16 convs), else as any move."""
    return None if c.inputs[0].op == "call_module" else _check_move(c)


def _emit_move(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if b.is_view_of(out, x):
        b.alias(out, x)  # the executor made a view (permute, squeeze, ...): no step at all
    elif out.shape == x.shape:  # contiguous(): the same elements in another layout
        b.reorder(x, out, src_q=None, dst_q=None)
    elif c.op != "permute" and c.op != "transpose" and out.stride == _contiguous_strides(out.shape):
        # a reshape that copied: x's elements in their logical order into out's contiguous memory
        b.reorder(x, b.view(out, x.shape, _contiguous_strides(x.shape)), src_q=None, dst_q=None)
    else:
        raise Unsupported(f"{c.op} copying into layout {out.stride}")


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
    if mod.weight.dim() not in (3, 4, 5):
        return f"fp32 conv with a {mod.weight.dim()}-D weight (the engine plans 1-D, 2-D and 3-D convs)"
    if not mod.fused:
        return "the fp32 kernels are unavailable (the module runs its ATen fallback)"
    return None


def _emit_fconv(
    b: Builder, c: Call, ins: list[Val], out: Val, *, sum_with: Val | None = None, dtype: str = "f32"
) -> None:
    """A float conv (fp32, or bf16 with fp32 accumulation): weights reordered once, bias fp32."""
    mod, x = c.a, ins[0]
    if x.dtype_name != dtype or len(x.shape) != mod.weight.dim() or (dtype == "bf16" and len(x.shape) != 4):
        raise Unsupported(f"{dtype} conv input {x.dtype_name} rank {len(x.shape)}")
    k = tuple(mod.weight.shape[2:])
    pad_r = [
        _pad_right(_spatial(x)[i], _spatial(out)[i], k[i], mod.stride[i], mod.dilation[i], mod.padding[i])
        for i in range(len(k))
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
    mod = c.a
    if len(ins[0].shape) < 2 or ins[0].dtype_name != "f32":
        raise Unsupported(f"fp32 linear on a rank-{len(ins[0].shape)} {ins[0].dtype_name} input")
    x, out = _as_rows(b, ins[0]), _as_rows(b, out, output=True)
    b.inner_product(
        x,
        out,
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        src_q=None,
        dst_q=None,
        eltwise=eltwise_of(mod.post_op) if hasattr(mod, "post_op") else [],  # a plain nn.Linear: none
    )


# ---------------------------------------------------------------- bf16 kernels (gml.kernels.bf16)
# bf16 src / weights / dst, fp32 accumulation inside oneDNN; the bias (bf16-rounded by the module)
# goes in as fp32, as the fp32 rules pass it. An fp32 source (the model's input) is reordered to bf16
# first, in its own layout: the step the module's ``x.to(torch.bfloat16)`` is.
_CASTS = {bf16.to_fp32: "to_fp32", bf16.to_bf16: "to_bf16"}


def _bf16_src(b: Builder, x: Val) -> Val:
    """``x`` as bf16, and NHWC when it is 4-D: oneDNN's fast bf16 convs (brgconv) take NHWC; an
    NCHW bf16 source gets its reference kernel (measured: 17 s for ResNet18's stem)."""
    want = _nhwc_strides(x.shape) if len(x.shape) == 4 else x.stride
    if x.dtype_name == "bf16" and x.stride == want:
        return x
    if x.dtype_name not in ("f32", "bf16"):
        raise Unsupported(f"bf16 kernel input {x.dtype_name}")
    t = b.temp(x.shape, want, "bf16")
    b.reorder(x, t, src_q=None, dst_q=None)
    return t


def _emit_bconv(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    _emit_fconv(b, c, [_bf16_src(b, ins[0])], out, dtype="bf16")


def _emit_bconv_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    if ins[1].dtype_name != "bf16":
        raise Unsupported(f"bf16 conv + add of a {ins[1].dtype_name} tensor")
    x = _bf16_src(b, ins[0])
    b.share(out, ins[1], also_read=x)
    _emit_fconv(b, c, [x], out, sum_with=ins[1], dtype="bf16")


def _check_blinear(c: Call) -> str | None:
    return None if c.a.backend == "onednn" else f"bf16 linear on the {c.a.backend} path"


def _emit_blinear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    mod = c.a
    # any layout: a view where the leading dims collapse, else a dense copy (ViT's MHA out_proj
    # reads a permuted value)
    x = _as_rows(b, _bf16_src(b, ins[0]))
    b.inner_product(
        x,
        _as_rows(b, out, output=True),
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        src_q=None,
        dst_q=None,
        eltwise=eltwise_of(mod.post_op),
    )


def _emit_cast(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=None, dst_q=None)  # f32 <-> bf16 (round to nearest even), any layout


def _check_flatten(c: Call) -> str | None:
    return None if type(c.a) is torch.nn.Flatten else f"{type(c.a).__module__}.Flatten (not torch.nn.Flatten)"


def _check_flin(c: Call) -> str | None:
    return None if type(c.a) is torch.nn.Linear else f"{type(c.a).__module__}.Linear (not torch.nn.Linear)"


def _check_fpool(c: Call) -> str | None:
    if type(c.a) not in (torch.nn.MaxPool2d, torch.nn.AvgPool2d, torch.nn.AdaptiveAvgPool2d):
        return f"{type(c.a).__module__}.{type(c.a).__name__} (not a torch.nn pool)"
    mod = c.a
    if isinstance(mod, torch.nn.MaxPool2d) and mod.return_indices:
        return "max pool returning indices"
    if isinstance(mod, torch.nn.AvgPool2d):
        if mod.divisor_override is not None:
            return "avg pool with divisor_override"
        if mod.ceil_mode:
            return "avg pool with ceil_mode"
    return None


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _emit_fpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # nn.MaxPool2d / nn.AvgPool2d / nn.AdaptiveAvgPool2d of an fp32 or bf16 graph
    mod, x = c.a, ins[0]
    if x.dtype_name not in ("f32", "bf16") or len(x.shape) != 4:
        raise Unsupported(f"pool module on a {x.dtype_name} rank-{len(x.shape)} input")
    if isinstance(mod, torch.nn.AdaptiveAvgPool2d):
        _emit_adaptive_pool(b, x, out, [])
        return
    k, s = _pair(mod.kernel_size), _pair(mod.stride if mod.stride is not None else mod.kernel_size)
    p = _pair(mod.padding)
    d = _pair(getattr(mod, "dilation", 1))
    pad_r = [_pad_right(_spatial(x)[i], _spatial(out)[i], k[i], s[i], d[i], p[i]) for i in range(2)]
    max_pool = isinstance(mod, torch.nn.MaxPool2d)
    alg = "max" if max_pool else "avg_include" if mod.count_include_pad else "avg_exclude"
    b.pool(x, out, alg, k, s, tuple(v - 1 for v in d), p, pad_r, [])


def _emit_adaptive_pool(b: Builder, x: Val, out: Val, eltwise: Eltwise) -> None:
    size, osize = _spatial(x), _spatial(out)
    if not 1 <= len(size) <= 3 or len(osize) != len(size) or any(i % o for i, o in zip(size, osize)):
        raise Unsupported(f"adaptive pool {tuple(size)} -> {tuple(osize)} is not a regular pooling window")
    k = tuple(i // o for i, o in zip(size, osize))
    zero = (0,) * len(k)
    b.pool(x, out, "avg_exclude", k, k, zero, zero, zero, eltwise)


def _always(c: Call) -> str | None:
    return None


@dataclass(frozen=True)
class Rule:
    check: Callable[[Any], str | None]
    emit: Callable[..., None]
    #: number of tensor inputs the node must have
    arity: int | None = 1
    #: its output may take a layout its primitive picks (a "free" value, gml.runtime.plan): fp32
    #: convs and pools, whose oneDNN kernels run fastest in blocked layouts (nChw16c on AVX-512)
    writes_free: bool = False
    #: it reads a free value in any layout (a oneDNN primitive that takes its source as it is)
    reads_free: bool = False
    #: its value is a tuple of views of its input (split) that getitem readers take apart: no step
    tuple_out: bool = False


#: The translation table (see the module docstring), keyed by :attr:`Call.op`. A node whose op is not
#: listed here stays in torch, reported as "no engine kernel".
RULES: dict[str, Rule] = {
    "qconv": Rule(_check_conv, _emit_conv),
    "qconv_add": Rule(_check_conv, _emit_conv_add, 2),
    "qlinear": Rule(_always, _emit_linear),
    "dynamic_linear": Rule(_check_dynamic_linear, _emit_dynamic_linear),
    "qadd": Rule(_check_add, _emit_add, 2),
    "qactivation": Rule(_check_activation, _emit_activation),
    "qmul": Rule(_always, _emit_mul, 2),
    "qmax_pool": Rule(_check_maxpool, _emit_maxpool),
    "qavg_pool2d": Rule(_check_avgpool, _emit_avgpool),
    "qadaptive_avg_pool": Rule(_always, _emit_adaptive),
    "qmean": Rule(_check_qmean, _emit_qmean),
    "qcat": Rule(_always, _emit_cat, None),
    "quantize": Rule(_always, _emit_quantize),
    "dequantize": Rule(_always, _emit_dequantize),
    "requantize": Rule(_always, _emit_requantize),
    "flatten": Rule(_always, _emit_flatten, reads_free=True),
    **{name: Rule(_check_move, _emit_move) for name in sorted(MOVES)},
    fp32.FusedConv.__name__: Rule(_check_fconv, _emit_fconv, writes_free=True, reads_free=True),
    fp32.FusedConvAdd.__name__: Rule(_check_fconv, _emit_fconv_add, 2, writes_free=True, reads_free=True),
    fp32.FusedLinear.__name__: Rule(_always, _emit_flinear),
    "Linear": Rule(_check_flin, _emit_flinear),  # an fp32 nn.Linear the fusion left as it was
    "MaxPool2d": Rule(_check_fpool, _emit_fpool, writes_free=True, reads_free=True),
    "AvgPool2d": Rule(_check_fpool, _emit_fpool, writes_free=True, reads_free=True),
    "AdaptiveAvgPool2d": Rule(_check_fpool, _emit_fpool, writes_free=True, reads_free=True),
    "Flatten": Rule(_check_flatten, _emit_flatten, reads_free=True),
    bf16.Bf16Conv.__name__: Rule(_check_fconv, _emit_bconv),
    bf16.Bf16ConvAdd.__name__: Rule(_check_fconv, _emit_bconv_add, 2),
    bf16.Bf16Linear.__name__: Rule(_check_blinear, _emit_blinear),
    "to_fp32": Rule(_always, _emit_cast),
    "to_bf16": Rule(_always, _emit_cast),
    # after the moves: a fused conv module's output made contiguous (a view, or one reordered copy)
    "contiguous": Rule(_check_contiguous, _emit_flatten, reads_free=True),
    # transformers (gml.runtime.transformer_rules)
    "LayerNorm": Rule(check_layer_norm, emit_layer_norm),
    "Embedding": Rule(check_embedding, emit_embedding),
    "to_bool": Rule(check_to_bool, emit_to_bool),
    "index": Rule(check_index, emit_index, None),
    "and": Rule(check_mask_and, emit_mask_and, 2),
    "expand_mask": Rule(check_expand_mask, emit_expand_mask),
    "attention": Rule(check_attention, emit_attention, None),
    "Add": Rule(check_float_add, emit_float_add, 2),
    "split": Rule(check_split, _always, tuple_out=True),
    "split_item": Rule(check_split_item, emit_split_item),
    **{name: Rule(check_eltwise, emit_eltwise) for name in ("GELU", "ReLU", "Tanh", "Sigmoid", "SiLU")},
}

#: fp32 ops whose ``backend`` names another library for the same fp32 math (MKL's GEMM for a
#: ``FusedLinear``): the engine runs them on oneDNN, equal up to float rounding.
FP32_BACKENDS = {fp32.FusedLinear.__name__: ("mkl", "aten")}


def rule_for(call: Call | None) -> tuple[Rule | None, str | None]:
    """``(rule, None)`` when the engine runs ``call``, else ``(None, reason)``."""
    if call is None:
        return None, "not a lowered GML op (runs in torch)"
    rule = RULES.get(call.op)
    if rule is None:
        return None, f"no engine kernel for {call.op}"
    backend = getattr(call.a, "backend", "onednn")
    backend = getattr(backend, "name", backend)
    if backend != "onednn" and backend not in FP32_BACKENDS.get(call.op, ()):
        return None, f"{call.op} uses the {backend} backend (the engine runs oneDNN's math)"
    reason = rule.check(call)
    return (None, reason) if reason else (rule, None)
