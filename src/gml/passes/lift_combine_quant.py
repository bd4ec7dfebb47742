"""LiftCombineQuant: move quantize ops up to the tensor they really quantize, then de-duplicate them.

Three rewrites, in this order, on per-tensor ``torch.quantize_per_tensor`` (and, for 2 and 3,
``torch.quantize_per_channel``) nodes, plus quantize/dequantize *modules* (see
:func:`quantize_of`):

1. **Lift** across a chain of single-user view ops (view/reshape/flatten/permute/transpose/
   squeeze/unsqueeze/contiguous, ``nn.Flatten``, ``nn.Identity``)::

       p → view → flatten → quantize(s, z)      ⇒      p → quantize(s, z) → view → flatten

   Per-tensor quantization is elementwise with one ``(s, z)``, so
   ``quantize(view(x)) == view(quantize(x))`` bit for bit; the views then move int8 data instead
   of fp32, and the quantize now sits on the producer's output where a lowering can fuse it.
2. **Combine** quantize ops that read the same tensor with *equal* scale, zero point and dtype
   into one. Equality is decided on the values (``get_attr`` buffers are fetched, Python numbers
   compared as numbers): torch.ao gives every observer its own ``_scale_k`` attribute, so two
   quantize ops with identical parameters are never the same node. A tensor read through
   ``getitem(p, i)`` (a multi-output producer) is identified by ``(p, i)``, so two ``getitem``
   nodes for the same output count as one tensor.
3. **Drop dequantize → quantize** with equal parameters::

       a(int8, s, z) → dequantize → quantize(s, z) → users      ⇒      a → users

   ``round((q - z)·s / s) + z == q`` exactly, so the quantized tensor flows straight through
   (the dequantize stays if something else reads it).

Skipped, each with a reason (``PassResult.skips``): a view in the chain with several users
("flatten has 2 users", lifting would need the fp32 value too), per-channel quantize ops for
lifting (a view can move the channel axis), parameters computed at run time, and differing
parameters ("qparams differ: scale 0.02 vs 0.03") for combining and for dequantize → quantize
(that pair is a requantization, not a no-op).

All three rewrites are exact: tolerance 0.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.ao.nn.quantized import Quantize as AoQuantize

from gml.ir import library
from gml.ir.qdq import is_dequantize
from gml.ir.values import TensorQParams
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.oplib import node_label, op_kind
from gml.passes.utils import remove_unused_nodes

_QUANTIZE_FNS = (torch.quantize_per_tensor, torch.quantize_per_channel)
_VIEW_KINDS = ("view", "flatten", "identity")


@dataclass
class QuantizeOp:
    """A quantize node: its fp32 input and the (possibly unresolved) parameters."""

    node: fx.Node
    input: fx.Node
    qparams: TensorQParams | None
    unresolved: str = ""  # why qparams is None


class _Unresolved(Exception):
    pass


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _value(gm: fx.GraphModule, arg: Any, what: str) -> Any:
    """A constant argument: Python number/dtype, tensor, or a ``get_attr`` node fetched to its value."""
    if isinstance(arg, fx.Node):
        if arg.op == "get_attr":
            return _fetch_attr(gm, str(arg.target))
        raise _Unresolved(f"{what} is computed at run time ({arg.name})")
    return arg


def _as_f64(x: Any) -> torch.Tensor:
    # A Python float is a double: convert it directly, never through the float32 default dtype.
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).flatten()
    return torch.tensor(x, dtype=torch.float64).flatten()


def _as_i64(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.int64).flatten()
    return torch.tensor(x, dtype=torch.int64).flatten()


def _bind(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def quantize_of(gm: fx.GraphModule, node: fx.Node, modules: dict[str, nn.Module]) -> QuantizeOp | None:
    """Recognise a quantize node and resolve its parameters.

    Forms: ``torch.quantize_per_tensor(x, scale, zero_point, dtype)``,
    ``torch.quantize_per_channel(x, scales, zero_points, axis, dtype)``, GML's ``gml.quantize``
    (plain ``uint8`` out, qparams as arguments) and a ``torch.ao.nn.quantized.Quantize`` module
    (``scale``/``zero_point``/``dtype``).
    """
    if node.op == "call_function" and node.target in _QUANTIZE_FNS:
        per_channel = node.target is torch.quantize_per_channel
        names = (
            ("input", "scales", "zero_points", "axis", "dtype")
            if per_channel
            else ("input", "scale", "zero_point", "dtype")
        )
        b = _bind(node, names)
        x = b.get("input")
        if not isinstance(x, fx.Node):
            return None
        try:
            qp = TensorQParams(
                _as_f64(_value(gm, b[names[1]], "scale")),
                _as_i64(_value(gm, b[names[2]], "zero point")),
                _value(gm, b["dtype"], "dtype"),
                int(_value(gm, b["axis"], "axis")) if per_channel else None,
            )
        except _Unresolved as e:
            return QuantizeOp(node, x, None, str(e))
        return QuantizeOp(node, x, qp)
    if library.gml_op_name(node) == "quantize" and isinstance(node.args[0], fx.Node):
        out = library.output_qparams_args(node)  # GML's quantize: plain uint8 out, qparams as arguments
        assert out is not None
        return QuantizeOp(node, node.args[0], TensorQParams(_as_f64(out[0]), _as_i64(out[1]), torch.uint8))
    if node.op == "call_module" and node.args and isinstance(node.args[0], fx.Node):
        mod = modules.get(str(node.target))
        if isinstance(mod, AoQuantize):
            return QuantizeOp(node, node.args[0], TensorQParams(_as_f64(mod.scale), _as_i64(mod.zero_point), mod.dtype))
    return None


def output_qparams(gm: fx.GraphModule, node: fx.Node, modules: dict[str, nn.Module]) -> TensorQParams | None:
    """Parameters of the quantized tensor ``node`` produces, or ``None`` if they are not known.

    Producers: a quantize op; a view of a per-tensor quantized tensor (views keep the parameters);
    a lowered ``torch.ops.gml`` op (its ``out_scale``/``out_zero_point`` arguments, read by schema
    name: :func:`gml.ir.library.output_qparams_args`).
    """
    for _ in range(64):  # view chains are short; the bound only guards against cycles in bad graphs
        q = quantize_of(gm, node, modules)
        if q is not None:
            return q.qparams
        if _is_view(node, modules) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        break
    out = library.output_qparams_args(node)  # a lowered op: its output qparams are its arguments
    if out is not None:
        return TensorQParams(_as_f64(out[0]), _as_i64(out[1]), torch.uint8)
    return None


def _is_view(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op not in ("call_function", "call_method", "call_module") or not node.args:
        return False
    return op_kind(node, modules) in _VIEW_KINDS and isinstance(node.args[0], fx.Node)


def _tensor_key(node: fx.Node) -> Hashable:
    """Identity of the tensor a node yields; ``getitem(p, i)`` nodes of one output are one tensor."""
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and isinstance(node.args[1], int)  # an element of a tuple output, not a slice of a tensor
    ):
        return ("getitem", node.args[0], node.args[1])
    return node


def _modules(gm: fx.GraphModule) -> dict[str, nn.Module]:
    # Every path, including a module object reachable under two names.
    return dict(gm.named_modules(remove_duplicate=False))


def _quantize_ops(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> Iterator[QuantizeOp]:
    """The quantize ops of ``gm`` in graph order, each read when it is reached: the caller may
    rewrite the graph as it goes (the nodes are listed first, so new ones are not visited)."""
    for node in list(gm.graph.nodes):
        q = quantize_of(gm, node, modules)
        if q is not None:
            yield q


def _copy_meta(src: fx.Node, dst: fx.Node) -> None:
    # The value changed shape/dtype, so tensor_meta is left for the next shape propagation.
    for key in ("stack_trace", "nn_module_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _erase_with_args(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and whatever only it read (its dequantize, its scale/zero-point get_attrs)."""
    inputs = node.all_input_nodes
    graph.erase_node(node)
    remove_unused_nodes(graph, inputs)


