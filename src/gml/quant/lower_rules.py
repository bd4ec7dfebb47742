"""The lowering rules of :class:`~gml.quant.lower.LowerToGML`: one per INT8 op family, as values.

A rule is a function ``(ctx, producer node, output qparams) -> plan | None``: ``None`` when the
producer is not its pattern, :class:`Decline` with the reason shown to the user when it is but
cannot be lowered (a post-op the backend's kernel lacks, an fp32 input, a padding mode), else a
:class:`_Plan` — the :mod:`gml.quant.modules` value that replaces the pattern, its uint8 inputs in
argument order and the fp32 nodes it covers. :data:`RULES` is the ordered list the pass tries on
the producer of every quantize node; the first plan wins. The recognisers (what a module behaves
as: conv/linear with a fused activation, add, activations) and builders (weights, geometry, the
trial of a plan against the backend) come first, then the rules, then the table.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import fx, nn

from gml.ir.layers import behaves_as
from gml.ir.ops import ACTIVATION_KINDS, INT8_KINDS
from gml.ir.qdq import is_dequantize
from gml.ir.values import ConvSpec, QParams
from gml.kernels.backend import Int8Backend
from gml.kernels.fp32 import NO_POST_OP, PostOp, post_op_of, post_op_of_module
from gml.passes.oplib import node_label, op_kind
from gml.quant.backend_config import ConvAct2d, LinearAct
from gml.quant.modules import (
    MOVE_METHODS,
    PIECE_METHODS,
    GMLQuantModuleBase,
    QActivation,
    QAdaptiveAvgPool2d,
    QAdaptiveAvgPool3d,
    QAdd,
    QAvgPool2d,
    QBatchNorm2d,
    QCat,
    QConv1d,
    QConv2d,
    QConv2dAdd,
    QConv3d,
    QFlatten,
    QHardtanh,
    QLinear,
    QMaxPool2d,
    QMaxPool3d,
    QMean,
    QMove,
    QMul,
    QPad,
    QReLU,
    RuntimeArg,
    extract_qparams,
    reference_weight,
)

try:  # gml.nn.Add / Mul are the normalized forms of every add / mul spelling (ADR 001)
    from gml.nn import Add as _GmlAdd
    from gml.nn import Mul as _GmlMul
except ImportError:  # pragma: no cover
    _GmlAdd = _GmlMul = None  # type: ignore[assignment,misc]


class Decline(Exception):
    """A rule saw its pattern but cannot lower it; the message is the reason shown to the user."""


@dataclass
class _Plan:
    module: nn.Module
    inputs: list[fx.Node]  # uint8 producers, in the module's argument order
    covered: list[fx.Node]  # the fp32 op nodes the module replaces
    label: str


Rule = Callable[["_Ctx", fx.Node, "QParams | None"], "_Plan | None"]


@dataclass
class _Ctx:
    gm: fx.GraphModule
    backend: Int8Backend
    modules: dict[str, nn.Module]
    #: shapes of the uint8 inputs :meth:`u8_input` handed to the rule being tried (for its trial run)
    input_shapes: list[tuple[int, ...] | None] = field(default_factory=list)

    def module(self, node: fx.Node) -> nn.Module | None:
        return self.modules.get(str(node.target)) if node.op == "call_module" else None

    def produces_u8(self, node: Any) -> bool:
        """A lowered node whose output is a uint8 tensor (not an fp32-output kernel)."""
        mod = self.module(node) if isinstance(node, fx.Node) else None
        return isinstance(mod, GMLQuantModuleBase) and mod.output_qparams is not None

    def u8_input(self, arg: Any) -> tuple[fx.Node, QParams]:
        """The uint8 producer behind a dequantize argument, with its qparams."""
        if not isinstance(arg, fx.Node) or not is_dequantize(arg):
            raise Decline("an input is not quantized (it comes from an fp32 region)")
        src = arg.args[0]
        if not self.produces_u8(src):
            raise Decline("an input's quantize op could not be lowered")
        qp = extract_qparams(src, self.gm)
        assert qp is not None
        self.input_shapes.append(_shape(arg))
        return src, qp

    def label(self, node: fx.Node) -> str:
        return node_label(node, self.modules)

    def unary(self, node: fx.Node, out_qp: QParams, cls: type[nn.Module], *params: Any, **options: Any) -> _Plan:
        """The one-module plan for ``node`` on its first input read as uint8:
        ``cls(*params, input_qparams, out_qp, backend=..., **options)`` (the constructor order of
        every single-input plan value)."""
        src, in_qp = self.u8_input(node.args[0])
        q = cls(*params, in_qp, out_qp, backend=self.backend, **options)
        return _Plan(q, [src], [node], self.label(node))


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def _ntuple(v: Any, n: int) -> tuple[int, ...]:
    """A module's int-or-tuple geometry argument as ``n`` ints."""
    return (int(v),) * n if isinstance(v, int) else tuple(int(x) for x in v)


