"""What every translation rule shares: the :class:`Call` a rule reads, the :class:`TranslationRule`
value, and the helpers more than one op family uses (qparams, oneDNN post-ops, padding, row views).

Vocabulary (one word for one thing): a **translation rule** (:class:`TranslationRule`) says how one
op of the lowered graph becomes engine steps; the **builder** (:class:`~gml.runtime.plan.Builder`)
records those steps for one input shape; the **native plan** is what the builder hands to the
engine. (Lowering rules, ``gml.quant.lower``, and rewrite rules, ``gml.ir.match.Rule``, are other
things: they change the graph, these read it.)

Quantization convention (the IR's): ``real = (q - zero_point) * scale`` on uint8.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from gml.ir.values import PostOp, QParams
from gml.runtime.plan import QP, Builder, Eltwise, Unsupported, Val, is_nhwc, nhwc_strides
from gml.runtime.plan import _contiguous as contiguous_strides

#: what a table entry is keyed by: the gml op name (``"qconv"``, docs/ir.md) or the Tensor method a
#: view op is (``"permute"``); the module class of a ``call_module`` node (``fp32.FusedConv``,
#: ``nn.LayerNorm``); the function of a ``call_function`` node no name covers (``bf16.to_fp32``)
OpKey = str | type | Callable[..., Any]


def op_name(op: OpKey) -> str:
    """How reports and reasons name ``op``: the string itself, else its ``__name__``."""
    return op if isinstance(op, str) else str(getattr(op, "__name__", op))


@dataclass(frozen=True)
class Call:
    """One node as a translation rule reads it: what it computes, and its arguments.

    ``op`` is the table key (:data:`OpKey`); ``a`` holds the arguments by schema name with
    ``get_attr`` constants resolved to tensors (for a module, the module itself); ``inputs`` are the
    activation values, in schema order. ``engine_runs`` answers whether the engine runs another
    node (the whole table's answer, set by :func:`gml.runtime.rules.read_call`): a view's rule
    asks it about the node its source comes from.
    """

    op: OpKey
    a: Any
    inputs: tuple[fx.Node, ...]
    engine_runs: Callable[[fx.Node], bool] | None = None

    @property
    def name(self) -> str:
        return op_name(self.op)


@dataclass(frozen=True)
class TranslationRule:
    """How the engine runs one op: ``check(call) -> reason | None`` (shape-independent; a reason
    keeps the node in torch, the runtime report prints it) and ``emit(builder, call, inputs,
    output)``, the engine steps for one input shape (it may raise
    :class:`~gml.runtime.plan.Unsupported` for a shape the engine cannot take: the segment then runs
    in torch for that shape)."""

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
    #: its value is a size (``x.shape``, ``x.size(1)``, ``n // 2``), fixed for the plan's input
    #: shapes: no step; the segment returns it as it was when the plan was made
    size_out: bool = False
    #: the ``backend`` values the node may name besides oneDNN: another library for the same fp32
    #: math (MKL's GEMM for a ``FusedLinear``), which the engine runs on oneDNN, equal up to rounding;
    #: or GML's own arithmetic (a ``qlinear``'s ``gml``), which the rule runs on GML's kernel
    other_backends: tuple[str, ...] = ()


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


def pads_right(
    x: Val, out: Val, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int], pad_left: Sequence[int]
) -> list[int]:
    """oneDNN's right padding per spatial dim that makes ``out``'s outputs from ``x`` (PyTorch floors /
    ceils, oneDNN is explicit): ``(out - 1) * stride + (kernel - 1) * dilation + 1 - size - pad_left``."""
    windows = zip(spatial(x), spatial(out), kernel, stride, dilation, pad_left, strict=True)
    return [(o - 1) * s + (k - 1) * d + 1 - i - p for i, o, k, s, d, p in windows]


def spatial(v: Val) -> tuple[int, ...]:
    return v.shape[2:]


def qparams(scale: float, zero_point: int) -> QParams:
    return QParams(float(scale), int(zero_point))


def x_qparams(a: Any) -> QParams:
    return qparams(a.x_scale, a.x_zero_point)


def out_qparams(a: Any) -> QParams | None:
    """The output qparams; ``None`` where the op writes fp32 (``out_dtype=torch.float32``)."""
    if getattr(a, "out_dtype", torch.uint8) != torch.uint8:
        return None
    return qparams(a.out_scale, a.out_zero_point)


def post_op_of(a: Any) -> PostOp:
    return PostOp(a.post_op, tuple(a.post_op_scalars), a.post_op_algorithm or "")


def always(c: Call) -> str | None:
    return None


def converted(b: Builder, v: Val, dtype: str) -> Val:
    """``v`` in ``dtype`` (f32 <-> bf16), a reorder into a temp of ``v``'s layout."""
    t = b.temp(v.shape, v.stride, dtype)
    b.reorder(v, t, src_q=None, dst_q=None)
    return t


def meta_shape(node: Any) -> tuple[int, ...] | None:
    """The static shape shape propagation / export recorded for ``node`` (None when unknown or
    symbolic)."""
    if not isinstance(node, fx.Node):
        return None
    shape = getattr(node.meta.get("val", node.meta.get("tensor_meta")), "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def meta_dtype(node: Any) -> torch.dtype | None:
    """The dtype shape propagation / export recorded for ``node`` (None when unknown: a segment's
    own placeholders; the emit functions check the values' actual dtypes again)."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get("val", node.meta.get("tensor_meta"))
    return getattr(meta, "dtype", None)


#: the float dtypes the engine computes in
FLOATS = (torch.float32, torch.bfloat16)


def rows_strides(v: Val) -> tuple[int, int] | None:
    """``(row stride, feature stride)`` when ``v``'s leading dims collapse into one (a view), else None."""
    dims = [(d, s) for d, s in zip(v.shape[:-1], v.stride[:-1]) if d != 1]
    for (_, outer), (d, inner) in itertools.pairwise(dims):
        if outer != inner * d:
            return None
    return (dims[-1][1] if dims else v.shape[-1] * v.stride[-1]), v.stride[-1]


def plain_or_channels_last(v: Val) -> bool:
    """Whether ``v``'s layout is one GML's gather-style kernel steps (``GroupNormStep``,
    ``ResizeStep``) read and write as it is: free (the fp32 convs' fixed NHWC), dense plain, or dense
    channels-last."""
    return v.free or v.stride == contiguous_strides(v.shape) or (len(v.shape) >= 3 and is_nhwc(v))


def dense(b: Builder, v: Val) -> Val:
    """``v``, or a dense row-major copy of it (for a step that reads plain rows)."""
    if v.stride == contiguous_strides(v.shape):
        return v
    t = b.temp(v.shape, contiguous_strides(v.shape), v.dtype_name)
    b.reorder(v, t, src_q=None, dst_q=None)
    return t


def as_rows(b: Builder, v: Val, *, output: bool = False) -> Val:
    """``v`` ([..., features], rank >= 2) as the 2-D ``[rows, features]`` matrix an inner product
    takes: a view of the same bytes, or (an input whose dims do not collapse, or whose features are
    not contiguous) a contiguous copy."""
    if not output and v.shape[-1] > 1 and v.stride[-1] != 1:
        # features strided (a transposed token matrix: timm XCiT's attention output): oneDNN's inner
        # product has only its reference kernel for such a source (xcit_nano fp32: 28x the executor)
        t = b.temp(v.shape, contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        v = t
    if len(v.shape) == 2:
        if v.stride[0] == v.shape[1] * v.stride[1]:
            return v
        if v.shape[0] == 1:
            # one row picked out of a bigger tensor (BERT's pooler: hidden[:, 0]): its row stride
            # is irrelevant, but oneDNN reads it and falls to its reference inner product
            return b.view(v, v.shape, (v.shape[1] * v.stride[1], v.stride[1]))
        if output:
            return v
        # rows picked out of a bigger tensor (a ViT head on x[:, 0] at batch 2): oneDNN 3.2's inner
        # product has only its reference kernel for strided rows (fp32 and bf16): a dense copy
        t = b.temp(v.shape, contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        return t
    rows = 1
    for d in v.shape[:-1]:
        rows *= d
    strides = rows_strides(v)
    if strides is None:
        if output:
            raise Unsupported(f"linear output layout {v.stride} does not collapse to rows")
        t = b.temp(v.shape, contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        v, strides = t, (v.shape[-1], 1)
    return as_rows(b, b.view(v, (rows, v.shape[-1]), strides), output=output)  # strided rows: as above


def as_nhwc(b: Builder, v: Val) -> Val:
    """``v``, or a channels-last copy of it: oneDNN's INT8 convs and pools are jitted for NHWC only;
    any other layout (a quantized permute of LayerNorm's output in ConvNeXt, timm botnet26t's
    attention output pooled 2 x 2) falls to its reference kernel, hundreds of times slower (issue
    #16: convnext_atto, resnest14d)."""
    if is_nhwc(v):
        return v
    t = b.temp(v.shape, nhwc_strides(v.shape), v.dtype_name)
    b.reorder(v, t, src_q=None, dst_q=None)
    return t


def bf16_src(b: Builder, x: Val) -> Val:
    """``x`` as bf16, and NHWC when it is 4-D: oneDNN's fast bf16 convs (brgconv) take NHWC; an
    NCHW bf16 source gets its reference kernel (measured: 17 s for ResNet18's stem)."""
    want = nhwc_strides(x.shape) if len(x.shape) == 4 else x.stride
    if x.dtype_name == "bf16" and x.stride == want:
        return x
    if x.dtype_name not in ("f32", "bf16"):
        raise Unsupported(f"bf16 kernel input {x.dtype_name}")
    t = b.temp(x.shape, want, "bf16")
    b.reorder(x, t, src_q=None, dst_q=None)
    return t


def broadcast_view(b: Builder, v: Val, rank: int) -> Val:
    """``v`` with leading 1s up to ``rank`` and every stride-0 (expanded) dim seen as size 1."""
    shape = (1,) * (rank - len(v.shape)) + tuple(v.shape)
    stride = (0,) * (rank - len(v.shape)) + tuple(v.stride)
    if shape == v.shape and 0 not in stride:
        return v
    shape = tuple(1 if s == 0 else d for d, s in zip(shape, stride))
    dense, acc = [], 1  # strides of size-1 dims are free: give them plain values oneDNN accepts
    for d, s in reversed(list(zip(shape, stride))):
        dense.append(s if d != 1 else acc)
        acc = max(acc, (s if d != 1 else acc) * d)
    return b.view(v, shape, tuple(reversed(dense)))


__all__ = [
    "FLOATS", "Builder", "Call", "Eltwise", "OpKey", "TranslationRule", "Unsupported", "Val", "always",
    "as_rows", "bf16_src", "broadcast_view", "contiguous_strides", "eltwise_of", "is_nhwc", "meta_dtype",
    "nhwc_strides", "op_name", "out_qparams", "pads_right", "post_op_of", "qp", "qparams", "requant_eltwise",
    "rows_strides", "spatial", "x_qparams",
]  # fmt: skip
