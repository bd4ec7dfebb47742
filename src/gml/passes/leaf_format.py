"""LeafMemoryFormat: hand an opaque leaf module the memory format it was traced with.

Before (after fusion; the fused conv writes channels-last)::

    y = FusedConv(x)          # channels_last
    z = leaf(y)               # a user module GML does not look into (a leaf, a Conv2dSame, ...)

After::

    y = FusedConv(x)
    z = leaf(y.contiguous(memory_format=torch.contiguous_format))   # the format captured at trace time

An opaque module was written, and traced, for the layout the model gave it; its kernels may be much
slower on another one (timm's vgg11_bn ConvMlp: a 7x7 conv at 245 ms on channels-last input vs
122 ms on contiguous). The conversion is a copy, values are unchanged (tolerance 0 on the values;
the leaf's own rounding may differ by layout, hence the default tolerance). :func:`gml.capture`
records each ``call_module`` node's input formats in ``node.meta[TRACED_FORMATS]``; GML kernel
modules are not opaque (they handle either layout) and are left alone; so are torch.nn layers, with
one exception.

The exception: a torch conv layer left unfused (it runs as the torch module) whose weight holds more
elements than its input. Given a channels-last input, torch converts the *weight* to channels-last on
every call. timm's vgg11_bn at 160 px: its ConvMlp 7x7 conv (4096 x 512 x 7 x 7, 411 MB) on a
512 x 7 x 7 input spent 360 ms copying the weight plus 292 ms in the conv, against 290 ms eager, under
the AVX2 cap (docs/coverage-avx2.md). Converting the 100 KB input instead costs nothing
measurable.
"""

from __future__ import annotations

import torch
from torch import fx

from gml.capture import TRACED_FORMATS
from gml.passes.base import GraphPass, PassResult, Skip
from gml.passes.utils import modules_of


def is_opaque(module: torch.nn.Module) -> bool:
    """A module GML runs as a black box: neither a torch layer nor a GML module."""
    return not type(module).__module__.startswith(("torch.", "gml."))


_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _weight_outweighs_input(module: torch.nn.Module, arg: object) -> bool:
    """A torch conv layer whose weight has more elements than its input (module doc: the exception)."""
    meta = arg.meta.get("tensor_meta") if isinstance(arg, fx.Node) else None
    shape = getattr(meta, "shape", None)
    if type(module) not in _CONVS or shape is None:
        return False
    return module.weight.numel() > torch.Size(shape).numel()


def _format_of(node: object) -> torch.memory_format | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return getattr(meta, "memory_format", None)


class LeafMemoryFormat(GraphPass):
    """Convert an opaque leaf's tensor inputs back to their traced memory format (see module doc)."""

    name = "leaf_memory_format"

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        converted = 0
        skips: list[Skip] = []
        for node in list(gm.graph.nodes):
            mod = modules.get(str(node.target)) if node.op == "call_module" else None
            traced = node.meta.get(TRACED_FORMATS)
            if mod is None or not traced:
                continue
            if not is_opaque(mod) and not (node.args and _weight_outweighs_input(mod, node.args[0])):
                continue
            for i, (arg, want) in enumerate(zip(node.args, traced)):
                have = _format_of(arg)
                if want is None or have is None or have == want:
                    continue
                if want not in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
                    skips.append(Skip(node.name, f"traced format {want} cannot be restored", "leaf format"))
                    continue
                with gm.graph.inserting_before(node):
                    fixed = gm.graph.call_method("contiguous", (arg,), {"memory_format": want})
                node.update_arg(i, fixed)
                converted += 1
        return PassResult.rewrote(
            gm, converted, skips, f"{converted} leaf input(s) converted back to their traced memory format"
        )


__all__ = ["LeafMemoryFormat", "is_opaque"]
