"""FuseAttention: recognise attention and make it one op, ``torch.ops.gml.attention`` (SDPA semantics).

Before → after::

    F.scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale=s)   →  gml.attention(q, k, v, mask, s, causal)
    softmax((q @ k^T) * c + M, dim=-1) @ v                                 →  gml.attention(q, k, v, M, c)
    softmax((q * c1) @ k^T / c2, -1) @ v    (nn.MultiheadAttention's path)  →  gml.attention(q, k, v, None, c1 / c2)

    math: SDPA(q, k, v, M, s) = softmax(q k^T s + M) v; a scale on q, or on the scores before the
    mask is added, is the same ``s`` (q k^T is bilinear); no scale at all is ``s = 1`` (SDPA's default
    would be 1/sqrt(E), so the scale is always passed).

Spellings: matmul as ``@``/``torch.matmul``/``torch.bmm``; ``k^T`` as ``k.transpose(-2, -1)`` (any
spelling of the last two dims) or a ``permute`` that swaps them; scale as ``* c``, ``/ c``,
``torch.mul``/``torch.div`` or ``gml.nn.MulScalar``; mask as ``+``/``torch.add``/``gml.nn.Add``;
softmax as ``F.softmax``/``torch.softmax``/``x.softmax``/``nn.Softmax`` over the last dim. Run it after
Normalize (which removes eval-mode dropout between softmax and the second matmul).

The op runs torch's fused CPU SDPA (flash attention): the ``[L, S]`` probabilities are never
materialised. Reordering the scale changes rounding only (tolerance: the default 1e-5 + 1e-4·max).

Skipped, with the reason: SDPA with ``dropout_p != 0`` (random) or ``enable_gqa``; softmax over
another dim, or with a ``dtype``; probabilities read elsewhere (a model that returns attention
weights); intermediate scores read elsewhere; a scale that is a tensor or computed at run time;
the mask added before the scale (``softmax((qk + M) c)`` scales the mask too); a mask that
broadcasts the scores to a bigger shape; operands whose batch dims differ (broadcasting matmul);
non-float operands; a second matmul that reads the probabilities as its right operand.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml import nn as gnn
from gml.ir.attention import attention_op
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.oplib import op_kind
from gml.passes.utils import modules_of

PATTERN = "matmul → scale → mask add → softmax → matmul"
SDPA = "scaled_dot_product_attention"

SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_DIVS = (operator.truediv, torch.div, torch.true_divide)
_MULS = (operator.mul, torch.mul)
_TRANSPOSES = ("transpose", "permute")


def _meta(node: Any) -> Any:
    return node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = _meta(node)
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _scale_of(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[fx.Node, float] | str | None:
    """``(x, c)`` if ``node`` computes ``x * c`` or ``x / c`` (``x / c`` gives ``1/c``); a reason
    if it is a scale we cannot use; ``None`` if it is no scale at all."""
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), gnn.MulScalar):
        c = _number(modules[str(node.target)].other)
        return (node.args[0], c) if c is not None else "scale is not a number"
    is_mul = (node.op == "call_function" and node.target in _MULS) or (
        node.op == "call_method" and node.target == "mul"
    )
    is_div = (node.op == "call_function" and node.target in _DIVS) or (
        node.op == "call_method" and node.target in ("div", "true_divide")
    )
    if not (is_mul or is_div) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if is_mul and isinstance(a, int | float) and isinstance(b, fx.Node):
        a, b = b, a
    c = _number(b)
    if not isinstance(a, fx.Node) or c is None:
        return "the scale is a tensor or computed at run time"
    if is_div:
        if c == 0:
            return "division by zero"
        c = 1.0 / c
    return a, c


def _is_add(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return type(modules.get(str(node.target))) is gnn.Add and modules[str(node.target)].alpha == 1
    return op_kind(node, modules) == "add" and len(node.args) == 2 and not node.kwargs


def _is_matmul(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    return op_kind(node, modules) == "matmul" and len(node.args) == 2 and not node.kwargs


def _untransposed(node: Any, rank: int) -> fx.Node | None:
    """``k`` if ``node`` is ``k`` with its last two dims swapped, else ``None``."""
    if not isinstance(node, fx.Node):
        return None
    if (node.op == "call_method" and node.target == "transpose") or (
        node.op == "call_function" and node.target is torch.transpose
    ):
        dims = tuple(d % rank if isinstance(d, int) else d for d in node.args[1:3])
        return node.args[0] if sorted(dims) == [rank - 2, rank - 1] else None
    if (node.op == "call_method" and node.target == "permute") or (
        node.op == "call_function" and node.target is torch.permute
    ):
        perm = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], list | tuple) else node.args[1:]
        want = [*range(rank - 2), rank - 1, rank - 2]
        return node.args[0] if [p % rank for p in perm] == want else None
    if node.op == "call_method" and node.target == "t" and rank == 2:
        return node.args[0]
    return None


def _softmax_dim(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[Any, Any]:
    """``(dim, dtype)`` of a softmax in any spelling (``F.softmax``'s third parameter is ``_stacklevel``)."""
    if node.op == "call_module":
        return modules[str(node.target)].dim, None
    dtype_at = 3 if node.target is F.softmax else 2
    return _arg(node, 1, "dim", None), _arg(node, dtype_at, "dtype", None)


@dataclass
class _Match:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float
    chain: list[fx.Node]  # nodes the op replaces, last = the output matmul


def _match(softmax: fx.Node, modules: dict[str, nn.Module]) -> _Match | str:
    """The attention pattern ending at ``softmax``'s reader, or why it is not one."""
    rank = len(_shape(softmax) or ())
    dim, dtype = _softmax_dim(softmax, modules)
    if rank == 0:
        return "no shape metadata (run shape propagation first)"
    if not isinstance(dim, int) or dim % rank != rank - 1:
        return f"softmax over dim {dim}, not the last"
    if dtype is not None:
        return f"softmax with dtype={dtype}"
    users = list(softmax.users)
    if len(users) != 1:
        readers = ", ".join(u.name for u in users)
        return f"the attention probabilities are read elsewhere ({len(users)} readers: {readers})"
    out = users[0]
    if not _is_matmul(out, modules) or out.args[0] is not softmax:
        return f"the probabilities feed {out.name}, not the first operand of a matmul"
    v = out.args[1]
    chain = [softmax, out]
    x = softmax.args[0]
    mask = None
    scale = 1.0
    if isinstance(x, fx.Node) and _is_add(x, modules):
        a, b = x.args
        pick = None
        for scores, other in ((a, b), (b, a)):
            is_scores = _is_matmul(scores, modules) or _scale_of(scores, modules) is not None
            if isinstance(scores, fx.Node) and is_scores:
                pick = (scores, other)
                break
        if pick is None:
            return f"softmax reads {x.name}, an add of no matmul scores"
        if not isinstance(pick[1], fx.Node):
            return "the mask is a number, not a tensor"
        if _shape(x) is not None and _shape(pick[0]) is not None and _shape(x) != _shape(pick[0]):
            return f"the mask broadcasts the scores from {list(_shape(pick[0]))} to {list(_shape(x))}"
        if len(x.users) != 1:
            return f"the masked scores {x.name} are read elsewhere"
        chain.insert(0, x)
        x, mask = pick
    if not isinstance(x, fx.Node):
        return "softmax input is not a node"
    scaled = _scale_of(x, modules)
    if isinstance(scaled, str):
        return scaled
    if scaled is not None:
        if len(x.users) != 1:
            return f"the scaled scores {x.name} are read elsewhere"
        chain.insert(0, x)
        x, scale = scaled[0], scaled[1]
    if not isinstance(x, fx.Node) or not _is_matmul(x, modules):
        kind = x.target if isinstance(x, fx.Node) else x
        if isinstance(x, fx.Node) and _is_add(x, modules) and mask is None:
            return "the mask is added before the scale (it would be scaled too)"
        return f"softmax input comes from {getattr(kind, '__name__', kind)}, not a matmul of q and k^T"
    if len(x.users) != 1:
        return f"the scores {x.name} are read elsewhere"
    chain.insert(0, x)
    q, kt = x.args
    k = _untransposed(kt, len(_shape(kt) or ()) or rank)
    if k is None:
        return f"the right operand of {x.name} is not k with its last two dims swapped"
    q_scaled = _scale_of(q, modules) if isinstance(q, fx.Node) else None
    if isinstance(q_scaled, tuple) and len(q.users) == 1:
        chain.insert(0, q)
        q, scale = q_scaled[0], scale * q_scaled[1]
    if not isinstance(q, fx.Node) or not isinstance(v, fx.Node):
        return "q or v is not a tensor node"
    shapes = [_shape(t) for t in (q, k, v)]
    if any(s is None for s in shapes):
        return "no shape metadata on q, k or v"
    sq, sk, sv = shapes
    if not (len(sq) == len(sk) == len(sv) >= 2) or not (sq[:-2] == sk[:-2] == sv[:-2]):
        return f"q, k, v batch dims differ ({list(sq)}, {list(sk)}, {list(sv)}): a broadcasting matmul"
    if any(not _meta(t).dtype.is_floating_point for t in (q, k, v)):
        return "non-float operands"
    return _Match(q, k, v, mask, scale, chain)


class FuseAttention(GraphPass):
    """Replace SDPA calls and hand-written attention with ``torch.ops.gml.attention`` (module docstring)."""

    name = "fuse_attention"
    tolerance = Tolerance()

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        modules = modules_of(gm)
        op = attention_op()
        skips: list[Skip] = []
        matches = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in SDPA_TARGETS:
                reason = self._sdpa(graph, node, op)
                if reason:
                    skips.append(Skip(node.name, reason, SDPA))
                else:
                    matches += 1
            elif op_kind(node, modules) == "softmax":
                found = _match(node, modules)
                if isinstance(found, str):
                    skips.append(Skip(node.name, found, PATTERN))
                    continue
                out = found.chain[-1]
                with graph.inserting_before(out):
                    new = graph.call_function(op, (found.q, found.k, found.v, found.mask, found.scale, False))
                new.meta = {k: v for k, v in out.meta.items() if k in ("tensor_meta", "stack_trace", "type")}
                out.replace_all_uses_with(new)
                for dead in reversed(found.chain):
                    if not dead.users:
                        graph.erase_node(dead)
                matches += 1
        for node in reversed(list(graph.nodes)):  # k^T transposes nobody reads any more
            if node.op == "call_method" and node.target in _TRANSPOSES and not node.users:
                graph.erase_node(node)
        graph.lint()
        gm.recompile()
        return PassResult(gm, matches > 0, matches, skips)

    @staticmethod
    def _sdpa(graph: fx.Graph, node: fx.Node, op: Any) -> str | None:
        q, k, v = node.args[:3]
        mask = _arg(node, 3, "attn_mask", None)
        dropout = _arg(node, 4, "dropout_p", 0.0)
        causal = _arg(node, 5, "is_causal", False)
        scale = node.kwargs.get("scale", node.args[6] if len(node.args) > 6 else None)
        gqa = node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False)
        if dropout != 0.0:
            return f"dropout_p={dropout} (random; SDPA drops only in training)"
        if gqa:
            return "enable_gqa=True (grouped-query attention is not in gml.attention's schema)"
        if not isinstance(causal, bool) or (scale is not None and _number(scale) is None):
            return "is_causal or scale computed at run time"
        with graph.inserting_before(node):
            new = graph.call_function(op, (q, k, v, mask, scale, causal))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        return None
