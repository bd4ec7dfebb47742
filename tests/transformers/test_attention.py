"""FuseAttention: SDPA calls and the hand-written pattern become one ``torch.ops.gml.attention``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.api import optimize
from gml.capture import capture
from gml.ir.attention import attention_op, is_attention
from gml.passes.attention import PATTERN, SDPA, FuseAttention
from gml.passes.normalize import Normalize


def _run(model: nn.Module, *inputs: torch.Tensor):
    gm = Normalize()(capture(model, inputs)).graph_module
    from gml.capture import propagate_shapes

    propagate_shapes(gm, inputs)
    return FuseAttention()(gm)


def _n_attention(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_attention(n))


class Heads(nn.Module):
    """q, k, v as [batch, heads, seq, dim] from one projection."""

    def __init__(self, e: int = 32, h: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(e, 3 * e)
        self.h = h

    def split(self, x: torch.Tensor):
        b, s, e = x.shape
        return self.qkv(x).view(b, s, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)


class HandWritten(Heads):
    def __init__(self, divide: bool = True, dropout: float = 0.1) -> None:
        super().__init__()
        self.divide = divide
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        scores = q @ k.transpose(-2, -1)
        scores = scores / math.sqrt(8) if self.divide else scores * 0.125
        p = self.drop(F.softmax(scores + mask, dim=-1))
        return (p @ v).transpose(1, 2).flatten(2)


class NoMask(Heads):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, -1), v)


class Sdpa(Heads):
    def __init__(self, causal: bool = False, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.causal = causal
        self.dropout_p = dropout_p

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        return F.scaled_dot_product_attention(q, k, v, mask, self.dropout_p, self.causal, scale=0.2)


def _padding_mask(batch: int = 2, seq: int = 10, keep: int = 6) -> torch.Tensor:
    """An additive mask: row 1 attends to its first ``keep`` tokens only."""
    mask = torch.zeros(batch, 1, 1, seq)
    mask[1, ..., keep:] = torch.finfo(torch.float32).min
    return mask


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_hand_written_pattern_becomes_one_op(divide: bool, padded: bool) -> None:
    torch.manual_seed(0)
    model = HandWritten(divide).eval()
    x = torch.randn(2, 10, 32)
    mask = _padding_mask() if padded else torch.zeros(2, 1, 1, 10)
    res = _run(model, x, mask)
    assert res.matches == 1 and res.skips == []
    gm = res.graph_module
    assert _n_attention(gm) == 1
    code = gm.code
    assert "softmax" not in code and "matmul" not in code
    node = next(n for n in gm.graph.nodes if is_attention(n))
    assert node.args[4] == pytest.approx(1 / math.sqrt(8) if divide else 0.125)
    with torch.no_grad():
        torch.testing.assert_close(gm(x, mask), model(x, mask), atol=1e-5, rtol=1e-4)
        # padded positions really are ignored: changing them leaves row 1 unchanged
        x2 = x.clone()
        x2[1, 6:] = torch.randn(4, 32)
        if padded:
            torch.testing.assert_close(gm(x2, mask)[1, :6], gm(x, mask)[1, :6], atol=1e-5, rtol=1e-4)


def test_no_mask_and_method_spellings() -> None:
    torch.manual_seed(0)
    model = NoMask().eval()
    x = torch.randn(3, 7, 32)
    res = _run(model, x)
    assert res.matches == 1
    node = next(n for n in res.graph_module.graph.nodes if is_attention(n))
    assert node.args[3] is None and node.args[4] == pytest.approx(0.3)
    with torch.no_grad():
        torch.testing.assert_close(res.graph_module(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_call_keeps_mask_scale_causal(causal: bool) -> None:
    torch.manual_seed(0)
    model = Sdpa(causal).eval()
    x = torch.randn(2, 10, 32)
    mask = None if causal else _padding_mask()
    inputs = (x,) if mask is None else (x, mask)
    res = _run(model, *inputs)
    assert res.matches == 1
    node = next(n for n in res.graph_module.graph.nodes if is_attention(n))
    assert node.args[4] == 0.2 and node.args[5] is causal
    with torch.no_grad():
        torch.testing.assert_close(res.graph_module(*inputs), model(*inputs), atol=1e-5, rtol=1e-4)


def test_optimize_runs_it_in_the_pipeline() -> None:
    torch.manual_seed(0)
    model = HandWritten().eval()
    x, mask = torch.randn(2, 10, 32), _padding_mask()
    res = optimize(model, (x, mask))
    rec = res.report.record("fuse_attention")
    assert rec.matches == 1 and rec.status == "applied"
    assert _n_attention(res.module) == 1
    assert res.max_abs_err < 1e-5


# --- declined candidates, each with its reason ---


class ReturnsProbabilities(Heads):
    def forward(self, x: torch.Tensor):
        q, k, v = self.split(x)
        p = (q @ k.transpose(-2, -1) * 0.125).softmax(-1)
        return p @ v, p


class SoftmaxOverQueries(Heads):
    def forward(self, x: torch.Tensor):
        q, k, v = self.split(x)
        return F.softmax(q @ k.transpose(-2, -1), dim=2) @ v


class MaskBeforeScale(Heads):
    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        q, k, v = self.split(x)
        return F.softmax((q @ k.transpose(-2, -1) + mask) * 0.125, dim=-1) @ v


class CausalMaskedFill(Heads):
    def forward(self, x: torch.Tensor):
        q, k, v = self.split(x)
        s = x.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        return F.softmax((q @ k.transpose(-2, -1)).masked_fill(causal, float("-inf")), dim=-1) @ v


class NotTransposed(Heads):
    """Scores against a learned matrix, not against keys: softmax(q W) v is not attention."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 10))

    def forward(self, x: torch.Tensor):
        q, _k, v = self.split(x)
        return F.softmax(q @ self.w, dim=-1) @ v


