"""Hugging Face models: capture from the plain model, attention_mask as a real input, model specs.

Skipped when the optional ``transformers`` extra is not installed. Configs are shrunk (2 layers,
hidden 64) so each test takes seconds; the real all-MiniLM-L6-v2 runs when its package is installed.
"""

from __future__ import annotations

import pytest
import torch

from gml.testing.tokens import padded_tokens

transformers = pytest.importorskip("transformers")

from gml.api import optimize  # noqa: E402
from gml.capture import capture  # noqa: E402
from gml.capture_export import capture_info  # noqa: E402
from gml.cli import main  # noqa: E402
from gml.errors import ModelLoadError  # noqa: E402
from gml.ir.attention import is_attention  # noqa: E402
from gml.models import example_inputs, load_with_defaults  # noqa: E402
from gml.models_hf import describe_inputs, load_hf  # noqa: E402

SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 1000,
}


def _bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(**SMALL)).eval()


def _distilbert():
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(n_layers=2, dim=64, n_heads=4, hidden_dim=128, vocab_size=1000)
    return transformers.DistilBertModel(cfg).eval()


_tokens = padded_tokens


@pytest.mark.parametrize("build", [_bert, _distilbert], ids=["bert", "distilbert"])
def test_capture_plain_model_dynamic_batch_and_sequence(build) -> None:
    model = build()
    gm = capture(model, _tokens(1, 16))
    info = capture_info(gm)
    assert info.path == "torch.export" and "torch.fx failed" in info.reason
    assert all(d.startswith("dynamic") for d in info.dims["input_ids"])
    for batch, seq, pad in ((1, 16, None), (3, 23, 9), (2, 5, 2)):  # other shapes than the example, padded
        ids, mask = _tokens(batch, seq, pad)
        with torch.no_grad():
            got, ref = gm(ids, mask), model(ids, mask)
        assert type(got) is type(ref)  # the ModelOutput, not a tuple
        torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_bert_optimize_attention_one_op_numerics(padded: bool) -> None:
    model = _bert()
    ids, mask = _tokens(2, 12, 7 if padded else None)
    res = optimize(model, (ids, mask))
    assert res.report.record("fuse_attention").matches == 2
    assert sum(1 for n in res.module.graph.nodes if is_attention(n)) == 2
    assert res.report.record("horizontal_merge").matches == 2  # Q/K/V merged per layer
    assert res.rel_err < 1e-5
    # the mask is a real input: padding changes the unpadded rows of nothing, and the padded row
    # agrees with eager on its real tokens
    ids2, mask2 = _tokens(3, 20, 11)
    with torch.no_grad():
        torch.testing.assert_close(
            res.module(ids2, mask2).last_hidden_state, model(ids2, mask2).last_hidden_state, atol=1e-5, rtol=1e-4
        )


