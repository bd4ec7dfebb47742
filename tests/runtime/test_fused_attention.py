"""The fused bf16 attention step (native/attention.h, docs/adr/009-fused-bf16-attention.md) against
fp32 math on the same bf16 inputs, against the three-primitive path, and its selection rules.

Tolerance. The kernel accumulates Q·Kᵀ and P·V in fp32 (exact products of bf16 values), computes
the softmax in fp32 with an exp accurate to 3e-6 relative, and rounds twice: the unnormalized
probabilities e_j to bf16 (relative error <= u = 2^-8 each: 8 significant bits) and the output to
bf16 (<= u). With O = Σ e_j v_j / Σ e_j the first rounding moves O by at most u · Σ p_j |v_j| <=
u · max|v|, the second by u · |O| <= u · max|v|: |O - O_ref| <= 2^-7 · max|v| (+ the exp's 3e-6). Tests use
that bound (BOUND) with a 1.25 margin for the fp32 sums' rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gml.errors import InputError
from gml.runtime import compile_engine, unavailable_reason
from gml.runtime.options import ATTENTION_ENV
from gml.runtime.rules.attention import fused_attention_cpu
from gml.runtime.target import detect_target
from runtime.helpers import assert_thread_counts_agree, attention_graph, strided_heads_graph

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
needs_kernel = pytest.mark.skipif(
    unavailable_reason() is not None or not fused_attention_cpu(detect_target()),
    reason="this target has no AVX512-BF16 (the fused attention kernel's ISA; ONEDNN_MAX_CPU_ISA included)",
)

BOUND = 1.25 * 2.0**-7
FUSED = "gml:attention_avx512_bf16"


def qkv(b, h, lq, s, e, ev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen).to(torch.bfloat16) for n, d in ((lq, e), (s, e), (s, ev))]


def reference(q, k, v, mask=None, scale=None, causal=False) -> torch.Tensor:
    """fp32 SDPA on the bf16 inputs' exact values."""
    m = mask
    if causal:
        m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=scale)


def impls(eng) -> list[str]:
    (seg,) = eng.segments()
    ((plan, _),) = seg._plans.values()
    return list(plan.step_impls())


def run(gm, *inputs, path: str, monkeypatch) -> tuple[torch.Tensor, list[str]]:
    monkeypatch.setenv(ATTENTION_ENV, path)
    with torch.no_grad():
        eng = compile_engine(gm, inputs)
        out = eng(*inputs)
    assert eng.report.path == "engine", str(eng.report)
    return out, impls(eng)


