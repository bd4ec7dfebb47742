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
