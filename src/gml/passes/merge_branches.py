"""MergeBranches: structural re-parameterization, parallel conv branches summed into one conv.

RepVGG, MobileOne, RepGhost, FastViT and RepViT train with several branches that read the same
input and are summed; timm builds them that way (``reparameterize()`` is the user's job). In eval
mode every branch is linear in its input once FoldBatchNorm has run, so the sum is one conv::

    y → Conv_a(W_a, b_a) ─┐
    y → Conv_b(W_b, b_b) ─┴→ Add        ⇒   y → Conv(W, b)
    W = pad(W_a) + pad(W_b),  b = b_a + b_b

    y → Conv_a(W_a, b_a) ─┐                            (identity branch: BN(y) = s·y + t, or y: s = 1, t = 0)
    y → BN(y) or y ───────┴→ Add        ⇒   y → Conv(W, b)
    W[o, o mod (C/groups), centre] += s_o,  b_o += t_o

**Alignment.** Output position ``o`` of a conv with stride ``S``, dilation ``D`` and zero padding
``P`` reads input position ``o·S − P + D·j`` at tap ``j``. The merged conv takes padding
``P = max(P_a, P_b)``; tap ``j`` of a branch with padding ``P_x`` moves to ``j + (P − P_x)/D``,
which must be an integer, and the merged kernel is as large as the shifted taps need. Taps the
merged kernel adds hold zero weights, so they multiply either padded zeros or real pixels by zero:
the sum is exact at the border too. The merged conv's output size is computed and must equal the
branches' (the add's shape), else the candidate is declined. The identity branch is the tap at
offset 0 (``j = P/D``), which needs stride 1, as many outputs as inputs per group, and a kernel
that contains that tap.

**A plain residual** ``conv(y) + y`` merges only when a BatchNorm reads the sum (RepViT's
``bn(conv(x) + conv1(x) + x)``, whose BN then folds): elsewhere the conv+add kernels already fuse
the add for free, and adding 1 to the centre tap widens the weight range INT8 has to cover. (A
re-parameterized RepVGG-style conv is known to quantize worse than its branches for the same
reason; the identity *BatchNorm* branch is merged anyway, since it is a whole op removed.)

**A zero branch.** MobileOne starts its sum at ``0`` (``out = 0; out += conv(x)``, ``out += 0`` when a
block has no identity branch): ``gml.nn.AddScalar(0)`` of a floating-point tensor is the tensor
itself (``x + 0 == x``, ``-0.0 + 0`` aside), so the pass removes it first and the convs around it
meet at one add.

Pairs merge one ``Add`` at a time until none is left, so RepVGG's ``(conv_1x1 + conv_3x3) + BN``
becomes one 3x3 conv. Only plain ``Conv{1,2,3}d`` modules with zero padding, no hooks, one call
site and one reader (the add) take part; the add must be ``gml.nn.Add`` with ``alpha = 1`` and
operands of the same shape (no broadcast); an identity BN must be an eval BatchNorm with running
statistics whose only reader is the add. Declined candidates are reported with the reason.

Run after FoldBatchNorm (the branches' own BNs are folded into their convs first) and before the
fusions. The merged conv takes the first branch's module path (or ``<path>_folded`` when that
module is called elsewhere); the other branch's modules are deleted.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from gml import nn as gnn
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.fold_bn import _BNS, FoldBatchNorm
from gml.passes.utils import modules_of, remove_unused_nodes

_CONVS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None


def _branch_conv(node: object, add: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The plain conv module ``node`` calls, if it is a branch the add alone reads."""
    if not isinstance(node, fx.Node) or node.op != "call_module" or len(node.users) != 1:
        return None
    conv = modules.get(str(node.target))
    if type(conv) not in _CONVS or conv._forward_hooks or conv._forward_pre_hooks:
        return None
    if len(node.args) != 1 or node.kwargs or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    return conv