def test_hf_architecture_by_name_uses_the_default_config_and_varied_ids() -> None:
    model, shapes, like = load_with_defaults("hf:DistilBertModel")
    assert type(model).__name__ == "DistilBertModel" and not model.training
    assert model.config.n_layers == transformers.DistilBertConfig().n_layers
    assert shapes == [(1, 128), (1, 128)]
    ids, mask = example_inputs([(2, 16), (2, 16)], like=like)
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.min() >= 1 and ids.max() < model.config.vocab_size and len(ids.unique()) > 20
    assert bool((mask == 1).all())
    assert describe_inputs(model, (ids, mask)).startswith("generated token ids uniform in [1, 30521]")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("hf:bert-base-uncased", "looks like a Hub name; GML-Lab never downloads"),
        ("hf:BertModle", "did you mean hf:BertModel"),
    ],
)
def test_hf_names_that_would_download_or_do_not_exist(spec: str, says: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_hf(spec)
    assert says in str(info.value)


def test_cli_inspect_a_local_model_folder(tmp_path, capsys) -> None:
    model = _bert()
    model.save_pretrained(tmp_path)  # config.json + model.safetensors, as a downloaded folder holds
    code = main(["inspect", str(tmp_path), "--input-shape", "2x16", "--no-nodes"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "captured with torch.export" in out and "dynamic" in out
    assert "generated token ids uniform in [1, 999]" in out
    assert "(2, 16), (2, 16)" in out


def test_cli_quantize_takes_the_transformer_scheme(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    _bert().save_pretrained(tmp_path)
    code = main(["quantize", str(tmp_path), "--input-shape", "2x16", "--no-time"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "transformer scheme: it is a transformers BertModel" in out and "quantize_linears_dynamic" in out
    assert out.count("per token") >= 9  # 2 x (QKV merged, out, 2 MLP) + pooler: every GEMM listed as int8
    assert "9/9 GEMMs INT8" in out and "dB on calibration data" in out
    assert "layernorm" in out and "attention (q·kᵀ, softmax, p·v)" in out
    # calibration on varied ids from the vocabulary, labelled as such (#15), never "N(0,1)"
    assert "random integer ids uniform in [1, 999] (the model's vocabulary" in out and "N(0" not in out
    cos = float(out.split("output cosine ")[1].split()[0].rstrip(","))
    assert cos > 0.99


@pytest.mark.parametrize("build", [_bert, _distilbert], ids=["bert", "distilbert"])
def test_hf_encoder_runs_on_the_engine_with_padding_and_new_shapes(build) -> None:
    """LayerNorm, attention (the padding mask), GEMMs, residual adds on the native engine; only the
    embedding lookups and the mask arithmetic stay in torch. Other batch / sequence sizes get
    their own plans (the sizes are segment inputs)."""
    from gml.runtime import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    model = build()
    res = optimize(model, _tokens(2, 12, 7))
    assert res.engine is not None, str(res.runtime)
    in_torch = {n.op for n in res.runtime.torch_nodes}
    assert not in_torch & {"attention", "LayerNorm", "FusedLinear", "Linear", "Add"}, str(res.runtime)
    assert not res.runtime.shape_fallbacks
    for batch, seq, pad in ((2, 12, 7), (3, 20, 11), (1, 1, None)):
        ids, mask = _tokens(batch, seq, pad)
        with torch.no_grad():
            got, ref = res.executable(ids, mask), model(ids, mask)
        torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-4)
    assert not res.runtime.shape_fallbacks, res.runtime.shape_fallbacks


def _gpt2(use_cache: bool):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, use_cache=use_cache)
    return transformers.GPT2Model(cfg).eval()


def test_gpt2_with_its_kv_cache_output_is_refused_with_the_fix() -> None:
    """A decoder returning its generation cache (past_key_values, a DynamicCache) was refused as
    'random in eval mode' (the cache objects of two runs compare unequal): the message names the cache."""
    from gml.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="DynamicCache") as e:
        optimize(_gpt2(use_cache=True), (torch.randint(0, 1000, (1, 12)),))
    assert "use_cache=False" in e.value.hint


def test_gpt2_without_cache_optimizes_and_quantizes_causal_attention() -> None:
    """GPT-2 (torch.export path, causal attention, run-time shape lists fed to engine segments)."""
    import gml

    model, x = _gpt2(use_cache=False), (torch.randint(0, 1000, (1, 12)),)
    res = optimize(model, x)
    assert res.rel_err < 1e-4
    q = gml.quantize(model, 2, example_inputs=x, cost_policy="off")
    assert q.scheme == "transformer" and q.accuracy.cosine > 0.999
    x2 = (torch.randint(0, 1000, (1, 20)),)  # another length: the run-time shapes differ
    with torch.no_grad():
        ref = model(*x2).last_hidden_state
        for f in (res.executable, q.executable):
            out = f(*x2).last_hidden_state
            assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.999


def test_model_folder_and_hf_names_load_without_the_kv_cache(tmp_path) -> None:
    _gpt2(use_cache=True).save_pretrained(tmp_path)
    assert load_hf(str(tmp_path)).config.use_cache is False


def test_an_optimized_transformer_saved_from_a_batch_of_one_loads_for_other_batches_and_lengths(tmp_path) -> None:
    """``OptimizeResult.save`` exports with the example inputs and every dim the graph allows
    dynamic: saved from the placeholders' shapes, the exported program was specialized to the
    sequence length 1 (a dynamic dim is traced at 1), and a batch of 1 to batch 1."""
    from gml.archive import looks_pickled
    from gml.io import load

    model, x = _gpt2(use_cache=False), (torch.randint(0, 1000, (1, 12)),)
    res = optimize(model, x)
    path = tmp_path / "gpt2.pt2"
    res.save(str(path))
    assert not looks_pickled(path)
    loaded = load(path)
    for shape in ((1, 12), (3, 17), (2, 5)):
        ids = torch.randint(0, 1000, shape)
        with torch.no_grad():
            want, got = model(ids).last_hidden_state, loaded(ids)["last_hidden_state"]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
