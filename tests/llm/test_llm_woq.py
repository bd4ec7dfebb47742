"""gml.llm with INT8 / INT4 weights against a plain weight-only fake quantization of the same HF model.

On tiny random configs top-1 agreement says little (near-tied logits), so the test compares logits:
GML's quantized model must equal HF eager run on weights rounded the same way (written out plainly
here, independently of gml.ir.llm_ops) up to fp32 summation order."""

from __future__ import annotations

import copy

import pytest
import torch

import gml
from assets.llm_models import tiny

PROMPT = [5, 17, 3, 99, 42, 8, 64, 23, 11, 7, 1, 2]


def fake_quant(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """``w [N, K]`` rounded to ``bits`` per group of ``group`` input columns."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if symmetric and bits == 4:  # the largest-magnitude value m on -8 (Q4_0) or on +7, the better
        m = g.gather(-1, g.abs().argmax(-1, keepdim=True))
        best = None
        for s in (m / -8, m / 7):
            s = torch.where(s == 0, torch.ones_like(s), s)
            fq = (torch.floor(g * (1 / s) + 8.5).clamp(0, 15) - 8) * s  # ties up, as Q4_0
            err = (fq - g).square().sum(-1, keepdim=True)
            best = (fq, err) if best is None else (torch.where(err < best[1], fq, best[0]), torch.minimum(err, best[1]))
        return best[0].reshape(n, k)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        s = g.abs().amax(-1, keepdim=True) / qmax
        s[s == 0] = 1.0  # an all-zero group (a padding token's embedding row) stays zero
        return (torch.round(g / s).clamp(-qmax - 1, qmax) * s).reshape(n, k)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = (hi - lo) / 15
    z = torch.round(-lo / s)
    return ((torch.round(g / s) + z).clamp(0, 15) - z).mul(s).reshape(n, k)


def fake_quantized_copy(model, bits: int, group: int | None, symmetric: bool):
    model = copy.deepcopy(model)
    body = model.transformer if hasattr(model, "transformer") else model.model
    with torch.no_grad():
        for name, m in body.named_modules():
            if "embed" in name or name.endswith(("wte", "wpe")) or not hasattr(m, "weight") or m.weight.dim() != 2:
                continue
            conv1d = type(m).__name__ == "Conv1D"  # GPT-2 stores [in, out]
            w = m.weight.t() if conv1d else m.weight
            fq = fake_quant(w.float(), bits, group or w.shape[1], symmetric)
            m.weight.copy_(fq.t() if conv1d else fq)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    ("family", "weights", "group", "symmetric"),
    [
        ("llama", "int8", None, True),  # per output channel
        ("gemma3", "int8", 32, True),  # the default: groups of 32 (llama.cpp's Q8_0)
        ("qwen3", "int8", 64, True),
        ("llama", "int4", 32, True),
        ("qwen2", "int4", 32, False),
        ("gemma", "int4", 64, True),
        ("phi3", "int4", 32, False),
        ("gpt2", "int4", 32, True),
    ],
)
def test_woq_logits_equal_fake_quantized_hf(family, weights, group, symmetric):
    model = tiny(family)
    bits = 8 if weights == "int8" else 4
    ref_model = fake_quantized_copy(model, bits, group, symmetric)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT]), use_cache=False).logits[0]
    lm = gml.llm(  # (an fp32 KV cache: the weights' error alone)
        model, weights=weights, group_size=group, symmetric=symmetric, lm_head_weights="fp32",
        embed_weights="fp32", max_length=32, kv_cache="fp32",
    )  # fmt: skip
    assert rel_err(lm.logits(PROMPT), ref) <= 1e-4
    # the quantization itself moves the logits (the test would pass vacuously otherwise)
    assert rel_err(gml.llm(model, max_length=32).logits(PROMPT), ref) > 1e-4


def test_quantized_lm_head_and_decode_path():
    model = tiny("qwen3")
    lm = gml.llm(model, weights="int4", lm_head_weights="int4", max_length=48)
    assert gml.llm(model, weights="int4", max_length=48).decoder.lm_head_weights == "int8"  # the default
    full = lm.logits(PROMPT)
    # decode over the cache reproduces the teacher-forced logits of the last position
    out = lm.generate(PROMPT[:-1], 2)
    assert out[0] == int(full[-2].argmax())
    assert lm.weight_bytes() < gml.llm(model, max_length=48).weight_bytes() / 6


def test_group_size_must_divide_the_features():
    with pytest.raises(gml.GMLError, match="not a multiple of group_size=128"):
        gml.llm(tiny("llama"), weights="int4", group_size=128)  # hidden 64
    with pytest.raises(gml.GMLError, match="group_size=48 is not one of"):
        gml.llm(tiny("llama"), weights="int4", group_size=48)
    with pytest.raises(gml.GMLError, match=r"not a multiple of group_size=128(?s:.*)group_size=None"):
        gml.llm(tiny("llama"), weights="int8", group_size=128)
    with pytest.raises(gml.GMLError, match=r"group_size=48 is not one of(?s:.*)per output channel"):
        gml.llm(tiny("llama"), weights="int8", group_size=48)
    with pytest.raises(gml.GMLError, match="int4 weights are group-wise"):
        gml.llm(tiny("llama"), weights="int4", group_size=None)


@pytest.mark.parametrize(("family", "weights", "group", "symmetric"), [("llama", "int8", None, True),
                                                                        ("llama", "int8", 32, True),
                                                                        ("qwen2", "int4", 32, False)])  # fmt: skip
def test_quantized_embedding_table_equals_fake_quantized_rows(family, weights, group, symmetric):
    """An untied table stored as ``weights`` (default): the lookup equals HF on the same rounding."""
    model = tiny(family)
    assert not model.config.tie_word_embeddings
    bits = 8 if weights == "int8" else 4
    ref_model = fake_quantized_copy(model, bits, group, symmetric)
    emb = ref_model.get_input_embeddings()
    with torch.no_grad():
        emb.weight.copy_(fake_quant(emb.weight.float(), bits, group or emb.weight.shape[1], symmetric))
        ref = ref_model(torch.tensor([PROMPT]), use_cache=False).logits[0]
    lm = gml.llm(model, weights=weights, group_size=group, symmetric=symmetric, lm_head_weights="fp32",
                 max_length=32, kv_cache="fp32")  # fmt: skip
    assert lm.decoder.embed_weights == weights
    assert rel_err(lm.logits(PROMPT), ref) <= 1e-4


def test_a_tied_table_and_head_share_one_quantized_tensor():
    model = tiny("gemma3")
    assert model.config.tie_word_embeddings
    lm = gml.llm(model, weights="int8", max_length=32, kv_cache="fp32")
    assert lm.decoder.embed_weights == "int8" and lm.decoder.lm_head.qweight is lm.decoder.embed
    assert lm.decoder.embed.group_size == 32  # int8 in groups of 32 by default
    # the head's quantization is the table's: HF with the shared tensor fake-quantized per row's groups
    ref_model = fake_quantized_copy(model, 8, 32, True)
    emb = ref_model.get_input_embeddings()
    with torch.no_grad():
        emb.weight.copy_(fake_quant(emb.weight.float(), 8, 32, True))  # ties the head too
        ref = ref_model(torch.tensor([PROMPT]), use_cache=False).logits[0]
    assert rel_err(lm.logits(PROMPT), ref) <= 1e-4
    untied = gml.llm(model, weights="int8", embed_weights="fp32", max_length=32)
    assert untied.decoder.lm_head.qweight is not None and untied.decoder.embed.dtype == torch.float32


def test_default_activations_follow_the_weights(tmp_path):
    # int4 weights decode with int8 activations unless told otherwise (their weights' error dominates:
    # docs/llm.md), int8 and float weights with fp32; a saved file gets its weights' default too.
    model = tiny("llama")

    def act_bits(lm) -> set[int]:
        layer = lm.decoder.layers[0]
        return {op.act_bits for op in (layer.qkv, layer.o, layer.up, layer.down)}

    assert act_bits(gml.llm(model, weights="int4", max_length=16)) == {8}
    assert act_bits(gml.llm(model, weights="int4", max_length=16, activations="fp32")) == {0}
    assert act_bits(gml.llm(model, weights="int8", max_length=16)) == {0}
    assert act_bits(gml.llm(model, weights="int8", max_length=16, activations="int8")) == {8}
    path = gml.llm(model, weights="int4", max_length=16, activations="fp32").save(tmp_path / "m.gml")
    assert act_bits(gml.llm(path)) == {8} and act_bits(gml.load(path)) == {8}  # not stored: the default
    assert act_bits(gml.llm(path, activations="fp32")) == {0}