class ScaleFromShape(Heads):
    def forward(self, x: torch.Tensor):
        q, k, v = self.split(x)
        return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


@pytest.mark.parametrize(
    ("model", "extra", "reason"),
    [
        (ScaleFromShape(), (), "the scale is a tensor or computed at run time"),
        (ReturnsProbabilities(), (), "the attention probabilities are read elsewhere (2 readers"),
        (SoftmaxOverQueries(), (), "softmax over dim 2, not the last"),
        (MaskBeforeScale(), (torch.zeros(2, 1, 1, 10),), "the mask is added before the scale"),
        (CausalMaskedFill(), (), "comes from masked_fill"),
        (NotTransposed(), (), "is not k with its last two dims swapped"),
    ],
    ids=[
        "scale-from-shape",
        "returns-probabilities",
        "softmax-dim",
        "mask-before-scale",
        "masked-fill",
        "not-transposed",
    ],
)
def test_declined_with_reason(model: nn.Module, extra: tuple, reason: str) -> None:
    x = torch.randn(2, 10, 32)
    res = _run(model.eval(), x, *extra)
    assert res.matches == 0 and not res.modified
    assert _n_attention(res.graph_module) == 0
    assert len(res.skips) == 1 and res.skips[0].pattern == PATTERN
    assert reason in res.skips[0].reason, res.skips[0].reason


def test_sdpa_with_dropout_is_declined() -> None:
    model = Sdpa(dropout_p=0.1).eval()
    gm = fx.symbolic_trace(model)
    res = FuseAttention()(gm)
    assert res.matches == 0
    assert res.skips[0].pattern == SDPA and "dropout_p=0.1" in res.skips[0].reason


def test_the_op_is_sdpa_and_has_a_fake_kernel() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
    mask = torch.randn(2, 1, 5, 7)
    op = attention_op()
    torch.testing.assert_close(op(q, k, v, mask, 0.5, False), F.scaled_dot_product_attention(q, k, v, mask, scale=0.5))
    torch.testing.assert_close(op(q, k, v), F.scaled_dot_product_attention(q, k, v))

    class UsesOp(nn.Module):
        def forward(self, q, k, v):
            return op(q, k, v, None, None, True)

    ep = torch.export.export(UsesOp(), (q, k, v))
    assert any(n.target is op for n in ep.graph.nodes)
    assert ep.module()(q, k, v).shape == (2, 4, 5, 3)
