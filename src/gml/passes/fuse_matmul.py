"""Fuse ``relu(x @ w + b)`` into one oneDNN inner product with a fused ReLU.

Before → after::

    m = x @ w; s = m + b; out = relu(s)     →   out = FusedLinear[relu](x)        (w, b constants)
                                            →   out = fused_matmul_add_relu(x, w, b)  (w computed)
    math: relu(x W + b) = relu(x (W^T)^T + b): an inner product with weight W^T, bias b, ReLU post-op

This is the fusion practice's pattern rule (phase 3), written with
``torch.fx.subgraph_rewriter.replace_pattern_with_filters``: one pattern per spelling of the three
ops (``@``/``torch.matmul`` × ``+``/``torch.add`` × ``F.relu``/``torch.relu``/``.relu()``), one
replacement, and a filter that declines matches the kernel cannot compute. When ``w`` and ``b`` are
constants (``get_attr``), the replaced call is lowered further into a
:class:`~gml.kernels.fp32.FusedLinear` holding ``W^T`` prepacked.

The subgraph rewriter compares ``call_module`` nodes by attribute *name*, so it cannot see the module
spellings Normalize produces (``self.relu_3``, ``gml.nn.Add``). Those go through a small type-aware
walker (matmul → add → relu by op kind) with the same checks and the same replacement.

Skipped, with the reason: ``b`` that is not a 1-D vector of ``w``'s column count (the kernel's bias is
per output feature; anything else would broadcast differently), ``w`` that is not 2-D, ``x`` with
fewer than 2 dims, non-fp32 operands, unknown shapes (no ``tensor_meta``), intermediate results
read elsewhere ("matmul output has 2 users").
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from gml.kernels import fp32 as k32
from gml.kernels.fp32 import fused_matmul_add_relu
from gml.passes import fuse_common as fc
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import add_module, modules_of

torch.fx.wrap("fused_matmul_add_relu")  # a leaf call in the traced replacement, not traced through

_MATMULS: dict[str, Callable] = {"@": operator.matmul, "torch.matmul": torch.matmul}
_ADDS: dict[str, Callable] = {"+": operator.add, "torch.add": torch.add}
_RELUS: dict[str, Callable] = {"F.relu": F.relu, "torch.relu": torch.relu, ".relu()": lambda t: t.relu()}
PATTERN = "matmul → add → relu"


def _pattern(mm: Callable, add: Callable, relu: Callable) -> fx.GraphModule:
    def pattern(x, w, b):
        return relu(add(mm(x, w), b))

    return fx.symbolic_trace(pattern)


def replacement(x, w, b):
    return fused_matmul_add_relu(x, w, b)


@functools.cache
def _replacement_graph() -> fx.GraphModule:
    # Traced once: every trace of ``replacement`` leaves a ``torch.fx.wrap`` registration behind (the
    # generated code re-runs ``wrap(...)`` in fresh globals), and every later ``symbolic_trace`` in
    # the process patches all of them, so re-tracing per run made tracing slower and slower.
    return fx.symbolic_trace(replacement)


@functools.cache
def patterns() -> list[tuple[str, fx.GraphModule]]:
    """Every spelling of ``relu(x @ w + b)`` as a pattern graph, labelled for reports."""
    return [
        (f"{mn} {an} {rn}", _pattern(m, a, r))
        for mn, m in _MATMULS.items()
        for an, a in _ADDS.items()
        for rn, r in _RELUS.items()
    ]


def _value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads (parameter, buffer or plain attribute)."""
    value: object = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _tensor_shape(gm: fx.GraphModule, node: fx.Node) -> tuple[int, ...] | None:
    shape = fc.shape_of(node)
    if shape is None and node.op == "get_attr":
        value = _value(gm, node)
        if value is not None:
            return tuple(value.shape)
    return shape


def operand_problem(gm: fx.GraphModule, x: fx.Node, w: fx.Node, b: fx.Node) -> str | None:
    """Why ``relu(x @ w + b)`` cannot run as one fused inner product, or ``None``."""
    if not all(isinstance(n, fx.Node) for n in (x, w, b)):
        return "an operand is a Python constant"
    xs, ws, bs = (_tensor_shape(gm, n) for n in (x, w, b))
    if xs is None or ws is None or bs is None:
        return "operand shapes unknown (no tensor_meta: capture with example inputs)"
    if len(ws) != 2:
        return f"w is {len(ws)}-D; the fused kernel takes a 2-D weight"
    if len(xs) < 2:
        return f"x is {len(xs)}-D; the fused kernel takes a batch of rows"
    if bs != (ws[1],):
        return f"bias shape {list(bs)} is not [{ws[1]}] (it would broadcast differently)"
    return fc.dtype_problem(x, w, b)


