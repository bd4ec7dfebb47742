"""bf16 kernels (gml.kernels.bf16) through the engine vs the Python executor, op by op.

Both run oneDNN's bf16 primitives on the same bf16 weights; they may pick different
implementations (accumulation order), so a bf16 output may differ by one rounding step: at most
2 ulp of bf16 (2^-7 relative) of the output's magnitude.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import gml
from gml.kernels import bf16 as kb
from gml.kernels.fp32 import FusedConv, FusedConvAdd, FusedLinear, PostOp
from gml.runtime import unavailable_reason
from runtime.helpers import graph_of, run_both

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
    pytest.mark.skipif(not kb.bf16_available(), reason=f"no native bf16: {kb.bf16_unavailable_reason()}"),
]

BF16_ENGINE_RTOL = 2.0**-7


def check_bf16(gm: fx.GraphModule, *inputs: torch.Tensor, expect: str = "engine"):
    ref, eng, got = run_both(gm, *inputs)
    assert eng.report.path == expect, str(eng.report)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = float((got.float() - ref.float()).abs().max())
    assert err <= BF16_ENGINE_RTOL * float(ref.float().abs().max()), err
    return eng


def _conv(cin, cout, k, **kw) -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(cin, cout, k, **kw).eval()


@pytest.mark.parametrize("post_op", [PostOp(), PostOp("relu"), PostOp("swish")], ids=str)
@pytest.mark.parametrize(
    "cin,cout,k,kw",
    [(3, 8, 3, dict(padding=1)), (8, 8, 3, dict(padding=1, groups=8)), (6, 9, 1, dict(stride=2))],
)
def test_bf16_conv_fp32_and_bf16_inputs(cin, cout, k, kw, post_op):
    conv = kb.Bf16Conv.from_fused(FusedConv.from_conv(_conv(cin, cout, k, **kw), post_op))
    x = torch.randn(2, cin, 9, 11)
    check_bf16(graph_of(conv), x)  # fp32 NCHW input: reordered to bf16 NHWC first
    check_bf16(graph_of(conv), x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("relu", [False, True])
def test_bf16_conv_add(relu):
    mod = kb.Bf16ConvAdd.from_fused(FusedConvAdd.from_conv(_conv(6, 8, 3, padding=1), relu=relu, inplace=False))
    x = torch.randn(1, 6, 8, 8)
    other = torch.randn(1, 8, 8, 8).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    check_bf16(graph_of(mod, n_inputs=2, wiring=[(0, 1)]), x, other)


@pytest.mark.parametrize("shape", [(3, 20), (2, 5, 20)])
def test_bf16_linear_2d_and_3d(shape):
    torch.manual_seed(0)
    mod = kb.Bf16Linear.from_fused(FusedLinear.from_linear(nn.Linear(20, 7), PostOp("gelu", (), "none")))
    check_bf16(graph_of(mod), torch.randn(*shape))


def test_casts_and_pools_of_a_bf16_graph():
    """maxpool (bf16) → to_fp32 → average (fp32) → flatten → linear → to_fp32: the ResNet tail."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).eval()
    x = torch.randn(2, 3, 16, 16)
    res = gml.optimize(model, x, precision="bf16", runtime="torch")
    code = res.module.code
    assert code.count("gml_kernels_bf16_to_fp32(") == 2
    eng = check_bf16(res.module, x)
    assert eng.report.segments == 1 and not eng.report.torch_nodes


def test_optimize_bf16_picks_the_engine_and_reports_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = torch.randn(1, 3, 10, 10)
    res = gml.optimize(model, x, precision="bf16")
    assert res.engine is not None and res.runtime.path == "engine"
    assert res.executable is res.engine
    with torch.no_grad():
        a, b = res.module(x), res.executable(x)
    assert a.dtype == b.dtype == torch.float32
    assert float((a - b).abs().max()) <= BF16_ENGINE_RTOL * float(a.abs().max())
    torch_only = gml.optimize(model, x, precision="bf16", runtime="torch")
    assert torch_only.engine is None and torch_only.executable.graph_module is torch_only.module


def test_partly_covered_bf16_graph_stays_on_the_executor_and_says_why():
    """A bf16 kernel, attention or LayerNorm left in torch (here a LayerNorm over two dims, which the
    engine declines) keeps the graph on the executor."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm((6, 16))

        def forward(self, x):
            return self.ln(x + self.fc(x))

    torch.manual_seed(0)
    res = gml.optimize(Block().eval(), torch.randn(2, 6, 16), precision="bf16")
    assert res.engine is None and res.executable.graph_module is res.module
    assert res.runtime.path == "torch" and "covers part of this bf16 graph" in res.runtime.note


def test_a_bf16_layer_norm_block_runs_on_the_engine():
    """LayerNorm(x + linear(x)): the linear and the residual add are one matmul, then a layer_norm."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

        def forward(self, x):
            return self.ln(x + self.fc(x))

    torch.manual_seed(0)
    x = torch.randn(4, 32)
    res = gml.optimize(Block().eval(), x, precision="bf16")
    assert res.runtime.path == "engine", str(res.runtime)
    with torch.no_grad():
        ref, got = res.module(x), res.executable(x)
    assert float((got - ref).abs().max()) <= BF16_ENGINE_RTOL * 4 * float(ref.abs().max())
