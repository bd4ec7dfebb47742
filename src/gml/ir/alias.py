"""One alias / mutation analysis for FX graphs: which values share memory, which ops write.

Every pass that moves, fuses or reuses a buffer asks these questions; they are answered here once,
from the op table (:mod:`gml.ir.ops`, tag ``view``) and from the spelling of in-place calls
(``x.relu_()``, ``x += y``, ``inplace=True``, ``nn.ReLU(inplace=True)``), plus the writes shape
propagation observed inside opaque calls (``node.meta[MUTATES]``, set by :mod:`gml.capture`).
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx, nn

from gml.ir.ops import functions_tagged, methods_tagged, modules_tagged

#: ``node.meta`` key: names of the inputs a call was seen to overwrite during shape propagation.
MUTATES = "gml_mutates"

VIEW_METHODS: frozenset[str] = methods_tagged("view")
VIEW_FUNCTIONS: frozenset[Any] = functions_tagged("view")
VIEW_MODULES: tuple[type[nn.Module], ...] = modules_tagged("view")
#: Activation modules whose ``inplace=True`` overwrites their input.
INPLACE_CAPABLE_MODULES: tuple[type[nn.Module], ...] = modules_tagged("activation")

_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem})


def inplace_spelling(node: fx.Node) -> bool:
    if node.target in _INPLACE_OPERATORS:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def writes_in_place(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` overwrites its first operand (``x.relu_()``, ``inplace=True``, an
    ``nn.ReLU(inplace=True)`` call, ``x += y``, ``x[i] = v``)."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        return isinstance(mod, INPLACE_CAPABLE_MODULES) and bool(getattr(mod, "inplace", False))
    if node.op in ("call_function", "call_method"):
        return inplace_spelling(node) or node.kwargs.get("inplace") is True
    return False


def mutates(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` may write into *any* of its inputs: an in-place spelling, or a module
    flagged ``inplace`` (an activation, or a fused kernel accumulating into an operand)."""
    if node.op == "call_module":
        return bool(getattr(modules.get(str(node.target)), "inplace", False))
    return writes_in_place(node, modules)


def returns_alias(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node``'s result may share storage with its first argument (a view, an in-place op)."""
    if node.op == "call_method":
        return node.target in VIEW_METHODS or writes_in_place(node, modules)
    if node.op == "call_function":
        return node.target in VIEW_FUNCTIONS or writes_in_place(node, modules)
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        return isinstance(mod, VIEW_MODULES) or writes_in_place(node, modules)
    return False


def alias_base(node: Any, modules: dict[str, nn.Module], limit: int = 64) -> Any:
    """The value ``node`` is a view of, following view / in-place chains to the first fresh value."""
    for _ in range(limit):
        if not (isinstance(node, fx.Node) and returns_alias(node, modules) and node.args):
            return node
        node = node.args[0]
    return node


def may_alias(a: Any, b: Any, modules: dict[str, nn.Module]) -> bool:
    """Whether values ``a`` and ``b`` may share memory (one is a view chain of the other, or both
    are views of one value)."""
    return isinstance(a, fx.Node) and isinstance(b, fx.Node) and alias_base(a, modules) is alias_base(b, modules)


def alias_set(node: fx.Node, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """``node`` and every value sharing its memory through views, in both directions."""
    root = alias_base(node, modules)
    seen: set[fx.Node] = set()
    work = [root] if isinstance(root, fx.Node) else [node]
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if returns_alias(user, modules) and user.args and user.args[0] is n:
                work.append(user)
    return seen


def written_in_place(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """A later op that overwrites ``node``'s value, directly or through a view of it, if any."""
    work, seen = [node], {node}
    while work:
        current = work.pop()
        for user in current.users:
            if (writes_in_place(user, modules) and user.args and user.args[0] is current) or (
                current.name in user.meta.get(MUTATES, ())
            ):
                return user
            if user not in seen and returns_alias(user, modules) and user.args and user.args[0] is current:
                seen.add(user)
                work.append(user)
    return None
