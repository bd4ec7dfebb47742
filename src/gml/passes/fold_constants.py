"""FoldConstants: compute once what depends only on the model's own (eval-mode) tensors.

Before (timm's ``StdConv2d``: the weight is standardized on every call)::

    w  = self.weight                                        # get_attr
    ws = F.batch_norm(w.reshape(1, C, -1), None, None, training=True, eps=e).reshape_as(w)
    y  = F.conv2d(x, ws, None, stride, padding)

After::

    ws = self._folded_0                                     # get_attr: a buffer holding ws
    y  = F.conv2d(x, ws, None, stride, padding)             # Normalize then makes this an nn.Conv2d

A node whose every input is a ``get_attr`` tensor, a literal or another such node computes the same
value on every call: the parameters are fixed in eval mode. The pass evaluates those nodes once (in
graph order, the way the model would) and replaces each one a run-time node reads by a buffer.
The values are the very results the model computed, so the rewrite is bit-exact (tolerance 0).
``F.batch_norm(..., training=True)`` here normalizes the *weight* with its own statistics, which are
constants too; it does not touch running statistics because none are passed.

Not folded: random ops (``torch.rand``, dropout in training mode: impure), in-place ops and ops that
write a buffer (a buffer a forward updates is state, not a constant), nodes whose value is not a
tensor (shape arithmetic stays as it is), and values of more than ``max_elements`` elements when the
inputs are smaller (an ``expand`` would turn into a large stored copy).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.normalize import writes_in_place
from gml.passes.utils import modules_of, remove_unused_nodes


def _updates_statistics(node: fx.Node) -> bool:
    """``F.batch_norm(..., running_mean, running_var, training=True)`` writes the running statistics
    (without moving their version counter): state, not a constant."""
    if node.target is not F.batch_norm:
        return False
    args = list(node.args) + [None] * 8
    training = node.kwargs.get("training", args[5] if len(node.args) > 5 else False)
    stats = [node.kwargs.get("running_mean", args[1]), node.kwargs.get("running_var", args[2])]
    return bool(training) and any(s is not None for s in stats)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class FoldConstants(GraphPass):
    """Replace run-time computations on parameters/buffers only by their precomputed value."""

    name = "fold_constants"
    tolerance = Tolerance(atol=0.0, rtol=0.0)

    def __init__(self, *, max_elements: int = 1 << 24) -> None:
        self.max_elements = max_elements

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        values: dict[fx.Node, Any] = {}
        skips: list[Skip] = []
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                values[node] = _fetch(gm, str(node.target))
                continue
            if node.op not in ("call_function", "call_method") or not node.all_input_nodes:
                continue
            if any(a not in values for a in node.all_input_nodes):
                continue
            if node.is_impure() or writes_in_place(node, modules) or _updates_statistics(node):
                why = "impure, in-place or state-updating op on constants: kept"
                skips.append(Skip(node.name, why, "fold constants"))
                continue
            # on copies: an op that writes one of its inputs (F.batch_norm updating running statistics)
            # must not touch the model, and is state rather than a constant
            args, kwargs = fx.node.map_arg(
                (node.args, node.kwargs),
                lambda n: values[n].clone() if isinstance(values[n], torch.Tensor) else values[n],
            )
            copies = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            versions = [t._version for t in copies]
            try:
                with torch.no_grad():
                    if node.op == "call_function":
                        out = node.target(*args, **kwargs)  # type: ignore[operator]
                    else:
                        self_obj, *rest = args
                        out = getattr(self_obj, str(node.target))(*rest, **kwargs)
            except Exception as e:  # leave it to run as before
                why = f"could not evaluate on constants ({type(e).__name__})"
                skips.append(Skip(node.name, why, "fold constants"))
                continue
            if any(t._version != v for t, v in zip(copies, versions)):
                why = "writes one of its inputs (state, not a constant): kept"
                skips.append(Skip(node.name, why, "fold constants"))
                continue
            values[node] = out

        folded = 0
        for node in list(values):
            out = values[node]
            if node.op == "get_attr" or not isinstance(out, torch.Tensor):
                continue
            if all(u in values for u in node.users):
                continue  # only constants read it; the frontier node further down is stored
            inputs = [values.get(a) for a in node.all_input_nodes]
            biggest_input = max((t.numel() for t in inputs if isinstance(t, torch.Tensor)), default=0)
            if out.numel() > self.max_elements and out.numel() > biggest_input:
                skips.append(Skip(node.name, f"constant of {out.numel()} elements: not stored", "fold constants"))
                continue
            name, k = "_folded_0", 0
            while hasattr(gm, name):
                k += 1
                name = f"_folded_{k}"
            gm.register_buffer(name, out.detach().clone(memory_format=torch.contiguous_format))
            with gm.graph.inserting_before(node):
                const = gm.graph.get_attr(name)
            const.meta = dict(node.meta)
            node.replace_all_uses_with(const)
            remove_unused_nodes(gm.graph, [node])
            folded += 1
        if folded:
            # get_attr nodes of the parameters nobody reads any more
            remove_unused_nodes(gm.graph, [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users])
        return PassResult.rewrote(gm, folded, skips, f"precomputed {folded} constant value(s)")


__all__ = ["FoldConstants"]
