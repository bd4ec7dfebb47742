"""Graph utilities shared by the passes.

* :func:`remove_unused_nodes` erases a node only when nothing reads it (ADR 002): a dequantize or a
  conv output that still feeds a residual branch survives.
* :func:`replace_module` / :func:`add_module` swap or register submodules by dotted path.
* :func:`match_chain` is a module-*type*-aware matcher for producer→consumer chains such as
  ``Conv2d → BatchNorm2d → ReLU``. ``torch.fx.subgraph_rewriter`` compares ``call_module`` nodes by
  attribute *name*, so a pattern traced from ``self.conv`` only matches a submodule that is also
  called ``conv`` (see ``tests/passes/test_utils.py``); matching on type needs this helper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from torch import fx, nn

from gml.passes.base import Skip
from gml.passes.oplib import op_kind

# A pattern element: a module type, a tuple of types, a canonical op name from oplib
# (matches every spelling), or a predicate over (node, modules).
Element = type[nn.Module] | tuple[type[nn.Module], ...] | str | Callable[[fx.Node, dict[str, nn.Module]], bool]


def modules_of(gm: fx.GraphModule) -> dict[str, nn.Module]:
    # remove_duplicate=False: a module reachable under two names (shared relu) is listed under both.
    return dict(gm.named_modules(remove_duplicate=False))


def get_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The submodule a ``call_module`` node calls, else ``None``."""
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


def add_module(gm: fx.GraphModule, base_name: str, module: nn.Module) -> str:
    """Register ``module`` under a fresh dotted name derived from ``base_name``; returns the name."""
    name = base_name.replace(".", "_")
    existing = modules_of(gm)
    candidate, i = name, 1
    while candidate in existing or hasattr(gm, candidate):
        candidate = f"{name}_{i}"
        i += 1
    gm.add_submodule(candidate, module)
    return candidate


def replace_module(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    """Put ``module`` at dotted path ``target`` (the old module object is dropped)."""
    parent_name, _, attr = target.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    setattr(parent, attr, module)


def remove_unused_nodes(graph: fx.Graph, nodes: Iterable[fx.Node], recursive: bool = True) -> int:
    """Erase the given nodes that have no users; return how many were erased.

    With ``recursive`` the inputs of an erased node are considered next, so a dead chain
    ``dequantize → view`` goes in one call. Placeholders, outputs and impure nodes are never erased.
    A node that still has users is kept, which is what makes this safe on residual graphs.
    """
    erased = 0
    work = list(nodes)
    seen: set[fx.Node] = set()
    while work:
        node = work.pop()
        if node in seen or node.graph is not graph:
            continue
        if node.users or node.op in ("placeholder", "output") or node.is_impure():
            continue
        seen.add(node)
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased += 1
        if recursive:
            work.extend(inputs)
    return erased


def _element_matches(element: Element, node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if isinstance(element, str):
        return op_kind(node, modules) == element
    if isinstance(element, type | tuple):
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        return mod is not None and isinstance(mod, element)
    return bool(element(node, modules))


def _describe(element: Element) -> str:
    if isinstance(element, str):
        return element
    if isinstance(element, type):
        return element.__name__
    if isinstance(element, tuple):
        return "|".join(t.__name__ for t in element)
    return getattr(element, "__name__", "predicate")


@dataclass
class ChainMatch:
    """A matched chain ``nodes[0] → nodes[1] → ...``; each later node reads the previous one
    (in any argument position: a residual ``add`` may read the conv as its second operand)."""

    nodes: list[fx.Node]
    modules: list[nn.Module | None] = field(default_factory=list)


def match_chain(
    gm: fx.GraphModule,
    pattern: Sequence[Element],
    *,
    require_single_user: bool = True,
    name: str | None = None,
) -> tuple[list[ChainMatch], list[Skip]]:
    """Find chains of nodes matching ``pattern`` (by module type / op kind), in graph order.

    A node matching ``pattern[0]`` whose chain breaks later is reported as a :class:`Skip` with the
    reason (e.g. "output has 2 users"), so passes can explain missed fusions. With
    ``require_single_user`` every node but the last must feed only the next one, since rewriting a
    chain removes the intermediate tensors. A node is used in at most one match.
    """
    if not pattern:
        raise ValueError("empty pattern")
    modules = modules_of(gm)
    label = name or " → ".join(_describe(e) for e in pattern)
    matches: list[ChainMatch] = []
    skips: list[Skip] = []
    used: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in used or not _element_matches(pattern[0], node, modules):
            continue
        chain = [node]
        for element in pattern[1:]:
            last = chain[-1]
            nxt = next((u for u in last.users if _element_matches(element, u, modules)), None)
            if nxt is None or nxt in used:
                break  # the chain does not continue: not a candidate, nothing to report
            if require_single_user and len(last.users) != 1:
                skips.append(
                    Skip(node.name, f"{last.name} has {len(last.users)} users, so it cannot be fused away", label)
                )
                break
            chain.append(nxt)
        if len(chain) == len(pattern):
            used.update(chain)
            matches.append(ChainMatch(chain, [modules.get(str(n.target)) for n in chain]))
    return matches, skips


def count_nodes(gm: fx.GraphModule) -> int:
    return len(gm.graph.nodes)
