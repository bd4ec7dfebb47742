"""The torch.export capture path: chosen automatically, with the reason; ATen raised to GML's vocabulary."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.api import optimize
from gml.capture import capture
from gml.capture_export import capture_info
from gml.errors import TraceFailure
from gml.ir.attention import is_attention
from gml.passes.raise_aten import RaiseATen


def _kinds(gm: fx.GraphModule) -> list[str]:
    return [type(gm.get_submodule(str(n.target))).__name__ for n in gm.graph.nodes if n.op == "call_module"]


def _aten(gm: fx.GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2).eval()


def test_transformer_encoder_captures_from_the_plain_model() -> None:
    model = _encoder()
    x = torch.randn(2, 10, 32)
    gm = capture(model, (x,))
    info = capture_info(gm)
    assert info is not None and info.path == "torch.export"
    # mask / src_key_padding_mask are traced as None (not placeholders): fx then stops at the
    # encoder's data-dependent fast-path checks, and torch.export takes over
    assert "torch.fx failed" in info.reason and "data-dependent control flow" in info.reason
    kinds = _kinds(gm)
    assert kinds.count("Linear") == 8 and kinds.count("LayerNorm") == 4  # in_proj, out_proj, linear1/2 per layer
    assert _aten(gm, "aten.linear") == 0 and _aten(gm, "aten.layer_norm") == 0
    assert info.dims["src"][0].startswith("dynamic")
    with torch.no_grad():
        x3 = torch.randn(3, 10, 32)  # another batch size than the example
        torch.testing.assert_close(gm(x3), model(x3), atol=1e-5, rtol=1e-4)


def test_transformer_encoder_optimizes_with_attention_as_one_op() -> None:
    model = _encoder()
    x = torch.randn(2, 10, 32)
    res = optimize(model, (x,))
    assert res.report.record("fuse_attention").matches == 2
    assert sum(1 for n in res.module.graph.nodes if is_attention(n)) == 2
    assert res.rel_err < 1e-5


class WithMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mha(x, x, x)[0])


def test_opaque_mha_leaf_switches_to_export_with_the_reason() -> None:
    torch.manual_seed(0)
    model = WithMHA().eval()
    x = torch.randn(2, 10, 32)
    gm = capture(model, (x,))
    info = capture_info(gm)
    assert info.path == "torch.export"
    assert info.reason == "torch.fx keeps mha (MultiheadAttention) as opaque leaves; torch.export traces into them"
    # need_weights=True by default: the averaged weights are dropped by the caller and removed
    res = optimize(model, (x,))
    assert res.report.record("fuse_attention").matches == 1
    assert res.rel_err < 1e-5


def test_explicit_leaf_keeps_the_fx_path() -> None:
    model = WithMHA().eval()
    x = torch.randn(2, 10, 32)
    gm = capture(model, (x,), leaf_modules=["mha"])
    assert capture_info(gm).path == "torch.fx"
    assert "MultiheadAttention" in _kinds(gm)


@torch.fx.wrap
def _gate(x: torch.Tensor) -> torch.Tensor:
    """Opaque to fx (wrapped); export traces into it and stops at the branch on a value."""
    return x * 2 if x.sum() > 0 else x


class MHAAndGate(WithMHA):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gate(super().forward(x))


def test_export_failing_keeps_the_fx_graph_with_both_reasons() -> None:
    model = MHAAndGate().eval()
    x = torch.randn(2, 10, 32)
    gm = capture(model, (x,))
    info = capture_info(gm)
    assert info.path == "torch.fx"
    assert "opaque leaves" in info.reason and "with torch.export either" in info.reason
    assert "MultiheadAttention" in _kinds(gm)
    torch.testing.assert_close(gm(x), model(x))


def test_mha_as_the_model_keeps_both_outputs() -> None:
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 10, 32)
    gm = capture(model, (x, x, x))
    assert capture_info(gm).path == "torch.export"
    out, weights = gm(x, x, x)
    ref_out, ref_weights = model(x, x, x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(weights, ref_weights)
    # the probabilities are an output, so the hand-written pattern is declined with that reason
    res = optimize(model, (x, x, x))
    skips = [s for p, s in res.report.skips if p == "fuse_attention"]
    assert res.report.record("fuse_attention").matches == 0
    assert any("attention probabilities are read elsewhere" in s.reason for s in skips)


def test_vit_captures_without_wrapper_or_leaves() -> None:
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64).eval()
    nn.init.normal_(model.heads.head.weight)  # torchvision zero-initialises the head: outputs would all be 0
    x = torch.randn(1, 3, 32, 32)
    res = optimize(model, (x,))
    assert capture_info(res.module).path == "torch.export"
    assert "FusedConv" in _kinds(res.module)  # the patch embedding, raised to nn.Conv2d and then fused
    assert res.report.record("fuse_attention").matches == 2
    assert res.max_abs_ref > 0 and res.rel_err < 1e-5


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a tensor value: neither fx nor export can record it
            return x * 2
        return x


def test_both_paths_failing_names_the_line() -> None:
    with pytest.raises(TraceFailure) as info:
        capture(DataDependent(), (torch.randn(2, 3),))
    text = info.value.message
    assert "Cannot capture DataDependent with torch.fx" in text
    assert "with torch.export either" in text
    assert "test_capture_export.py" in text and "if x.sum() > 0" in text


def test_without_example_inputs_fx_errors_stay_fx_errors() -> None:
    with pytest.raises(TraceFailure, match=r"torch\.fx") as info:
        capture(DataDependent())
    assert "torch.export" not in info.value.message


# --- RaiseATen on its own: golden graph, bit-exact numerics, declined candidate ---


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(4, 16))

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        h = torch.nn.functional.gelu(self.norm(h))
        computed = torch.nn.functional.linear(h, self.scale * 2)  # weight computed at run time
        return {"logits": self.fc(h), "other": computed.relu()}


def test_raise_aten_golden() -> None:
    torch.manual_seed(0)
    model = Small().eval()
    ids = torch.randint(0, 50, (2, 7))
    exported = torch.export.export(model, (ids,)).module()
    gm = fx.GraphModule(exported, exported.graph, "Small")
    gm._in_spec, gm._out_spec = exported._in_spec, exported._out_spec
    res = RaiseATen()(gm)
    out = res.graph_module
    assert res.modified and res.matches >= 8
    assert sorted(_kinds(out)) == ["Conv1d", "Embedding", "GuardsFn", "LayerNorm", "Linear"]
    # the modules sit where the model had them, holding the model's own parameter values
    assert out.get_submodule("fc").weight.data_ptr() == exported.get_submodule("fc").weight.data_ptr()
    assert out.get_submodule("emb").padding_idx == 0
    code = out.code
    assert "torch.nn.functional.gelu" in code or "torch._C._nn.gelu" in code
    assert "aten.linear" in code  # the computed-weight linear stays ATen...
    assert [s.reason for s in res.skips] == ["weight or bias is computed, not a constant"]  # ...and says why
    assert "_assert_tensor_metadata" not in code
    with torch.no_grad():
        got, ref = out(ids), model(ids)
    assert set(got) == {"logits", "other"}
    assert torch.equal(got["logits"], ref["logits"]) and torch.equal(got["other"], ref["other"])


def test_fx_models_still_take_the_fx_path() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    gm = capture(model, (torch.randn(2, 4),))
    assert capture_info(gm).path == "torch.fx"
    assert not gm.training


class _Conv1DLike(nn.Module):
    """HF GPT-2's ``Conv1D``: ``addmm(b, x.view(-1, in), W)`` with ``W`` stored ``[in, out]``."""

    def __init__(self, n_in: int, n_out: int, alpha: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = nn.Parameter(torch.randn(n_out))
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight, alpha=self.alpha)
        return y.view(*x.shape[:-1], -1)


