"""RecognizeGroupNorm: GroupNorm, as a module or a function call, becomes one ``torch.ops.gml.group_norm``.

Before → after::

    nn.GroupNorm(G, C, eps)(x)                        →  gml.group_norm(x, G, weight, bias, eps)
    F.group_norm(x, G, self.weight, self.bias, eps)   →  gml.group_norm(x, G, weight, bias, eps)
    math: (x − μ_g) / sqrt(σ²_g + eps) · w[c] + b[c], μ_g / σ²_g over group g's C/G channels and
    all positions — the same formula, one op (gml/ir/group_norm.py)

The function form is what timm writes (``GroupNormAct`` in BiT's ``resnetv2_*``, ``GroupNorm1`` in
PoolFormer / MambaOut-style nets: ``nn.GroupNorm`` subclasses whose ``forward`` FX traces through).
Why: the engine had no rule for either, so every GroupNorm ended one engine segment and began the
next (resnetv2_50x1_bit: 51 segments; poolformer_s12: 25). As ``gml.group_norm`` the engine runs it
as one GML kernel step (native/group_norm.h) inside the segment of the convs around it. Rounding
differs from eager by a few ulps (the statistics are accumulated in double).

Declined, with the reason: an input that is not fp32 or has fewer than 2 dims, groups that do not
divide the channels, a weight or bias that is not a stored fp32 ``[C]`` tensor (a computed one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.ir.group_norm import group_norm_op
from gml.ir.match import Match, Op, Rule, Var, apply_rules
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import modules_of

_FUNCTIONS = (F.group_norm, torch.group_norm, torch.ops.aten.group_norm.default)


def _is_module(node: fx.Node) -> bool:
    root = node.graph.owning_module
    return (
        node.op == "call_module" and root is not None and isinstance(root.get_submodule(str(node.target)), nn.GroupNorm)
    )


def _is_function(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _FUNCTIONS


def _meta(node: Any) -> Any:
    return node.meta.get("val", node.meta.get("tensor_meta")) if isinstance(node, fx.Node) else None


def _stored(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, else None."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _check(x: fx.Node, groups: Any, affine: dict[str, Any], eps: Any, stored: dict[str, Any]) -> str | None:
    """Why ``group_norm(x, groups, weight, bias, eps)`` cannot be ``gml.group_norm``, or None."""
    meta = _meta(x)
    dtype, shape = getattr(meta, "dtype", None), getattr(meta, "shape", None)
    if dtype not in (None, torch.float32):
        return f"input is {dtype}, not fp32"
    if shape is not None and len(shape) < 2:
        return f"input of rank {len(shape)} (GroupNorm normalizes [N, C, ...])"
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
        return f"num_groups {groups!r} is not a positive int"
    channels = int(shape[1]) if shape is not None else None
    if channels is not None and channels % groups:
        return f"{groups} groups do not divide {channels} channels"
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 <= eps < float("inf"):
        return f"eps {eps!r} is not a finite number >= 0"
    for name, arg in affine.items():
        if arg is None:
            continue
        t = stored.get(name)
        if t is None:
            return f"the {name} is computed in the graph, not a stored tensor"
        if t.dtype != torch.float32 or t.dim() != 1 or (channels is not None and t.shape[0] != channels):
            return f"{name} of shape {tuple(t.shape)} ({t.dtype}) is not fp32 [C]"
    return None


class ModuleGroupNorm(Rule):
    """``nn.GroupNorm`` → ``gml.group_norm`` (its weight and bias stored on the graph)."""

    name = "nn.GroupNorm"
    pattern = Op(_is_module, Var("x"), name="norm")

    def check(self, m: Match) -> str | None:
        norm = m.root.graph.owning_module.get_submodule(str(m.root.target))  # type: ignore[union-attr]
        if type(norm).forward is not nn.GroupNorm.forward:
            return f"{type(norm).__name__} has its own forward"
        affine = {"weight": norm.weight, "bias": norm.bias}
        return _check(m["x"], norm.num_groups, affine, norm.eps, affine)

    def rewrite(self, m: Match) -> fx.Node:
        gm = m.root.graph.owning_module
        assert isinstance(gm, fx.GraphModule)
        norm = gm.get_submodule(str(m.root.target))
        with m.root.graph.inserting_before(m.root):
            attrs = []
            for part in ("weight", "bias"):
                t = getattr(norm, part)
                if t is None:
                    attrs.append(None)
                    continue
                name = f"{m.root.name}_{part}"
                while hasattr(gm, name):
                    name += "_"
                gm.register_buffer(name, t.detach().clone())
                attrs.append(m.root.graph.get_attr(name))
            args = (m["x"], int(norm.num_groups), *attrs, float(norm.eps))
            new = m.root.graph.call_function(group_norm_op(), args)
        new.meta = dict(m.root.meta)
        return new


def _function_args(node: fx.Node) -> tuple[Any, Any, Any, Any]:
    """``(num_groups, weight, bias, eps)`` of an ``F.group_norm`` / ``aten.group_norm`` call."""
    names = ("input", "num_groups", "weight", "bias", "eps")
    defaults: dict[str, Any] = {"weight": None, "bias": None, "eps": 1e-5}
    got = {**defaults, **dict(zip(names, node.args, strict=False)), **node.kwargs}
    return got.get("num_groups"), got["weight"], got["bias"], got["eps"]


class FunctionGroupNorm(Rule):
    """``F.group_norm(x, G, weight, bias, eps)`` with stored weight / bias → ``gml.group_norm``."""

    name = "F.group_norm"
    pattern = Op(_is_function, Var("x"), name="norm")

    def check(self, m: Match) -> str | None:
        gm = m.root.graph.owning_module
        if set(m.root.kwargs) - {"num_groups", "weight", "bias", "eps", "cudnn_enabled"}:
            return f"arguments {sorted(m.root.kwargs)}"
        groups, weight, bias, eps = _function_args(m.root)
        affine = {"weight": weight, "bias": bias}
        stored = {k: _stored(gm, v) for k, v in affine.items()}  # type: ignore[arg-type]
        return _check(m["x"], groups, affine, eps, stored)

    def rewrite(self, m: Match) -> fx.Node:
        groups, weight, bias, eps = _function_args(m.root)
        with m.root.graph.inserting_before(m.root):
            new = m.root.graph.call_function(group_norm_op(), (m["x"], int(groups), weight, bias, float(eps)))
        new.meta = dict(m.root.meta)
        return new


def rules() -> list[Rule]:
    return [ModuleGroupNorm(), FunctionGroupNorm()]


class RecognizeGroupNorm(GraphPass):
    """GroupNorm as ``nn.GroupNorm`` or ``F.group_norm`` → ``torch.ops.gml.group_norm`` (module doc)."""

    name = "recognize_group_norm"
    tolerance = Tolerance(atol=1e-5, rtol=1e-5)

    def call(self, gm: fx.GraphModule) -> PassResult:
        report = apply_rules(gm, rules(), modules_of(gm))
        skips = [Skip(node.name, reason, rule) for node, rule, reason in report.declined]
        if report.total:
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()
        return PassResult.rewrote(gm, report.total, skips, f"{report.total} GroupNorm(s) → gml.group_norm")


__all__ = ["FunctionGroupNorm", "ModuleGroupNorm", "RecognizeGroupNorm"]
