"""The fused fp32 attention for AVX2 + FMA (native/attention_avx2.h; ADR 009, session-22 amendment)
against fp32 SDPA, and when the rules pick it.

The plans are built for ``Target("avx2")`` (the CPU description an AVX2-only machine, or
``ONEDNN_MAX_CPU_ISA=AVX2``, gives), so the kernel runs on any CPU with AVX2 + FMA. Tolerance: scores
and P·V are fp32 sums (their order differs from SDPA's), exp is accurate to ~1e-7 relative — the
result is SDPA's to a few fp32 ulps of max|v|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gml.ir.target import Target
from gml.runtime import compile_engine, native, unavailable_reason
from gml.runtime.options import ATTENTION_ENV
from gml.runtime.rules.attention import fused_attention_kernels
from runtime.helpers import assert_thread_counts_agree, attention_graph, strided_heads_graph

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None or "avx2" not in native.load().fused_attention_kernels(),
    reason=str(unavailable_reason() or "this CPU has no AVX2 + FMA"),
)

AVX2 = Target("avx2")
FUSED = "gml:attention_avx2_f32"


def qkv(b, h, lq, s, e, ev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen) for n, d in ((lq, e), (s, e), (s, ev))]


def run(gm, *inputs, monkeypatch, path: str = "auto", target: Target = AVX2) -> tuple[torch.Tensor, list[str]]:
    monkeypatch.setenv(ATTENTION_ENV, path)
    with torch.no_grad():
        eng = compile_engine(gm, inputs, target=target)
        out = eng(*inputs)
    assert eng.report.path == "engine", str(eng.report)
    (seg,) = eng.segments()
    ((plan, _),) = seg._plans.values()
    return out, list(plan.step_impls())


def assert_close(got: torch.Tensor, want: torch.Tensor, v: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * float(v.abs().max()))


def test_the_kernel_table():
    assert fused_attention_kernels(AVX2) == {"f32": "avx2"}
    assert fused_attention_kernels(Target("avx512_core_vnni")) == {"f32": "avx2"}  # AVX-512, no bf16
    assert fused_attention_kernels(Target("sse41")) == {}


@pytest.mark.parametrize(
    "b,h,lq,s,e,ev",
    [
        (1, 12, 11, 11, 32, 32),  # MiniLM on a short sentence
        (1, 12, 128, 128, 32, 32),  # MiniLM at 128 tokens
        (2, 3, 7, 21, 8, 36),  # value head 36: 16 + 16 + a masked 4
        (1, 2, 1, 37, 64, 64),  # one query (decoding), keys not a multiple of 8
        (2, 2, 19, 11, 6, 16),  # head size 6
        (1, 1, 5, 200, 32, 48),  # 200 keys; value head 48
        (1, 2, 33, 65, 32, 80),  # 33 rows: a 1-row block at the end
        (1, 1, 3, 3, 5, 3),  # odd head size (the AVX-512 kernel's bf16 pairs need an even one), value head 3
        (2, 1, 3, 9, 8, 8),  # value head 8: one whole vector
    ],
)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_sdpa(b, h, lq, s, e, ev, scale, monkeypatch):
    q, k, v = qkv(b, h, lq, s, e, ev)
    got, used = run(attention_graph(3, scale), q, k, v, monkeypatch=monkeypatch)
    assert used == [FUSED]  # auto on AVX2: one step, no head copies, no scores in memory
    assert_close(got, F.scaled_dot_product_attention(q, k, v, scale=scale), v)


def test_masks_padding_float_per_row_causal_and_constant(monkeypatch):
    b, s = 2, 21
    q, k, v = qkv(b, 3, s, s, 16, 16, seed=2)

    def check(gm, *mask, want):
        got, used = run(gm, q, k, v, *mask, monkeypatch=monkeypatch)
        assert used[-1] == FUSED
        assert_close(got, want, v)

    pad = torch.arange(s)[None, None, None, :] < torch.tensor([s, 9])[:, None, None, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
    check(attention_graph(4), pad, want=want)
    check(attention_graph(4), pad.expand(b, 3, s, s), want=want)  # stride-0 dims read as size 1
    additive = torch.randn(b, 1, s, s) * 2
    check(
        attention_graph(4, 0.2), additive, want=F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.2)
    )
    strided = (torch.randn(b, 1, s, s) * 2).transpose(-1, -2)  # a column stride of s
    check(attention_graph(4), strided, want=F.scaled_dot_product_attention(q, k, v, attn_mask=strided))
    per_row = torch.randn(b, 1, s, 1) * 3  # one value per query row: column stride 0
    check(attention_graph(4), per_row, want=F.scaled_dot_product_attention(q, k, v, attn_mask=per_row))
    check(attention_graph(3, causal=True), want=F.scaled_dot_product_attention(q, k, v, is_causal=True))
    const = torch.rand(s, s, generator=torch.Generator().manual_seed(3)) > 0.3
    const[:, 0] = True  # no fully masked row
    check(attention_graph(3, mask_buffer=const), want=F.scaled_dot_product_attention(q, k, v, attn_mask=const))


def test_masked_keys_weigh_exactly_zero(monkeypatch):
    """A padded key changes nothing, whatever its values: its weight is exactly 0."""
    q, k, v = qkv(1, 2, 6, 10, 16, 16, seed=4)
    pad = torch.arange(10)[None, None, None, :] < 7
    first, _ = run(attention_graph(4), q, k, v, pad, monkeypatch=monkeypatch)
    k2, v2 = k.clone(), v.clone()
    k2[..., 7:, :], v2[..., 7:, :] = 1e4, -1e4
    second, _ = run(attention_graph(4), q, k2, v2, pad, monkeypatch=monkeypatch)
    assert torch.equal(first, second)


def test_a_fully_masked_row_is_zeros(monkeypatch):
    """SDPA's answer for a bool mask (tests/runtime/test_masked_rows.py has every path and mask kind)."""
    q, k, v = qkv(1, 1, 3, 5, 16, 16, seed=5)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False
    got, _ = run(attention_graph(4), q, k, v, mask, monkeypatch=monkeypatch)
    assert float(got[0, 0, 1].abs().max()) == 0.0
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-6)