def _exported(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    exported = torch.export.export(model, inputs).module()
    gm = fx.GraphModule(exported, exported.graph, type(model).__name__)
    gm._in_spec, gm._out_spec = exported._in_spec, exported._out_spec
    return gm


def test_raise_aten_turns_gpt2_conv1d_addmm_into_a_linear_bit_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Conv1DLike(16, 24), nn.GELU(), _Conv1DLike(24, 8)).eval()
    x = torch.randn(2, 5, 16)
    res = RaiseATen()(_exported(model, x))
    out = res.graph_module
    assert "aten.addmm" not in out.code and _kinds(out).count("Linear") == 2
    lin = next(m for m in out.modules() if type(m) is nn.Linear)
    # the weight is the model's [in, out] storage seen transposed, not a copy
    assert lin.weight.shape == (24, 16) and lin.weight.data_ptr() == model[0].weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(out(x), model(x))


def test_raise_aten_keeps_a_scaled_addmm_and_says_why() -> None:
    model = _Conv1DLike(8, 8, alpha=0.5).eval()
    res = RaiseATen()(_exported(model, torch.randn(3, 8)))
    assert "aten.addmm" in res.graph_module.code
    assert [s.reason for s in res.skips] == ["addmm with alpha or beta other than 1"]


class _BatchTiedBranch(nn.Module):
    """A branch on an equation between the batch and another dim (as HF MobileViT / Swin / SigLIP
    have when they fold the batch into patches): the graph exported on a doubled batch keeps a guard
    that the example's batch of 1 fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] * 4 == x.shape[1]:
            return self.lin(x) * 2
        return self.lin(x)


def test_export_whose_doubled_batch_guard_refuses_the_example_is_redone_on_the_example() -> None:
    from gml.capture_export import export_capture

    torch.manual_seed(0)
    model, x = _BatchTiedBranch().eval(), torch.randn(1, 4, 8)
    gm = export_capture(model, (x,), reason="test")
    info = capture_info(gm)
    assert any("refuses the example" in note for note in info.notes), info.notes
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


class _TFPaddedBlock(nn.Module):
    """HF MobileNetV2 / ResNet in an export graph: a pad computed with ``int(x.shape[-1])`` (fx
    cannot trace it; export fixes it), ReLU6 (``aten.hardtanh``), a residual ``+=``
    (``aten.add_``) and a LeakyReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3, 2), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = 1 if int(x.shape[-1]) % 2 == 0 else 2
        y = nn.functional.relu6(self.a(nn.functional.pad(x, (0, pad, 0, pad))))
        z = self.b(y)
        z += y
        return nn.functional.leaky_relu(z, 0.2)