def assert_within_bound(got: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    err = float((got.float() - ref).abs().max())
    assert err <= BOUND * float(v.float().abs().max()), err


@needs_kernel
@pytest.mark.parametrize(
    "b,h,lq,s,e,ev",
    [
        (1, 12, 128, 128, 32, 32),  # MiniLM's layer
        (2, 3, 7, 7, 8, 16),
        (1, 2, 1, 37, 64, 64),  # one query (decoding), keys not a multiple of 16
        (2, 2, 19, 11, 6, 16),  # head size 6: three pairs
        (1, 1, 5, 200, 32, 48),  # more than 64 keys plus a tail; value head 48
        (1, 2, 33, 65, 32, 80),  # 33 rows: a 1-row block at the end; value head > 64
        (1, 4, 50, 50, 36, 36),  # MobileViT-style head 36: the value head's last vector stored masked
        (2, 1, 3, 9, 8, 8),  # value head 8: one partial vector
    ],
)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_fused_matches_fp32_math(b, h, lq, s, e, ev, scale, monkeypatch):
    q, k, v = qkv(b, h, lq, s, e, ev)
    got, used = run(attention_graph(3, scale), q, k, v, path="fused", monkeypatch=monkeypatch)
    assert used == [FUSED]  # one step: no head copies, no scores in memory
    assert_within_bound(got, reference(q, k, v, scale=scale), v)


@needs_kernel
def test_fused_and_primitive_paths_agree(monkeypatch):
    q, k, v = qkv(2, 4, 24, 24, 32, 32, seed=1)
    gm = attention_graph(3)
    fused, used_f = run(gm, q, k, v, path="fused", monkeypatch=monkeypatch)
    prim, used_p = run(gm, q, k, v, path="primitives", monkeypatch=monkeypatch)
    assert FUSED in used_f and FUSED not in used_p
    assert float((fused.float() - prim.float()).abs().max()) <= 2 * BOUND * float(v.float().abs().max())


@needs_kernel
def test_masks_padding_float_causal_and_constant(monkeypatch):
    b, s = 2, 21
    q, k, v = qkv(b, 3, s, s, 16, 16, seed=2)
    pad = torch.arange(s)[None, None, None, :] < torch.tensor([s, 9])[:, None, None, None]
    got, used = run(attention_graph(4), q, k, v, pad, path="fused", monkeypatch=monkeypatch)
    assert used[-1] == FUSED
    assert_within_bound(got, reference(q, k, v, pad), v)
    # an expanded bool mask (stride-0 dims read as size 1) and an additive float one
    got, _ = run(attention_graph(4), q, k, v, pad.expand(b, 3, s, s), path="fused", monkeypatch=monkeypatch)
    assert_within_bound(got, reference(q, k, v, pad), v)
    additive = (torch.randn(b, 1, s, s) * 2).to(torch.bfloat16)
    got, _ = run(attention_graph(4, 0.2), q, k, v, additive, path="fused", monkeypatch=monkeypatch)
    assert_within_bound(got, reference(q, k, v, additive.float(), scale=0.2), v)
    # a transposed float mask (made dense fp32 first), and a mask broadcast over the keys (one value
    # per query row: not the scores tile's epilogue but the softmax pass adds it)
    strided = (torch.randn(b, 1, s, s) * 2).to(torch.bfloat16).transpose(-1, -2)
    got, _ = run(attention_graph(4), q, k, v, strided, path="fused", monkeypatch=monkeypatch)
    assert_within_bound(got, reference(q, k, v, strided.float()), v)
    per_row = (torch.randn(b, 1, s, 1) * 3).to(torch.bfloat16)
    got, _ = run(attention_graph(4), q, k, v, per_row, path="fused", monkeypatch=monkeypatch)
    assert_within_bound(got, reference(q, k, v, per_row.float()), v)
    # SDPA's is_causal, and a model's constant bool mask (a buffer: a plan constant)
    got, _ = run(attention_graph(3, causal=True), q, k, v, path="fused", monkeypatch=monkeypatch)
    assert_within_bound(got, reference(q, k, v, causal=True), v)
    const = torch.rand(s, s, generator=torch.Generator().manual_seed(3)) > 0.3
    const[:, 0] = True  # no fully masked row
    got, _ = run(attention_graph(3, mask_buffer=const), q, k, v, path="fused", monkeypatch=monkeypatch)
    assert_within_bound(got, reference(q, k, v, const), v)


@needs_kernel
def test_masked_keys_weigh_exactly_zero(monkeypatch):
    """A padded key changes nothing, whatever its values: its probability is exactly 0."""
    q, k, v = qkv(1, 2, 6, 10, 16, 16, seed=4)
    pad = torch.arange(10)[None, None, None, :] < 7
    gm = attention_graph(4)
    first, _ = run(gm, q, k, v, pad, path="fused", monkeypatch=monkeypatch)
    k2, v2 = k.clone(), v.clone()
    k2[..., 7:, :], v2[..., 7:, :] = 1e4, -1e4
    second, _ = run(gm, q, k2, v2, pad, path="fused", monkeypatch=monkeypatch)
    assert torch.equal(first, second)


@needs_kernel
def test_a_fully_masked_row_is_zeros(monkeypatch):
    """SDPA's answer for a bool mask (tests/runtime/test_masked_rows.py has every path and mask kind)."""
    q, k, v = qkv(1, 1, 3, 5, 16, 16, seed=5)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False
    got, _ = run(attention_graph(4), q, k, v, mask, path="fused", monkeypatch=monkeypatch)
    assert float(got[0, 0, 1].float().abs().max()) == 0.0
    assert_within_bound(got, reference(q, k, v, mask), v)


@needs_kernel
def test_strided_heads_are_read_in_place(monkeypatch):
    """q / k / v as the QKV merge leaves them (transposed views of one [B, L, 3·H·E] tensor): the
    fused step reads them with their strides — no dense copies (the primitive path makes three)."""
    gm = strided_heads_graph(2, 9, 2, 16)
    x = torch.randn(2, 9, 96).to(torch.bfloat16)
    got, used = run(gm, x, path="fused", monkeypatch=monkeypatch)
    assert used == [FUSED]
    q, k, v = (t.view(2, 9, 2, 16).transpose(1, 2) for t in x.split(32, dim=-1))
    assert_within_bound(got, reference(q, k, v), v)


@needs_kernel
def test_two_threads_and_two_callers_give_the_one_thread_result(monkeypatch):
    q, k, v = qkv(2, 6, 40, 40, 32, 32, seed=6)
    monkeypatch.setenv(ATTENTION_ENV, "fused")
    assert_thread_counts_agree(compile_engine(attention_graph(3), (q, k, v)), q, k, v)


@needs_kernel
@pytest.mark.parametrize("b,h,lq,s,e,ev", [(1, 12, 128, 128, 32, 32), (2, 3, 7, 21, 8, 36), (2, 3, 7, 21, 5, 7)])
def test_fp32_forced_matches_sdpa_to_fp32_accuracy(b, h, lq, s, e, ev, monkeypatch):
    """fp32 through the same kernel (FMA for vdpbf16ps, exp to 1.9e-7): SDPA's result to ~1e-6."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for n, d in ((lq, e), (s, e), (s, ev)))
    pad = torch.arange(s)[None, None, None, :] < torch.tensor([s, s - 5][:b])[:, None, None, None]
    got, used = run(attention_graph(4), q, k, v, pad, path="fused", monkeypatch=monkeypatch)
    assert used[-1] == "gml:attention_avx512_f32"
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * float(v.abs().max()))
    _, auto = run(attention_graph(3), q, k, v, path="auto", monkeypatch=monkeypatch)
    assert auto == ["gml:attention_avx512_f32"]  # auto: fp32 fused too (ADR 009, session 22)


@needs_kernel
def test_an_odd_head_size_keeps_the_primitive_path(monkeypatch):
    q, k, v = qkv(1, 2, 4, 4, 5, 16)
    _, used = run(attention_graph(3), q, k, v, path="fused", monkeypatch=monkeypatch)
    assert FUSED not in used


@pytest.mark.skipif(not detect_target().avx512, reason="oneDNN 3.2 has no bf16 matmul below AVX-512 (the cap)")
def test_primitives_forced_and_a_bad_setting(monkeypatch):
    q, k, v = qkv(1, 2, 4, 4, 16, 16)
    _, used = run(attention_graph(3), q, k, v, path="primitives", monkeypatch=monkeypatch)
    assert FUSED not in used
    monkeypatch.setenv(ATTENTION_ENV, "fastest")
    with pytest.raises(InputError, match="GML_ATTENTION='fastest'"):
        compile_engine(attention_graph(3), (q, k, v))