def test_a_nan_reaches_its_row_only(monkeypatch):
    """A NaN score makes its row NaN, as softmax's math does (``vmaxps`` alone would drop it, and the
    row would pass as fully masked). Segments send NaN inputs to the Python executor, so the check is
    skipped here to reach the kernel the way a NaN computed inside a segment does."""
    q, k, v = qkv(1, 1, 6, 12, 8, 8, seed=8)
    q[0, 0, 2, 3] = float("nan")
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    with torch.no_grad():
        eng = compile_engine(attention_graph(3), (q, k, v), target=AVX2)
        (seg,) = eng.segments()
        monkeypatch.setattr(seg, "_finite", lambda inputs, key: True)
        (got,) = seg(q, k, v)
    assert [i for p, _ in seg._plans.values() for i in p.step_impls()] == [FUSED]
    assert got[0, 0, 2].isnan().all()
    want = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v  # SDPA's CPU kernel gives 0 there
    rows = [0, 1, 3, 4, 5]
    assert_close(got[0, 0, rows], want[0, 0, rows], v)


def test_strided_heads_are_read_in_place(monkeypatch):
    """q / k / v as the QKV merge leaves them (transposed views of one [B, L, 3·H·E] tensor)."""
    x = torch.randn(2, 9, 96)
    got, used = run(strided_heads_graph(2, 9, 2, 16), x, monkeypatch=monkeypatch)
    assert used == [FUSED]
    q, k, v = (t.view(2, 9, 2, 16).transpose(1, 2) for t in x.split(32, dim=-1))
    assert_close(got, F.scaled_dot_product_attention(q, k, v), v)


def test_two_threads_and_two_callers_give_the_one_thread_result(monkeypatch):
    q, k, v = qkv(2, 6, 70, 70, 32, 32, seed=6)  # L·S >= 4096: the heads split over the team
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    assert_thread_counts_agree(compile_engine(attention_graph(3), (q, k, v), target=AVX2), q, k, v)


def test_when_the_rules_take_it(monkeypatch):
    q, k, v = qkv(1, 2, 8, 8, 16, 16)
    # AVX-512 without native bf16: oneDNN's brgemm matmul with post-ops on auto, the kernel if forced
    vnni = Target("avx512_core_vnni")
    _, auto = run(attention_graph(3), q, k, v, monkeypatch=monkeypatch, target=vnni)
    assert FUSED not in auto and len(auto) > 1
    _, forced = run(attention_graph(3), q, k, v, monkeypatch=monkeypatch, path="fused", target=vnni)
    assert forced == [FUSED]
    _, prim = run(attention_graph(3), q, k, v, path="primitives", monkeypatch=monkeypatch)
    assert FUSED not in prim and len(prim) > 1
    # bf16 has no AVX2 kernel: the primitive path (oneDNN emulates bf16 there)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    monkeypatch.setenv(ATTENTION_ENV, "fused")
    with torch.no_grad():
        eng = compile_engine(attention_graph(3), (qb, kb, vb), target=AVX2)
        eng(qb, kb, vb)
    assert not any(
        i.startswith("gml:attention") for s in eng.segments() for p, _ in s._plans.values() if p for i in p.step_impls()
    )
