"""Two exact rewrites the INT8 reference graph needs before torch.ao's conv+add fusion.

They live apart from :mod:`gml.quant.frontend` (which runs torch.ao) because the INT8 pipeline
(:mod:`gml.quant.pipeline`) lists them, and the frontend runs that pipeline: one direction of
import each, no circle.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from gml import nn as gnn
from gml.passes.base import PassResult, Skip


def _fusable_conv(node: Any, modules: dict[str, nn.Module]) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and type(modules.get(str(node.target))) is nn.Conv2d
        and len(node.users) == 1
    )


def fold_self_add_into_conv(gm: fx.GraphModule) -> PassResult:
    """``Add(y, y, alpha)`` with ``y = conv(x)`` → ``conv2(x)``, whose weight and bias are ``(1 + alpha)`` times
    the conv's.

    Why: the conv+add pattern of the BackendConfig would match the add's two operands to the same
    conv node, and a fused conv+add cannot read its own output (torch.ao's fuser fails on it).
    Math: ``y + alpha * y = (1 + alpha) * conv(x; W, b) = conv(x; (1 + alpha) W, (1 + alpha) b)``.
    For ``y + y`` the factor 2 only moves the exponent, so every product, partial sum and
    transform inside the conv doubles exactly and the result is bit-identical (barring subnormals
    and overflow); other factors round differently by at most an ulp or so of each output. Only
    for a conv whose one user is the add; the conv module is copied, never changed in place.
    """
    from gml.passes.utils import replace_module

    modules = dict(gm.named_modules(remove_duplicate=False))
    folded = 0
    for node in list(gm.graph.nodes):
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(mod, gnn.Add) or len(node.args) != 2 or node.kwargs:
            continue
        y, other = node.args
        if y is not other or not _fusable_conv(y, modules):
            continue
        factor = 1.0 + float(mod.alpha)
        conv = copy.deepcopy(modules[str(y.target)])
        with torch.no_grad():
            conv.weight.mul_(factor)
            if conv.bias is not None:
                conv.bias.mul_(factor)
        replace_module(gm, str(y.target), conv)
        modules[str(y.target)] = conv
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, folded > 0, folded, [])


def conv_operand_first(gm: fx.GraphModule) -> PassResult:
    """``Add(y, conv(x))`` → ``Add(conv(x), y)`` so the conv+add(+relu) pattern sees the conv first.

    Only for ``alpha == 1`` (then ``y + c == c + y`` bit for bit) and a single-user conv on the
    right with none on the left; a conv+add whose conv is on the right of ``Add(alpha != 1)`` is
    skipped (swapping would change the math) and stays an unfused conv and add.
    """
    modules = dict(gm.named_modules(remove_duplicate=False))
    swapped = 0
    skips: list[Skip] = []
    for node in gm.graph.nodes:
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(mod, gnn.Add) or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if _fusable_conv(a, modules) or not _fusable_conv(b, modules):
            continue
        if mod.alpha != 1:
            skips.append(Skip(node.name, f"conv on the right of an add with alpha={mod.alpha}", "conv + add"))
            continue
        node.args = (b, a)
        swapped += 1
    if swapped:
        gm.recompile()
    return PassResult(gm, swapped > 0, swapped, skips)


__all__ = ["conv_operand_first", "fold_self_add_into_conv"]
