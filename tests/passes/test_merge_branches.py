"""MergeBranches: RepVGG / MobileOne / RepGhost style parallel branches summed into one conv (#16)."""

from __future__ import annotations

import pytest
import torch
from tests.passes.test_fold_bn import randomize_bn
from torch import fx, nn

from gml import nn as gnn
from gml.passes.fold_bn import FoldBatchNorm
from gml.passes.manager import PassManager
from gml.passes.merge_branches import MergeBranches
from gml.passes.normalize import Normalize
from gml.passes.pipeline import canonical_passes


class RepVggBlock(nn.Module):
    """timm's RepVggBlock in training form: 3x3 conv+BN, 1x1 conv+BN, identity BN, summed, ReLU."""

    def __init__(self, c: int = 6, groups: int = 1, stride: int = 1) -> None:
        super().__init__()
        self.kxk = nn.Sequential(nn.Conv2d(c, c, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(c))
        self.k1 = nn.Sequential(nn.Conv2d(c, c, 1, stride, 0, groups=groups, bias=False), nn.BatchNorm2d(c))
        self.identity = nn.BatchNorm2d(c) if stride == 1 else None
        self.act = nn.ReLU()

    def forward(self, x):
        out = self.k1(x) + self.kxk(x)
        if self.identity is not None:
            out = out + self.identity(x)
        return self.act(out)


def run(model: nn.Module, x: torch.Tensor):
    gm = fx.symbolic_trace(model)
    out = PassManager([Normalize(), FoldBatchNorm(), MergeBranches()], strict=True).run(gm, [(x,)])
    return out.graph_module, out.report.record("merge_branches")


def convs(gm: fx.GraphModule) -> list[nn.Conv2d]:
    return [m for m in gm.modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.parametrize("groups", [1, 3, 6])
def test_golden_graph_repvgg_block_is_one_conv(groups: int):
    model = randomize_bn(nn.Sequential(RepVggBlock(groups=groups), RepVggBlock(groups=groups)))
    x = torch.randn(2, 6, 9, 9)
    gm, rec = run(model, x)
    assert rec.matches == 4 and rec.notes == ["merged into one conv: conv + conv ×2, conv + BatchNorm ×2"]
    # conv → ReLU → conv → ReLU: no add, no BN left
    kinds = [type(gm.get_submodule(str(n.target))).__name__ for n in gm.graph.nodes if n.op == "call_module"]
    assert kinds == ["Conv2d", "ReLU", "Conv2d", "ReLU"]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) and c.groups == groups for c in convs(gm))
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_strided_block_without_identity_and_odd_border():
    model = randomize_bn(RepVggBlock(stride=2))
    x = torch.randn(1, 6, 10, 7)
    gm, rec = run(model, x)
    assert rec.matches == 1 and len(convs(gm)) == 1
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_conv_plus_plain_identity_and_a_bn_after():
    """RepViT's RepVggDw: ``bn(conv(x) + conv1(x) + x)``; the BN after the sum folds next (the pipeline)."""

    class RepVggDw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(4, 4, 3, 1, 1, groups=4, bias=False), nn.BatchNorm2d(4))
            self.conv1 = nn.Conv2d(4, 4, 1, groups=4)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x) + self.conv1(x) + x)

    model = randomize_bn(RepVggDw())
    x = torch.randn(1, 4, 6, 6)
    gm, rec = run(model, x)
    assert rec.matches == 2 and len(convs(gm)) == 1
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)
    out = PassManager(canonical_passes(), strict=True).run(fx.symbolic_trace(model), [(x,)])
    leaves = [type(m) for m in out.graph_module.modules() if not list(m.children())]
    assert leaves == [nn.Conv2d]  # the trailing BN folded too
    torch.testing.assert_close(out.graph_module(x), model(x), atol=1e-5, rtol=1e-4)


