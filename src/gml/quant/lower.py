"""Lower a reference Q/DQ graph to ``torch.ops.gml`` calls that pass uint8 tensors to each other.

Before (what torch.ao's ``convert_to_reference_fx`` produces; every quantized value is a
``quantize`` node read through ``dequantize`` nodes)::

    q0 = quantize(x, s0, z0)
    a  = conv1_relu(q0.dequantize());                     q1 = quantize(a, s1, z1)
    b  = relu(conv2(q1.dequantize()) + q0.dequantize());  q2 = quantize(b, s2, z2)
    y  = q2.dequantize()

After (every qparam, geometry and post-op an argument; weights ``get_attr`` constants; docs/ir.md)::

    u0 = gml.quantize(x, s0, z0)                          # fp32 → uint8, once, where INT8 starts
    u1 = gml.qconv(u0, s0, z0, W1, sw1, b1, ..., s1, z1, uint8, "relu", ...)
    u2 = gml.qconv_add(u1, s1, z1, W2, ..., u0, s0, z0, s2, z2, "relu")   # one oneDNN kernel
    y  = gml.dequantize(u2, s2, z2)                       # uint8 → fp32, once, where it ends

Math. A pattern ``Q_out(f(DQ(u_1), ..., DQ(u_n)))`` with ``DQ(u) = (u - z) * s`` becomes one op
``F(u_1, ..., u_n)`` that computes ``f`` on the integers with the input and output qparams folded in
(the kernel's job), so each value is quantized exactly once. Fusions: conv/linear + an activation
the backend's kernel has as eltwise post-op (relu; on oneDNN also ReLU6/hardtanh, hardswish,
SiLU; on fbgemm ReLU6/hardtanh as a clamp of the result); conv + add (+ relu) where the reference
graph already fused them (torch.ao's ``ConvAdd2d``). When the reference quantizes the conv output
before the add (``conv → Q → DQ → add``), this pass lowers conv and add separately and the next
pass of the INT8 pipeline, :class:`~gml.quant.fuse_int8.FuseQConvAdd`, joins them. Lowering
requantizes in integer kernels where the reference computed in fp32, so this pass has no tolerance
(``None``); the tests check it against the reference graph by cosine instead.

Phases of :meth:`LowerToGML.call`:

1. every quantize node, in graph order: match its producer against :data:`RULES` (conv and linear
   with a fused activation, conv+add(+relu), add(+relu), mul, standalone activations (relu,
   ReLU6/hardtanh as integer clamps, hardswish, sigmoid, hardsigmoid), mean, max/avg pool,
   flatten, cat);
   on a match, the rule's plan value (a :mod:`gml.quant.modules` class, whose constructor checks
   what the backend can run) replaces the pattern; otherwise the quantize node becomes a
   ``gml.quantize`` and the op stays in fp32 (a Skip with the reason, e.g. "no INT8 kernel for
   GELU; kept in fp32", unless it is the model input);
2. the replaced patterns are deleted through :func:`~gml.passes.utils.remove_unused_nodes` only (a
   node still read by another branch, such as a residual's dequantize, is never erased); then
   conv / linear whose result is *not* quantized (e.g. logits the frontend keeps fp32) become
   calls whose kernel writes fp32 directly (``out_dtype=torch.float32``);
3. shape queries (``x.size()``, ``x.dim()``, ``x.shape``) read the uint8 value directly;
   dequantize nodes still read by fp32 code become ``gml.dequantize``;
4. every plan becomes the ``torch.ops.gml`` call its ``op_call`` names (data movement: the same
   torch op on the integers, plus ``gml.requantize`` where qparams change); unused submodules and
   the reference graph's qparam attributes are dropped.

The ops are functional (``qconv_add`` never writes its residual operand), so no phase has to prove
a skip tensor dead.

Declined, with a reason: ops with no INT8 kernel (SiLU on its own, GELU, ...), a fused activation
the backend's kernel lacks ("the fbgemm backend has no INT8 conv2d kernel with a hardswish
post-op"), inputs that are not quantized (fp32 regions),
non-uint8 or per-channel activation qparams, asymmetric or non-int8 weights, conv with non-zero
padding modes / string padding, pools that change qparams in ways the kernel cannot express,
add with ``alpha != 1`` or broadcasting operands, fp32 op outputs read by other ops as well.
The coverage (which nodes became which op, which stayed fp32 and why) lives in ``node.meta`` and
is read off the graph by :func:`coverage_of` (also ``LoweringResult.coverage`` and the notes); the
pass keeps no per-run state.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import fx, nn

from gml.errors import UnsupportedError
from gml.ir import library
from gml.ir.layers import behaves_as
from gml.ir.ops import ACTIVATION_KINDS, INT8_KINDS
from gml.ir.qdq import is_dequantize, is_quantize, quantize_args
from gml.ir.target import Target
from gml.ir.values import ConvSpec, QParams
from gml.kernels.backend import Int8Backend
from gml.kernels.fp32 import NO_POST_OP, PostOp, post_op_of, post_op_of_module
from gml.kernels.int8_ops import register as register_int8_ops
from gml.kernels.registry import get_backend
from gml.passes.base import GraphPass, PassResult, Skip
from gml.passes.oplib import node_label, op_kind
from gml.passes.utils import add_module, remove_unused_nodes
from gml.quant.backend_config import ConvAct2d, LinearAct
from gml.quant.modules import (
    MOVE_METHODS,
    PIECE_METHODS,
    Dequantize,
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
    Quantize,
    RuntimeArg,
    extract_qparams,
    reference_weight,
)

try:  # gml.nn.Add / Mul are the normalized forms of every add / mul spelling (ADR 001)
    from gml.nn import Add as _GmlAdd
    from gml.nn import Mul as _GmlMul
except ImportError:  # pragma: no cover
    _GmlAdd = _GmlMul = None  # type: ignore[assignment,misc]


@dataclass
class CoverageEntry:
    """One pattern: the fp32 node(s) it covered, what they computed, and what they became."""

    nodes: list[str]
    op: str
    result: str  # the torch.ops.gml op (or uint8 data-movement op) it became, or "fp32"
    reason: str = ""


@dataclass
class LoweringCoverage:
    """Which nodes became which GML op, and which stayed fp32 and why.

    Read off a lowered graph by :func:`coverage_of` (the entries live in ``node.meta``), so the
    coverage always describes the module it is reported with, whichever passes ran after lowering.
    """

    lowered: list[CoverageEntry] = field(default_factory=list)
    kept_fp32: list[CoverageEntry] = field(default_factory=list)

    @property
    def fused_conv_add(self) -> int:
        return self.counts().get("qconv_add", 0)

    def counts(self) -> Counter[str]:
        return Counter(e.result for e in self.lowered)

    def summary(self) -> str:
        parts = ", ".join(f"{n} {name}" for name, n in sorted(self.counts().items()))
        kept = f"; {len(self.kept_fp32)} op(s) kept in fp32" if self.kept_fp32 else ""
        return f"lowered to INT8: {parts or 'nothing'}{kept}"

    def table(self, title: str = "INT8 lowering coverage"):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=title)
        for col in ("node(s)", "op", "became", "why fp32"):
            t.add_column(col)
        for e in self.lowered:
            t.add_row(", ".join(e.nodes), e.op, f"[green]{e.result}[/]", "")
        for e in self.kept_fp32:
            t.add_row(", ".join(e.nodes), e.op, "[yellow]fp32[/]", e.reason)
        return t


@dataclass
class LoweringResult(PassResult):
    coverage: LoweringCoverage = field(default_factory=LoweringCoverage)


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


def _as_conv(mod: nn.Module | None) -> tuple[nn.Conv2d, PostOp] | None:
    """(conv, fused post-op) for Conv2d, reference Conv2d, ``nni.ConvReLU2d`` and :class:`ConvAct2d`."""
    if isinstance(mod, nni.ConvReLU2d) and behaves_as(mod[0], nn.Conv2d):
        return mod[0], PostOp("relu")
    if isinstance(mod, ConvAct2d) and behaves_as(mod[0], nn.Conv2d):
        return mod[0], _fused_post_op(mod[1])
    if behaves_as(mod, nn.Conv2d):
        return mod, NO_POST_OP  # type: ignore[return-value]
    return None


def _as_linear(mod: nn.Module | None) -> tuple[nn.Linear, PostOp] | None:
    if isinstance(mod, nni.LinearReLU) and behaves_as(mod[0], nn.Linear):
        return mod[0], PostOp("relu")
    if isinstance(mod, LinearAct) and behaves_as(mod[0], nn.Linear):
        return mod[0], _fused_post_op(mod[1])
    if behaves_as(mod, nn.Linear):
        return mod, NO_POST_OP  # type: ignore[return-value]
    return None


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
def _rule_conv(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    hit = _as_conv(ctx.module(node))
    if hit is None:
        return None
    conv, post_op = hit
    return _qconv(ctx, conv, node.args[0], out_qp, post_op, [node], ctx.label(node))


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


def _rule_linear(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    hit = _as_linear(ctx.module(node))
    if hit is None:
        return None
    lin, post_op = hit
    return _qlinear(ctx, lin, node.args[0], out_qp, post_op, [node], ctx.label(node))


def _qlinear(ctx: _Ctx, lin: nn.Linear, x_arg: Any, out_qp: QParams | None, post_op: PostOp, covered, label) -> _Plan:
    _check_fuses(ctx, "linear", post_op)
    src, in_qp = ctx.u8_input(x_arg)
    w, ws, b = _weights(lin)
    mod = QLinear(w, ws, b, in_qp, out_qp, post_op=post_op, input_shape=_shape(x_arg), backend=ctx.backend)
    return _Plan(mod, [src], covered, label)


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
    src, in_qp = ctx.u8_input(node.args[0])
    q = QMean(tuple(dims), keepdim, in_qp, out_qp, backend=ctx.backend)
    return _Plan(q, [src], [node], ctx.label(node))


def _rule_max_pool(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    mod = ctx.module(node)
    if not behaves_as(mod, (nn.MaxPool2d, nn.MaxPool3d)):
        return None
    if mod.return_indices:
        raise Decline("max pool returning indices has no INT8 kernel")
    src, in_qp = ctx.u8_input(node.args[0])
    cls, n = (QMaxPool2d, 2) if isinstance(mod, nn.MaxPool2d) else (QMaxPool3d, 3)
    stride = mod.stride if mod.stride is not None else mod.kernel_size
    q = cls(
        _ntuple(mod.kernel_size, n),
        _ntuple(stride, n),
        _ntuple(mod.padding, n),
        _ntuple(mod.dilation, n),
        bool(mod.ceil_mode),
        in_qp,
        out_qp,
        backend=ctx.backend,
    )
    return _Plan(q, [src], [node], ctx.label(node))


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
    src, in_qp = ctx.u8_input(node.args[0])
    q = QBatchNorm2d(bn, in_qp, out_qp, relu=relu, backend=ctx.backend)
    return _Plan(q, [src], [node], ctx.label(node))


def _rule_avg_pool(ctx: _Ctx, node: fx.Node, out_qp: QParams | None) -> _Plan | None:
    if out_qp is None:
        return None
    mod = ctx.module(node)
    if behaves_as(mod, nn.AvgPool2d):
        src, in_qp = ctx.u8_input(node.args[0])
        stride = mod.stride if mod.stride is not None else mod.kernel_size
        q = QAvgPool2d(
            _pair(mod.kernel_size),
            _pair(stride),
            _pair(mod.padding),
            bool(mod.ceil_mode),
            bool(mod.count_include_pad),
            mod.divisor_override,
            in_qp,
            out_qp,
            backend=ctx.backend,
        )
        return _Plan(q, [src], [node], ctx.label(node))
    if not behaves_as(mod, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        return None
    cls, n = (QAdaptiveAvgPool2d, 2) if isinstance(mod, nn.AdaptiveAvgPool2d) else (QAdaptiveAvgPool3d, 3)
    size = mod.output_size
    size = (size,) * n if isinstance(size, int) else tuple(size)
    if any(s is None for s in size):
        raise Decline("adaptive avg pool with a None output size has no INT8 kernel")
    src, in_qp = ctx.u8_input(node.args[0])
    q = cls(tuple(int(s) for s in size), in_qp, out_qp, backend=ctx.backend)
    return _Plan(q, [src], [node], ctx.label(node))


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
    src, in_qp = ctx.u8_input(node.args[0])
    return _Plan(QFlatten(start, end, in_qp, out_qp, backend=ctx.backend), [src], [node], ctx.label(node))


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
    from gml.passes.fold_pad import pad_of

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


#: ``node.meta`` keys of the lowering's coverage entries (see :func:`coverage_of`)
LOWERED = "gml_coverage"
KEPT_FP32 = "gml_kept_fp32"
#: set by the cost policy (gml.quant.cost_policy.KEEP_FP32) on ops it keeps fp32: the reason
KEEP_FP32_COST = "gml_cost_keep_fp32"


class LowerToGML(GraphPass):
    """Replace ``DQ → op → Q`` patterns of a reference graph with calls of ``torch.ops.gml`` ops.

    Args:
        backend: kernel backend name or instance (``None``: oneDNN if available, else FBGEMM); it
            decides which patterns lower (which post-ops fuse) and is recorded in each op's
            ``backend`` argument for the Python executor.
        target: the CPU the lowered graph is for (:class:`~gml.ir.target.Target`; default: this
            process's). Weights a reference graph holds outside the target's INT8 range (8-bit
            weights of torch.ao's own configs on a CPU without VNNI) are requantized
            (:func:`gml.quant.retarget.retarget_weights`, listed in the notes), so the kernels are
            exact there (ADR 011).
    """

    name = "lower_to_gml"
    tolerance = None

    def __init__(self, backend: str | Int8Backend | None = None, target: Target | None = None) -> None:
        self.backend = get_backend(backend)
        self.target = target
        register_int8_ops()

    def requires(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if is_quantize(node):
                bad = [u.name for u in node.users if not is_dequantize(u)]
                if bad:
                    raise UnsupportedError(
                        f"quantized value {node.name} is read directly by {', '.join(bad)}; the "
                        "lowering expects a reference graph (quantized values read through dequantize).",
                        hint="produce the graph with convert_to_reference_fx (gml.quant.frontend).",
                    )

    def call(self, gm: fx.GraphModule) -> PassResult:
        ctx = _Ctx(gm, self.backend, dict(gm.named_modules(remove_duplicate=False)))
        skips: list[Skip] = []
        graph = gm.graph
        dead: list[fx.Node] = []
        matches = 0

        # 1. every quantize node: lower its producer, or make it the start of an INT8 region
        for q in list(graph.nodes):
            if not is_quantize(q):
                continue
            src = q.args[0]
            try:
                out_qp, _ = quantize_args(q, gm)
            except ValueError as e:
                skips.append(Skip(q.name, f"{e}; left as a torch quantize op", "quantize"))
                continue
            plan, reason = self._match(ctx, src, out_qp) if isinstance(src, fx.Node) else (None, "")
            if plan is not None:
                new = self._insert(ctx, q, plan.module, plan.inputs, plan.covered[-1].name)
                new.meta[LOWERED] = CoverageEntry([n.name for n in plan.covered], plan.label, "")
                matches += 1
            else:
                new = self._insert(ctx, q, Quantize(out_qp, backend=self.backend), [src], f"{_base(src)}_u8")
                if reason:  # an op between DQ and Q that stays fp32 (not the model input)
                    skips.append(Skip(src.name, reason, ctx.label(src)))
                    src.meta[KEPT_FP32] = CoverageEntry([src.name], ctx.label(src), "fp32", reason)
            q.replace_all_uses_with(new)
            dead.append(q)

        # 2. drop the replaced patterns (quantize → op → dequantize chains nobody reads now)
        qparam_attrs = {str(a.target) for q in dead for a in q.all_input_nodes if a.op == "get_attr"}
        remove_unused_nodes(graph, dead)

        # 2b. conv / linear whose result stays fp32 (e.g. the logits): their kernels write fp32
        matches += self._lower_fp32_outputs(ctx, skips)

        # 3. dequantize nodes still read by fp32 code become gml.dequantize
        dequantize_nodes = [n for n in graph.nodes if is_dequantize(n)]
        for node in dequantize_nodes:
            if node.users and ctx.produces_u8(node.args[0]):
                for user in [u for u in node.users if _is_shape_query(u)]:
                    user.replace_input_with(node, node.args[0])  # same shape as uint8: no Dequantize
            if node.users and ctx.produces_u8(node.args[0]):
                qp = extract_qparams(node.args[0], gm)
                assert qp is not None
                deq = Dequantize(qp, backend=self.backend)
                new = self._insert(ctx, node, deq, [node.args[0]], f"{_base(node.args[0])}_fp32")
                node.replace_all_uses_with(new)
                for user in new.users:
                    if user.op != "output" and KEPT_FP32 not in user.meta:
                        why = "its output is not quantized in the reference graph"
                        user.meta[KEPT_FP32] = CoverageEntry([user.name], ctx.label(user), "fp32", why)
        remove_unused_nodes(graph, dequantize_nodes)

        # 4. every planned INT8 module becomes the torch.ops.gml call it stands for
        self._emit_ops(ctx)
        self._drop_unused_attributes(gm, qparam_attrs)
        # 5. weights outside the target's INT8 range (a reference quantized for another CPU)
        from gml.quant.retarget import retarget_weights
        from gml.runtime.target import resolve

        retargeted = retarget_weights(gm, resolve(self.target))

        graph.lint()
        gm.recompile()
        cov = coverage_of(gm)
        return LoweringResult(
            gm, modified=matches > 0 or bool(dead), matches=matches, skips=skips,
            notes=[cov.summary(), *retargeted], coverage=cov,
        )  # fmt: skip

    # ------------------------------------------------------------------ helpers
    def _match(self, ctx: _Ctx, src: fx.Node, out_qp: QParams) -> tuple[_Plan | None, str]:
        """A plan for the producer of a quantize node, or the reason it stays fp32 ("" at the input)."""
        if not _reads_int8(ctx, src):
            return None, ""  # fp32 → quantize: the INT8 region starts here
        if KEEP_FP32_COST in src.meta:  # the cost policy measured INT8 slower here
            return None, str(src.meta[KEEP_FP32_COST])
        if len(src.users) != 1:
            return None, f"{src.name}'s fp32 result is also read elsewhere ({len(src.users)} users); kept in fp32"
        for rule in RULES:
            ctx.input_shapes = []
            try:
                plan = rule(ctx, src, out_qp)
                if plan is not None:
                    _trial_run(ctx, plan)
            except Decline as e:
                return None, f"{e}; kept in fp32"
            if plan is not None:
                return plan, ""
        return None, f"no INT8 kernel for {_op_name(ctx, src)}; kept in fp32"

    def _lower_fp32_outputs(self, ctx: _Ctx, skips: list[Skip]) -> int:
        graph = ctx.gm.graph
        lowered = 0
        for node in list(graph.nodes):
            if node.op not in ("call_module", "call_function", "call_method") or is_dequantize(node):
                continue
            if any(is_quantize(u) for u in node.users) or not _reads_int8(ctx, node):
                continue
            if KEEP_FP32_COST in node.meta:
                continue
            if _single_user(node) and _fuses_into(ctx, node, next(iter(node.users))):
                continue  # the activation reading it fuses it
            plan, reason = None, ""
            for rule in (_rule_activation, _rule_conv, _rule_linear):
                ctx.input_shapes = []
                try:
                    plan = rule(ctx, node, None)
                    if plan is not None:
                        _trial_run(ctx, plan)
                except Decline as e:
                    reason = f"{e}; kept in fp32"
                    break
                if plan is not None:
                    break
            if plan is None:
                if reason:
                    skips.append(Skip(node.name, reason, ctx.label(node)))
                    node.meta[KEPT_FP32] = CoverageEntry([node.name], ctx.label(node), "fp32", reason)
                continue
            new = self._insert(ctx, node, plan.module, plan.inputs, node.name)
            new.meta[LOWERED] = CoverageEntry([n.name for n in plan.covered], f"{plan.label} (fp32 out)", "")
            node.replace_all_uses_with(new)
            remove_unused_nodes(graph, [node])
            lowered += 1
        return lowered

    def _insert(self, ctx: _Ctx, before: fx.Node, module: nn.Module, inputs: list[Any], name: str) -> fx.Node:
        target = add_module(ctx.gm, f"q_{name}", module)
        ctx.modules[target] = module
        with ctx.gm.graph.inserting_before(before):
            node = ctx.gm.graph.call_module(target, tuple(inputs))
        return node

    @staticmethod
    def _emit_ops(ctx: _Ctx) -> None:
        emit_op_calls(ctx.gm, ctx.module)

    @staticmethod
    def _drop_unused_attributes(gm: fx.GraphModule, qparam_attrs: set[str]) -> None:
        """Remove submodules, and the qparam tensors of erased quantize ops, no node refers to any more."""
        gm.delete_all_unused_submodules()
        used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        for target in sorted(qparam_attrs - used):
            parent_name, _, attr = target.rpartition(".")
            parent = gm.get_submodule(parent_name) if parent_name else gm
            if hasattr(parent, attr):
                delattr(parent, attr)


def emit_op_calls(gm: fx.GraphModule, module_of: Callable[[fx.Node], nn.Module | None]) -> None:
    """Replace each call of a GML INT8 module (``module_of(node)``) by its
    :class:`~gml.quant.modules.OpCall`: tensors among the arguments become buffers of the graph
    module read by ``get_attr`` (dense constants). What :class:`LowerToGML` emits; tests build
    one-op graphs of the IR with it."""
    register_int8_ops()  # the graph calls torch.ops.gml.*: their schemas and Python kernels
    graph = gm.graph
    for node in list(graph.nodes):
        mod = module_of(node)
        if not isinstance(mod, GMLQuantModuleBase | Dequantize):
            continue
        call = mod.op_call(list(node.args))
        prefix = str(node.target)
        with graph.inserting_before(node):
            if isinstance(call.target, str) and call.target.startswith("."):
                new = graph.call_method(call.target[1:], call.args)
                result = call.target[1:]
            elif isinstance(call.target, str):
                op = library.op(call.target)
                names = [a.name for a in op._schema.arguments]
                args = tuple(
                    _constant_node(gm, f"{prefix}_{names[i]}", a) if isinstance(a, torch.Tensor) else a
                    for i, a in enumerate(call.args)
                )
                new = graph.call_function(op, args)
                result = call.target
            else:
                new = graph.call_function(call.target, call.args)
                result = getattr(call.target, "__name__", str(call.target))
            entry = node.meta.get(LOWERED)
            if call.item is not None:
                new = graph.call_function(operator.getitem, (new, call.item))
            if call.requantize is not None and not call.requantize[0].close_to(call.requantize[1]):
                (a, b) = call.requantize
                new = graph.call_function(
                    library.op("requantize"), (new, a.scale, a.zero_point, b.scale, b.zero_point)
                )
        if entry is not None:
            entry.result = result
            new.meta[LOWERED] = entry
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _constant_node(gm: fx.GraphModule, base: str, value: torch.Tensor) -> fx.Node:
    """A ``get_attr`` node reading ``value``, registered as a buffer of ``gm`` under a fresh name."""
    name, i = base.replace(".", "_"), 1
    candidate = name
    while hasattr(gm, candidate):
        candidate, i = f"{name}_{i}", i + 1
    gm.register_buffer(candidate, value.detach())
    return gm.graph.get_attr(candidate)


def coverage_of(gm: fx.GraphModule) -> LoweringCoverage:
    """The lowering coverage of a lowered graph: which nodes became which op, which stayed fp32."""
    cov = LoweringCoverage()
    for node in gm.graph.nodes:
        if LOWERED in node.meta:
            cov.lowered.append(node.meta[LOWERED])
        if KEPT_FP32 in node.meta:
            cov.kept_fp32.append(node.meta[KEPT_FP32])
    return cov


def _trial_run(ctx: _Ctx, plan: _Plan) -> None:
    """Run a planned INT8 module once on uint8 inputs of the recorded shapes (at the zero point):
    a kernel the backend rejects for this geometry declines *this* rewrite, with the backend's
    reason, instead of failing the whole lowered model (which the PassManager would roll back)."""
    if len(ctx.input_shapes) != len(plan.inputs) or any(s is None for s in ctx.input_shapes):
        return  # data-movement ops with run-time sizes, or no shape metadata: checked with the model
    args = []
    for node, shape in zip(plan.inputs, ctx.input_shapes):
        assert shape is not None
        qp = extract_qparams(node, ctx.gm)
        t = torch.full(shape, qp.zero_point if qp is not None else 0, dtype=torch.uint8)
        args.append(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t)
    try:
        with torch.no_grad():
            plan.module(*args)
    except Exception as e:  # the backend's own error is the reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Decline(f"the {ctx.backend.name} kernel rejects {type(plan.module).__name__} here ({first})") from None


def _base(node: Any) -> str:
    """Readable stem for a boundary module's name: the value it converts."""
    name = node.name if isinstance(node, fx.Node) else "const"
    return name[2:] if name.startswith("q_") else name


def _reads_int8(ctx: _Ctx, node: fx.Node) -> bool:
    """Whether ``node`` (or the producer a relu would fuse with) reads a dequantized value."""
    inputs = node.all_input_nodes
    if any(is_dequantize(a) for a in inputs):
        return True
    if _is_activation(ctx, node) and inputs and _single_user(inputs[0]):
        return any(is_dequantize(a) for a in inputs[0].all_input_nodes)
    if node.target is operator.getitem and inputs:  # a piece of a chunk / split of an INT8 value
        return any(is_dequantize(a) for a in inputs[0].all_input_nodes)
    return False


def _is_shape_query(node: fx.Node) -> bool:
    """``x.size()``, ``x.size(d)``, ``x.dim()``, ``x.shape``: reads only the shape, not the values."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return node.op == "call_function" and node.target is getattr and node.args[1:2] == ("shape",)


def _op_name(ctx: _Ctx, node: fx.Node) -> str:
    mod = ctx.module(node)
    if mod is not None:
        return type(mod).__name__
    kind = op_kind(node, ctx.modules)
    return kind.upper() if kind else ctx.label(node)
