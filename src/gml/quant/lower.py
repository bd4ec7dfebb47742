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
from torch import fx, nn

from gml.errors import UnsupportedError
from gml.ir import library
from gml.ir.qdq import is_dequantize, is_quantize, quantize_args
from gml.ir.target import Target
from gml.ir.values import QParams
from gml.kernels.backend import Int8Backend
from gml.kernels.int8_ops import register as register_int8_ops
from gml.kernels.registry import get_backend
from gml.passes.base import GraphPass, PassResult, Skip
from gml.passes.oplib import op_kind
from gml.passes.utils import add_module, remove_unused_nodes
from gml.quant.lower_rules import (
    RULES,
    Decline,
    _Ctx,
    _fuses_into,
    _is_activation,
    _Plan,
    _rule_activation,
    _rule_conv,
    _rule_linear,
    _single_user,
)
from gml.quant.modules import (
    Dequantize,
    GMLQuantModuleBase,
    Quantize,
    extract_qparams,
)


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
        plan, reason = _first_plan(ctx, RULES, src, out_qp)
        if plan is None and not reason:
            reason = f"no INT8 kernel for {_op_name(ctx, src)}; kept in fp32"
        return plan, reason

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
            plan, reason = _first_plan(ctx, (_rule_activation, _rule_conv, _rule_linear), node, None)
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


def _first_plan(
    ctx: _Ctx, rules: Sequence[Callable[..., _Plan | None]], node: fx.Node, out_qp: QParams | None
) -> tuple[_Plan | None, str]:
    """The plan of the first of ``rules`` that matches ``node`` (each rule tried with fresh
    ``ctx.input_shapes``, its plan trial-run), else ``(None, "")``; a rule that declines stops the
    search: ``(None, "<its reason>; kept in fp32")``."""
    for rule in rules:
        ctx.input_shapes = []
        try:
            plan = rule(ctx, node, out_qp)
            if plan is not None:
                _trial_run(ctx, plan)
                return plan, ""
        except Decline as e:
            return None, f"{e}; kept in fp32"
    return None, ""


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
