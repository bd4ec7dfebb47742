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
A weight shared by several calls is requantized once. The function returns one line per weight it
changed, for the runtime report (``m.runtime``: "changed for this CPU: ...").
"""

from __future__ import annotations

import torch
from torch import fx

from gml.ir.library import gml_op_name, op_args
from gml.ir.target import Target

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
        if key in seen:
            continue
        seen.add(key)
        weight, scale = _fetch(gm, key), _fetch(gm, str(s_node.target))
        if weight.dtype != torch.int8:
            continue
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
