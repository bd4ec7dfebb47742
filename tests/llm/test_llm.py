"""gml.llm: capture of 8 families, GML's KV cache vs HF eager (greedy tokens, logits), generation, errors."""

from __future__ import annotations

import pytest
import torch

import gml
from assets.llm_models import FAMILIES, VOCAB, hf_greedy, tiny
from gml.errors import InputError, ModelLoadError, UnsupportedError

PROMPT = [5, 17, 3, 99, 42, 8, 64, 23, 11, 7]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_eager(family):
    model = tiny(family)
    lm = gml.llm(model, max_length=96)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT]), use_cache=False).logits[0]
    got = lm.logits(PROMPT)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3", "gpt2"])
def test_greedy_with_kv_cache_equals_hf_without_cache(family):
    # GQA, qk-norm, sliding windows, sandwich norms + soft-capping, learned positions + Conv1D.
    # 10 + 64 positions: past Mistral's (16) and Gemma3's (8) sliding windows.
    model = tiny(family)
    lm = gml.llm(model, max_length=96)
    assert lm.generate(PROMPT, max_new_tokens=64) == hf_greedy(model, PROMPT, 64)


def test_batched_logits_and_bf16_kv_cache():
    model = tiny("llama")
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    got = gml.llm(model, max_length=32).logits(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    bf16 = gml.llm(model, max_length=32, kv_cache="bf16").logits(ids)
    assert (bf16 - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_bf16_weights_close_to_fp32():
    model = tiny("qwen2")
    ref = gml.llm(model, max_length=32).logits(PROMPT)
    got = gml.llm(model, max_length=32, weights="bf16").logits(PROMPT)
    assert (got - ref).abs().max() <= 3e-2 * ref.abs().max()


def test_stream_sampling_seed_and_stop_tokens():
    lm = gml.llm(tiny("llama"), max_length=64)
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    a = lm.generate(PROMPT, 20, **kw)
    assert a == lm.generate(PROMPT, 20, **kw)  # the seed fixes the draw
    assert len(a) == 20 and all(0 <= t < VOCAB for t in a)
    greedy = lm.generate(PROMPT, 12)
    assert list(lm.stream(PROMPT, 12)) == greedy
    stop = greedy[4]
    first = greedy.index(stop)
    assert lm.generate(PROMPT, 12, stop_tokens=[stop]) == greedy[: first + 1]
    assert lm.stats.prompt_tokens == len(PROMPT) and lm.stats.new_tokens == first + 1


def test_top_k_one_is_greedy():
    lm = gml.llm(tiny("gemma"), max_length=64)
    assert lm.generate(PROMPT, 8, temperature=1.5, top_k=1, seed=0) == lm.generate(PROMPT, 8)


def test_local_folder(tmp_path):
    model = tiny("phi3")
    model.save_pretrained(tmp_path)
    lm = gml.llm(str(tmp_path), max_length=64)
    assert lm.generate(PROMPT, 8) == gml.llm(model, max_length=64).generate(PROMPT, 8)


def test_bad_inputs_are_clear():
    lm = gml.llm(tiny("llama"), max_length=16)
    with pytest.raises(InputError, match="outside the vocabulary"):
        lm.generate([1, VOCAB], 2)
    with pytest.raises(InputError, match="more than max_length=16"):
        lm.logits(list(range(17)))
    with pytest.raises(InputError, match="exceed max_length=16"):
        lm.generate(list(range(10)), 7)
    with pytest.raises(InputError, match="integer"):
        lm.generate([0.5, 1.0], 2)
    with pytest.raises(InputError, match="weights="):
        gml.llm(tiny("llama"), weights="int3")


def test_unsupported_family_names_the_supported_ones():
    import transformers as tf

    cfg = tf.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, is_decoder=True
    )
    with pytest.raises(UnsupportedError, match=r"(?s)cannot capture a 'bert'.*gpt2.*llama"):
        gml.llm(tf.BertLMHeadModel(cfg))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        gml.llm(str(tmp_path))


def test_gpt2_max_length_beyond_learned_positions():
    with pytest.raises(UnsupportedError, match="256 learned positions"):
        gml.llm(tiny("gpt2"), max_length=512)


def test_chunked_prefill_equals_one_pass():
    """A prompt run in chunks over the KV cache (``prefill_chunk``) gives the logits and tokens of one pass."""
    model = tiny("gemma3")  # sliding windows: chunks cross the window's edge
    one = gml.llm(model, max_length=96)
    one.prefill_chunk = 10_000
    chunked = gml.llm(model, max_length=96)
    chunked.prefill_chunk = 7
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.testing.assert_close(chunked.logits(ids), one.logits(ids), rtol=1e-5, atol=1e-5)
    assert chunked.generate(ids, 16) == one.generate(ids, 16)
