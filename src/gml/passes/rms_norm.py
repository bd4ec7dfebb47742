"""RecognizeRMSNorm: RMSNorm, as a module or written out, becomes one ``torch.ops.gml.rms_norm`` call.

Before → after (after Normalize: ``AddScalar`` / ``Mul`` modules; ``pow`` / ``mean`` / ``rsqrt`` in
any spelling; ``to(float32)`` / ``to(x.dtype)`` / ``float()`` / ``type_as`` casts, which change nothing
in an fp32 graph, absorbed where they sit in HF's code)::

    nn.RMSNorm(D, eps)(x)                                             →  gml.rms_norm(x, weight, eps)
    h = x.to(f32); h = Mul(h, rsqrt(AddScalar(eps)(mean(pow(h, 2), -1, keepdim=True))))
    out = Mul(weight, h.to(f32))                                      →  gml.rms_norm(x, weight, eps)
    math: rms_norm(x, w, eps) = x / sqrt(mean(x², -1) + eps) · w   — the same formula, one op

The written-out form is Llama's / Qwen's / Mistral's / T5's ``*RMSNorm.forward`` and Gemma's (whose
``1 + w`` FoldConstants has made a constant). Why: in torch it is six element-wise ops between engine
segments; as one op the engine runs it as one kernel step (native/rms_norm.h) inside the segment of
the linears around it. Rounding differs from eager by a few ulps (the reduction order).

Declined, with the reason: a power other than 2, a mean over another dim or without ``keepdim``, an
``AddScalar`` with ``alpha != 1`` or a negative eps, a weight that is not a constant ``[D]`` fp32
tensor, a cast to another dtype, an input that is not fp32, intermediate results read elsewhere, and
``nn.RMSNorm`` over more than the last dim.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from gml import nn as gnn
from gml.ir.match import Match, Op, Rule, Var, apply_rules
from gml.ir.rms_norm import rms_norm_op
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import modules_of

#: a match left to the rule that also takes the cast after it (at that cast: not a skip to report)
_DEFERRED = "a cast to fp32 follows: matched together with it"
_POW = (torch.pow, operator.pow, torch.ops.aten.pow.Tensor_Scalar)
_MEAN = (torch.mean, torch.ops.aten.mean.dim)
_RSQRT = (torch.rsqrt, torch.ops.aten.rsqrt.default)


def _calls(functions: tuple[Callable[..., object], ...], method: str) -> Callable[[fx.Node], bool]:
    def test(node: fx.Node) -> bool:
        return (node.op == "call_function" and node.target in functions) or (
            node.op == "call_method" and node.target == method
        )

    test.__name__ = method
    return test


def _module(cls: type[nn.Module]) -> Callable[[fx.Node], bool]:
    def test(node: fx.Node) -> bool:
        root = node.graph.owning_module
        return node.op == "call_module" and root is not None and type(root.get_submodule(str(node.target))) is cls

    test.__name__ = cls.__name__
    return test


def _f32_cast(node: fx.Node) -> bool:
    """A cast an fp32 graph does not see: ``x.to(torch.float32)``, ``x.float()``, ``x.type_as(y)``, and
    torch.export's ``aten.to.dtype`` / ``aten._to_copy`` to fp32."""
    if node.op == "call_function" and node.target in (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default):
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return dtype is torch.float32 and set(node.kwargs) <= {"dtype"}
    if node.op != "call_method":
        return False
    if node.target == "float":
        return True
    if node.target == "to":
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return len(node.args) <= 2 and (dtype is torch.float32 or _dtype_of_value(dtype))
    return node.target == "type_as" and _meta_dtype(node) is torch.float32


def _dtype_of_value(arg: object) -> bool:
    """``arg`` is ``v.dtype`` of a graph value (HF's ``h.to(input_dtype)``): fp32 in an fp32 graph;
    :meth:`WrittenOutRMSNorm.check` refuses an input whose recorded dtype is not fp32."""
    return (
        isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is getattr and arg.args[1:] == ("dtype",)
    )


