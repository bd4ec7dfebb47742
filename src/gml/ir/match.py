"""A small pattern matcher over FX graphs, and rules in onnxscript's shape: pattern, check → reason, rewrite.

Patterns are values::

    conv_add = Op("qadd", Op("qconv", Var("x"), name="conv"), Var("other"), name="add", commutative=True)

* :class:`Op` matches a node by what it computes — a ``torch.ops.gml`` op name (``"qconv"``), a
  canonical kind of the op table (``"relu"``, any spelling: :func:`gml.ir.ops.op_kind`), or a
  predicate ``node -> bool`` — and its *value inputs* (the node arguments that are graph values,
  ``get_attr`` constants excluded) against its sub-patterns, in order (``commutative``: either
  order of two inputs).
* :class:`Var` matches any value and binds it. A name bound twice must be the same node, which is
  how a pattern is a DAG rather than a chain: attention's ``matmul(softmax(matmul(q, k)), v)``
  shares nothing, but ``mul(x, sigmoid(x))`` (SiLU) reads ``x`` twice.
* Chains are the one-input case: ``Op("relu", Op("conv", Var("x")))``.

A :class:`Rule` pairs a pattern with ``check(match) -> reason | None`` and ``rewrite(match)``;
:func:`apply_rules` runs rules over a graph in order and reports every declined match with the
rule's reason, so a pass built on it gets its ``matches`` and ``skips`` for free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from gml.ir.library import gml_op_name
from gml.ir.ops import op_kind


@dataclass(frozen=True)
class Var:
    """Any value, bound to ``name``."""

    name: str


class Op:
    """A node computing ``what`` whose value inputs match ``inputs``; bound to ``name`` if given."""

    def __init__(
        self,
        what: str | Callable[[fx.Node], bool],
        *inputs: Op | Var,
        name: str | None = None,
        commutative: bool = False,
        exact_inputs: bool = False,
    ) -> None:
        if commutative and len(inputs) != 2:
            raise ValueError("commutative patterns take exactly two inputs")
        self.what, self.inputs, self.name = what, inputs, name
        self.commutative, self.exact_inputs = commutative, exact_inputs

    def __repr__(self) -> str:
        what = self.what if isinstance(self.what, str) else getattr(self.what, "__name__", "?")
        inner = ", ".join(repr(i) for i in self.inputs)
        return f"{what}({inner})" + (f" as {self.name}" if self.name else "")


Pattern = Op | Var


@dataclass
class Match:
    """The nodes a pattern bound, by name; ``root`` is the node the outermost :class:`Op` matched."""

    root: fx.Node
    nodes: dict[str, fx.Node] = field(default_factory=dict)

    def __getitem__(self, name: str) -> fx.Node:
        return self.nodes[name]

    def interior(self) -> list[fx.Node]:
        """The matched op nodes other than the root (what a rewrite replaces along with it)."""
        return [n for k, n in self.nodes.items() if n is not self.root and not k.startswith("$")]


def value_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's arguments that are graph values (not ``get_attr`` constants), in argument order."""
    out: list[fx.Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node):
            if a.op != "get_attr":
                out.append(a)
        elif isinstance(a, list | tuple):
            for x in a:
                visit(x)

    for a in (*node.args, *node.kwargs.values()):
        visit(a)
    return out


def _computes(node: fx.Node, what: Any, modules: dict[str, nn.Module]) -> bool:
    if callable(what):
        return bool(what(node))
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    return gml_op_name(node) == what or op_kind(node, modules) == what


def _match(p: Pattern, node: Any, modules: dict[str, nn.Module], bound: dict[str, fx.Node]) -> Iterator[dict]:
    if isinstance(p, Var):
        prev = bound.get(p.name)
        if prev is None:
            yield {**bound, p.name: node}
        elif prev is node:
            yield bound
        return
    if not isinstance(node, fx.Node) or not _computes(node, p.what, modules):
        return
    if p.name is not None:
        prev = bound.get(p.name)
        if prev is not None and prev is not node:
            return
        bound = {**bound, p.name: node}
    ins = value_inputs(node)
    if len(ins) < len(p.inputs) or (p.exact_inputs and len(ins) != len(p.inputs)):
        return
    orders = [ins[: len(p.inputs)]]
    if p.commutative:
        orders.append(list(reversed(ins[:2])))
    for order in orders:
        yield from _match_all(list(p.inputs), order, modules, bound)


def _match_all(ps: list[Pattern], nodes: list[Any], modules: dict[str, nn.Module], bound: dict) -> Iterator[dict]:
    if not ps:
        yield bound
        return
    for b in _match(ps[0], nodes[0], modules, bound):
        yield from _match_all(ps[1:], nodes[1:], modules, b)


def matches(pattern: Op, node: fx.Node, modules: dict[str, nn.Module] | None = None) -> list[Match]:
    """Every way ``pattern`` matches with its root at ``node`` (several for commutative patterns)."""
    found = []
    for b in _match(pattern, node, modules or {}, {}):
        found.append(Match(node, dict(b)))
    return found


class Rule:
    """A rewrite rule: ``pattern``, ``check(match) -> reason | None``, ``rewrite(match) -> new node``.

    Subclasses set :attr:`pattern` and implement :meth:`check` and :meth:`rewrite`; :meth:`prefer`
    picks among several passing matches of one root (default: the first)."""

    name: str = ""
    pattern: Op

    def check(self, m: Match) -> str | None:
        return None

    def rewrite(self, m: Match) -> fx.Node:  # pragma: no cover - abstract
        raise NotImplementedError

    def prefer(self, ms: Sequence[Match]) -> Match:
        return ms[0]


@dataclass
class RuleReport:
    """What :func:`apply_rules` did: rewrites per rule, and every declined match with its reason."""

    rewrites: dict[str, int] = field(default_factory=dict)
    declined: list[tuple[fx.Node, str, str]] = field(default_factory=list)  # (root, rule name, reason)

    @property
    def total(self) -> int:
        return sum(self.rewrites.values())


def apply_rules(gm: fx.GraphModule, rules: Sequence[Rule], modules: dict[str, nn.Module] | None = None) -> RuleReport:
    """Try ``rules`` in order at every node (graph order); the first rule with a passing match
    rewrites it: its root's users read the new node, and the root plus interior nodes nobody reads
    any more are erased (never a node another branch still reads)."""
    report = RuleReport()
    modules = modules if modules is not None else dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False):
            continue
        for rule in rules:
            ms = matches(rule.pattern, node, modules)
            if not ms:
                continue
            reasons = [(m, rule.check(m)) for m in ms]
            ok = [m for m, why in reasons if why is None]
            if not ok:
                report.declined.append((node, rule.name, reasons[0][1] or ""))
                continue
            m = rule.prefer(ok)
            new = rule.rewrite(m)
            node.replace_all_uses_with(new)
            for dead in [node, *reversed(m.interior())]:
                if not dead.users and dead is not new:
                    gm.graph.erase_node(dead)
            report.rewrites[rule.name] = report.rewrites.get(rule.name, 0) + 1
            break
    return report


__all__ = ["Match", "Op", "Rule", "RuleReport", "Var", "apply_rules", "matches", "value_inputs"]