def test_raise_aten_takes_hardtanh_leaky_relu_pad_and_in_place_adds_bit_exactly() -> None:
    """Before, these stayed ATen calls: ReLU6 and the pad cut HF MobileNetV2's fp32 plan into 53
    segments, and the in-place residual add kept HF ResNet's adds out of INT8."""
    torch.manual_seed(0)
    model, x = _TFPaddedBlock().eval(), torch.randn(1, 4, 10, 10)
    res = RaiseATen()(_exported(model, x))
    out = res.graph_module
    for name in ("aten.hardtanh", "aten.leaky_relu", "aten.pad", "aten.add_"):
        assert _aten(out, name) == 0, (name, out.code)
    assert any(n.op == "call_method" and n.target == "add_" for n in out.graph.nodes)
    with torch.no_grad():
        assert torch.equal(out(x), model(x))
    # the whole pipeline: the pad is the conv's padding, ReLU6 its post-op, the add its sum: one plan
    opt = optimize(model, x)
    assert len(opt.engine.segments()) == 1, str(opt.runtime)
    assert {n.op for n in opt.runtime.torch_nodes} <= {"InputGuard", "ShapeGuards"}, str(opt.runtime)
    with torch.no_grad():
        torch.testing.assert_close(opt.executable(x), model(x), rtol=1e-5, atol=1e-5)
