"""Helpers shared by the pass tests."""

from __future__ import annotations

from torch import fx

from gml.ir.library import gml_op_name


def op_names(gm: fx.GraphModule) -> list[str]:
    """What each node computes, in graph order: a module's class name, a ``torch.ops.gml`` op's name,
    or a function's / method's name (placeholders, constants and the output left out)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            out.append(type(gm.get_submodule(str(n.target))).__name__)
        elif n.op in ("call_function", "call_method"):
            out.append(gml_op_name(n) or str(getattr(n.target, "__name__", n.target)))
    return out
