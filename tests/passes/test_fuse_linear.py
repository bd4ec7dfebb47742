from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.testing import FileCheck

from gml.kernels import fp32 as k32
from gml.kernels.fp32 import FusedLinear, PostOp
from gml.passes.fuse_linear import FuseLinearActivation
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize

pytestmark = pytest.mark.skipif(not k32.kernels_available(), reason="oneDNN fp32 kernels unavailable")


def traced(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(model.eval())
    ShapeProp(gm).propagate(*inputs)
    return gm


def module_types(gm: fx.GraphModule) -> Counter[str]:
    mods = dict(gm.named_modules())
    return Counter(type(mods[n.target]).__name__ for n in gm.graph.nodes if n.op == "call_module")


class MLP(nn.Module):
    """The fusion practice's model: Linear → ReLU → Linear → ReLU → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu1 = nn.Linear(32, 64), nn.ReLU()
        self.fc2, self.relu2 = nn.Linear(64, 64), nn.ReLU()
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


def test_linear_relu_golden():
    model, x = MLP(), torch.randn(8, 32)
    gm = traced(model, x)
    result = FuseLinearActivation(backend="onednn")(gm)
    assert result.modified and result.matches == 2 and result.skips == []
    FileCheck().check("self.fc1(x)").check("self.fc2(fc1)").check("self.head(fc2)").check_not("relu").run(gm.code)
    assert module_types(gm) == Counter({"FusedLinear": 3})
    assert gm.fc1.post_op == PostOp("relu") and gm.head.post_op == k32.NO_POST_OP
    assert set(gm.state_dict()) == set(model.state_dict())
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max().item() < 1e-4


@pytest.mark.parametrize("act", [nn.GELU(), nn.Tanh(), nn.SiLU(), nn.LeakyReLU(0.05)], ids=lambda m: type(m).__name__)
def test_linear_activation_numerics(act):
    model = nn.Sequential(nn.Linear(16, 16), act, nn.Linear(16, 4)).eval()
    x = torch.randn(3, 5, 16)  # 3-D input: the kernel flattens leading dims
    gm = traced(model, x)
    assert FuseLinearActivation(backend="onednn")(gm).matches == 1
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max().item() < 1e-4


def test_functional_relu_after_normalize_and_through_manager():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return F.relu(self.fc(x)) + x.relu()

    model, x = M().eval(), torch.randn(4, 8)
    gm = traced(model, x)
    result = PassManager([Normalize(), FuseLinearActivation(backend="onednn")], strict=True).run(gm, [(x,)])
    out = result.graph_module
    assert result.report.record("fuse_linear").matches == 1
    assert isinstance(out.fc, FusedLinear) and out.fc.post_op == PostOp("relu")


def test_backend_follows_the_shape():
    model = nn.Sequential(nn.Linear(512, 1000), nn.ReLU(), nn.Linear(1000, 16)).eval()
    one, many = traced(model, torch.randn(1, 512)), traced(model, torch.randn(64, 512))
    r_many = FuseLinearActivation()(many)
    assert r_many.matches == 1 and many.get_submodule("0").backend == "onednn"
    r_one = FuseLinearActivation()(one)
    expected = k32.choose_linear_backend(1, 512, 1000)
    if expected != "onednn":  # one row: the GEMV is faster unfused, and the report says so
        assert r_one.matches == 0
        assert "measured faster than oneDNN's fused kernel" in r_one.skips[0].reason
        assert isinstance(one.get_submodule("1"), nn.ReLU)
    assert isinstance(one.get_submodule("2"), nn.Linear)  # 1 x 1000 x 16: tiny, stays on ATen
    with torch.no_grad():
        x = torch.randn(1, 512)
        assert (one(x) - model(x)).abs().max().item() < 1e-4


def test_declined_candidates_have_reasons():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.two_users = nn.Linear(8, 8)
            self.relu = nn.ReLU()
            self.shared = nn.Linear(8, 8)
            self.elu = nn.ELU()
            self.last = nn.Linear(8, 8)

        def forward(self, x):
            y = self.two_users(x)
            z = self.relu(y) + y
            z = self.shared(self.shared(z))
            return self.elu(self.last(z))

    model, x = M().eval(), torch.randn(2, 8)
    gm = traced(model, x)
    result = FuseLinearActivation(backend="onednn")(gm)
    reasons = {(s.node, s.reason) for s in result.skips}
    assert reasons == {
        ("two_users", "linear output has 2 users"),
        ("shared", "linear module shared is called at 2 sites (run UntieSharedModules first)"),
        ("shared_1", "linear module shared is called at 2 sites (run UntieSharedModules first)"),
        ("elu", "post-op not fused: ELU has no oneDNN post-op (supported: " + ", ".join(k32.UNARY_ATTRS) + ")"),
    }
    assert result.matches == 0 and isinstance(gm.two_users, FusedLinear) and isinstance(gm.last, FusedLinear)
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max().item() < 1e-4


def test_lower_unfused_false_only_fuses():
    model, x = MLP(), torch.randn(2, 32)
    gm = traced(model, x)
    FuseLinearActivation(lower_unfused=False, backend="onednn")(gm)
    assert module_types(gm) == Counter({"FusedLinear": 2, "Linear": 1})
