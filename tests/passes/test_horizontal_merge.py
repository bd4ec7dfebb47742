from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.testing import FileCheck

from gml.kernels import fp32 as k32
from gml.passes.fuse_conv import FuseConvActivation
from gml.passes.fuse_linear import FuseLinearActivation
from gml.passes.horizontal_merge import HorizontalMerge
from gml.passes.manager import PassManager


def traced(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(model.eval())
    ShapeProp(gm).propagate(*inputs)
    return gm


def module_types(gm: fx.GraphModule) -> Counter[str]:
    mods = dict(gm.named_modules())
    return Counter(type(mods[n.target]).__name__ for n in gm.graph.nodes if n.op == "call_module")


class QKV(nn.Module):
    def __init__(self, d: int = 32, bias_k: bool = True) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=bias_k)
        self.v = nn.Linear(d, 2 * d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        attn = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return attn @ v


@pytest.mark.parametrize("bias_k", [True, False])
def test_qkv_golden(bias_k):
    model, x = QKV(bias_k=bias_k), torch.randn(2, 5, 32)
    gm = traced(model, x)
    result = HorizontalMerge()(gm)
    assert result.matches == 1 and result.notes == ["merged q, k, v"]
    FileCheck().check_count("self.q_k_v(x)", 1, exactly=True).check("torch.functional.split").check("[32, 32, 64]").run(
        gm.code
    )
    assert module_types(gm) == Counter({"Linear": 1})
    assert gm.q_k_v.weight.shape == (128, 32)
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max().item() < 1e-5


def test_conv_siblings_with_a_shared_activation_then_fuse():
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 6, 1)
            self.ra, self.rb = nn.ReLU(), nn.ReLU()
            self.c = nn.Conv2d(8, 4, 3, padding=1)  # other geometry: stays alone

        def forward(self, x):
            return torch.cat([self.ra(self.a(x)), self.rb(self.b(x)), self.c(x)], 1)

    model, x = Branches(), torch.randn(1, 8, 6, 6)
    gm = traced(model, x)
    result = PassManager([HorizontalMerge(convs=True), FuseConvActivation()], strict=True).run(gm, [(x,)])
    out = result.graph_module
    assert result.report.record("horizontal_merge").matches == 1
    if k32.kernels_available():
        assert module_types(out) == Counter({"FusedConv": 2})
        assert out.a_b.post_op == k32.PostOp("relu")  # the shared ReLU ran once, before the split
    with torch.no_grad():
        assert (out(x) - model(x)).abs().max().item() < 1e-4


def test_merged_linear_is_lowered_by_fuse_linear():
    model, x = QKV(), torch.randn(1, 4, 32)
    gm = traced(model, x)
    result = PassManager([HorizontalMerge(), FuseLinearActivation(backend="onednn")], strict=True).run(gm, [(x,)])
    if k32.kernels_available():
        assert module_types(result.graph_module) == Counter({"FusedLinear": 1})


def test_mismatched_siblings_are_reported():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.one = nn.Conv2d(4, 4, 1)
            self.three = nn.Conv2d(4, 4, 3, padding=1)
            self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)

        def forward(self, x):
            return self.one(x) + self.three(x) + self.dw(x)

    model, x = M(), torch.randn(1, 4, 5, 5)
    gm = traced(model, x)
    assert HorizontalMerge()(gm).skips == []  # convs are opt-in
    result = HorizontalMerge(convs=True)(gm)
    assert not result.modified
    assert [(s.node, s.reason) for s in result.skips] == [
        ("dw", "groups=4"),
        ("x", "siblings one, three differ in shape or geometry"),
    ]


def test_siblings_feeding_different_activations_stay_apart():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.relu, self.gelu = nn.ReLU(), nn.GELU()

        def forward(self, x):
            return self.relu(self.a(x)) + self.gelu(self.b(x))

    model, x = M(), torch.randn(2, 8)
    gm = traced(model, x)
    result = HorizontalMerge()(gm)
    assert not result.modified
    assert [s.reason for s in result.skips] == ["siblings a, b feed different activations (merging would unfuse them)"]


def test_single_linear_is_not_a_candidate():
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(1, 4)
    gm = traced(model, x)
    result = HorizontalMerge()(gm)
    assert not result.modified and result.skips == []


class ViewsAcrossTheSlice(nn.Module):
    """``b.view(n, -1)`` joins the sliced dimension with the one before it: fine on eager's contiguous
    output, impossible on a slice of a merged output (fuzz, seed 20261128); ``c.view(n, s, 2, 2)``
    keeps it apart and works on the slice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(3, 4)

    def forward(self, x):
        n, s = x.shape[0], x.shape[1]
        return self.a(x), self.b(x).view(n, -1), self.c(x).view(n, s, 2, 2)


def test_a_view_across_the_sliced_dimension_keeps_its_sibling_apart_with_the_reason():
    torch.manual_seed(0)
    model, x = ViewsAcrossTheSlice().eval(), torch.randn(2, 5, 3)
    gm = traced(model, x)
    res = PassManager([HorizontalMerge()], strict=True).run(gm, [(x,)])
    (rec,) = res.report.records
    assert rec.status == "applied" and rec.notes == ["merged a, c"], rec
    (skip,) = [s for s in rec.skips if s.node == "b"]
    assert "views its output in a shape a slice of the merged output cannot take" in skip.reason
    with torch.no_grad():
        for got, want in zip(res.graph_module(x), model(x)):
            torch.testing.assert_close(got, want)
