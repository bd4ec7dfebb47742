"""RecognizeTanhGelu: HF's written-out tanh GELU becomes one nn.GELU("tanh") (golden graph,
numerics vs eager, declined cases with their reasons, and the linear fusion it enables)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx, nn

from gml.capture import capture
from gml.kernels import fp32 as k32
from gml.passes.gelu import RecognizeTanhGelu
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize
from gml.passes.pipeline import fp32_passes


class NewGELU(nn.Module):
    """transformers.activations.NewGELUActivation, verbatim."""

    def __init__(self, cubic: float = 0.044715, reuse: bool = False) -> None:
        super().__init__()
        self.cubic, self.reuse = cubic, reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = x + self.cubic * torch.pow(x, 3.0)
        out = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * inner))
        return out + inner if self.reuse else out  # reuse: an intermediate read elsewhere


class MLP(nn.Module):
    def __init__(self, act: nn.Module, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), act, nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _run(model: nn.Module, x: torch.Tensor):
    gm = capture(model, (x,))
    return PassManager([Normalize(), RecognizeTanhGelu()]).run(gm, [(x,)])


def _types(gm: fx.GraphModule) -> list[str]:
    return [type(gm.get_submodule(str(n.target))).__name__ for n in gm.graph.nodes if n.op == "call_module"]


def test_golden_graph_and_numerics():
    torch.manual_seed(0)
    model, x = MLP(NewGELU()).eval(), torch.randn(4, 16) * 3
    res = _run(model, x)
    gm = res.graph_module
    assert _types(gm) == ["Linear", "GELU", "Linear"]  # eight ops → one module
    gelu = next(m for m in gm.modules() if isinstance(m, nn.GELU))
    assert gelu.approximate == "tanh"
    assert not any("pow" in str(n.target) or n.target is torch.tanh for n in gm.graph.nodes)
    rec = res.report.records[-1]
    assert rec.status == "applied" and rec.matches == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "act,reason",
    [
        (NewGELU(cubic=0.05), "constant 0.05 where GELU has 0.044715"),
        (NewGELU(reuse=True), "read elsewhere"),
    ],
)
def test_declined_with_the_reason(act, reason):
    res = _run(MLP(act).eval(), torch.randn(4, 16))
    rec = res.report.records[-1]
    assert rec.matches == 0 and "GELU" not in _types(res.graph_module)
    assert any(reason in s.reason for s in rec.skips), rec.skips


def test_the_recognized_gelu_is_fused_into_the_linear():
    torch.manual_seed(1)
    model, x = MLP(NewGELU(), d=256).eval(), torch.randn(128, 256)  # big enough for oneDNN's kernel
    gm = PassManager(fp32_passes()).run(capture(model, (x,)), [(x,)]).graph_module
    fused = [m for m in gm.modules() if isinstance(m, k32.FusedLinear)]
    assert fused and "gelu" in repr(fused[0]).lower(), gm.code
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)