class LiftCombineQuant(GraphPass):
    """Lifts quantize ops above view chains, merges equal quantize ops of one tensor, and drops
    dequantize → quantize pairs with equal parameters (see the module docstring)."""

    name = "lift_combine_quant"
    tolerance = Tolerance(atol=0.0, rtol=0.0)

    def __init__(self, *, lift: bool = True, combine: bool = True, drop_dq_q: bool = True) -> None:
        self.lift = lift
        self.combine = combine
        self.drop_dq_q = drop_dq_q

    def call(self, gm: fx.GraphModule) -> PassResult:
        skips: list[Skip] = []
        counts = {"lifted": 0, "combined": 0, "dq→q dropped": 0}
        if self.lift:
            counts["lifted"] = self._lift(gm, skips)
        if self.combine:
            counts["combined"] = self._combine(gm, skips)
        if self.drop_dq_q:
            counts["dq→q dropped"] = self._drop_dq_q(gm, skips)
        matches = sum(counts.values())
        if matches:
            gm.delete_all_unused_submodules()  # merged quantize modules
            gm.graph.lint()
            gm.recompile()
        notes = [", ".join(f"{k}: {v}" for k, v in counts.items())]
        return PassResult(gm, matches > 0, matches, skips, notes)

    # ------------------------------------------------------------------ 1. lift
    def _lift(self, gm: fx.GraphModule, skips: list[Skip]) -> int:
        graph = gm.graph
        modules = _modules(gm)
        lifted = 0
        for q in _quantize_ops(gm, modules):
            node = q.node
            chain: list[fx.Node] = []
            producer = q.input
            blocked = ""
            while _is_view(producer, modules):
                if len(producer.users) > 1:
                    blocked = (
                        f"{producer.name} ({node_label(producer, modules)}) has {len(producer.users)} users; "
                        "lifting past it would need its fp32 value too"
                    )
                    break
                chain.append(producer)
                producer = producer.args[0]
            if blocked:
                done = f"lifted above {len(chain)} view(s), then stopped: " if chain else ""
                skips.append(Skip(node.name, done + blocked, "lift quantize"))
            if not chain:
                continue
            if q.qparams is not None and q.qparams.axis is not None:
                skips.append(
                    Skip(
                        node.name,
                        f"per-channel quantize (axis {q.qparams.axis}): a view may move the axis",
                        "lift quantize",
                    )
                )
                continue
            # New nodes go right before the old quantize: every argument is defined by then.
            with graph.inserting_before(node):
                new_q = graph.create_node(node.op, node.target, (producer, *node.args[1:]), dict(node.kwargs))
                _copy_meta(node, new_q)
                current = new_q
                for view in reversed(chain):
                    current = graph.create_node(view.op, view.target, (current, *view.args[1:]), dict(view.kwargs))
                    _copy_meta(view, current)
            node.replace_all_uses_with(current)
            graph.erase_node(node)
            remove_unused_nodes(graph, [chain[0]])
            lifted += 1
        return lifted

    # ------------------------------------------------------------------ 2. combine
    def _combine(self, gm: fx.GraphModule, skips: list[Skip]) -> int:
        graph = gm.graph
        modules = _modules(gm)
        groups: dict[Hashable, list[QuantizeOp]] = {}
        for q in _quantize_ops(gm, modules):
            groups.setdefault(_tensor_key(q.input), []).append(q)
        order = {n: i for i, n in enumerate(graph.nodes)}  # combining only erases: stays valid
        merged = 0
        for ops in groups.values():
            if len(ops) < 2:
                continue
            kept: list[QuantizeOp] = []  # representatives, in graph order
            for q in ops:
                if q.qparams is None:
                    skips.append(Skip(q.node.name, f"cannot compare qparams: {q.unresolved}", "combine quantize"))
                    continue
                same = next((k for k in kept if k.qparams is not None and k.qparams.equals(q.qparams)), None)
                if same is None:
                    if kept:
                        diff = kept[0].qparams.difference(q.qparams)  # type: ignore[union-attr]
                        skips.append(
                            Skip(q.node.name, f"qparams differ from {kept[0].node.name}: {diff}", "combine quantize")
                        )
                    kept.append(q)
                    continue
                q.node.replace_all_uses_with(same.node)
                _erase_with_args(graph, q.node)
                self._merge_views(graph, same.node, modules, order)
                merged += 1
        return merged

    def _merge_views(
        self, graph: fx.Graph, node: fx.Node, modules: dict[str, nn.Module], order: dict[fx.Node, int]
    ) -> None:
        """Identical view calls on one (now shared) quantized tensor become one node: the first in
        graph order, which precedes every reader of the others."""
        seen: dict[Hashable, fx.Node] = {}
        for user in sorted(node.users, key=order.__getitem__):
            if not _is_view(user, modules) or user.args[0] is not node:
                continue
            try:
                sig = (user.op, user.target, tuple(user.args[1:]), tuple(sorted(user.kwargs.items())))
                hash(sig)
            except TypeError:  # unhashable arguments (lists): leave the view alone
                continue
            first = seen.setdefault(sig, user)
            if first is not user:
                user.replace_all_uses_with(first)
                graph.erase_node(user)
                self._merge_views(graph, first, modules, order)

    # ------------------------------------------------------------------ 3. dequantize → quantize
    def _drop_dq_q(self, gm: fx.GraphModule, skips: list[Skip]) -> int:
        modules = _modules(gm)
        dropped = 0
        for q in _quantize_ops(gm, modules):
            source = _dequantized_source(q, modules)
            if source is None:
                continue
            reason = _dq_q_refusal(gm, q, source, modules)
            if reason is not None:
                skips.append(Skip(q.node.name, reason, "dequantize → quantize"))
                continue
            q.node.replace_all_uses_with(source)
            _erase_with_args(gm.graph, q.node)
            dropped += 1
        return dropped


def _dequantized_source(q: QuantizeOp, modules: dict[str, nn.Module]) -> fx.Node | None:
    """``s`` when ``q`` is ``quantize(dequantize(s))``, else None."""
    dq = q.input
    if not is_dequantize(dq, modules):
        return None
    source = dq.args[0] if dq.args else None
    return source if isinstance(source, fx.Node) else None


def _dq_q_refusal(gm: fx.GraphModule, q: QuantizeOp, source: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """Why ``q`` = ``quantize(dequantize(source))`` is not ``source`` itself, or None when it is
    (the same qparams: the round trip is exact)."""
    if q.qparams is None:
        return f"cannot compare qparams: {q.unresolved}"
    src_qp = output_qparams(gm, source, modules)
    if src_qp is None:
        return f"qparams of {source.name} (the dequantized tensor) are unknown"
    if not src_qp.equals(q.qparams):
        return f"requantization, qparams differ: {src_qp.difference(q.qparams)}"
    return None


__all__ = ["LiftCombineQuant", "QuantizeOp", "TensorQParams", "output_qparams", "quantize_of"]
