from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import fx, nn
from torch.testing import FileCheck

from gml.passes.base import Skip
from gml.passes.manager import PassManager
from gml.passes.untie import UntieSharedModules


def call_sites(gm: fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")


class Basic(nn.Module):
    """torchvision BasicBlock's shape: one ReLU object called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv2(self.relu(self.conv1(x))) + x)


def test_basic_block_relu_gets_one_copy_per_site():
    model = Basic().eval()
    gm = fx.symbolic_trace(model)
    result = UntieSharedModules()(gm)
    assert result.modified and result.matches == 1 and result.skips == []
    FileCheck().check("self.conv1").check("self.relu(").check("self.conv2").check("self.relu_1(").run(gm.code)
    assert max(call_sites(gm).values()) == 1
    assert gm.relu is not gm.relu_1 and isinstance(gm.relu_1, nn.ReLU)
    assert result.notes == [
        "added a copy per extra call site: ReLU ×1",
        "weight growth from untying: +0 parameters/buffers (0.00 MiB, +0.00%)",
    ]
    x = torch.randn(1, 4, 5, 5)
    assert torch.equal(gm(x), model(x))


def test_rewriting_one_site_no_longer_changes_the_other():
    model = Basic().eval()
    gm = fx.symbolic_trace(model)
    UntieSharedModules()(gm)
    gm.relu = nn.Identity()  # what a fuse pass does when it absorbs the first ReLU into conv1
    gm.recompile()
    x = torch.randn(1, 4, 5, 5)
    expected = torch.relu(model.conv2(model.conv1(x)) + x)  # second ReLU must still run
    assert torch.equal(gm(x), expected)


def test_names_are_stable_and_skip_taken_ones():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Sigmoid()
            self.act_1 = nn.Tanh()  # the obvious name is taken

        def forward(self, x):
            return self.act(self.act_1(self.act(self.act(x))))

    gm = fx.symbolic_trace(M())
    UntieSharedModules()(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["act", "act_2", "act_1", "act_3"]
    assert isinstance(gm.act_3, nn.Sigmoid) and isinstance(gm.act_1, nn.Tanh)


def test_shared_conv_untied_by_default_with_growth_note():
    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Conv2d(3, 8, 3)

        def forward(self, a, b):
            return self.enc(a) - self.enc(b)

    model = Siamese().eval()
    gm = fx.symbolic_trace(model)
    result = UntieSharedModules()(gm)
    assert call_sites(gm) == {"enc": 1, "enc_1": 1}
    assert gm.enc.weight is not gm.enc_1.weight and torch.equal(gm.enc.weight, gm.enc_1.weight)
    n = 8 * 3 * 3 * 3 + 8
    assert result.notes[1] == f"weight growth from untying: +{n} parameters/buffers ({n * 4 / 2**20:.2f} MiB, +100.00%)"
    a, b = torch.randn(1, 3, 6, 6), torch.randn(1, 3, 6, 6)
    assert torch.equal(gm(a, b), model(a, b))


def test_opt_out_keeps_parameterized_modules_shared():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.GELU()

        def forward(self, x):
            return self.act(self.fc(self.act(self.fc(x))))

    gm = fx.symbolic_trace(M())
    result = UntieSharedModules(untie_parameterized=False)(gm)
    assert call_sites(gm) == {"fc": 2, "act": 1, "act_1": 1}
    assert result.skips == [
        Skip(
            "fc_1",
            "fc holds 20 parameters/buffers; left shared (untie_parameterized=False)",
            "Linear fc × 2 call sites",
        )
    ]


def test_training_mode_module_with_buffers_is_declined():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.bn(x))

    gm = fx.symbolic_trace(M().train())
    result = UntieSharedModules()(gm)
    assert not result.modified
    assert [s.reason for s in result.skips] == [
        "bn is in training mode and updates its buffers on every call; copies would diverge"
    ]


def test_resnet18_every_call_site_owns_its_module():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    out = PassManager([UntieSharedModules()]).run(fx.symbolic_trace(model), [(x,)])
    rec = out.report.record("untie")
    assert rec.status == "applied" and rec.matches == 8 and rec.max_abs_err == 0.0  # 8 BasicBlocks
    gm = out.graph_module
    assert max(call_sites(gm).values()) == 1
    assert "layer1.0.relu_1" in dict(gm.named_modules())
    node = next(n for n in gm.graph.nodes if n.target == "layer1.0.relu_1")
    assert next(reversed(node.meta["nn_module_stack"].values()))[0] == "layer1.0.relu_1"
