"""Graph shapes where the native engine once ran slower than the Python executor (issue #16).

Each test builds a small model with the shape that caused it and asserts what the plan now does
(structure, never timing), plus the numbers against the Python executor.

* timm mixnet_s, fp32 (79 ms on the engine vs 20 ms on the executor): a ``torch.split`` whose
  source is a torch op (an fp32 ``torch.cat``, a ``Mul``) stays in torch, but its ``getitem`` pieces
  went into the next engine segment, whose input was then the split's *tuple*. The plan cache was
  keyed by the tuple's tensors, new on every call: every call compiled the segment again, failed
  ("segment input is a tuple") and ran its Python executor — ~9 ms per mixed 1x1 conv.
* The same model's squeeze-excite convs ran oneDNN's reference kernel (``ref:any``): their
  ``(1, C, 1, 1)`` source came NCHW-strided, their output NHWC-strided; oneDNN reads a size-1
  dim's stride as given and finds no jitted conv for the mix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gml
from gml.runtime import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


class MixBlock(nn.Module):
    """mixnet's inverted residual: mixed 1x1 expansion, mixed-kernel depthwise, squeeze-excite,
    mixed 1x1 projection; each mixed conv splits the channels, convolves each piece, concatenates."""

    def __init__(self) -> None:
        super().__init__()
        self.pw = nn.ModuleList([nn.Conv2d(4, 8, 1), nn.Conv2d(4, 8, 1)])
        self.dw = nn.ModuleList([nn.Conv2d(8, 8, k, padding=k // 2, groups=8) for k in (3, 5)])
        self.se_reduce, self.se_expand = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.pwl = nn.ModuleList([nn.Conv2d(8, 6, 1), nn.Conv2d(8, 6, 1)])

    @staticmethod
    def mixed(convs: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(x, [x.shape[1] // len(convs)] * len(convs), dim=1)
        return torch.cat([c(p) for c, p in zip(convs, pieces)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.mixed(self.pw, x))
        y = F.silu(self.mixed(self.dw, y))
        s = self.se_expand(F.silu(self.se_reduce(y.mean((2, 3), keepdim=True))))
        y = torch.erf(y * torch.sigmoid(s))  # erf: a torch op (no engine step), the next split's source
        return self.mixed(self.pwl, y)


def _plans(engine):
    return [plan for seg in engine.segments() for plan, _ in seg._plans.values()]


def test_mixnet_block_fp32_plans_once_and_runs_no_reference_kernel():
    torch.manual_seed(0)
    model, x = MixBlock().eval(), torch.randn(1, 8, 14, 14)
    res = gml.optimize(model, (x,))
    engine = res.engine
    assert engine is not None, str(res.runtime)
    # the pieces of a split that stays in torch stay in torch too (a segment never takes a tuple)
    pieces = [n for n in engine.report.torch_nodes if n.op == "split_item"]
    assert pieces and all("its split stays in torch" in n.reason for n in pieces), str(engine.report)
    assert not engine.report.shape_fallbacks, engine.report.shape_fallbacks
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(res.executable(x), res.module(x), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(res.executable(x), model(x), rtol=1e-4, atol=1e-5)
    plans = _plans(engine)
    # one plan per segment, compiled once (no recompilation per call), every one a native plan
    assert all(seg.num_plans == 1 for seg in engine.segments())
    assert plans and all(p is not None for p in plans)
    impls = [i for p in plans for i in p.step_impls()]
    assert not [i for i in impls if i.startswith("ref")], impls  # the SE convs: no reference kernel
    # a conv on a split piece: one copy of the strided piece (jitted convs take dense sources only),
    # then the conv writing the segment's NHWC output directly (no reorder of an NHWC temp into it)
    for p in plans:
        names = p.step_names()
        assert all(names.count(n) <= 2 for n in names), names


def test_a_segment_given_a_tuple_input_plans_once():
    """Defence in depth: a sequence input is keyed by its items' layouts, so a segment that cannot
    plan it falls back once (reported), not on every call."""
    from gml.runtime.compile import _input_key

    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert _input_key((a, b)) == _input_key((a.clone(), b.clone()))
    assert _input_key((a, b)) != _input_key((a, b.t()))


class TinyPVT(nn.Module):
    """timm pvt_v2's shape: a conv patch embedding, attention whose keys come from a strided conv
    (spatial reduction), an MLP with a depthwise conv between its linears."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 16, 4, 4)
        self.norm = nn.LayerNorm(16)
        self.q, self.kv, self.proj = nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(16, 16)
        self.sr = nn.Conv2d(16, 16, 2, 2)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        b, c, h, w = x.shape
        t = self.norm(x.flatten(2).transpose(1, 2))
        q = self.q(t).reshape(b, -1, 2, 8).transpose(1, 2)
        r = self.sr(t.transpose(1, 2).reshape(b, c, h, w)).flatten(2).transpose(1, 2)
        k, v = self.kv(r).reshape(b, -1, 2, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
        t = t + self.proj(a)
        m = self.fc1(t).transpose(1, 2).reshape(b, 32, h, w)
        m = F.gelu(self.dw(m)).flatten(2).transpose(1, 2)
        return t + self.fc2(m)


def test_transformer_scheme_runs_the_convs_between_its_gemms_on_fused_fp32_kernels():
    """timm pvt_v2_b0: INT8 1.10x slower than gml.optimize's fp32 model. The transformer scheme
    quantized the linears and left the convs as plain nn.Conv2d in torch (gml.optimize fuses them and
    the engine runs them); now they get the same conv fusions, and only the GEMMs differ. And the
    MLP's segment (depthwise conv, flatten into tokens, fc2) could not be planned ("flatten to a
    non-contiguous" view of the conv's free NHWC output) and ran the Python executor, INT8 GEMM
    included, in both models."""
    torch.manual_seed(0)
    model, x = TinyPVT().eval(), torch.randn(1, 3, 32, 32)
    q = gml.quantize(model, 2, example_inputs=(x,), per_layer=False)
    opt = gml.optimize(model, (x,))
    assert q.scheme == "transformer", q.scheme_reason
    assert not [n for n, m in q.module.named_modules() if type(m) is nn.Conv2d]
    convs_in_torch = {n.name for n in q.runtime.torch_nodes if "conv" in n.op.lower()}
    assert convs_in_torch == {n.name for n in opt.runtime.torch_nodes if "conv" in n.op.lower()} == set(), str(
        q.runtime
    )
    # the depthwise conv's NHWC output flattened into tokens is a view in the plan: no segment falls
    # back to its Python executor (the INT8 one would run gml.dynamic_linear's Python kernel there)
    assert not q.runtime.shape_fallbacks and not opt.runtime.shape_fallbacks, str(q.runtime)
    with torch.no_grad():
        torch.testing.assert_close(opt.executable(x), model(x), rtol=1e-4, atol=1e-5)
        got, want = q.executable(x), model(x)
        torch.testing.assert_close(q.executable(x), q.module(x), rtol=0.05, atol=0.05 * float(want.abs().max()))
    assert float(F.cosine_similarity(got.flatten(), want.flatten(), 0)) > 0.99


class PaddedMixedConv(nn.Module):
    """tf_mixnet_s's mixed conv with TF "same" padding: each piece of the split is padded (an
    asymmetric ``F.pad``, a torch node) before its stride-2 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.pw = nn.Conv2d(4, 16, 1)
        self.dw = nn.ModuleList([nn.Conv2d(8, 8, k, stride=2, groups=8) for k in (3, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(F.relu(self.pw(x)), [8, 8], dim=1)
        a = self.dw[0](F.pad(pieces[0], (0, 2, 0, 2)))
        b = self.dw[1](F.pad(pieces[1], (0, 4, 0, 4)))
        return torch.cat([a, b], 1)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_a_torch_node_between_split_pieces_does_not_split_the_pieces_from_their_split(int8):
    """The pad of the first piece ended the split's engine run: the second piece's segment took the
    split's tuple and both segments ran their Python executor. Pieces now follow their split."""
    torch.manual_seed(0)
    model, x = PaddedMixedConv().eval(), torch.randn(1, 4, 12, 12)
    res = gml.quantize(model, 2, example_inputs=(x,), per_layer=False) if int8 else gml.optimize(model, (x,))
    assert res.engine is not None, str(res.runtime)
    assert not res.runtime.shape_fallbacks, str(res.runtime)
    assert all(p is not None for p in _plans(res.engine))
    with torch.no_grad():
        want = res.module(x)
        torch.testing.assert_close(res.executable(x), want, rtol=1e-4, atol=0.05 * float(want.abs().max()))


class TransposedTokens(nn.Module):
    """XCiT's cross-covariance attention hands its projection a transposed token matrix: features
    strided by the token count."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_by_tokens = self.a(x).transpose(1, 2).contiguous()  # [B, C, N]
        return self.proj(channels_by_tokens.transpose(1, 2))  # [B, N, C], strides (C*N, 1, N)


def test_linear_on_a_transposed_token_matrix_runs_no_reference_kernel():
    """timm xcit_nano fp32 took 28x the Python executor's time on the engine: its attention
    projection's inner product read a source with strided features (oneDNN: ``ref:any``). The plan
    now copies such a source dense first."""
    torch.manual_seed(0)
    model, x = TransposedTokens().eval(), torch.randn(1, 16, 8)  # batch 1: the rows view is (N, C), strides (1, N)
    res = gml.optimize(model, (x,))
    assert res.engine is not None, str(res.runtime)
    impls = [i for p in _plans(res.engine) for i in p.step_impls()]
    assert impls and not [i for i in impls if i.startswith("ref")], impls
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-4, atol=1e-5)
