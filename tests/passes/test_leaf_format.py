"""LeafMemoryFormat (gml/passes/leaf_format.py): an unfused torch conv whose weight outweighs its
input gets its input back in the traced (contiguous) format, so torch does not convert the weight to
channels-last on every call; a conv whose input is the bigger tensor is left alone."""

from __future__ import annotations

import torch
from torch import fx, nn

import gml
from gml.passes.leaf_format import LeafMemoryFormat


def _as_channels_last_producer(gm: fx.GraphModule, name: str) -> None:
    """Say that ``name``'s input arrives channels-last (as a fused conv's output does)."""
    node = next(n for n in gm.graph.nodes if n.name == name)
    arg = node.args[0]
    arg.meta["tensor_meta"] = arg.meta["tensor_meta"]._replace(memory_format=torch.channels_last)


def _captured() -> tuple[nn.Module, fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    # "0": 216 weights against a 1x3x16x16 (768) input; "2": 64 x 8 x 7 x 7 = 25,088 weights against
    # an 8 x 7 x 7 (392) input, as timm's ConvMlp head (4096 x 512 x 7 x 7 on 512 x 7 x 7)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.AdaptiveAvgPool2d(7), nn.Conv2d(8, 64, 7)).eval()
    x = torch.randn(1, 3, 16, 16)
    return model, gml.capture(model, (x,)), x


def test_a_conv_whose_weight_outweighs_its_input_gets_its_traced_format_back():
    model, gm, x = _captured()
    _as_channels_last_producer(gm, "_2")
    result = LeafMemoryFormat()(gm)
    assert result.matches == 1
    head = next(n for n in gm.graph.nodes if n.name == "_2")
    fixed = head.args[0]
    assert fixed.op == "call_method" and fixed.target == "contiguous"
    assert fixed.kwargs == {"memory_format": torch.contiguous_format}
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))  # a copy: the very same values


def test_a_conv_whose_input_is_bigger_is_left_alone():
    _, gm, _ = _captured()
    _as_channels_last_producer(gm, "_0")
    result = LeafMemoryFormat()(gm)
    assert result.matches == 0
    assert not any(n.op == "call_method" and n.target == "contiguous" for n in gm.graph.nodes)