def _pair(v: Any) -> tuple[int, int]:
    return _ntuple(v, 2)  # type: ignore[return-value]


# ---------------------------------------------------------------- op recognisers
def _fused_post_op(act: nn.Module) -> PostOp:
    post_op = post_op_of_module(act)
    if isinstance(post_op, str):
        raise Decline(post_op)
    return post_op


def _as_layer(mod: nn.Module | None, layer: type, with_relu: type, with_act: type) -> tuple[Any, PostOp] | None:
    """(layer, fused post-op) for a ``layer`` (float or reference), its torch.ao ``with_relu``
    container and GML's ``with_act`` container (layer → any fusable activation); else ``None``."""
    if isinstance(mod, with_relu) and behaves_as(mod[0], layer):
        return mod[0], PostOp("relu")
    if isinstance(mod, with_act) and behaves_as(mod[0], layer):
        return mod[0], _fused_post_op(mod[1])
    if behaves_as(mod, layer):
        return mod, NO_POST_OP
    return None


def _as_conv(mod: nn.Module | None) -> tuple[nn.Conv2d, PostOp] | None:
    """(conv, fused post-op) for Conv2d, reference Conv2d, ``nni.ConvReLU2d`` and :class:`ConvAct2d`."""
    return _as_layer(mod, nn.Conv2d, nni.ConvReLU2d, ConvAct2d)


def _as_linear(mod: nn.Module | None) -> tuple[nn.Linear, PostOp] | None:
    """(linear, fused post-op) for Linear, reference Linear, ``nni.LinearReLU`` and :class:`LinearAct`."""
    return _as_layer(mod, nn.Linear, nni.LinearReLU, LinearAct)


def _is_plain_add_module(mod: nn.Module | None) -> bool:
    return _GmlAdd is not None and isinstance(mod, _GmlAdd) and mod.alpha == 1


def _add_operands(ctx: _Ctx, node: fx.Node) -> tuple[Any, Any] | None:
    """The two operands of a tensor-tensor add in any spelling, or None if ``node`` is no add."""
    mod = ctx.module(node)
    if node.op == "call_module":
        if _GmlAdd is not None and isinstance(mod, _GmlAdd):
            if mod.alpha != 1:
                raise Decline(f"add with alpha={mod.alpha} has no INT8 kernel")
            return node.args[0], node.args[1]
        return None
    if op_kind(node, ctx.modules) != "add" or node.target in (operator.iadd,):
        return None
    if node.kwargs.get("alpha", 1) != 1:
        raise Decline("add with alpha != 1 has no INT8 kernel")
    args = list(node.args)
    if len(args) != 2 or not all(isinstance(a, fx.Node) for a in args):
        return None  # add of a constant: handled (declined) by the generic fallback
    return args[0], args[1]


#: Activations a conv/linear kernel may fuse, or that have a standalone INT8 op.
#: activations with an INT8 lowering (standalone, or fused as a conv / linear post-op): the op table's tags
INT8_ACTIVATION_KINDS = ACTIVATION_KINDS & INT8_KINDS


def _is_activation(ctx: _Ctx, node: fx.Node) -> bool:
    return op_kind(node, ctx.modules) in INT8_ACTIVATION_KINDS


def _fuses_into(ctx: _Ctx, producer: fx.Node, act: fx.Node) -> bool:
    """Whether the backend's conv / linear kernel can compute ``act(producer(x))`` as one op."""
    if not _is_activation(ctx, act):
        return False
    post_op = post_op_of(act, ctx.modules)
    mod = ctx.module(producer)
    if isinstance(post_op, str) or mod is None:
        return False
    try:
        conv, lin = _as_conv(mod), _as_linear(mod)
    except Decline:
        return False
    if conv is not None:
        return conv[1] == NO_POST_OP and ctx.backend.fuses("conv2d", post_op)
    return lin is not None and lin[1] == NO_POST_OP and ctx.backend.fuses("linear", post_op)


