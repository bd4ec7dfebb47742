"""RecognizeGroupNorm: nn.GroupNorm and F.group_norm (timm's GroupNormAct / GroupNorm1) become one
gml.group_norm (golden graph, numerics vs eager, declined cases with their reasons)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gml.capture import capture
from gml.ir.library import gml_op_name
from gml.passes.fold_constants import FoldConstants
from gml.passes.group_norm import RecognizeGroupNorm
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize
from passes.helpers import op_names


class GroupNormAct(nn.GroupNorm):
    """timm's GroupNormAct: an nn.GroupNorm subclass whose forward calls F.group_norm (traced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class Computed(nn.Module):
    """A weight computed in the graph from the input: not a stored tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, 2, x.mean((0, 2, 3)), None)


class Block(nn.Module):
    def __init__(self, norm: nn.Module, c: int = 16) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(3, c, 3, padding=1), norm, nn.Conv2d(c, 8, 1)
        with torch.no_grad():
            for p in self.norm.parameters():
                p.uniform_(-0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.norm(self.conv1(x)))


def _run(model: nn.Module, x: torch.Tensor):
    gm = capture(model, (x,))
    return PassManager([FoldConstants(), Normalize(), RecognizeGroupNorm()]).run(gm, [(x,)])


@pytest.mark.parametrize(
    "norm, groups, ops",
    [
        (nn.GroupNorm(4, 16, eps=1e-3), 4, ["Conv2d", "group_norm", "Conv2d"]),
        (nn.GroupNorm(1, 16), 1, ["Conv2d", "group_norm", "Conv2d"]),
        (nn.GroupNorm(16, 16, affine=False), 16, ["Conv2d", "group_norm", "Conv2d"]),
        (GroupNormAct(8, 16), 8, ["Conv2d", "group_norm", "ReLU", "Conv2d"]),
    ],
    ids=["module", "one-group", "per-channel-no-affine", "timm-function"],
)
def test_golden_graph_and_numerics(norm, groups, ops):
    torch.manual_seed(0)
    model, x = Block(norm).eval(), torch.randn(2, 3, 7, 9) * 3 + 1
    res = _run(model, x)
    gm = res.graph_module
    assert op_names(gm) == ops
    rec = res.report.records[-1]
    assert rec.status == "applied" and rec.matches == 1 and not rec.skips, rec
    (call,) = [n for n in gm.graph.nodes if gml_op_name(n) == "group_norm"]
    assert call.args[1] == groups and call.args[4] == pytest.approx(norm.eps)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_declined_with_reason():
    x = torch.randn(2, 4, 5, 5)
    res = _run(Computed(), x)
    assert "group_norm" in op_names(res.graph_module)  # still torch's own function
    assert not any(gml_op_name(n) == "group_norm" for n in res.graph_module.graph.nodes)
    reasons = [s.reason for s in res.report.records[-1].skips]
    assert any("the weight is computed in the graph" in r for r in reasons), reasons
    torch.testing.assert_close(res.graph_module(x), Computed()(x))


def test_a_bf16_input_is_declined():
    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.GroupNorm(2, 4).to(torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x.to(torch.bfloat16)).float()

    x = torch.randn(1, 4, 3, 3)
    res = _run(Cast(), x)
    reasons = [s.reason for s in res.report.records[-1].skips]
    assert any("not fp32" in r for r in reasons), reasons
