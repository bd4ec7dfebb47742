"""The ranges of the ``torch.ops.gml`` ops' arguments: one rule per argument name.

The schemas (:mod:`gml.ir.library`, :mod:`gml.ir.attention`) fix each argument's *type*; torch checks
those at every call. What a type cannot say — a stride of 0, a negative padding, a scale of NaN, a
zero point outside uint8, a weight that does not match its channel count — is checked here, once,
for a graph that comes from outside GML (a loaded file) before any executor prepacks a weight or
builds an engine step from it. Argument names mean the same thing in every gml op, so a rule is
keyed by the name alone.

:func:`check_call` returns the reason a call is refused, or ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from gml.ir import library

Rule = Callable[[Any], "str | None"]

#: the oneDNN eltwise post-ops and activations the executors implement (library's docstring)
POST_OPS = frozenset(
    {
        *("none", "relu", "hardtanh", "hardswish", "hardsigmoid", "swish", "silu", "gelu", "sigmoid", "tanh"),
        *("leaky_relu", "elu", "mish", "linear", "clip", "abs"),
    }
)
BACKENDS = frozenset({"onednn", "fbgemm"})
#: ``gml``: GML's own exact arithmetic (8-bit weights without VNNI, ADR 011), a ``qlinear`` with
#: post-op ``none`` or ``relu`` only (gml.kernels.exact_int8)
EXACT_BACKEND_OPS = {"qlinear": frozenset({"none", "relu"})}


def _ints(lo: int, hi: int = 1 << 31, *, length: tuple[int, ...] = (1, 2, 3)) -> Rule:
    def rule(v: Any) -> str | None:
        if type(v) is int and 1 in length:  # an int where a list is allowed (aten's padding=1)
            v = [v]
        if not isinstance(v, list | tuple) or len(v) not in length:
            return f"must be a list of {' or '.join(map(str, length))} integers"
        if not all(type(i) is int and lo <= i <= hi for i in v):
            return f"must hold integers in [{lo}, {hi}], not {list(v)}"
        return None

    return rule


def _int(lo: int, hi: int) -> Rule:
    def rule(v: Any) -> str | None:
        return None if type(v) is int and lo <= v <= hi else f"must be an integer in [{lo}, {hi}], not {v!r}"

    return rule


def _scale(v: Any) -> str | None:
    ok = isinstance(v, int | float) and math.isfinite(v) and v > 0
    return None if ok else f"must be a finite positive number, not {v!r}"


def _scales(v: Any) -> str | None:
    if not isinstance(v, list | tuple):
        return "must be a list of scales"
    return next((r for r in map(_scale, v) if r), None)


def _zero_points(v: Any) -> str | None:
    if not isinstance(v, list | tuple):
        return "must be a list of zero points"
    return next((r for r in map(_ZERO_POINT, v) if r), None)


def _eps(v: Any) -> str | None:
    return None if isinstance(v, int | float) and math.isfinite(v) and v >= 0 else f"must be finite and >= 0, not {v!r}"


def _choice(values: frozenset[str]) -> Rule:
    def rule(v: Any) -> str | None:
        return None if v in values else f"must be one of {sorted(values)}, not {str(v)[:40]!r}"

    return rule


def _finite_floats(v: Any) -> str | None:
    if not isinstance(v, list | tuple) or len(v) > 8:
        return "must be a short list of numbers"
    ok = all(x is None or (isinstance(x, int | float) and not math.isnan(x)) for x in v)
    return None if ok else "must not hold NaN"


def _tensor_scale(v: Any) -> str | None:
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or v.numel() == 0:
        return "must be a non-empty float tensor"
    ok = bool(torch.isfinite(v).all()) and bool((v > 0).all())
    return None if ok else "must hold finite positive scales"


_ZERO_POINT = _int(-128, 255)

#: argument name -> its rule (every gml op that has the argument)
RULES: dict[str, Rule] = {
    "stride": _ints(1),
    "dilation": _ints(1),
    "padding": _ints(0),
    "kernel_size": _ints(1),
    "output_size": _ints(1),
    "groups": _int(1, 1 << 20),
    "divisor_override": lambda v: None if v is None else _int(1, 1 << 20)(v),
    "x_scale": _scale,
    "out_scale": _scale,
    "a_scale": _scale,
    "b_scale": _scale,
    "other_scale": _scale,
    "x_scales": _scales,
    "x_zero_point": _ZERO_POINT,
    "out_zero_point": _ZERO_POINT,
    "a_zero_point": _ZERO_POINT,
    "b_zero_point": _ZERO_POINT,
    "other_zero_point": _ZERO_POINT,
    "x_zero_points": _zero_points,
    "weight_scale": _tensor_scale,
    "eps": _eps,
    "post_op": _choice(POST_OPS),
    "op": _choice(POST_OPS),
    "post_op_algorithm": _choice(frozenset({"", "none", "tanh"})),
    "post_op_scalars": _finite_floats,
    "scalars": _finite_floats,
    "backend": _choice(BACKENDS | {"gml"}),
    "out_dtype": lambda v: None if v in (torch.uint8, torch.float32) else f"must be uint8 or float32, not {v!r}",
}


def _weight_geometry(name: str, args: dict[str, Any]) -> str | None:
    """A conv weight ``[O, I/groups, *k]`` whose channels the groups divide, scales one per channel."""
    w = args.get("weight")
    if not isinstance(w, torch.Tensor):
        return None
    scale = args.get("weight_scale")
    if isinstance(scale, torch.Tensor) and scale.numel() not in (1, w.shape[0] if w.dim() else 1):
        return f"weight_scale has {scale.numel()} values for {w.shape[0] if w.dim() else 0} output channels"
    if name in ("qconv", "qconv_add"):
        spatial = w.dim() - 2
        if spatial < 1 or any(len(args[k]) != spatial for k in ("stride", "padding", "dilation")):
            return f"a {w.dim()}-D weight does not match stride/padding/dilation of its conv"
        if w.shape[0] % args["groups"]:
            return f"groups={args['groups']} does not divide the {w.shape[0]} output channels"
    bias = args.get("bias")
    if isinstance(bias, torch.Tensor) and w.dim() and bias.numel() != w.shape[0]:
        return f"bias has {bias.numel()} values for {w.shape[0]} output channels"
    return None


def check_call(name: str, args: dict[str, Any]) -> str | None:
    """Why the call ``gml.<name>(**args)`` (arguments by schema name) is refused, or None."""
    for arg, value in args.items():
        rule = RULES.get(arg)
        reason = rule(value) if rule is not None else None
        if reason:
            return f"gml.{name}: {arg} {reason}"
    if args.get("backend") == "gml" and args.get("post_op", "none") not in EXACT_BACKEND_OPS.get(name, ()):
        return f"gml.{name}: backend 'gml' runs qlinear with post-op none or relu only"
    reason = _weight_geometry(name, args)
    return f"gml.{name}: {reason}" if reason else None


def _value(gm: fx.GraphModule, arg: Any) -> Any:
    """A call's argument as the executor will see it: constants fetched, graph values left as nodes."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value: Any = gm
        for part in str(arg.target).split("."):
            value = getattr(value, part, None)
        return value
    return arg