def _activation(ctx: _Ctx, node: fx.Node) -> PostOp | None:
    """The element-wise function ``node`` computes, as a post-op, if it is an activation we lower."""
    if op_kind(node, ctx.modules) not in INT8_ACTIVATION_KINDS:
        return None
    post_op = post_op_of(node, ctx.modules)
    if isinstance(post_op, str):
        raise Decline(post_op)
    return post_op


# ---------------------------------------------------------------- builders
def _check_padding(conv: nn.Module) -> None:
    if isinstance(conv.padding, str):
        raise Decline(f"conv padding={conv.padding!r} (string padding) is not supported by the INT8 conv")
    if conv.padding_mode != "zeros":
        raise Decline(f"conv padding_mode={conv.padding_mode!r}; the INT8 conv pads with zeros only")


def _conv_spec(conv: nn.Conv2d) -> ConvSpec:
    _check_padding(conv)
    return ConvSpec(_pair(conv.stride), _pair(conv.padding), _pair(conv.dilation), int(conv.groups))


def _conv_out_shape(
    x_shape: tuple[int, ...] | None, out_channels: int, kernel: Sequence[int], spec: ConvSpec
) -> tuple[int, ...] | None:
    """A 2-D conv's output shape for an input of ``x_shape`` (torch's formula), if that is known."""
    if x_shape is None or len(x_shape) != 4:
        return None
    k = _pair(tuple(kernel))
    hw = [
        (size + 2 * pad - dil * (kk - 1) - 1) // stride + 1
        for size, pad, dil, kk, stride in zip(x_shape[2:], spec.padding, spec.dilation, k, spec.stride)
    ]
    return (x_shape[0], int(out_channels), *hw)