def _meta_dtype(node: object) -> torch.dtype | None:
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get("val", node.meta.get("tensor_meta"))
    return getattr(meta, "dtype", None)


def _arg(node: fx.Node, i: int, name: str, default: object = None) -> object:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _written_out(cast_in: bool, cast_mid: bool, cast_out: bool) -> Op:
    """``[cast_out](Mul(w, [cast_mid](Mul(h, rsqrt(AddScalar(mean(pow(h, 2))))))))``, ``h = [cast_in](x)``."""
    h: Op | Var = Op(_f32_cast, Var("x"), name="cast_in") if cast_in else Var("x")
    stats = Op(
        _calls(_RSQRT, "rsqrt"),
        Op(
            _module(gnn.AddScalar),
            Op(_calls(_MEAN, "mean"), Op(_calls(_POW, "pow"), h, name="square"), name="mean"),
            name="eps",
        ),
        name="rsqrt",
    )
    norm: Op = Op(_module(gnn.Mul), h, stats, name="norm", commutative=True)
    if cast_mid:
        norm = Op(_f32_cast, norm, name="cast_mid")
    out = Op(_module(gnn.Mul), norm, name="scale", exact_inputs=True)  # the weight is a constant, not an input
    return Op(_f32_cast, out, name="cast_out") if cast_out else out


