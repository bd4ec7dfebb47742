"""RecognizeTanhGelu: the tanh GELU written out as arithmetic becomes one ``nn.GELU("tanh")``.

Hugging Face's ``NewGELUActivation`` ("gelu_new": GPT-2, ALBERT, GPT-J/Neo, CodeGen, BigBird, ...)
spells the tanh approximation of GELU as eight tensor ops::

    0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

Before → after (after Normalize: ``MulScalar`` / ``AddScalar`` / ``Add`` / ``Mul`` / ``nn.Tanh``
modules; ``pow`` in any spelling)::

    h = MulScalar(0.5)(x); c = MulScalar(0.044715)(pow(x, 3)); s = MulScalar(√(2/π))(Add(x, c))
    out = Mul(h, AddScalar(1)(Tanh(s)))                                    →   out = nn.GELU("tanh")(x)
    math: GELU_tanh(x) = x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))  — the same formula, one kernel

Why: the fusions take ``nn.GELU`` as a post-op of the linear before it (oneDNN ``eltwise_gelu_tanh``;
``gml.dynamic_linear``'s ``gelu tanh``), so the FFN of these models is one GEMM instead of a GEMM and
eight element-wise ops in torch between engine segments. ATen's ``gelu(approximate="tanh")`` evaluates
the same expression in another order: results agree to a few ulps (tolerance 1e-5).

Declined, with the reason: constants other than GELU's (0.5, 0.044715, √(2/π) to 1e-6 relative, 1,
the cube), an ``Add`` with ``alpha != 1``, and intermediate results read elsewhere.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from gml import nn as gnn
from gml.ir.match import Match, Op, Rule, Var, apply_rules
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import add_module, modules_of

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


def _module(cls: type[nn.Module]) -> Callable[[fx.Node], bool]:
    def test(node: fx.Node) -> bool:
        if node.op != "call_module":
            return False
        root = node.graph.owning_module
        return root is not None and type(root.get_submodule(str(node.target))) is cls

    test.__name__ = cls.__name__
    return test


def _is_pow(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in (torch.pow, operator.pow, torch.ops.aten.pow.Tensor_Scalar)
    return node.op == "call_method" and node.target == "pow"


def _close(a: object, b: float) -> bool:
    return isinstance(a, int | float) and not isinstance(a, bool) and abs(float(a) - b) <= 1e-6 * abs(b)


class TanhGeluRule(Rule):
    """``Mul(MulScalar(0.5)(x), AddScalar(1)(Tanh(MulScalar(√(2/π))(Add(x, MulScalar(0.044715)(x³))))))``."""

    name = "tanh GELU"
    pattern = Op(
        _module(gnn.Mul),
        Op(_module(gnn.MulScalar), Var("x"), name="half"),
        Op(
            _module(gnn.AddScalar),
            Op(
                _module(nn.Tanh),
                Op(
                    _module(gnn.MulScalar),
                    Op(
                        _module(gnn.Add),
                        Var("x"),
                        Op(_module(gnn.MulScalar), Op(_is_pow, Var("x"), name="cube"), name="cubic"),
                        name="inner",
                        commutative=True,
                    ),
                    name="scale",
                ),
                name="tanh",
            ),
            name="one_plus",
        ),
        name="out",
        commutative=True,
    )

    def check(self, m: Match) -> str | None:
        mod = m.root.graph.owning_module.get_submodule  # type: ignore[union-attr]
        cube = m["cube"]
        exponent = cube.args[1] if len(cube.args) > 1 else cube.kwargs.get("exponent")
        if not _close(exponent, 3.0):
            return f"pow exponent {exponent!r}, not 3"
        for name, want in (("half", 0.5), ("cubic", CUBIC), ("scale", SQRT_2_OVER_PI)):
            got = mod(str(m[name].target)).other
            if not _close(got, want):
                return f"constant {got!r} where GELU has {want:.7g}"
        one = mod(str(m["one_plus"].target))
        if not (_close(one.other, 1.0) and one.alpha == 1):
            return f"1 + tanh(...) has {one.other!r} (alpha {one.alpha!r})"
        if mod(str(m["inner"].target)).alpha != 1:
            return "x + 0.044715 x³ is an add with alpha != 1"
        for name in ("half", "cube", "cubic", "inner", "scale", "tanh", "one_plus"):
            if len(m[name].users) != 1:
                return f"{m[name].name} is read elsewhere ({len(m[name].users)} users)"
        return None

    def __init__(self) -> None:
        #: the interior nodes of each rewrite, erased once nothing reads them (apply_rules erases in
        #: binding order, which leaves the cube behind while its reader still exists)
        self.replaced: list[fx.Node] = []

    def rewrite(self, m: Match) -> fx.Node:
        self.replaced += [m[n] for n in ("half", "cube", "cubic", "inner", "scale", "tanh", "one_plus")]
        gm = m.root.graph.owning_module
        assert isinstance(gm, fx.GraphModule)
        target = add_module(gm, f"{m.root.name}_gelu", nn.GELU(approximate="tanh"))
        with m.root.graph.inserting_before(m.root):
            new = m.root.graph.call_module(target, (m["x"],))
        new.meta = dict(m.root.meta)
        return new


class RecognizeTanhGelu(GraphPass):
    """The written-out tanh GELU (``NewGELUActivation``) → ``nn.GELU(approximate="tanh")`` (module doc)."""

    name = "recognize_gelu"
    tolerance = Tolerance(atol=1e-5, rtol=1e-5)

    def call(self, gm: fx.GraphModule) -> PassResult:
        rule = TanhGeluRule()  # one per run: it collects the nodes its rewrites replaced
        report = apply_rules(gm, [rule], modules_of(gm))
        skips = [Skip(node.name, reason, rule_name) for node, rule_name, reason in report.declined]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in sorted((n for n in set(rule.replaced) if n in order), key=order.__getitem__, reverse=True):
            if not node.users:
                gm.graph.erase_node(node)
        if report.total:
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()
        notes = [f"{report.total} tanh GELU(s) written as arithmetic → nn.GELU(approximate='tanh')"]
        return PassResult(gm, report.total > 0, report.total, skips, notes)


__all__ = ["RecognizeTanhGelu", "TanhGeluRule"]