class FuseMatmulAddRelu(GraphPass):
    """Replaces ``relu(x @ w + b)`` with one fused inner product (see module doc)."""

    name = "fuse_matmul"
    tolerance = Tolerance(atol=1e-4, rtol=1e-4)

    def call(self, gm: fx.GraphModule) -> PassResult:
        skips: list[Skip] = []
        notes = fc.fallback_notes()
        calls: list[fx.Node] = []

        def check(match, original_graph, pattern_graph) -> bool:
            x, w, b = match.placeholder_nodes
            ops = [match.nodes_map[pn] for pn in pattern_graph.nodes if pn.op in ("call_function", "call_method")]
            why = "the add reads the matmul output twice" if b in ops else operand_problem(gm, x, w, b)
            write = fc.mutation_between(ops[0], ops[-1], modules_of(gm)) if why is None else None
            if write is not None:
                why = f"in-place {write.name} between the matmul and the relu"
            if why:
                skip = Skip(match.returning_nodes[0].name, why, PATTERN)
                if all((s.node, s.reason) != (skip.node, skip.reason) for s in skips):
                    skips.append(skip)
            return why is None

        for _label, pat in patterns():
            for rep in replace_pattern_with_filters(gm, pat, _replacement_graph(), match_filters=[check]):
                out = next(pn for pn in pat.graph.nodes if pn.op == "output").args[0]
                for n in rep.replacements:
                    if n.target is fused_matmul_add_relu:
                        n.meta = dict(rep.nodes_map[out].meta)  # the rewriter leaves new nodes bare
                        calls.append(n)
        calls.extend(self._module_spellings(gm, skips))
        lowered = sum(self._lower_constant(gm, n) for n in calls)
        if calls:
            notes.append(f"{len(calls)} matmul+add+relu fused ({lowered} with constant weights as FusedLinear)")
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()
        return PassResult(gm, bool(calls), len(calls), skips, notes)

    @staticmethod
    def _module_spellings(gm: fx.GraphModule, skips: list[Skip]) -> list[fx.Node]:
        """matmul → add → relu where add/relu are modules (after Normalize): match by op kind."""
        modules = modules_of(gm)
        out = []
        for mm in list(gm.graph.nodes):
            if fc.kind_of(mm, modules) != "matmul" or mm.target not in (torch.matmul, operator.matmul):
                continue
            if len(mm.users) != 1:
                continue
            (add,) = mm.users
            if fc.kind_of(add, modules) != "add" or len(add.users) != 1:
                continue
            (relu,) = add.users
            if add.op != "call_module" and relu.op != "call_module":
                continue  # an all-function spelling: the pattern rule above already judged it
            post = k32.post_op_of(relu, modules) if fc.kind_of(relu, modules) == "relu" else None
            if not isinstance(post, k32.PostOp):
                continue
            ops = fc.add_operands(add, modules)
            if isinstance(ops, str):
                skips.append(Skip(relu.name, ops, PATTERN))
                continue
            b = ops[1] if ops[0] is mm else ops[0]
            x, w = mm.args[0], mm.args[1]
            why = "the add reads the matmul output twice" if b is mm else operand_problem(gm, x, w, b)
            write = fc.mutation_between(mm, relu, modules)
            if why is None and write is not None:
                why = f"in-place {write.name} between the matmul and the relu"
            if why:
                skips.append(Skip(relu.name, why, PATTERN))
                continue
            with gm.graph.inserting_before(relu):
                new = gm.graph.call_function(fused_matmul_add_relu, (x, w, b))
            new.meta = dict(relu.meta)
            relu.replace_all_uses_with(new)
            fc.erase_chain(gm.graph, [mm, add, relu])
            out.append(new)
        return out

    @staticmethod
    def _lower_constant(gm: fx.GraphModule, call: fx.Node) -> bool:
        """``fused_matmul_add_relu(x, W, b)`` with constant ``W``, ``b`` → ``FusedLinear`` (``W^T`` packed)."""
        x, w, b = call.args
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and isinstance(b, fx.Node) and b.op == "get_attr"):
            return False
        weight, bias = _value(gm, w), _value(gm, b)
        shape = fc.shape_of(x)
        rows = int(torch.tensor(shape[:-1]).prod()) if shape else None
        mod = k32.FusedLinear(weight.detach().t().contiguous(), bias, post_op=k32.PostOp("relu"), rows=rows)
        prefix = str(w.target).rpartition(".")[0]
        name = add_module(gm, f"{prefix}.fused_matmul" if prefix else "fused_matmul", mod)
        with gm.graph.inserting_before(call):
            new = gm.graph.call_module(name, (x,))
        new.meta = dict(call.meta)
        call.replace_all_uses_with(new)
        gm.graph.erase_node(call)
        for n in (w, b):
            if not n.users:
                gm.graph.erase_node(n)
                _drop_attr(gm, str(n.target))
        return True


def _drop_attr(gm: fx.GraphModule, target: str) -> None:
    """Delete a constant no node reads any more (the fused module holds its own copy)."""
    if any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
        return
    parent_name, _, attr = target.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    if hasattr(parent, attr):
        delattr(parent, attr)


__all__ = ["FuseMatmulAddRelu", "operand_problem", "patterns", "replacement"]
