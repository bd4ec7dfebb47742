"""gml.llm.decode: the batch-1 decode step (preallocated buffers, native glue) equals Decoder.forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gml
from assets.llm_models import FAMILIES, tiny
from gml.errors import UnsupportedError
from gml.llm.decode import DecodeStep, native_glue
from gml.llm.model import KVCache
from gml.llm.sampling import Sampling, next_token

PROMPT = [5, 17, 3, 99, 42, 8, 64, 23, 11, 7]

pytestmark = pytest.mark.skipif(native_glue() is None, reason="the native engine is not built")


def _both(lm, tokens: list[int], kv_dtype=torch.float32):
    """Logits of each token fed one decode step at a time after PROMPT, by forward and by DecodeStep."""
    dec = lm.decoder
    caches = [KVCache(dec.spec, 1, lm.max_length, kv_dtype) for _ in range(2)]
    for c in caches:
        dec.forward(torch.tensor([PROMPT]), c, last_only=True)
    step = DecodeStep(dec, caches[1], native_glue())
    ref, got = [], []
    for t in tokens:
        ids = torch.tensor([[t]])
        ref.append(dec.forward(ids, caches[0], last_only=True)[0, -1])
        got.append(step(ids)[0, -1].clone())
    assert caches[0].length == caches[1].length == len(PROMPT) + len(tokens)
    return torch.stack(ref), torch.stack(got), caches


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_decode_step_equals_forward(family, weights):
    # every family's variant: GQA / MQA, q/k norm, sandwich norms, (1 + w), soft-capping, partial rotary,
    # layer norm + learned positions; 20 steps past Mistral's (16) and Gemma 3's (8) sliding windows
    lm = gml.llm(tiny(family), weights=weights, max_length=64)
    tokens = [(13 * i + 5) % 128 for i in range(20)]
    ref, got, caches = _both(lm, tokens)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    n = caches[0].length
    assert torch.allclose(caches[0].data[..., :n, :], caches[1].data[..., :n, :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_decode_step_int4_and_int8_activations(activations):
    lm = gml.llm(tiny("llama"), weights="int4", activations=activations, max_length=64)
    ref, got, _ = _both(lm, list(range(30, 42)))
    # int8 activations: an fp32-rounding difference upstream may flip one rounding of x to int8
    tol = 1e-5 if activations == "fp32" else 1e-3
    assert (got - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_decode_step_16bit_cache_and_bf16_weights(kv_dtype):
    lm = gml.llm(tiny("qwen3"), weights="bf16", max_length=64)
    ref, got, caches = _both(lm, list(range(12)), kv_dtype=kv_dtype)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    n = caches[0].length  # the step's native K / V writes round as forward's torch writes
    assert torch.equal(caches[0].data[..., :n, :], caches[1].data[..., :n, :])


def test_generate_uses_the_step_and_rebinds_on_a_new_cache_or_thread_count():
    lm = gml.llm(tiny("gemma3"), weights="int8", max_length=96)
    first = lm.generate(PROMPT, 16)
    step = lm._step
    assert isinstance(step, DecodeStep) and step.fits(lm._cache)
    assert lm.generate(PROMPT, 16) == first and lm._step is step  # same cache: the step is reused
    lm.logits(torch.tensor([PROMPT, PROMPT]))  # a batch-2 cache replaces the batch-1 one
    assert lm.generate(PROMPT, 16) == first and lm._step is not step
    threads = torch.get_num_threads()  # (an earlier test may have left it at 1: take another count)
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        assert not lm._step.fits(lm._cache)
        assert lm.generate(PROMPT, 16) == first
    finally:
        torch.set_num_threads(threads)


def test_native_glue_matches_torch():
    eng = native_glue()
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 300), torch.randn(300), torch.randn(300)
    y = torch.empty(1, 300)
    eng.decode_norm(x.data_ptr(), 300, w.data_ptr(), 0, 0, 1e-6, y.data_ptr())
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
    eng.decode_norm(x.data_ptr(), 300, w.data_ptr(), b.data_ptr(), 1, 1e-5, y.data_ptr())
    assert torch.allclose(y, torch.nn.functional.layer_norm(x, (300,), w, b, 1e-5), rtol=1e-5, atol=1e-5)
    # residual add with the delta's own norm, then the next norm
    h, delta, dw = torch.randn(1, 300), torch.randn(1, 300), torch.randn(300)
    h_ref = h + delta * torch.rsqrt(delta.pow(2).mean(-1, keepdim=True) + 1e-6) * dw
    args = (h.data_ptr(), delta.data_ptr(), 300, True, dw.data_ptr(), 0, w.data_ptr(), 0, 0, 1e-6, y.data_ptr())
    eng.decode_residual_norm(*args)
    assert torch.allclose(h, h_ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y, h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * w, rtol=1e-5, atol=1e-6)
    # RoPE on 12 of 16 dims (partial rotary), 3 q heads + 1 k head, no q/k norm; v untouched
    heads, kv, d, r = 3, 1, 16, 12
    qkv = torch.randn(1, (heads + 2 * kv) * d)
    ang = torch.rand(r // 2)
    cos, sin = torch.cat([ang.cos()] * 2), torch.cat([ang.sin()] * 2)
    x4 = qkv[0, : (heads + kv) * d].view(heads + kv, d)
    xr, x1, x2 = x4[:, :r], x4[:, : r // 2], x4[:, r // 2 : r]
    expect = torch.cat([xr * cos + torch.cat((-x2, x1), -1) * sin, x4[:, r:]], -1).reshape(-1)
    v = qkv[0, (heads + kv) * d :].clone()
    eng.decode_qk_norm_rope(qkv.data_ptr(), heads, kv, d, 0, 0, 0, 1e-6, r, cos.data_ptr(), sin.data_ptr())
    assert torch.equal(qkv[0, : (heads + kv) * d], expect)  # same products, same rounding
    assert torch.equal(qkv[0, (heads + kv) * d :], v)
    with pytest.raises(ValueError, match="rotary"):
        eng.decode_qk_norm_rope(qkv.data_ptr(), heads, kv, d, 0, 0, 0, 1e-6, 7, cos.data_ptr(), sin.data_ptr())


KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native_attention(eng, qkv, cache, heads, kv, d, lo, pos, tier, threads, scale=0.3):
    out = torch.empty(1, heads * d)
    eng.decode_attention(
        qkv.data_ptr(), heads, kv, d, cache[0].data_ptr(), cache[1].data_ptr(), cache.shape[2], lo, pos, scale,
        KV_TYPES[cache.dtype], tier, threads, out.data_ptr(),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# the kernels' tiers (native/decode_attention.h): 2 AVX-512 (head sizes a multiple of 16; a CPU without it
# runs 1), 1 AVX2 + FMA + F16C, 0 scalar
@pytest.mark.parametrize("tier", [2, 1, 0])
@pytest.mark.parametrize(
    "heads, kv, d, pos, lo",
    [
        (6, 2, 36, 29, 0),  # GQA (3 query heads per KV head), a head size with an 8-lane tail, one item
        (6, 2, 36, 29, 21),  # a sliding window
        (4, 1, 256, 300, 0),  # Gemma-3-270M's MQA: 3 items of positions (128, 128, 45), merged
        (10, 1, 16, 259, 70),  # 10 query heads of one KV head (sub-groups of 8 + 2), a window over 2 items
        (8, 4, 64, 140, 0),  # TinyLlama's group of 8, 2 items per KV head
        (8, 1, 20, 40, 0),  # a group of 8 (the 8-sum hadd tree) with a 4-lane tail
        (8, 2, 20, 40, 0),  # a group of 4 (the 4-sum hadd tree) with a 4-lane tail
        (7, 1, 32, 150, 0),  # a group of 7: its scores rows are 7 of 8 lanes (masked loads / stores)
        (4, 4, 48, 130, 3),  # multi-head (a group of 1), 16-lane head size
    ],
)
def test_native_attention_matches_sdpa(dtype, tier, heads, kv, d, pos, lo):
    """decode_attention (native/decode_attention.h) writes the new k / v at pos (rounded to the cache type as torch
    rounds) and equals SDPA over [lo, pos] of the cache; split over 2 threads, bit for bit the 1-thread
    result (the items do not depend on the thread count)."""
    eng = native_glue()
    torch.manual_seed(pos + d)
    max_len = pos + 7
    cache = torch.randn(2, kv, max_len, d).to(dtype)
    qkv = torch.randn(1, (heads + 2 * kv) * d)
    q = qkv[0, : heads * d].view(kv, heads // kv, d)
    k_new, v_new = qkv[0, heads * d : (heads + kv) * d].view(kv, d), qkv[0, (heads + kv) * d :].view(kv, d)
    out = _native_attention(eng, qkv, cache, heads, kv, d, lo, pos, tier, 1)
    assert torch.equal(cache[0, :, pos], k_new.to(dtype)) and torch.equal(cache[1, :, pos], v_new.to(dtype))
    c = cache.float()
    ref = torch.nn.functional.scaled_dot_product_attention(q, c[0, :, lo : pos + 1], c[1, :, lo : pos + 1], scale=0.3)
    # fp32 sums in another order than SDPA's (a 256-long scalar dot product: ~1e-6 of a score of ~5)
    torch.testing.assert_close(out.view(kv, heads // kv, d), ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(_native_attention(eng, qkv, cache, heads, kv, d, lo, pos, tier, 2), out)


def test_native_attention_kv_rounding_and_bad_arguments():
    """The new k / v rounded to bf16 / fp16 as torch rounds (ties, subnormals, the largest finite fp16, NaN;
    bf16: 1e6 and inf); what fp16 would round to inf refused; arguments out of range refused."""
    eng = native_glue()
    heads, kv, d = 1, 1, 16
    special = [1 + 2**-8, 1 + 3 * 2**-8, 2**-20, -(2**-24) * 1.5, 65519.0, -65519.9, float("nan")]
    for dtype, extra in ((torch.bfloat16, [1e6, float("inf")]), (torch.float16, [])):
        row = torch.tensor(special + extra + [0.1 * i for i in range(d - len(special) - len(extra))])
        qkv = torch.cat([torch.zeros(d), row, row]).view(1, -1)
        cache = torch.zeros(2, kv, 4, d, dtype=dtype)
        _native_attention(eng, qkv, cache, heads, kv, d, 0, 2, 0, 1)
        want = row.to(dtype)
        got = cache[0, 0, 2]
        assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
        assert got[want.isnan()].isnan().all()
    for big in (65520.0, -1e6, float("inf")):  # fp16 rounds these to inf
        qkv = torch.cat([torch.zeros(d), torch.full((d,), big), torch.zeros(d)]).view(1, -1)
        cache = torch.zeros(2, kv, 4, d, dtype=torch.float16)
        with pytest.raises(OverflowError, match="fp16"):
            _native_attention(eng, qkv, cache, heads, kv, d, 0, 2, 1, 1)
        assert not cache.any()  # nothing written
    cache = torch.zeros(2, kv, 4, d)
    with pytest.raises(ValueError, match="lo <= pos"):
        eng.decode_attention(qkv.data_ptr(), heads, kv, d, 0, 0, 4, 0, 4, 0.3, 0, 1, 1, 0)
    with pytest.raises(ValueError, match="kv_type"):
        eng.decode_attention(qkv.data_ptr(), heads, kv, d, cache[0].data_ptr(), cache[1].data_ptr(), 4, 0, 1, 0.3, 3,
                             1, 1, 0)  # fmt: skip
    with pytest.raises(ValueError, match="tier"):
        eng.decode_attention(qkv.data_ptr(), heads, kv, d, cache[0].data_ptr(), cache[1].data_ptr(), 4, 0, 1, 0.3, 0,
                             3, 1, 0)  # fmt: skip


def test_greedy_argmax_is_torch_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [float("nan"), 1.0, float("nan"), 2.0]])
    got = next_token(logits, Sampling(), torch.Generator())
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
    big = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 262144)).astype(np.float32))
    assert torch.equal(next_token(big, Sampling(), torch.Generator()), big.argmax(-1))


def test_fp16_cache_refuses_keys_beyond_its_range():
    """A key / value beyond 65504 would be inf in an fp16 cache (NaN logits after): prefill and the decode
    step refuse it naming the fix, and a bf16 cache (fp32's range) takes it."""
    lm = gml.llm(tiny("llama"), weights="int8", max_length=32)
    assert lm.kv_dtype == torch.float16  # the default for quantized weights
    spec = lm.decoder.spec
    for layer in lm.decoder.layers:  # scale v's rows of the fused QKV matrix (the last ones): values of ~1e6
        layer.qkv.qweight.scales[-spec.num_kv_heads * spec.head_dim :] *= 1e6
    with pytest.raises(UnsupportedError, match="kv_cache='bf16'"):
        lm.generate(PROMPT, 4)
    dec = lm.decoder
    cache = KVCache(spec, 1, 32, torch.float16)
    step = DecodeStep(dec, cache, native_glue())
    with pytest.raises(UnsupportedError, match="beyond fp16's range"):
        step(torch.tensor([[5]]))
    bf16 = KVCache(spec, 1, 32, torch.bfloat16)
    dec.forward(torch.tensor([PROMPT]), bf16, last_only=True)
    assert DecodeStep(dec, bf16, native_glue())(torch.tensor([[5]])).isfinite().all()
