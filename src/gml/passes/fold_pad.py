"""FoldPadIntoConv: a zero pad that only a conv reads becomes the conv's own padding.

Before (timm's ``Conv2dSame`` after shape specialisation, ``nn.ZeroPad2d`` / ``nn.ConstantPad2d(p, 0)``
in front of a conv)::

    p = F.pad(x, [l, r, t, b])            # constant mode, value 0
    y = conv(p)                           # nn.Conv2d, padding (ph, pw), padding_mode "zeros"

After, when ``l == r`` and ``t == b``::

    y = conv'(x)                          # conv' = conv with padding (ph + t, pw + l)

Math: a conv with ``padding_mode="zeros"`` computes on its input surrounded by ``ph`` / ``pw`` rows
and columns of zeros; padding first with ``t`` / ``l`` more zeros on each side is the same input
with ``ph + t`` / ``pw + l`` zeros, so the outputs are identical (tolerance 0). The pad's copy of
the whole activation disappears, and in INT8 the conv is no longer split from its producer by an
fp32 op.

Declined, with the reason: asymmetric pads (a conv's padding is the same on both sides; in INT8 such
a pad runs on the integers, see ``QPad``), non-zero fill values and other modes (reflect,
replicate), pads read by more than one op, pads of other ranks than the conv's spatial dims, convs
with another ``padding_mode`` or string padding, and subclasses of ``nn.Conv2d`` with their own
``forward`` (their padding may not be what their attribute says, e.g. ``Conv2dSame``).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import fx, nn

from gml.ir.layers import behaves_as
from gml.ir.ops import pad_of
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import modules_of, replace_module


class FoldPadIntoConv(GraphPass):
    """Fold symmetric zero pads into the padding of the conv that reads them (exact)."""

    name = "fold_pad"
    tolerance = Tolerance(atol=0.0, rtol=0.0)

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        matches = 0
        for node in list(gm.graph.nodes):
            spec = pad_of(node, modules)
            if spec is None:
                continue
            pads, mode, value = spec
            reason, conv_node = self._why_not(node, pads, mode, value, modules)
            if reason:
                skips.append(Skip(node.name, reason, "pad → conv"))
                continue
            assert conv_node is not None
            conv = modules[str(conv_node.target)]
            dims = len(pads) // 2
            extra = [pads[2 * (dims - 1 - i)] for i in range(dims)]  # F.pad lists the last dim first
            new = copy.deepcopy(conv)
            new.padding = tuple(int(p) + int(e) for p, e in zip(conv.padding, extra))
            replace_module(gm, str(conv_node.target), new)
            modules[str(conv_node.target)] = new
            conv_node.replace_input_with(node, node.args[0])
            gm.graph.erase_node(node)
            matches += 1
        return PassResult.rewrote(gm, matches, skips, f"{matches} zero pad(s) folded into conv padding")

    @staticmethod
    def _why_not(
        node: fx.Node, pads: list[Any], mode: Any, value: Any, modules: dict[str, nn.Module]
    ) -> tuple[str, fx.Node | None]:
        if mode != "constant" or value not in (None, 0, 0.0):
            return f"a {mode} pad with value {value} is not a conv's zero padding", None
        if not all(isinstance(p, int) and p >= 0 for p in pads) or len(pads) % 2:
            return f"pad {pads} is not a list of non-negative literal sizes", None
        if len(node.users) != 1:
            return f"the padded tensor is read by {len(node.users)} ops", None
        user = next(iter(node.users))
        conv = modules.get(str(user.target)) if user.op == "call_module" else None
        if not isinstance(conv, nn.Conv1d | nn.Conv2d | nn.Conv3d) or user.args[:1] != (node,):
            return "no conv reads the pad", None
        if not behaves_as(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return f"{type(conv).__name__} has its own forward: its padding is not its attribute", None
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            return f"the conv pads with mode {conv.padding_mode!r} / padding {conv.padding!r}", None
        dims = len(conv.padding)
        if len(pads) != 2 * dims:
            return f"pad {pads} does not cover exactly the conv's {dims} spatial dims", None
        if any(pads[2 * i] != pads[2 * i + 1] for i in range(dims)):
            return f"asymmetric pad {pads}: a conv's padding is the same on both sides", None
        return "", user