def test_mobileone_zero_start_is_a_zero_branch():
    """timm's MobileOneBlock without a scale or identity branch: ``out = 0; out += conv(x) ...; out += 0``."""

    class MobileOneLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList(
                nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)) for _ in range(3)
            )

        def forward(self, x):
            out = 0
            for c in self.convs:
                out += c(x)
            out += 0
            return torch.relu(out)

    model = randomize_bn(MobileOneLike())
    x = torch.randn(1, 4, 5, 5)
    gm, rec = run(model, x)
    assert rec.matches == 4 and "conv + conv ×2" in rec.notes[0] and "zero branch removed ×2" in rec.notes[0]
    assert len(convs(gm)) == 1 and not any(isinstance(m, (gnn.Add, gnn.AddScalar)) for m in gm.modules())
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_strided_branches_of_different_kernels_line_up():
    """3x3/pad 1 and 2x2/pad 0, stride 2: the 2x2 taps are the 3x3's last two; exact."""

    class Strided(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 3, 3, padding=1, stride=2), nn.Conv2d(3, 3, 2, stride=2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = Strided().eval()
    x = torch.randn(1, 3, 8, 8)
    gm, rec = run(model, x)
    assert rec.matches == 1 and len(convs(gm)) == 1
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_dilated_branches_line_up():
    class Dilated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 5, 3, padding=2, dilation=2), nn.Conv2d(3, 5, 1, dilation=2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = Dilated().eval()
    x = torch.randn(1, 3, 8, 8)
    gm, rec = run(model, x)
    assert rec.matches == 1
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


class TestDeclined:
    def test_misaligned_branches_keep_the_add_with_the_reason(self):
        class Shifted(nn.Module):  # dilation 2: b's taps sit between a's, no common kernel holds both
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Conv2d(3, 3, 3, padding=2, dilation=2)
                self.b = nn.Conv2d(3, 3, 2, padding=1, dilation=2)

            def forward(self, x):
                return self.a(x) + self.b(x)

        model = Shifted().eval()
        x = torch.randn(1, 3, 8, 8)
        gm, rec = run(model, x)
        assert rec.matches == 0 and "taps do not line up" in rec.skips[0].reason
        assert any(isinstance(m, gnn.Add) for m in gm.modules())
        torch.testing.assert_close(gm(x), model(x))

    def test_identity_needs_stride_one(self):
        class Strided(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Conv2d(3, 3, 1, stride=2)

            def forward(self, x):
                return self.a(x) + x[:, :, ::2, ::2]

        model = Strided().eval()
        x = torch.randn(1, 3, 8, 8)
        gm, rec = run(model, x)
        assert rec.matches == 0
        torch.testing.assert_close(gm(x), model(x))

    def test_branch_read_elsewhere_is_kept(self):
        class Tapped(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 1)

            def forward(self, x):
                ya = self.a(x)
                return ya + self.b(x), ya  # the 3x3 branch is also an output

        model = Tapped().eval()
        x = torch.randn(1, 3, 5, 5)
        _gm, rec = run(model, x)
        assert rec.matches == 0

    def test_identity_channel_mismatch_has_a_reason(self):
        class Widen(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.bn = nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.BatchNorm2d(4)

            def forward(self, x):
                return self.a(x) + self.bn(x)

        model = randomize_bn(Widen())
        x = torch.randn(1, 4, 5, 5)
        gm, rec = run(model, x)  # groups=2 with 2 in/2 out per group: the identity fits
        assert rec.matches == 1
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_canonical_pipeline_folds_every_bn_of_a_repvgg_net():
    model = randomize_bn(nn.Sequential(RepVggBlock(), RepVggBlock(stride=2), RepVggBlock()))
    x = torch.randn(1, 6, 12, 12)
    out = PassManager(canonical_passes(), strict=True).run(fx.symbolic_trace(model), [(x,)])
    gm = out.graph_module
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())
    assert len(convs(gm)) == 3
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_plain_residual_around_one_conv_stays_an_add():
    """``x + conv(x)`` with nothing after: the conv+add kernels fuse it; merging would only widen the
    INT8 weight range (module doc)."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return torch.relu(x + self.conv(x))

    model = Residual().eval()
    x = torch.randn(1, 4, 5, 5)
    gm, rec = run(model, x)
    assert rec.matches == 0 and any(isinstance(m, gnn.Add) for m in gm.modules())
