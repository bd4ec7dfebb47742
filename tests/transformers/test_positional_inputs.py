"""Example inputs are positional: what a batch's items bind to in an HF ``forward`` whose every
parameter is optional, and ``None`` for a skipped parameter (``(ids, None, mask)``: GPT-2's second
parameter is its cache, not the attention mask).

Before: ``gml.quantize(bert, [(ids, mask), ...])`` quantized a graph without the attention mask (the
batch was cut to the required parameters: none, so one item), ``(ids, None, mask)`` failed with
``AttributeError: 'NoneType' object has no attribute 'is_floating_point'``, and ``(ids, mask)`` for
GPT-2 failed on ``get_seq_length`` with no word of where the mask had gone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.errors import InputError, TraceFailure
from gml.optimizing import _inputs_of_batch
from gml.testing.tokens import padded_tokens

transformers = pytest.importorskip("transformers")


class _Optional(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None):
        return input_ids


class _Image(nn.Module):
    def forward(self, x, mask=None):
        return x


def test_a_batch_binds_every_input_it_holds_and_drops_a_trailing_label():
    ids, mask, labels = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long), torch.ones(2).long()
    assert len(_inputs_of_batch(_Optional(), (ids, mask))) == 2  # both optional: both taken
    assert len(_inputs_of_batch(_Optional(), (ids, mask, labels))) == 2  # a [B] integer label after [B, L]
    assert len(_inputs_of_batch(_Optional(), (ids, None, mask))) == 3  # None skips a parameter
    assert len(_inputs_of_batch(_Optional(), (ids, mask, None))) == 2  # a trailing None binds nothing
    x = torch.randn(2, 3, 8, 8)
    assert len(_inputs_of_batch(_Image(), (x, labels))) == 1  # (x, label) for forward(x, mask=None)
    assert len(_inputs_of_batch(nn.Conv2d(3, 4, 3), (x, labels))) == 1  # forward(input): one parameter


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000
    )
    return transformers.BertModel(config).eval()


def test_an_hf_model_is_quantized_with_its_attention_mask():
    model, (ids, mask) = _bert(), padded_tokens(2, 12, 7)
    q = gml.quantize(model, [(ids, mask)] * 2, per_layer=False, cost_policy="off")
    graph = q.module.graph
    assert [n.name for n in graph.nodes if n.op == "placeholder"] == ["input_ids", "attention_mask"]
    with torch.no_grad():
        got = q.executable(ids, mask)["last_hidden_state"]
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0)) > 0.99


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0, use_cache=False
    )
    return transformers.GPT2Model(config).eval()


def test_none_skips_a_decoders_cache_to_give_its_attention_mask(tmp_path):
    model, (ids, mask) = _gpt2(), padded_tokens(2, 12, 7)
    example = (ids, None, mask)
    result = gml.optimize(model, example)
    with torch.no_grad():
        want = model(*example).last_hidden_state
        torch.testing.assert_close(result.executable(*example)["last_hidden_state"], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="input 1 was None in the example"):
        result.executable(ids, mask, mask)
    result.save(str(tmp_path / "gpt2.pt2"))
    loaded = gml.load(str(tmp_path / "gpt2.pt2"))
    assert loaded.runtime.runtime != "torch", loaded.runtime.note  # the load check ran on the saved example
    with torch.no_grad():
        torch.testing.assert_close(loaded(*example)["last_hidden_state"], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="input 1 was None in the example"):
        loaded(ids, mask, mask)


def test_a_capture_failure_says_what_the_inputs_were_given_as():
    model, (ids, mask) = _gpt2(), padded_tokens(2, 12, 7)
    with pytest.raises(TraceFailure, match=r"given to forward positionally: input_ids=int64\[2, 12\], \w+=int64"):
        gml.optimize(model, (ids, mask))
