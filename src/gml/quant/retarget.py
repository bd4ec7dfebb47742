"""Rebuild a lowered INT8 graph's weights for the CPU it runs on (a saved model moved between machines).

A model quantized where u8×s8 dot products accumulate in int32 (VNNI, AMX) has 8-bit weights. On a
target without VNNI (AVX2, AVX-512 without VNNI) the same kernels add pairs of products in a
saturating int16 (``255·127·2 > 32,767``: docs/adr/011-int8-on-every-isa.md), so the weights of
every ``qconv`` / ``qconv_add`` / ``qlinear`` output channel outside the target's range are
requantized to 7 bits (``dynamic_linear``'s too, ``Target.dynamic_weight_qmax``: its AVX2 kernel
is exact with 8 bits but faster with 7)::

    w7[o, :] = round_half_even(w8[o, :] / 2)      (|w7| <= 64: 2·255·64 = 32,640 fits in int16)
    s7[o]    = 2 · s8[o]                          (w7 · s7 ≈ w8 · s8: the same float weights)

One more rounding of each weight (at most half a 7-bit step); then every kernel on the target
computes the exact integer sums, the Python executor and the engine alike. Channels already in range
and ``backend="fbgemm"`` calls (7-bit activations: pairs of ``127·128`` cannot saturate) are kept.
A weight shared by several calls is requantized once.

A ``qlinear`` over ``[batch, features]`` rows (post-op ``none`` / ``relu``) keeps its 8-bit weights
where the target has GML's exact linear (``Int8Arithmetic.exact_linear``: AVX2 without VNNI; a
linear over token rows is halved like a conv, for speed: ``exact_linear_names``): its backend becomes ``gml``
(gml.kernels.exact_int8), whose weights lie in ``[-127, 127]``. A ``-128`` (torch's symmetric
observer rounds a channel's ``-127.5`` steps there) becomes ``-127``: the same half-step error as
that rounding, to the other side. Where a ``gml`` linear lands on a VNNI / AMX target it goes back
to ``onednn`` (the same integers, exact there); without AVX2 it is halved like the others.

The function returns one line per weight or call it changed, for the runtime report (``m.runtime``:
"changed for this CPU: ...").
"""

from __future__ import annotations

import torch
from torch import fx

from gml.ir.checks import EXACT_BACKEND_OPS
from gml.ir.library import gml_op_name, op_args
from gml.ir.target import Target

EXACT_POST_OPS = EXACT_BACKEND_OPS["qlinear"]

#: the gml ops with int8 weights (schema arguments ``weight`` / ``weight_scale``): u8 activations
#: (qconv, qconv_add, qlinear), or per-token s8 ones that the kernels shift to u8 (dynamic_linear)
WEIGHTED_OPS = ("qconv", "qconv_add", "qlinear", "dynamic_linear")


