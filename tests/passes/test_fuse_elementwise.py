from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from gml.kernels.fp32 import AddReLU
from gml.passes.fuse_elementwise import FuseElementwise
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize


def traced(fn, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(*inputs)
    return gm


def module_types(gm: fx.GraphModule) -> Counter[str]:
    mods = dict(gm.named_modules())
    return Counter(type(mods[n.target]).__name__ for n in gm.graph.nodes if n.op == "call_module")


def test_add_relu_silu_hardswish_golden():
    def fn(a, b, x):
        return F.relu(a + b), x * torch.sigmoid(x), F.hardsigmoid(x) * x

    a, b, x = torch.randn(2, 8, 4, 4), torch.randn(8, 1, 1), torch.randn(3, 16) * 4
    gm = traced(fn, a, b, x)
    result = FuseElementwise()(gm)
    assert result.matches == 3 and result.skips == []
    assert module_types(gm) == Counter({"AddReLU": 1, "SiLU": 1, "Hardswish": 1})
    assert not any(n.op == "call_function" for n in gm.graph.nodes)
    assert result.notes == ["fused: add+relu ×1, x * hardsigmoid(x) ×1, x * sigmoid(x) ×1"]
    for got, ref in zip(gm(a, b, x), fn(a, b, x)):
        assert (got - ref).abs().max().item() < 1e-6


def test_normalized_spellings_fuse_under_the_manager():
    class M(nn.Module):
        def forward(self, a, b):
            s = a + b
            return s.relu()

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    gm = traced(M(), a, b)
    result = PassManager([Normalize(), FuseElementwise()], strict=True).run(gm, [(a, b)])
    assert module_types(result.graph_module) == Counter({"AddReLU": 1})
    assert torch.equal(result.graph_module(a, b), torch.relu(a + b))
    assert isinstance(AddReLU(), nn.Module)


def test_chains_without_a_kernel_are_reported_not_faked():
    def fn(a, b):
        return torch.sigmoid(a + b), torch.tanh(a * b)

    a, b = torch.randn(4), torch.randn(4)
    gm = traced(fn, a, b)
    result = FuseElementwise()(gm)
    assert not result.modified
    assert sorted(s.reason for s in result.skips) == [
        "no single CPU kernel computes add → sigmoid (left as two ops)",
        "no single CPU kernel computes mul → tanh (left as two ops)",
    ]


def test_add_with_two_users_and_scalar_add_are_declined():
    def fn(a, b):
        s = a + b
        return F.relu(s), s, F.relu(a + 1.0)

    a, b = torch.randn(4), torch.randn(4)
    gm = traced(fn, a, b)
    result = FuseElementwise()(gm)
    assert not result.modified
    assert [s.reason for s in result.skips if s.pattern == "add → relu"] == [
        "add output has 2 users",
        "add of a tensor and a constant",
    ]
