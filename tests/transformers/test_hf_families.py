"""More Hugging Face families through the default INT8 path (shrunk configs: 2 layers, hidden 64).

Each family has its own attention code, embeddings (ALBERT/ELECTRA factorised, DeBERTa's
disentangled relative positions, MPNet's relative bias) and output types; the plain model must
capture, get the transformer scheme and stay within the scheme's accuracy. Skipped without the
optional ``transformers`` extra.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gml  # noqa: E402
from gml.models_hf import input_templates  # noqa: E402

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
FAMILIES = {
    "RobertaModel": ("RobertaConfig", {}),
    "AlbertModel": ("AlbertConfig", {"embedding_size": 32}),
    "ElectraModel": ("ElectraConfig", {"embedding_size": 32}),
    "MPNetModel": ("MPNetConfig", {}),
    "DebertaV2Model": ("DebertaV2Config", {}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_quantizes_with_the_transformer_scheme(family: str) -> None:
    config_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=1000, **SMALL, **extra)
    model = getattr(transformers, family)(config).eval()
    inputs = input_templates(model, 16)
    q = gml.quantize(model, 2, example_inputs=inputs, cost_policy="off", per_layer=False)
    assert q.scheme == "transformer", q.scheme_reason
    assert sum(p.precision == "int8" for p in q.precisions) >= 8  # 2 layers x (QKV, out, 2 MLP)
    assert q.accuracy.cosine > 0.999
    with torch.no_grad():
        ref = model(*inputs).last_hidden_state
        got = q.executable(*inputs).last_hidden_state
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.999


VISION = {
    # a reshape folds the batch into the patches: the doubled-batch export's guards refuse batch 1
    # (HF Swin too, but torch.export needs ~50 s per attempt on its window partition: not in the suite)
    "MobileViTModel": (
        "MobileViTConfig",
        {"image_size": 64, "hidden_sizes": [32, 40, 48], "neck_hidden_sizes": [8, 8, 16, 16, 24, 32, 64]},
    ),
    "SiglipVisionModel": ("SiglipVisionConfig", {**SMALL, "image_size": 32, "patch_size": 8}),
}


@pytest.mark.parametrize("family", sorted(VISION))
def test_vision_family_whose_export_is_redone_on_the_example(family: str) -> None:
    config_name, extra = VISION[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**extra)
    model = getattr(transformers, family)(config).eval()
    x = torch.randn(1, 3, config.image_size, config.image_size)
    r = gml.optimize(model, x)
    with torch.no_grad():
        ref, got = model(x), r.executable(x)
    assert type(got) is type(ref)  # a ModelOutput, not the plain dict of fx
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, rtol=1e-4, atol=1e-4)


DECODERS = {
    "LlamaModel": ("LlamaConfig", {"num_key_value_heads": 2}),
    "Qwen2Model": ("Qwen2Config", {"num_key_value_heads": 2}),
    "PhiModel": ("PhiConfig", {}),
    "GemmaModel": ("GemmaConfig", {"num_key_value_heads": 2, "head_dim": 16}),  # its norms' type_as
}


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_a_decoder_with_left_padding_is_one_engine_plan(family: str) -> None:
    """Rotary embeddings' ``neg`` (export's ``aten.neg``), RMSNorm's identity ``x.to(float32)`` and
    ``repeat_kv``'s ``expand → reshape`` each ran in torch and split a Llama into 13 engine segments
    (2 layers; 25 at 4 layers, GML fp32 0.994x eager, now 0.79x: docs/benchmarks.md, session 24).
    Left padding gives the first query rows of the padded sequence no key at all: those rows are
    SDPA's (ADR 009, session-24 amendment)."""
    config_name, extra = DECODERS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=1000, use_cache=False, **SMALL, **extra)
    model = getattr(transformers, family)(config).eval()
    ids = torch.randint(5, 900, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    result = gml.optimize(model, (ids, mask))
    assert len(result.executable.segments()) == 1, str(result.runtime)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = result.executable(ids, mask)["last_hidden_state"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
