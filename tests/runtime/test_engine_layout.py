"""An INT8 conv whose uint8 input is not channels-last (ConvNeXt: LayerNorm over a permuted tensor,
then quantize) runs on a jitted NHWC kernel after a reorder, not on oneDNN's reference kernel
(hundreds of times slower: issue #16, convnext_atto / resnest14d)."""

from __future__ import annotations

import torch
from torch import nn

import gml


class PermutedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.fc = nn.Conv2d(32, 64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return torch.relu(self.fc(x))


def test_conv_on_a_permuted_uint8_input_runs_a_jitted_kernel():
    torch.manual_seed(0)
    model = PermutedNorm().eval()
    x = torch.randn(1, 32, 4, 4)
    q = gml.quantize(model, 2, example_inputs=(x,), per_layer=False, cost_policy="off")
    assert q.engine is not None
    impls = [i for seg in q.engine.segments() for plan, _ in seg._plans.values() if plan for i in plan.step_impls()]
    assert impls and not [i for i in impls if i.startswith("ref")], impls
    with torch.no_grad():
        assert torch.allclose(q.executable(x), q.module(x), atol=1e-5)


class ShuffleThenConv(nn.Module):
    """shufflenet_v2's tail: a channel shuffle (view / transpose / view: torch makes it NCHW) between
    two fp32 convs, so the second conv's segment reads an NCHW input and writes channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 16, 1), nn.Conv2d(16, 32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        return torch.relu(self.b(y))


def test_fp32_conv_on_an_nchw_segment_input_writing_nhwc_runs_a_jitted_kernel():
    """Once 1.5 s per call for shufflenet_v2's conv5 (oneDNN's reference kernel for NCHW in, NHWC out)."""
    torch.manual_seed(0)
    model, x = ShuffleThenConv().eval(), torch.randn(1, 8, 7, 7)
    res = gml.optimize(model, x)
    assert res.engine is not None
    impls = [i for seg in res.engine.segments() for plan, _ in seg._plans.values() if plan for i in plan.step_impls()]
    assert impls and not [i for i in impls if i.startswith("ref")], impls
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-4, atol=1e-5)