def _fetch(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def _store(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    parent_name, _, attr = target.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    if attr in getattr(parent, "_buffers", {}):
        parent._buffers[attr] = value
    elif attr in getattr(parent, "_parameters", {}):
        parent._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        setattr(parent, attr, value)


def requantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(weight', scale', channels changed)``: the output channels of int8 ``weight`` outside
    ``[qmin, qmax]`` halved (round half to even) and their scales doubled; every channel when the
    scale is per-tensor. None when all are in range already."""
    w = weight.to(torch.int32).flatten(1)
    rows = w.amax(1).gt(qmax) | w.amin(1).lt(qmin)
    if not bool(rows.any()):
        return None
    if scale.numel() == 1:
        rows = torch.ones_like(rows)
    halved = torch.where(rows[:, None], torch.round(w / 2.0).to(torch.int32), w)
    if int(halved.amax()) > qmax or int(halved.amin()) < qmin:
        raise ValueError(f"int8 weights halved still fall outside [{qmin}, {qmax}]")
    factor = torch.where(rows, 2.0, 1.0)
    per = scale.reshape(-1).float()
    new_scale = per * factor if per.numel() > 1 else per * 2.0
    q = halved.to(torch.int8).reshape(weight.shape).contiguous()
    return q, new_scale.reshape(scale.shape).contiguous(), int(rows.sum())


def _set_backend(node: fx.Node, backend: str) -> None:
    """Set the ``backend`` argument of a gml op call, however the call passed it."""
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    i = names.index("backend")
    if i < len(node.args):
        node.update_arg(i, backend)
    else:
        node.update_kwarg("backend", backend)


def _rank(value: object) -> int | None:
    """The rank of a call's activation argument, from the graph's metadata (None where unknown)."""
    if not isinstance(value, fx.Node):
        return None
    meta = value.meta.get("val", value.meta.get("tensor_meta"))
    shape = getattr(meta, "shape", None)
    return None if shape is None else len(shape)


def _exact_linear(gm: fx.GraphModule, node: fx.Node, key: str, weight: torch.Tensor, target: Target) -> str | None:
    """A ``qlinear`` moved to GML's exact kernel with its 8-bit weights (module docstring); the report
    line, or None when the call stays as it is."""
    args = op_args(node)
    lo, hi = target.int8.weight_qmin, target.int8.weight_qmax
    if args.get("post_op", "none") not in EXACT_POST_OPS or weight.dim() != 2:
        return None
    if args.get("backend", "onednn") != "gml" and (_rank(args["x"]) or 2) > 2:
        return None  # token rows: oneDNN's 7-bit GEMM is the faster (gml.quant.backend_config.exact_linear_names)
    if args.get("backend", "onednn") != "gml" and int(weight.amin()) >= lo and int(weight.amax()) <= hi:
        return None  # in the convs' range already: oneDNN's kernel is exact on it
    low = int((weight == -128).sum())
    if low:
        _store(gm, key, weight.clamp(min=-127).contiguous())
    was = args.get("backend", "onednn")
    _set_backend(node, "gml")
    if was == "gml" and not low:
        return None
    return (
        f"{node.name} (qlinear): runs GML's exact AVX2 GEMM with its 8-bit weights"
        + (f", {low} weights of -128 set to -127" if low else "")
        + " (u8×s8 pairs would saturate oneDNN's int16 here)"
    )


def retarget_weights(gm: fx.GraphModule, target: Target) -> list[str]:
    """Requantize ``gm``'s INT8 weights that ``target``'s kernels could saturate on (module
    docstring), in place; returns what changed, one line per weight."""
    arith = target.int8
    changes: list[str] = []
    seen: set[str] = set()
    for node in gm.graph.nodes:
        name = gml_op_name(node)
        if name not in WEIGHTED_OPS:
            continue
        args = op_args(node)
        w_node, s_node = args["weight"], args["weight_scale"]
        if args.get("backend", "onednn") == "fbgemm":
            continue
        if not (isinstance(w_node, fx.Node) and w_node.op == "get_attr"):
            continue
        if not (isinstance(s_node, fx.Node) and s_node.op == "get_attr"):
            continue
        key = str(w_node.target)
        weight, scale = _fetch(gm, key), _fetch(gm, str(s_node.target))
        if weight.dtype != torch.int8:
            continue
        gml_linear = args.get("backend") == "gml"
        if name == "qlinear" and arith.exact_linear:
            line = _exact_linear(gm, node, key, weight, target)
            if line:
                changes.append(line)
            if op_args(node).get("backend") == "gml":  # on GML's exact kernel now (or already)
                seen.add(key)
                continue
        elif gml_linear:  # back to oneDNN's kernel: exact with VNNI; halved below without it
            _set_backend(node, "onednn")
            changes.append(f"{node.name} (qlinear): runs oneDNN's INT8 kernel ({target.isa} has no GML exact linear)")
        if key in seen:
            continue
        seen.add(key)
        # dynamic_linear's range is its own fact (Target.dynamic_weight_qmax), equal to the static one today
        qmin, qmax = (
            (-target.dynamic_weight_qmax, target.dynamic_weight_qmax)
            if name == "dynamic_linear"
            else (arith.weight_qmin, arith.weight_qmax)
        )
        out = requantize_weight(weight, scale, qmin, qmax)
        if out is None:
            continue
        q, s, n = out
        _store(gm, key, q)
        _store(gm, str(s_node.target), s)
        changes.append(
            f"{node.name} ({name}): weights of {n}/{q.shape[0]} output channels requantized to "
            f"[{qmin}, {qmax}], scales x2 ({arith.reason})"
        )
    return changes


__all__ = ["WEIGHTED_OPS", "requantize_weight", "retarget_weights"]
