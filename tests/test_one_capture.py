"""``gml.quantize`` captures the model once (issue #25): the scheme is read from that graph, the
scheme quantizes it, and the whole-model guard builds GML's fp32 model from it instead of calling
``gml.optimize`` (a second capture, a second copy of the weights: the quantize peak of #28)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import nn

import gml
from assets.models import SmallCNN

capture_module = importlib.import_module("gml.capture")  # gml.capture is also the function


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the models ``gml.capture`` traced (every capture starts with torch.fx's trace;
    torch.export runs only after it, where fx fails or hides attention)."""
    seen: list[str] = []
    trace = capture_module.trace

    def counted(model: nn.Module, *args: Any, **kw: Any) -> Any:
        seen.append(type(model).__name__)
        return trace(model, *args, **kw)

    monkeypatch.setattr(capture_module, "trace", counted)
    return seen


@pytest.fixture
def fp32_guard(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The whole-model guard builds its fp32 model and finds INT8 slower, so quantize returns it."""
    import gml.quant.cost_policy as cp

    built: list[float] = []

    def guard(executable: Any, fp32: Any, inputs: Any, **kw: Any) -> tuple[float, float]:
        fp32()
        built.append(1.0)
        return 3.0, 1.0

    monkeypatch.setattr(cp, "guard_whole_model", guard)
    return built


class _HandAttention(nn.Module):
    """A plain module whose attention only its graph shows (matmul → scale → softmax → matmul)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-2, -1) * 32**-0.5, dim=-1)
        return self.proj(a @ v)


def test_static_quantize_captures_once_and_its_guard_builds_fp32_from_that_graph(
    traces: list[str], fp32_guard: list[float]
) -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 16, 16)
    q = gml.quantize(model, [(x,)] * 2, per_layer=False, cost_policy="measure")
    assert q.scheme == "static"
    assert fp32_guard, "the whole-model guard did not run"
    assert traces == ["SmallCNN"], f"captured {len(traces)} times: {traces}"
    # the guard's fp32 model is gml.optimize's: same numbers as optimize on the model
    assert q.precision == "fp32"
    opt = gml.optimize(model, x)
    with torch.no_grad():
        torch.testing.assert_close(q.executable(x), opt.executable(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [_HandAttention, lambda: nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)])
def test_transformer_quantize_captures_once(traces: list[str], fp32_guard: list[float], make: Any) -> None:
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(2, 8, 32)
    q = gml.quantize(model, [(x,)] * 2, per_layer=False, cost_policy="measure")
    assert q.scheme == "transformer", q.scheme_reason
    assert fp32_guard
    assert len(traces) == 1, f"captured {len(traces)} times: {traces}"
    with torch.no_grad():
        torch.testing.assert_close(q.executable(x), model(x), rtol=1e-3, atol=1e-3)


def test_forced_static_scheme_on_a_graph_with_attention_still_captures_once(traces: list[str]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    q = gml.quantize(_HandAttention().eval(), [(x,)] * 2, scheme="static", per_layer=False, cost_policy="off")
    assert q.scheme == "static" and q.scheme_reason == "scheme='static' requested"
    assert len(traces) == 1
