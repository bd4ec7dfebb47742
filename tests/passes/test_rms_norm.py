"""RecognizeRMSNorm: nn.RMSNorm and HF's written-out RMSNorm become one gml.rms_norm (golden graph,
numerics vs eager, declined cases with their reasons, and what the engine makes of it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gml.capture import capture
from gml.ir.library import gml_op_name
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize
from gml.passes.rms_norm import RecognizeRMSNorm
from passes.helpers import op_names


class HFRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (Qwen2 / Mistral / T5 the same), verbatim but for the knobs."""

    def __init__(self, d: int, eps: float = 1e-6, power: float = 2, dim: int = -1, reuse: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon, self.power, self.dim, self.reuse = eps, power, dim, reuse

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(self.power).mean(self.dim, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        out = self.weight * hidden_states.to(input_dtype)
        return out + variance if self.reuse else out  # reuse: an intermediate read elsewhere


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: ``(1 + w)``, casts at both ends."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(d))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Block(nn.Module):
    def __init__(self, norm: nn.Module, d: int = 48) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(d, d), norm, nn.Linear(d, 8)
        with torch.no_grad():
            for p in self.norm.parameters():
                p.uniform_(-0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)))


def _run(model: nn.Module, x: torch.Tensor, *extra):
    from gml.passes.fold_constants import FoldConstants

    gm = capture(model, (x,))
    return PassManager([FoldConstants(), Normalize(), *extra, RecognizeRMSNorm()]).run(gm, [(x,)])


@pytest.mark.parametrize(
    "norm",
    [HFRMSNorm(48), GemmaRMSNorm(48), nn.RMSNorm(48, eps=1e-5), nn.RMSNorm(48)],
    ids=["hf-llama", "gemma3", "nn.RMSNorm", "nn.RMSNorm-default-eps"],
)
def test_golden_graph_and_numerics(norm):
    torch.manual_seed(0)
    model, x = Block(norm).eval(), torch.randn(2, 5, 48) * 3
    res = _run(model, x)
    gm = res.graph_module
    assert op_names(gm) == ["Linear", "rms_norm", "Linear"]  # six ops and two casts (or a module) → one op
    rec = res.report.records[-1]
    assert rec.status == "applied" and rec.matches == 1 and not rec.skips, rec
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    (call,) = [n for n in gm.graph.nodes if gml_op_name(n) == "rms_norm"]
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None)) or torch.finfo(torch.float32).eps
    assert call.args[2] == pytest.approx(eps)


def test_no_affine_module():
    norm = nn.RMSNorm(16, elementwise_affine=False)
    x = torch.randn(3, 16)
    gm = _run(nn.Sequential(norm), x).graph_module
    (call,) = [n for n in gm.graph.nodes if gml_op_name(n) == "rms_norm"]
    assert call.args[1] is None
    torch.testing.assert_close(gm(x), norm(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "norm, reason",
    [
        (HFRMSNorm(48, power=3), "pow exponent 3, not 2"),
        (HFRMSNorm(48, dim=1), "mean over dim 1, not the last"),
        (HFRMSNorm(48, reuse=True), "read elsewhere"),
    ],
    ids=["cube", "other-dim", "reused"],
)
def test_declined_with_reason(norm, reason):
    model, x = Block(norm).eval(), torch.randn(2, 5, 48)
    res = _run(model, x)
    assert "rms_norm" not in op_names(res.graph_module)
    reasons = [s.reason for s in res.report.records[-1].skips]
    assert any(reason in r for r in reasons), reasons
    torch.testing.assert_close(res.graph_module(x), model(x), equal_nan=True)  # a cube's mean can be < 0


def test_multi_dim_module_is_declined():
    norm, x = nn.RMSNorm([4, 8]), torch.randn(2, 4, 8)
    res = _run(nn.Sequential(norm), x)
    assert "rms_norm" not in op_names(res.graph_module)
    assert any("normalizes over 2 dims" in s.reason for s in res.report.records[-1].skips)


def test_hf_llama_rms_norm_class():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    model, x = Block(llama.LlamaRMSNorm(48, eps=1e-5)).eval(), torch.randn(1, 7, 48)
    gm = _run(model, x).graph_module
    assert op_names(gm) == ["Linear", "rms_norm", "Linear"]
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_hf_llama_model_through_optimize_every_norm_is_one_op():
    """A whole HF Llama (torch.export's capture: ``aten.to.dtype`` casts): 2 per layer + the final one."""
    tf = pytest.importorskip("transformers")
    import gml

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model, ids = tf.LlamaModel(cfg).eval(), torch.randint(0, 128, (1, 12))
    res = gml.optimize(model, (ids,), runtime="torch")
    assert [gml_op_name(n) for n in res.module.graph.nodes].count("rms_norm") == 2 * 2 + 1
    assert res.max_abs_err < 1e-4