def _weights(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    try:
        w, ws = reference_weight(mod)
    except ValueError as e:
        raise Decline(f"{e}; no INT8 kernel for it") from None
    bias = mod.bias.detach() if getattr(mod, "bias", None) is not None else None
    return w, ws, bias


def _check_fuses(ctx: _Ctx, op: str, post_op: PostOp) -> None:
    if not ctx.backend.fuses(op, post_op):
        raise Decline(f"the {ctx.backend.name} backend has no INT8 {op} kernel with a {post_op} post-op")


def _qconv(ctx: _Ctx, conv: nn.Conv2d, x_arg: Any, out_qp: QParams | None, post_op: PostOp, covered, label) -> _Plan:
    spec = _conv_spec(conv)
    _check_fuses(ctx, "conv2d", post_op)
    src, in_qp = ctx.u8_input(x_arg)
    w, ws, b = _weights(conv)
    mod = QConv2d(w, ws, b, spec, in_qp, out_qp, post_op=post_op, input_shape=_shape(x_arg), backend=ctx.backend)
    return _Plan(mod, [src], covered, label)


def _qconv_add(
    ctx: _Ctx, conv: nn.Conv2d, x_arg: Any, other_arg: Any, out_qp: QParams, relu: bool, covered, label
) -> _Plan:
    if not ctx.backend.supports_conv_add:
        raise Decline(f"the {ctx.backend.name} backend has no fused conv+add kernel")
    spec = _conv_spec(conv)
    src, in_qp = ctx.u8_input(x_arg)
    other, other_qp = ctx.u8_input(other_arg)
    other_shape, out_shape = _shape(other_arg), _shape(covered[-1])
    conv_shape = _conv_out_shape(_shape(x_arg), conv.out_channels, conv.kernel_size, spec)
    # (the PassManager propagates shapes before every pass; without metadata the trial run decides)
    if any(s is not None and out_shape is not None and s != out_shape for s in (conv_shape, other_shape)):
        raise Decline(
            f"conv+add of shapes {conv_shape and list(conv_shape)} and {other_shape and list(other_shape)} "
            "broadcasts; the fused kernel "
            "(sum post-op) needs equal shapes"
        )
    w, ws, b = _weights(conv)
    mod = QConv2dAdd(w, ws, b, spec, in_qp, other_qp, out_qp, relu=relu, input_shape=_shape(x_arg), backend=ctx.backend)
    return _Plan(mod, [src, other], covered, label)


def _conv_add_module(ctx: _Ctx, node: fx.Node, mod: nn.Module | None) -> tuple[nn.Conv2d, bool] | None:
    if isinstance(mod, nni.ConvAdd2d | nni.ConvAddReLU2d) and behaves_as(mod[0], nn.Conv2d):
        if not _is_plain_add_module(mod.add) and mod.add not in (operator.add, torch.add):
            alpha = getattr(getattr(mod.add, "add", mod.add), "alpha", "?")
            raise Decline(f"conv+add with a scaled or swapped add (alpha={alpha}) has no INT8 kernel")
        return mod[0], isinstance(mod, nni.ConvAddReLU2d)
    return None


# ---------------------------------------------------------------- rules: producer node → plan
def _layer_rule(as_layer: Callable[[nn.Module | None], Any], lower: Callable[..., _Plan]) -> Rule:
    """The rule of a weighted layer alone: ``as_layer`` recognises the node's module (the layer and
    its fused post-op, or None), ``lower`` plans it (:func:`_qconv`, :func:`_qlinear`)."""

    def rule(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
        hit = as_layer(ctx.module(node))
        if hit is None:
            return None
        layer, post_op = hit
        return lower(ctx, layer, node.args[0], out_qp, post_op, [node], ctx.label(node))

    return rule


_rule_conv = _layer_rule(_as_conv, _qconv)


def _rule_conv1d(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """``Conv1d`` / ``ConvReLU1d`` → :class:`QConv1d` (the 2-D kernel at height 1)."""
    mod = ctx.module(node)
    if isinstance(mod, nni.ConvReLU1d) and behaves_as(mod[0], nn.Conv1d):
        conv, post_op = mod[0], PostOp("relu")
    elif behaves_as(mod, nn.Conv1d):
        conv, post_op = mod, NO_POST_OP
    else:
        return None
    _check_fuses(ctx, "conv2d", post_op)
    _check_padding(conv)
    (stride,), (pad,), (dil,) = conv.stride, conv.padding, conv.dilation
    spec = ConvSpec((1, int(stride)), (0, int(pad)), (1, int(dil)), int(conv.groups))
    src, in_qp = ctx.u8_input(node.args[0])
    w, ws, b = _weights(conv)
    shape = _shape(node.args[0])
    q = QConv1d(w, ws, b, spec, in_qp, out_qp, post_op=post_op, input_shape=shape, backend=ctx.backend)
    return _Plan(q, [src], [node], ctx.label(node))


def _rule_conv3d(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """``Conv3d`` / ``ConvReLU3d`` (video models) → :class:`QConv3d`."""
    mod = ctx.module(node)
    if isinstance(mod, nni.ConvReLU3d) and behaves_as(mod[0], nn.Conv3d):
        conv, relu = mod[0], True
    elif behaves_as(mod, nn.Conv3d):
        conv, relu = mod, False
    else:
        return None
    if not ctx.backend.has_conv3d:
        raise Decline(f"the {ctx.backend.name} backend has no INT8 conv3d kernel")
    if relu and (out_qp is None or out_qp.zero_point != 0):
        # the 5-D kernel has no eltwise post-op: ReLU comes from saturating at a zero point of 0
        raise Decline("conv3d + relu whose output is fp32 or has a non-zero zero point (no relu post-op in 3-D)")
    _check_padding(conv)
    spec = ConvSpec(_ntuple(conv.stride, 3), _ntuple(conv.padding, 3), _ntuple(conv.dilation, 3), int(conv.groups))
    src, in_qp = ctx.u8_input(node.args[0])
    w, ws, b = _weights(conv)
    q = QConv3d(w, ws, b, spec, in_qp, out_qp, relu=relu, input_shape=_shape(node.args[0]), backend=ctx.backend)
    return _Plan(q, [src], [node], ctx.label(node))


def _rule_conv_add(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    hit = _conv_add_module(ctx, node, ctx.module(node))
    if hit is None:
        return None
    conv, relu = hit
    return _qconv_add(ctx, conv, node.args[0], node.args[1], out_qp, relu, [node], ctx.label(node))


def _qlinear(ctx: _Ctx, lin: nn.Linear, x_arg: Any, out_qp: QParams | None, post_op: PostOp, covered, label) -> _Plan:
    _check_fuses(ctx, "linear", post_op)
    src, in_qp = ctx.u8_input(x_arg)
    w, ws, b = _weights(lin)
    mod = QLinear(w, ws, b, in_qp, out_qp, post_op=post_op, input_shape=_shape(x_arg), backend=ctx.backend)
    return _Plan(mod, [src], covered, label)


_rule_linear = _layer_rule(_as_linear, _qlinear)


def _qadd(ctx: _Ctx, node: fx.Node, operands: tuple[Any, Any], out_qp: QParams, relu: bool, covered) -> _Plan:
    a, a_qp = ctx.u8_input(operands[0])
    b, b_qp = ctx.u8_input(operands[1])
    sa, sb = _shape(operands[0]), _shape(operands[1])
    if sa is not None and sb is not None and sa != sb:
        raise Decline(f"add of shapes {list(sa)} and {list(sb)} (broadcasting) has no INT8 kernel")
    mod = QAdd(a_qp, b_qp, out_qp, relu=relu, backend=ctx.backend)
    return _Plan(mod, [a, b], covered, "add" + (" → relu" if relu else ""))


def _rule_add(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    operands = _add_operands(ctx, node)
    if operands is None:
        return None
    return _qadd(ctx, node, operands, out_qp, False, [node])


def _rule_activation(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """An activation fused into its producer when it is the only reader (conv / linear: any
    post-op the backend's kernel has; conv+add and add: relu), else a standalone INT8 op (relu,
    relu6/hardtanh as integer clamps; hardswish, sigmoid, hardsigmoid on the backend's kernels)."""
    post_op = _activation(ctx, node)
    if post_op is None:
        return None
    prod = node.args[0]
    is_relu = post_op == PostOp("relu")
    if isinstance(prod, fx.Node) and not is_dequantize(prod) and _single_user(prod):
        pmod = ctx.module(prod)
        label = f"{ctx.label(prod)} → {ctx.label(node)}"
        conv = _as_conv(pmod)
        if conv is not None and conv[1] == NO_POST_OP:
            return _qconv(ctx, conv[0], prod.args[0], out_qp, post_op, [prod, node], label)
        lin = _as_linear(pmod)
        if lin is not None and lin[1] == NO_POST_OP:
            return _qlinear(ctx, lin[0], prod.args[0], out_qp, post_op, [prod, node], label)
        if out_qp is None:
            return None  # only the weighted kernels write fp32
        conv_add = _conv_add_module(ctx, prod, pmod)
        if conv_add is not None and not conv_add[1] and is_relu:
            return _qconv_add(ctx, conv_add[0], prod.args[0], prod.args[1], out_qp, True, [prod, node], label)
        operands = _add_operands(ctx, prod)
        if operands is not None and is_relu:
            return _qadd(ctx, prod, operands, out_qp, True, [prod, node])
    if out_qp is None:
        return None
    src, in_qp = ctx.u8_input(prod)
    if is_relu:
        return _Plan(QReLU(in_qp, out_qp, backend=ctx.backend), [src], [node], "relu")
    if post_op.attr == "hardtanh":
        lo, hi = post_op.scalars
        return _Plan(QHardtanh(lo, hi, in_qp, out_qp, backend=ctx.backend), [src], [node], ctx.label(node))
    if post_op.attr not in ctx.backend.activations:
        raise Decline(f"no INT8 kernel for {ctx.label(node)} on its own (only fused after a conv or linear)")
    return _Plan(QActivation(post_op, in_qp, out_qp, backend=ctx.backend), [src], [node], ctx.label(node))


def _rule_mul(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """Tensor × tensor (``gml.nn.Mul`` or any function spelling), broadcasting allowed."""
    if out_qp is None:
        return None
    if node.op == "call_module":
        if _GmlMul is None or not isinstance(ctx.module(node), _GmlMul):
            return None
    elif op_kind(node, ctx.modules) != "mul" or node.op != "call_function" or node.kwargs:
        return None  # (x.mul(y) and in-place spellings are normalized to gml.nn.Mul before this)
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None  # a product with a constant: declined by the generic fallback
    a, a_qp = ctx.u8_input(node.args[0])
    b, b_qp = ctx.u8_input(node.args[1])
    return _Plan(QMul(a_qp, b_qp, out_qp, backend=ctx.backend), [a, b], [node], "mul")


def _rule_mean(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """``x.mean(dims, keepdim)`` / ``torch.mean(x, dims, keepdim)`` with constant dims."""
    if out_qp is None:
        return None
    if not ((node.op == "call_method" and node.target == "mean") or node.target is torch.mean):
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = (dims,) if isinstance(dims, int) else dims
    if node.kwargs.get("dtype") is not None or not isinstance(keepdim, bool):
        raise Decline("mean with a dtype or a run-time keepdim has no INT8 kernel")
    if not isinstance(dims, list | tuple) or not dims or not all(isinstance(d, int) for d in dims):
        raise Decline("mean over all dims or run-time dims has no INT8 kernel")
    return ctx.unary(node, out_qp, QMean, tuple(dims), keepdim)


def _rule_max_pool(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    mod = ctx.module(node)
    if not behaves_as(mod, (nn.MaxPool2d, nn.MaxPool3d)):
        return None
    if mod.return_indices:
        raise Decline("max pool returning indices has no INT8 kernel")
    cls, n = (QMaxPool2d, 2) if isinstance(mod, nn.MaxPool2d) else (QMaxPool3d, 3)
    stride = mod.stride if mod.stride is not None else mod.kernel_size
    window = (_ntuple(v, n) for v in (mod.kernel_size, stride, mod.padding, mod.dilation))
    return ctx.unary(node, out_qp, cls, *window, bool(mod.ceil_mode))


def _rule_batch_norm(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """A BatchNorm2d left after folding (nothing to fold into), alone or fused with its ReLU."""
    if out_qp is None:
        return None
    mod = ctx.module(node)
    relu = isinstance(mod, nni.BNReLU2d)
    bn = mod[0] if relu else mod
    if not behaves_as(bn, nn.BatchNorm2d):
        return None
    if bn.training:
        raise Decline("batch norm in training mode (batch statistics) has no INT8 kernel")
    if bn.running_mean is None or bn.running_var is None:
        raise Decline("batch norm without running statistics has no INT8 kernel")
    return ctx.unary(node, out_qp, QBatchNorm2d, bn, relu=relu)


def _rule_avg_pool(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    mod = ctx.module(node)
    if behaves_as(mod, nn.AvgPool2d):
        stride = mod.stride if mod.stride is not None else mod.kernel_size
        window = (_pair(mod.kernel_size), _pair(stride), _pair(mod.padding))
        flags = (bool(mod.ceil_mode), bool(mod.count_include_pad), mod.divisor_override)
        return ctx.unary(node, out_qp, QAvgPool2d, *window, *flags)
    if not behaves_as(mod, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        return None
    cls, n = (QAdaptiveAvgPool2d, 2) if isinstance(mod, nn.AdaptiveAvgPool2d) else (QAdaptiveAvgPool3d, 3)
    size = mod.output_size
    size = (size,) * n if isinstance(size, int) else tuple(size)
    if any(s is None for s in size):
        raise Decline("adaptive avg pool with a None output size has no INT8 kernel")
    return ctx.unary(node, out_qp, cls, tuple(int(s) for s in size))


def _rule_flatten(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    mod = ctx.module(node)
    if behaves_as(mod, nn.Flatten):
        start, end = mod.start_dim, mod.end_dim
    elif op_kind(node, ctx.modules) == "flatten" and node.op != "call_module":
        extra = list(node.args[1:])
        start = extra[0] if extra else node.kwargs.get("start_dim", 0)
        end = extra[1] if len(extra) > 1 else node.kwargs.get("end_dim", -1)
        if not isinstance(start, int) or not isinstance(end, int):
            raise Decline("flatten with dims computed at run time")
    else:
        return None
    return ctx.unary(node, out_qp, QFlatten, start, end)


_MOVE_FUNCTIONS: dict[Any, str] = {
    torch.reshape: "reshape",
    torch.transpose: "transpose",
    torch.permute: "permute",
    torch.squeeze: "squeeze",
    torch.unsqueeze: "unsqueeze",
}


def _move_method(node: fx.Node) -> str | None:
    if node.op == "call_method" and node.target in MOVE_METHODS:
        return str(node.target)
    if node.op == "call_function":
        if node.target is torch.chunk:
            return "chunk"
        if node.target is torch.split:
            return "split"
        return _MOVE_FUNCTIONS.get(node.target)
    return None


def _move_args(node: fx.Node, args: Sequence[Any]) -> tuple[list[Any], list[fx.Node]]:
    """Constant arguments as they are, values computed at run time (sizes) as :class:`RuntimeArg`
    slots plus the nodes that feed them."""
    template: list[Any] = []
    runtime: list[fx.Node] = []
    for a in args:
        if isinstance(a, fx.Node):
            template.append(RuntimeArg())
            runtime.append(a)
        elif isinstance(a, int | list | tuple) and all(not isinstance(v, fx.Node) for v in _flat(a)):
            template.append(a)
        else:
            raise Decline(f"{node.name} has an argument the INT8 data movement cannot replay ({a!r})")
    return template, runtime


def _flat(a: Any) -> list[Any]:
    return [v for x in a for v in _flat(x)] if isinstance(a, list | tuple) else [a]


def _rule_move(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """view / reshape / transpose / permute / contiguous / (un)squeeze, and ``chunk(...)[i]`` /
    ``split(...)[i]`` (Res2Net, MixNet, CSP), on the
    integers (ShuffleNet's channel shuffle and split)."""
    if out_qp is None:
        return None
    item: int | None = None
    target = node
    if node.op == "call_function" and node.target is operator.getitem:
        src, index = node.args
        if not isinstance(src, fx.Node) or _move_method(src) not in PIECE_METHODS or not isinstance(index, int):
            return None
        target, item = src, index
    method = _move_method(target)
    if method is None or (method in PIECE_METHODS) != (item is not None):
        return None
    if target.kwargs and set(target.kwargs) - {"dim"}:
        raise Decline(f"{method} with keyword arguments {sorted(target.kwargs)} has no INT8 replay")
    args = list(target.args[1:]) + ([target.kwargs["dim"]] if "dim" in target.kwargs else [])
    template, runtime = _move_args(target, args)
    src, in_qp = ctx.u8_input(target.args[0])
    q = QMove(method, template, in_qp, out_qp, item=item, backend=ctx.backend)
    label = ctx.label(target) + ("" if item is None else f"[{item}]")
    return _Plan(q, [src, *runtime], [node], label)


def _rule_pad(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    """A constant zero pad (``F.pad``, ``nn.ZeroPad2d``, ``nn.ConstantPad2d(p, 0)``) on the integers,
    padding with the zero point (a symmetric one before a conv was folded into its padding)."""
    from gml.ir.ops import pad_of

    spec = pad_of(node, ctx.modules) if out_qp is not None else None
    if spec is None:
        return None
    pads, mode, value = spec
    if mode != "constant" or value not in (None, 0, 0.0):
        raise Decline(f"a {mode} pad with value {value} has no INT8 replay (only zero pads)")
    template, runtime = _move_args(node, pads)  # sizes from x.shape (timm's "same" pads): run-time inputs
    src, in_qp = ctx.u8_input(node.args[0])
    assert out_qp is not None
    return _Plan(QPad(template, in_qp, out_qp, backend=ctx.backend), [src, *runtime], [node], ctx.label(node))


def _rule_cat(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    if op_kind(node, ctx.modules) != "cat" or node.op != "call_function":
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or not isinstance(dim, int):
        raise Decline("cat with inputs or dim computed at run time")
    inputs = [ctx.u8_input(t) for t in tensors]
    q = QCat(dim, [qp for _, qp in inputs], out_qp, backend=ctx.backend)
    return _Plan(q, [n for n, _ in inputs], [node], ctx.label(node))


# Order matters only where patterns nest: activations first, so conv → relu6 fuses instead of the conv
# being claimed alone (the conv is not the quantize node's producer then anyway).
# Rules return None for a pattern they do not recognise (or for ``out_qp=None``, an fp32
# output, unless they are a weighted op whose kernel writes fp32), and raise Decline with a reason.
RULES: tuple[Rule, ...] = (
    _rule_activation,
    _rule_conv,
    _rule_conv1d,
    _rule_conv3d,
    _rule_conv_add,
    _rule_linear,
    _rule_add,
    _rule_mul,
    _rule_mean,
    _rule_max_pool,
    _rule_avg_pool,
    _rule_batch_norm,
    _rule_flatten,
    _rule_move,
    _rule_pad,
    _rule_cat,
)