class WrittenOutRMSNorm(Rule):
    """HF's ``*RMSNorm.forward`` after Normalize, casts included or not (module doc)."""

    name = "RMSNorm written out"

    def __init__(self, cast_in: bool, cast_mid: bool, cast_out: bool) -> None:
        self.pattern = _written_out(cast_in, cast_mid, cast_out)
        self.cast_out = cast_out
        #: the interior nodes of each rewrite, erased once nothing reads them (apply_rules erases in
        #: binding order, which leaves the square behind while the mean still reads it)
        self.replaced: list[fx.Node] = []
        self.interior = [n for n, on in (("cast_in", cast_in), ("cast_mid", cast_mid), ("scale", cast_out)) if on]
        self.interior += ["square", "mean", "eps", "rsqrt", "norm"]

    def _weight(self, m: Match) -> fx.Node | None:
        scale = m["scale"]
        consts = [a for a in scale.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        return consts[0] if len(consts) == 1 else None

    def check(self, m: Match) -> str | None:
        mod = m.root.graph.owning_module.get_submodule  # type: ignore[union-attr]
        if _meta_dtype(m["x"]) not in (None, torch.float32):
            return f"input is {_meta_dtype(m['x'])}, not fp32"
        exponent = _arg(m["square"], 1, "exponent")
        if exponent != 2:
            return f"pow exponent {exponent!r}, not 2"
        mean = m["mean"]
        dim, keepdim = _arg(mean, 1, "dim"), _arg(mean, 2, "keepdim", False)
        rank = getattr(m["x"].meta.get("val"), "ndim", None)
        if dim not in (-1, [-1], (-1,)) and not (rank is not None and dim in (rank - 1, [rank - 1], (rank - 1,))):
            return f"mean over dim {dim!r}, not the last"
        if keepdim is not True:
            return "mean without keepdim"
        add = mod(str(m["eps"].target))
        if add.alpha != 1 or not isinstance(add.other, int | float) or not (0 <= add.other < math.inf):
            return f"mean + {add.other!r} (alpha {add.alpha!r}) is not mean + eps"
        w = self._weight(m)
        if w is None:
            return "the scale is not one constant weight"
        t = _constant(m.root.graph.owning_module, w)
        width = getattr(m["x"].meta.get("val"), "shape", (None,))[-1]
        if t.dim() != 1 or t.dtype != torch.float32 or (width is not None and t.shape[0] != width):
            return f"weight of shape {tuple(t.shape)} ({t.dtype}) is not fp32 [D]"
        if not self.cast_out and len(m.root.users) == 1 and _f32_cast(next(iter(m.root.users))):
            return _DEFERRED
        inside = set(m.nodes.values())
        for name in self.interior:
            if not set(m[name].users) <= inside or (name != "cast_in" and len(m[name].users) != 1):
                return f"{m[name].name} is read elsewhere ({len(m[name].users)} users)"
        return None

    def rewrite(self, m: Match) -> fx.Node:
        self.replaced += [m[n] for n in self.interior]
        eps = float(m.root.graph.owning_module.get_submodule(str(m["eps"].target)).other)  # type: ignore[union-attr]
        with m.root.graph.inserting_before(m.root):
            new = m.root.graph.call_function(rms_norm_op(), (m["x"], self._weight(m), eps))
        new.meta = dict(m.root.meta)
        return new


class ModuleRMSNorm(Rule):
    """``torch.nn.RMSNorm`` over the last dim → ``gml.rms_norm`` (its weight stored on the graph)."""

    name = "nn.RMSNorm"
    pattern = Op(_module(nn.RMSNorm), Var("x"), name="norm")

    def check(self, m: Match) -> str | None:
        norm = m.root.graph.owning_module.get_submodule(str(m.root.target))  # type: ignore[union-attr]
        if len(norm.normalized_shape) != 1:
            return f"normalizes over {len(norm.normalized_shape)} dims (gml.rms_norm: the last one)"
        if norm.weight is not None and norm.weight.dtype != torch.float32:
            return f"weight is {norm.weight.dtype}"
        if _meta_dtype(m["x"]) not in (None, torch.float32):
            return f"input is {_meta_dtype(m['x'])}, not fp32"
        return None

    def rewrite(self, m: Match) -> fx.Node:
        gm = m.root.graph.owning_module
        assert isinstance(gm, fx.GraphModule)
        norm = gm.get_submodule(str(m.root.target))
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps  # nn.RMSNorm's default
        with m.root.graph.inserting_before(m.root):
            weight = None
            if norm.weight is not None:
                name = f"{m.root.name}_weight"
                while hasattr(gm, name):
                    name += "_"
                gm.register_buffer(name, norm.weight.detach().clone())
                weight = m.root.graph.get_attr(name)
            new = m.root.graph.call_function(rms_norm_op(), (m["x"], weight, float(eps)))
        new.meta = dict(m.root.meta)
        return new


def _constant(gm: object, node: fx.Node) -> torch.Tensor:
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value


def rules() -> list[Rule]:
    """The module form, then every cast placement of the written-out form (most casts first, so a
    pattern never stops short of a cast it could absorb)."""
    placements = sorted(((a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)), key=sum)
    return [ModuleRMSNorm(), *(WrittenOutRMSNorm(*p) for p in reversed(placements))]


class RecognizeRMSNorm(GraphPass):
    """RMSNorm as ``nn.RMSNorm`` or written out → ``torch.ops.gml.rms_norm`` (module doc)."""

    name = "recognize_rms_norm"
    tolerance = Tolerance(atol=1e-5, rtol=1e-5)

    def call(self, gm: fx.GraphModule) -> PassResult:
        table = rules()  # one per run: the written-out rules collect the nodes they replaced
        report = apply_rules(gm, table, modules_of(gm))
        skips = [Skip(node.name, reason, rule) for node, rule, reason in report.declined if reason != _DEFERRED]
        if report.total:
            replaced = {n for r in table for n in getattr(r, "replaced", ())}
            for node in reversed(list(gm.graph.nodes)):  # and the ``x.dtype`` reads of absorbed casts
                if (node in replaced or _dtype_of_value(node)) and not node.users:
                    gm.graph.erase_node(node)
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()
        return PassResult.rewrote(gm, report.total, skips, f"{report.total} RMSNorm(s) → gml.rms_norm")


__all__ = ["ModuleRMSNorm", "RecognizeRMSNorm", "WrittenOutRMSNorm"]
