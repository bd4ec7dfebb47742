"""``gml demo``: every phase runs (or says which stage is missing) and the demo's own fusion is real."""

from __future__ import annotations

import torch
from rich.console import Console
from torch import fx, nn

from gml.demo import DemoMLP, FusedLinearReLU, MatmulBlock, _pattern, _replacement, fuse_linear_relu, run_demo


class SmallConvNet(nn.Module):
    example_input_shape = (1, 3, 32, 32)

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)) + x)
        return self.fc(torch.flatten(self.pool(x), 1))


def test_demo_walks_every_phase_and_ends_with_the_summary():
    console = Console(record=True, width=140)
    code = run_demo(console, model=SmallConvNet(), rounds=3, calib_batches=2)
    text = console.export_text()
    assert code == 0, text
    for phase in (
        "Phase 1: trace basics",
        "Phase 2: manual Linear+ReLU fusion",
        "Phase 3: matmul+add+relu pattern rewrite",
        "Phase 4: fused vs unfused benchmark",
        "Phase 5: Conv+BN folding",
        "Phase 6: INT8 quantize + lower",
        "GML-Lab tour",
    ):
        assert phase in text
    assert "2 pairs fused, nodes 7 → 5" in text
    assert "2 matches rewritten" in text
    assert "2 → 0 BatchNorm nodes" in text
    assert "KiB unfused" in text and "intermediate tensors" in text
    assert "failed:" not in text


def test_manual_fusion_uses_the_onednn_kernel_and_matches_eager():
    model = DemoMLP(64).eval()
    gm = fx.symbolic_trace(model)
    assert fuse_linear_relu(gm) == 2
    kinds = [type(m) for m in gm.modules()]
    assert kinds.count(FusedLinearReLU) == 2 and nn.ReLU not in kinds
    assert kinds.count(nn.Linear) == 1  # the head has no ReLU after it
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    # the fused module is one kernel call, not Linear then ReLU
    fused_gm = fx.symbolic_trace(gm.fc1_relu)
    torch.testing.FileCheck().check_count("mkldnn._linear_pointwise", 1, exactly=True).check_not("relu(").run(
        fused_gm.code
    )


def test_manual_fusion_leaves_a_linear_with_two_readers():
    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return torch.relu(y) + y

    gm = fx.symbolic_trace(TwoReaders().eval())
    assert fuse_linear_relu(gm) == 0
    assert not any(isinstance(m, FusedLinearReLU) for m in gm.modules())


def test_pattern_rewrite_replaces_both_blocks():
    from torch.fx import subgraph_rewriter

    model = MatmulBlock(32).eval()
    gm = fx.symbolic_trace(model)
    assert len(subgraph_rewriter.replace_pattern(gm, _pattern, _replacement)) == 2
    torch.testing.FileCheck().check_count("torch.ops.mkldnn._linear_pointwise(", 2, exactly=True).run(gm.code)
    assert "matmul" not in gm.code and "relu" not in gm.code.replace("'relu'", "")
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
