"""FoldBatchNorm: fold an eval-mode BatchNorm into the conv or linear that feeds it.

Before: ``x → Conv(W, b) → BN(γ, β, μ, σ², ε) → y``      After: ``x → Conv(W', b') → y``

In eval mode BN is the per-channel affine map ``y_c = s_c·(z_c − μ_c) + β_c`` with
``s_c = γ_c / sqrt(σ²_c + ε)`` and constants ``μ, σ²`` (the running statistics). ``z = W∗x + b`` is
linear in ``W`` and ``b`` per output channel, so::

    W'[c, ...] = s_c · W[c, ...]        b'_c = s_c · (b_c − μ_c) + β_c       (b = 0 if the conv has none)

exactly (up to float rounding). ``affine=False`` means ``γ = 1, β = 0``. The arithmetic is torch's own
``torch.nn.utils.fusion.fuse_conv_bn_weights`` / ``fuse_linear_bn_weights``.

Handled: ``Conv{1,2,3}d`` (any groups, depthwise included, any padding mode, with or without bias)
+ ``BatchNorm{1,2,3}d``; ``ConvTranspose{1,2,3}d`` + BN; ``Linear`` + ``BatchNorm1d`` on a 2-D
``(N, features)`` output. ConvTranspose stores its weight as ``(in, out/groups, k...)``: output
channel ``g·(out/groups) + j`` is column ``j`` of the rows of group ``g``. With one group that is
torch's ``transpose=True`` (scale on dim 1); with several groups the weight is regrouped to
``(out, in/groups, k...)`` first, scaled per output channel, and put back.

**Through a channel concat.** ``BN(cat([conv_1(x), ..., conv_n(x)], dim=1))`` (timm's
``MixedConv2d``) is the concat of per-slice BNs, each of which folds into the conv that produces
its channels.

**Through a reshape.** ``BN(reshape(conv_or_linear(x)))`` (LeViT's ``LinearNorm``: a Linear on
``(B, N, C)``, then ``BatchNorm1d`` on ``y.flatten(0, 1)``, then ``reshape_as(y)``). Reshape, view,
flatten, unflatten, squeeze and unsqueeze keep the *row-major order* of the elements, so the element at
flat index ``f`` is the same value before and after. In a tensor whose channel axis has ``C`` entries
and whose trailing axes (after the channel axis) hold ``S`` elements, flat index ``f`` is channel
``(f // S) mod C``. The producer's channel axis is the last one for a Linear (``S = 1``) and dim 1 for a
conv; BN's is dim 1. When both give the same ``C`` and ``S``, every element keeps its channel, so the
BN is a per-channel affine map *of the producer's output* and folds into it as above (exact)::

    (B, N, C) → Linear → flatten(0, 1) → (B·N, C) → BN1d(C) → reshape_as → (B, N, C)
    ⇒  (B, N, C) → Linear' → flatten(0, 1) → reshape_as          (then the round trip goes, below)

A reshape that reads the reshaped value and restores the producer's exact shape is then the
producer's output itself (same elements, same order, same shape) and is bypassed; the chain left
without readers is erased. The producer's other readers may only read its shape (``reshape_as(y)``'s
argument, ``y.shape``, ``y.size()``), which the fold keeps. Declined, with the reason, when a
permute/transpose is in the chain (the order changes), the channel count or the trailing size differ
(``Linear`` to ``(B·N·2, C/2)``), a value in the chain has another reader, or there is no shape
metadata.

**Forward, into the next layer.** A BN that no conv/linear feeds (after a pool, a concat, the
model input) folds into the conv or Linear that is its only reader (:func:`fold_bn_into_next`)::

    x → BN → Conv(W, b)   ⇒   x → Conv(W', b'),   W'[o,i,·] = W[o,i,·]·s_i,   b'_o = b_o + Σ_{i,k} W[o,i,k]·t_i

with ``BN(x)_i = s_i·x_i + t_i``. This is exact only when that conv has **no padding**: the conv
pads the *normalized* map with zeros, and a zero after the BN is ``−t_i/s_i`` before it, which no
weight change can produce at the border (so a padded conv declines, with that reason; the BN then
runs as an INT8 op after quantization). A Linear takes a ``BatchNorm1d`` on ``(N, features)``.

The fused conv replaces the original module at the same path when that conv has no other call
site and none of its parameters is read elsewhere; otherwise it is installed beside it
(``<path>_folded``) so the other uses keep the unfolded weights. The BN node is erased and
unused submodules are deleted. Modules are never edited in place (after ``symbolic_trace`` they
are the user's objects).

Skipped, each with a reason: BN in training mode (batch statistics), BN without running
statistics (``track_running_stats=False``: batch statistics even in eval), a conv output that
something else also reads (folding would change that reader), channel-count mismatch, a BN that
reads anything but a module conv/linear (including ``F.conv2d`` calls: not supported), conv/linear
subclasses and modules with forward hooks (their forward may not be the plain op), a Linear output
that is not known to be 2-D (``BatchNorm1d`` on ``(N, C, L)`` normalises dim 1, not the features;
run shape propagation first), and an unbatched conv output.

**LayerNorm is not folded** (docs/adr/003-no-layernorm-folding.md). LayerNorm normalises every row
with *that row's* mean and variance, computed at run time from the input; unlike BN's running
statistics they are not constants, so ``Linear → LayerNorm`` has nothing to fold and the
"W' = diag(γ/sqrt(var+ε))·W" recipe is wrong for any input but the one it was computed on. Only
LayerNorm's affine tail ``γ·n + β`` is constant; it could move into a *following* Linear
(``W' = W·diag(γ)``, ``b' = W·β + b``), which is a different rewrite that keeps the normalisation
and that this pass does not do. The pass reports both ``Linear → LayerNorm`` and
``LayerNorm → Linear`` as skips with that reason.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata
from torch.nn.modules.conv import _ConvTransposeNd
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.oplib import node_label, op_kind
from gml.passes.utils import modules_of, remove_unused_nodes, replace_module

_CONVS: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_BNS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

NOTHING_BEFORE = "not a conv or linear output; nothing to fold it into"
LAYERNORM_REASON = (
    "LayerNorm normalises each row with that row's own mean and variance, computed at run time; "
    "they are not constants, so there is nothing to fold into the Linear (ADR 003)"
)
LAYERNORM_AFFINE_REASON = (
    "only LayerNorm's affine part (gamma, beta) could move into the following Linear; "
    "that is a different rewrite that keeps the normalisation, not done by this pass (ADR 003)"
)


def _rank(node: fx.Node) -> int | None:
    meta = node.meta.get("tensor_meta")
    return len(meta.shape) if isinstance(meta, TensorMetadata) else None


def _has_hooks(mod: nn.Module) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks)


def fold_conv_bn(conv: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A new conv computing ``bn(conv(x))`` in eval mode; ``conv`` and ``bn`` are left untouched."""
    assert bn.running_mean is not None and bn.running_var is not None
    fused = copy.deepcopy(conv)
    w = conv.weight
    transposed = isinstance(conv, _ConvTransposeNd)
    if transposed and conv.groups > 1:
        g = conv.groups
        cin, out_per_group, *k = w.shape
        # (in, out/g, k...) → (out, in/g, k...): row g*(out/g)+j is output channel g*(out/g)+j.
        out_major = w.reshape(g, cin // g, out_per_group, *k).transpose(1, 2).reshape(g * out_per_group, cin // g, *k)
        fw, fb = fuse_conv_bn_weights(
            out_major, conv.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, transpose=False
        )
        back = fw.detach().reshape(g, out_per_group, cin // g, *k).transpose(1, 2).reshape(w.shape)
        fw = nn.Parameter(back.contiguous(), w.requires_grad)
    else:
        fw, fb = fuse_conv_bn_weights(
            w, conv.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, transpose=transposed
        )
    fused.weight, fused.bias = fw, fb
    return fused


def fold_bn_into_next(bn: nn.modules.batchnorm._BatchNorm, layer: nn.Module) -> nn.Module:
    """A new conv/linear computing ``layer(bn(x))`` in eval mode (an unpadded conv, or a Linear on
    ``(N, features)``); ``bn`` and ``layer`` are left untouched.

    With ``bn(x)_i = s_i·x_i + t_i`` (``s = γ/sqrt(σ²+ε)``, ``t = β − μ·s``) and input channel ``i``::

        W'[o, i, ...] = W[o, i, ...]·s_i        b'_o = b_o + Σ_{i,k} W[o, i, k]·t_i

    For a grouped conv, ``W[o, j]`` reads input channel ``group(o)·(C/groups) + j``.
    """
    assert bn.running_mean is not None and bn.running_var is not None
    fused = copy.deepcopy(layer)
    s = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        s = s * bn.weight
    t = -bn.running_mean * s + (bn.bias if bn.bias is not None else 0)
    w = layer.weight.detach()
    if isinstance(layer, nn.Linear):
        s_full, t_full = s.unsqueeze(0), t.unsqueeze(0)
    else:
        g, out = layer.groups, w.shape[0]
        per = w.shape[1]
        s_full = s.view(g, 1, per).expand(g, out // g, per).reshape(out, per)
        t_full = t.view(g, 1, per).expand(g, out // g, per).reshape(out, per)
    shape = (*s_full.shape, *([1] * (w.dim() - 2)))
    with torch.no_grad():
        new_w = w * s_full.reshape(shape)
        shift = (w * t_full.reshape(shape)).flatten(1).sum(1)
        new_b = shift if layer.bias is None else layer.bias.detach() + shift
    fused.weight = nn.Parameter(new_w.detach(), layer.weight.requires_grad)
    fused.bias = nn.Parameter(new_b.detach(), layer.weight.requires_grad)
    return fused


def fold_linear_bn(linear: nn.Linear, bn: nn.modules.batchnorm._BatchNorm) -> nn.Linear:
    """A new Linear computing ``bn(linear(x))`` for 2-D ``x`` in eval mode."""
    assert bn.running_mean is not None and bn.running_var is not None
    fused = copy.deepcopy(linear)
    ones, zeros = torch.ones_like(bn.running_mean), torch.zeros_like(bn.running_mean)
    gamma = bn.weight if bn.weight is not None else ones  # affine=False: gamma = 1, beta = 0
    beta = bn.bias if bn.bias is not None else zeros
    fused.weight, fused.bias = fuse_linear_bn_weights(
        linear.weight, linear.bias, bn.running_mean, bn.running_var, bn.eps, gamma, beta
    )
    return fused


#: methods and functions that keep the row-major order of the elements (only the shape changes)
_RESHAPE_METHODS = frozenset(
    {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze", "contiguous"}
)
_RESHAPE_FUNCTIONS = frozenset({torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze})
_SHAPE_METHODS = frozenset({"size", "dim", "numel"})


def _is_reshape(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """``node`` is a reshape of its first argument: same elements in the same row-major order."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_module":
        return type(modules.get(str(node.target))) in (nn.Flatten, nn.Unflatten)
    if any(isinstance(a, torch.dtype) for a in (*node.args, *node.kwargs.values())):
        return False  # x.view(torch.int32) reinterprets the bytes
    if node.op == "call_method":
        return node.target in _RESHAPE_METHODS
    return node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS


def _reads_only_shape(user: fx.Node, value: fx.Node) -> bool:
    """``user`` reads ``value``'s shape only (``x.reshape_as(value)``, ``value.shape``, ``value.size()``)."""
    if user.op == "call_method" and user.target in ("reshape_as", "view_as", "expand_as"):
        return user.args[0] is not value and not user.kwargs
    if user.op == "call_method" and user.target in _SHAPE_METHODS:
        return True
    return user.op == "call_function" and user.target is getattr and user.args[1:] == ("shape",)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None


class FoldBatchNorm(GraphPass):
    """Fold eval-mode BatchNorm into the preceding Conv/ConvTranspose/Linear (see module doc)."""

    name = "fold_bn"
    tolerance = Tolerance(atol=1e-5, rtol=1e-4)

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        folded: Counter[str] = Counter()
        for node in list(gm.graph.nodes):
            kind = op_kind(node, modules)
            if kind == "layernorm":
                skips.extend(self._layernorm_skips(node, modules))
                continue
            if kind != "batchnorm":
                continue
            if node.op != "call_module":
                skips.append(Skip(node.name, "functional batch_norm: only BatchNorm modules are folded", "bn"))
                continue
            producer = node.args[0] if node.args else None
            pattern = f"{node_label(producer, modules) if isinstance(producer, fx.Node) else '?'} → BatchNorm"
            reason = self._why_not(gm, node, producer, modules)
            if reason is not None and reason.endswith(NOTHING_BEFORE) and self._fold_through_cat(gm, node, modules):
                folded["convs through a channel concat"] += 1
                continue
            through: str | None = ""
            if reason is not None and reason.endswith(NOTHING_BEFORE):
                through = self._fold_through_reshape(gm, node, modules)
                if through is None:
                    folded["conv/linear through a reshape"] += 1
                    continue
            if reason is not None and reason.endswith(NOTHING_BEFORE):
                # nothing to fold into backwards: into the conv/linear that reads the BN, if exact
                consumer = next(iter(node.users)) if len(node.users) == 1 else None
                why_not_next = self._why_not_forward(node, consumer, modules)
                if why_not_next is None:
                    assert consumer is not None
                    layer = modules[str(consumer.target)]
                    self._install(gm, consumer, fold_bn_into_next(modules[str(node.target)], layer), modules)
                    node.replace_all_uses_with(node.args[0])
                    gm.graph.erase_node(node)
                    folded[f"next {type(layer).__name__}"] += 1
                    continue
                reason = f"{reason}; {why_not_next}"
                if through:  # a conv/linear precedes it through a reshape: say why that fold is not exact
                    reason, pattern = f"{through}; {why_not_next}", f"{pattern} (through a reshape)"
            if reason is not None:
                skips.append(Skip(node.name, reason, pattern))
                continue
            assert isinstance(producer, fx.Node)
            layer, bn = modules[str(producer.target)], modules[str(node.target)]
            fused = fold_linear_bn(layer, bn) if isinstance(layer, nn.Linear) else fold_conv_bn(layer, bn)
            self._install(gm, producer, fused, modules)
            node.replace_all_uses_with(producer)
            gm.graph.erase_node(node)
            folded[type(layer).__name__] += 1

        note = "folded BatchNorm into " + ", ".join(f"{k} ×{v}" for k, v in folded.most_common())
        return PassResult.rewrote(gm, sum(folded.values()), skips, note, prune_modules=True)

    def _why_not(
        self, gm: fx.GraphModule, bn_node: fx.Node, producer: Any, modules: dict[str, nn.Module]
    ) -> str | None:
        bn = modules[str(bn_node.target)]
        if type(bn) not in _BNS:
            return f"{type(bn).__name__} is a BatchNorm subclass; its forward may differ"
        if bn.training:
            return "BatchNorm is in training mode: it normalises with batch statistics (call model.eval())"
        if bn.running_mean is None or bn.running_var is None:
            return (
                "BatchNorm has no running statistics (track_running_stats=False): it normalises with "
                "batch statistics even in eval mode, so there are no constants to fold"
            )
        if not isinstance(producer, fx.Node):
            return "BatchNorm input is not a graph value"
        kind = op_kind(producer, modules)
        if producer.op != "call_module" or kind not in ("conv", "conv_transpose", "linear"):
            if kind in ("conv", "conv_transpose", "linear"):
                return f"conv/linear is a function call ({node_label(producer, modules)}); only modules are folded"
            return f"BatchNorm reads {producer.name} ({node_label(producer, modules)}), {NOTHING_BEFORE}"
        layer = modules[str(producer.target)]
        if type(layer) not in (*_CONVS, nn.Linear):
            return f"{type(layer).__name__} is a subclass of a conv/linear; its forward may not be the plain op"
        if _has_hooks(layer) or _has_hooks(bn):
            return "conv/linear or BatchNorm has forward hooks, which would see different values"
        if len(producer.users) > 1:
            others = [u.name for u in producer.users if u is not bn_node]
            return f"{producer.name} output is also read by {', '.join(others)}; folding would change what they see"
        channels = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        if channels != bn.num_features:
            return f"channel mismatch: {type(layer).__name__} has {channels} outputs, BatchNorm {bn.num_features}"
        rank = _rank(producer)
        if isinstance(layer, nn.Linear):
            if rank is None:
                return (
                    "cannot tell whether the Linear output is 2-D (no shape metadata; run shape propagation "
                    "first): BatchNorm1d on (N, C, L) normalises dim 1, not the Linear's features"
                )
            if rank != 2:
                return f"Linear output is {rank}-D: BatchNorm1d normalises dim 1, not the Linear's features"
        elif rank is not None and rank != layer.weight.dim():
            return "unbatched conv output: BatchNorm would normalise a different dimension"
        if layer.weight.dtype != bn.running_mean.dtype:
            return f"dtype mismatch: {layer.weight.dtype} weights, {bn.running_mean.dtype} BatchNorm statistics"
        return None

    def _fold_through_cat(self, gm: fx.GraphModule, bn_node: fx.Node, modules: dict[str, nn.Module]) -> bool:
        """``BN(cat([conv_1(x_1), ..., conv_n(x_n)], dim=1))`` (timm's MixedConv2d: a conv split by
        kernel size) is ``cat([BN_1(conv_1(x_1)), ...])`` with ``BN_j`` the channel slice of BN that
        conv ``j`` produces; each slice folds into its conv. All or nothing."""
        cat = bn_node.args[0] if bn_node.args else None
        if not (isinstance(cat, fx.Node) and cat.op == "call_function" and op_kind(cat, modules) == "cat"):
            return False
        parts = cat.args[0] if cat.args else cat.kwargs.get("tensors")
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        bn = modules[str(bn_node.target)]
        if len(cat.users) != 1 or not isinstance(parts, list | tuple) or dim not in (1, -3 if _rank(cat) == 4 else 1):
            return False
        if len({id(p) for p in parts}) != len(parts):
            return False  # cat(y, y): one conv would need two different foldings
        convs = []
        for part in parts:
            layer = modules.get(str(part.target)) if isinstance(part, fx.Node) and part.op == "call_module" else None
            if type(layer) not in (nn.Conv1d, nn.Conv2d, nn.Conv3d) or len(part.users) != 1 or _has_hooks(layer):
                return False
            if _rank(part) != layer.weight.dim() or layer.weight.dtype != bn.running_mean.dtype:
                return False
            convs.append((part, layer))
        if sum(layer.out_channels for _, layer in convs) != bn.num_features or _has_hooks(bn):
            return False
        start = 0
        for part, layer in convs:
            piece = copy.deepcopy(bn)
            stop = start + layer.out_channels
            piece.num_features = layer.out_channels
            piece.running_mean, piece.running_var = bn.running_mean[start:stop], bn.running_var[start:stop]
            if bn.weight is not None:
                piece.weight = nn.Parameter(bn.weight.detach()[start:stop])
                piece.bias = nn.Parameter(bn.bias.detach()[start:stop])
            self._install(gm, part, fold_conv_bn(layer, piece), modules)
            start = stop
        bn_node.replace_all_uses_with(cat)
        gm.graph.erase_node(bn_node)
        return True

    def _fold_through_reshape(self, gm: fx.GraphModule, bn_node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
        """Fold ``BN(reshape(...(producer)))`` into ``producer`` when every element keeps its channel
        (module doc, "Through a reshape"). ``None``: folded; ``""``: no conv/linear up the chain
        (nothing to say); else the reason the fold is not exact."""
        chain: list[fx.Node] = []
        cur = bn_node.args[0] if bn_node.args else None
        while isinstance(cur, fx.Node) and _is_reshape(cur, modules):
            chain.append(cur)
            cur = cur.args[0]
        if not chain or not isinstance(cur, fx.Node) or cur.op != "call_module":
            return ""
        layer = modules[str(cur.target)]
        if type(layer) not in (*_CONVS, nn.Linear):
            return ""
        bn = modules[str(bn_node.target)]
        why = "cannot fold through the reshape into the preceding conv/linear"
        if _has_hooks(layer) or _has_hooks(bn):
            return f"{why}: conv/linear or BatchNorm has forward hooks, which would see different values"
        readers = [u for n in chain for u in n.users if u not in chain and u is not bn_node]
        readers += [u for u in cur.users if u is not chain[-1] and not _reads_only_shape(u, cur)]
        if readers:
            return f"{why}: {', '.join(u.name for u in readers)} also read(s) a value before the BatchNorm"
        out, into = _shape(cur), _shape(chain[0])
        if out is None or into is None:
            return f"{why}: no shape metadata (run shape propagation first)"
        axis = len(out) - 1 if isinstance(layer, nn.Linear) else 1
        if len(into) < 2 or (axis == 1 and len(out) != layer.weight.dim()):
            return f"{why}: unbatched input (the channel axis is not dim 1)"
        layout = (out[axis], math.prod(out[axis + 1 :]))
        if layout != (bn.num_features, math.prod(into[2:])) or into[1] != bn.num_features:
            return (
                f"{why}: elements change channel ({type(layer).__name__} output {tuple(out)} has {out[axis]} "
                f"channels over {layout[1]} trailing elements; the BatchNorm input {tuple(into)} has "
                f"{into[1]} over {math.prod(into[2:])})"
            )
        if layer.weight.dtype != bn.running_mean.dtype:
            return f"{why}: dtype mismatch ({layer.weight.dtype} weights, {bn.running_mean.dtype} statistics)"
        fused = fold_linear_bn(layer, bn) if isinstance(layer, nn.Linear) else fold_conv_bn(layer, bn)
        self._install(gm, cur, fused, modules)
        bn_node.replace_all_uses_with(chain[0])
        gm.graph.erase_node(bn_node)
        # a reshape of the chain back to the producer's shape is the producer's output itself
        bypassed = [u for u in chain[0].users if u.args[0] is chain[0] and _is_reshape(u, modules) and _shape(u) == out]
        for user in bypassed:
            user.replace_all_uses_with(cur)
        remove_unused_nodes(gm.graph, [*bypassed, *chain])
        return None

    @staticmethod
    def _why_not_forward(bn_node: fx.Node, consumer: fx.Node | None, modules: dict[str, nn.Module]) -> str | None:
        """Why the BN cannot fold into the conv/linear reading it (``None``: it can)."""
        if consumer is None:
            return "nor into a following layer (the BN output has several readers)"
        layer = modules.get(str(consumer.target)) if consumer.op == "call_module" else None
        if type(layer) not in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear) or consumer.args[:1] != (bn_node,):
            return "nor into a following layer (no plain conv/linear reads it)"
        bn = modules[str(bn_node.target)]
        if _has_hooks(layer) or len(consumer.args) != 1 or consumer.kwargs:
            return "nor into the following layer (hooks or extra arguments)"
        if isinstance(layer, nn.Linear):
            if _rank(bn_node) != 2 or layer.in_features != bn.num_features:
                return "nor into the following Linear (only a BatchNorm1d on (N, features) folds into it)"
        else:
            if layer.in_channels != bn.num_features or _rank(bn_node) != layer.weight.dim():
                return "nor into the following conv (channel or rank mismatch)"
            if isinstance(layer.padding, str) or any(p != 0 for p in layer.padding):
                return (
                    "nor into the following conv: it pads with zeros, which are zeros after the BN but "
                    "would be -beta'/scale before it, so the fold is only exact without padding"
                )
        if layer.weight.dtype != bn.running_mean.dtype:
            return "nor into the following layer (dtype mismatch)"
        return None

    @staticmethod
    def _install(gm: fx.GraphModule, site: fx.Node, fused: nn.Module, modules: dict[str, nn.Module]) -> None:
        """Point ``site`` at ``fused``: in place of the old module if nothing else uses it, else beside it."""
        target = str(site.target)
        shared = any(
            n is not site
            and (
                (n.op == "call_module" and n.target == target)
                or (n.op == "get_attr" and str(n.target).startswith(target + "."))
            )
            for n in gm.graph.nodes
        )
        if not shared:
            replace_module(gm, target, fused)
            modules[target] = fused
            return
        name, k = f"{target}_folded", 0
        while name in modules or hasattr(gm, name):
            k += 1
            name = f"{target}_folded_{k}"
        gm.add_submodule(name, fused)
        modules[name] = fused
        site.target = name

    @staticmethod
    def _layernorm_skips(node: fx.Node, modules: dict[str, nn.Module]) -> list[Skip]:
        skips = []
        producer = node.args[0] if node.args else None
        if isinstance(producer, fx.Node) and op_kind(producer, modules) == "linear":
            skips.append(Skip(node.name, LAYERNORM_REASON, "Linear → LayerNorm"))
        if any(op_kind(u, modules) == "linear" for u in node.users):
            skips.append(Skip(node.name, LAYERNORM_AFFINE_REASON, "LayerNorm → Linear"))
        return skips


__all__ = ["FoldBatchNorm", "fold_bn_into_next", "fold_conv_bn", "fold_linear_bn"]