def _identity_scale(
    node: object, y: fx.Node, modules: dict[str, nn.Module]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(s, t)`` with ``node == s·y + t`` per channel: ``y`` itself or an eval ``BN(y)`` only the add reads."""
    if node is y:
        return None  # the caller builds s = 1, t = 0 for the channel count it knows
    if not isinstance(node, fx.Node) or node.op != "call_module" or node.args[:1] != (y,) or len(node.users) != 1:
        raise LookupError
    bn = modules.get(str(node.target))
    if type(bn) not in _BNS or bn.training or bn.running_mean is None or bn.running_var is None:
        raise LookupError
    if bn._forward_hooks or bn._forward_pre_hooks or len(node.args) != 1 or node.kwargs:
        raise LookupError
    s = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        s = s * bn.weight.detach()
    t = -bn.running_mean * s + (bn.bias.detach() if bn.bias is not None else 0)
    return s, t


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def merge_convs(a: nn.Module, b: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> nn.Module | str:
    """A conv computing ``a(y) + b(y)`` (module doc), or why there is none."""
    same = ("in_channels", "out_channels", "groups", "stride", "dilation")
    if type(a) is not type(b) or any(getattr(a, f) != getattr(b, f) for f in same):
        return "the branches differ in channels, groups, stride or dilation"
    if a.weight.dtype != b.weight.dtype:
        return "the branches differ in dtype"
    pads, kernel = [], []
    for i, (pa, pb, ka, kb, d) in enumerate(zip(a.padding, b.padding, a.kernel_size, b.kernel_size, a.dilation)):
        p = max(pa, pb)
        if (p - pa) % d or (p - pb) % d:
            return "the branches' taps do not line up (padding difference not a multiple of the dilation)"
        k = max(ka + (p - pa) // d, kb + (p - pb) // d)
        if _out_size(in_shape[2 + i], k, a.stride[i], p, d) != out_shape[2 + i]:
            return "the merged conv would not produce the branches' output size"
        pads.append(p)
        kernel.append(k)
    merged = copy.deepcopy(a)
    w = torch.zeros(a.weight.shape[:2] + tuple(kernel), dtype=a.weight.dtype)
    bias = torch.zeros(a.out_channels, dtype=a.weight.dtype)
    for conv in (a, b):
        idx = [slice(None), slice(None)]
        for p, pc, kc, d in zip(pads, conv.padding, conv.kernel_size, conv.dilation):
            start = (p - pc) // d
            idx.append(slice(start, start + kc))
        w[tuple(idx)] += conv.weight.detach()
        if conv.bias is not None:
            bias += conv.bias.detach()
    merged.kernel_size, merged.padding = tuple(kernel), tuple(pads)
    merged._reversed_padding_repeated_twice = [p for p in reversed(pads) for _ in range(2)]
    merged.weight = nn.Parameter(w, a.weight.requires_grad)
    merged.bias = nn.Parameter(bias, a.weight.requires_grad)
    return merged


def add_identity(conv: nn.Module, s: torch.Tensor, t: torch.Tensor) -> nn.Module | str:
    """A conv computing ``conv(y) + s·y + t`` per channel (module doc), or why there is none."""
    per_in = conv.in_channels // conv.groups
    if conv.in_channels != conv.out_channels or any(st != 1 for st in conv.stride):
        return "an identity branch needs stride 1 and as many output as input channels"
    centre = []
    for p, k, d in zip(conv.padding, conv.kernel_size, conv.dilation):
        if p % d or p // d >= k:
            return "the conv has no tap at offset 0 (its padding is not a whole number of taps inside the kernel)"
        centre.append(p // d)
    merged = copy.deepcopy(conv)
    w = conv.weight.detach().clone()
    o = torch.arange(conv.out_channels)
    w[(o, o % per_in, *[torch.full_like(o, c) for c in centre])] += s.to(w.dtype)
    bias = (conv.bias.detach().clone() if conv.bias is not None else torch.zeros_like(s)) + t
    merged.weight = nn.Parameter(w, conv.weight.requires_grad)
    merged.bias = nn.Parameter(bias.to(w.dtype), conv.weight.requires_grad)
    return merged


class MergeBranches(GraphPass):
    """Sum parallel conv / identity branches into one conv (see module doc)."""

    name = "merge_branches"
    tolerance = Tolerance(atol=1e-5, rtol=1e-4)

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        merged: Counter[str] = Counter()
        skips: dict[str, Skip] = {}
        for node in list(gm.graph.nodes):
            if self._is_zero_add(node, modules):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                merged["zero branch removed"] += 1
        changed = True
        while changed:
            changed = False
            for node in list(gm.graph.nodes):
                if node.op != "call_module" or type(modules.get(str(node.target))) is not gnn.Add:
                    continue
                outcome = self._try(gm, node, modules)
                if outcome is None:
                    continue
                if outcome.startswith("merged "):
                    merged[outcome.removeprefix("merged ")] += 1
                    skips.pop(node.name, None)
                    changed = True
                    break
                skips[node.name] = Skip(node.name, outcome, "conv branches → Add")
        note = "merged into one conv: " + ", ".join(f"{k} ×{v}" for k, v in merged.most_common())
        return PassResult.rewrote(gm, sum(merged.values()), list(skips.values()), note, prune_modules=True)

    @staticmethod
    def _feeds_bn(add: fx.Node, modules: dict[str, nn.Module]) -> bool:
        user = next(iter(add.users)) if len(add.users) == 1 else None
        return user is not None and user.op == "call_module" and type(modules.get(str(user.target))) in _BNS

    @staticmethod
    def _is_zero_add(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
        """``x + 0`` on a floating-point tensor (``gml.nn.AddScalar(0)``): ``x`` itself."""
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if type(mod) is not gnn.AddScalar or mod.other != 0 or isinstance(mod.other, bool):
            return False
        meta = node.meta.get("tensor_meta")
        x = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        xmeta = x.meta.get("tensor_meta") if isinstance(x, fx.Node) else None
        if not (isinstance(meta, TensorMetadata) and isinstance(xmeta, TensorMetadata)):
            return False
        return meta.dtype.is_floating_point and meta.dtype == xmeta.dtype and meta.shape == xmeta.shape

    def _try(self, gm: fx.GraphModule, add: fx.Node, modules: dict[str, nn.Module]) -> str | None:
        """``"merged <what>"`` after a rewrite, a reason when a conv branch could not merge, ``None``
        when the add is not a branch sum at all."""
        if modules[str(add.target)].alpha != 1 or len(add.args) != 2 or add.kwargs:
            return None
        x, z = add.args
        if not (isinstance(x, fx.Node) and isinstance(z, fx.Node)) or x is z:
            return None  # y + y is fold_self_add_into_conv's (gml.quant.reference_rewrites)
        for conv_node, other in ((x, z), (z, x)):
            conv = _branch_conv(conv_node, add, modules)
            if conv is None:
                continue
            y = conv_node.args[0]
            out, into = _shape(add), _shape(y) if isinstance(y, fx.Node) else None
            if out is None or into is None or _shape(x) != _shape(z):
                return "no shape metadata, or the operands broadcast"
            other_conv = _branch_conv(other, add, modules)
            if other_conv is not None and other.args[0] is y:
                fused = merge_convs(conv, other_conv, into, out)
                what = "conv + conv"
            else:
                try:
                    st = _identity_scale(other, y, modules)
                except LookupError:
                    continue
                if st is None:
                    if not self._feeds_bn(add, modules):
                        continue  # a plain residual around one conv: conv+add fuses it already (module doc)
                    st = (torch.ones(conv.out_channels), torch.zeros(conv.out_channels))
                fused = add_identity(conv, *st)
                what = "conv + identity" if other is y else "conv + BatchNorm"
            if isinstance(fused, str):
                return fused
            FoldBatchNorm._install(gm, conv_node, fused, modules)
            add.replace_all_uses_with(conv_node)
            gm.graph.erase_node(add)
            if other is not y:
                remove_unused_nodes(gm.graph, [other])
            return f"merged {what}"
        return None


__all__ = ["MergeBranches", "add_identity", "merge_convs"]