#: geometry arguments of the other kernels a GML graph calls (oneDNN's fused fp32 ops, aten convs and
#: pools): the same names, an empty list meaning "the default"
GEOMETRY_RULES: dict[str, Rule] = {
    "stride": _ints(1, length=(0, 1, 2, 3)),
    "dilation": _ints(1, length=(0, 1, 2, 3)),
    "padding": _ints(0, length=(0, 1, 2, 3)),
    "kernel_size": _ints(1, length=(1, 2, 3)),
    "groups": _int(1, 1 << 20),
}
_GEOMETRY_OPS = ("conv", "pool")


def graph_problems(gm: fx.GraphModule) -> list[str]:
    """Every refused call of ``gm`` (empty when all pass), in graph order: gml ops by :data:`RULES`,
    the geometry of oneDNN's fused ops and aten's convs and pools by :data:`GEOMETRY_RULES`."""
    problems = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.split("::")[-1]
        if target.namespace == library.NAMESPACE and name in library.SCHEMAS:
            reason = check_call(name, {k: _value(gm, v) for k, v in library.schema_args(node).items()})
        elif target.namespace == "mkldnn" or (target.namespace == "aten" and any(k in name for k in _GEOMETRY_OPS)):
            args = library.schema_args(node)
            reason = next(
                (f"{name}: {k} {r}" for k, rule in GEOMETRY_RULES.items() if k in args and (r := rule(args[k]))), None
            )
        else:
            continue
        if reason:
            problems.append(f"node {node.name}: {reason}")
    return problems


__all__ = ["BACKENDS", "GEOMETRY_RULES", "POST_OPS", "RULES", "check_call", "graph_problems"]
