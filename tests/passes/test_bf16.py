"""LowerToBf16 (gml.passes.bf16) and gml.optimize(precision="bf16"): golden graphs, numerics vs
eager within the bf16 bound, the precision report, and the refusal on a CPU without bf16."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch import fx, nn
from torch.testing import FileCheck

import gml
from gml.errors import InputError, UnsupportedError
from gml.kernels import bf16 as kb
from gml.kernels import fp32 as k32
from gml.passes.bf16 import BF16_TOLERANCE, LowerToBf16
from gml.passes.manager import PassManager
from gml.passes.pipeline import fp32_passes

needs_bf16 = pytest.mark.skipif(not kb.bf16_available(), reason=f"no native bf16: {kb.bf16_unavailable_reason()}")


class ResBlock(nn.Module):
    """conv-bn-relu, conv-bn + skip, relu, global average, linear: every bf16 class of op."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + x)
        return self.fc(torch.flatten(self.pool(y), 1))


class Encoder(nn.Module):
    """A pre-norm transformer MLP block: LayerNorm + softmax must stay fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.fc2(self.act(self.fc1(self.ln(x))))
        return torch.softmax(x + h, dim=-1)


def _types(gm: fx.GraphModule) -> Counter[str]:
    mods = dict(gm.named_modules())
    return Counter(type(mods[n.target]).__name__ for n in gm.graph.nodes if n.op == "call_module")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@needs_bf16
def test_resblock_golden_graph_and_report():
    torch.manual_seed(0)
    model, x = ResBlock().eval(), torch.randn(2, 3, 12, 12)
    res = gml.optimize(model, x, precision="bf16", runtime="torch")
    gm = res.module
    assert _types(gm) == Counter(
        {"Bf16Conv": 2, "Bf16ConvAdd": 1, "Bf16Linear": 1, "AdaptiveAvgPool2d": 1, "Flatten": 1}
    )
    # the average is a reduction: fp32 in; the output converted back to fp32
    FileCheck().check("to_fp32").check("self.pool(").check("self.fc(").check("to_fp32").run(gm.code)
    rep = res.precision
    assert rep.requested == rep.effective == "bf16" and rep.warnings == []
    by_op = {e.op: e for e in rep.entries}
    assert by_op["Bf16Conv"].precision == "bf16" and "fp32 accumulate" in by_op["Bf16Conv"].reason
    assert by_op["AdaptiveAvgPool2d"].precision == "fp32" and "reduction" in by_op["AdaptiveAvgPool2d"].reason
    assert "bf16" in str(rep) and "fp32" in rep.summary()
    with torch.no_grad():
        y, ref = res.module(x), model(x)
    assert y.dtype == torch.float32
    assert _rel_err(y, ref) <= BF16_TOLERANCE.rtol
    assert float(torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), 0)) > 0.999


@needs_bf16
def test_layernorm_and_softmax_stay_fp32():
    torch.manual_seed(1)
    model, x = Encoder().eval(), torch.randn(2, 5, 32)
    res = gml.optimize(model, x, precision="bf16", runtime="torch")
    entries = {e.op: e for e in res.precision.entries}
    assert entries["LayerNorm"].precision == "fp32" and "LayerNorm statistics" in entries["LayerNorm"].reason
    assert entries["softmax"].precision == "fp32"
    assert entries["Bf16Linear"].precision == "bf16"
    # the residual add mixes the fp32 input and a bf16 linear output: promoted, and said so
    assert entries["Add"].precision == "fp32" and "promoted" in entries["Add"].reason
    with torch.no_grad():
        y, ref = res.module(x), model(x)
    assert y.dtype == torch.float32 and _rel_err(y, ref) <= BF16_TOLERANCE.rtol


@needs_bf16
def test_pass_rolls_back_when_bf16_is_too_coarse():
    """A model whose output is a small difference of large values loses every digit in bf16: the
    manager's bf16 bound catches it and keeps fp32, the report says why."""

    class Cancels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight * (1 + 2**-12))
                self.b.bias.copy_(self.a.bias)

        def forward(self, x):
            return (self.b(x) - self.a(x)) * 1000.0

    torch.manual_seed(2)
    res = gml.optimize(Cancels().eval(), torch.randn(4, 16) * 100, precision="bf16", runtime="torch")
    rec = next(r for r in res.report.records if r.name == "lower_bf16")
    assert rec.status == "rolled back" and "numerics" in rec.error
    assert res.precision.effective == "fp32" and "rolled back" in res.precision.warnings[0]
    assert not any(isinstance(m, kb.bf16_kernel_modules()) for m in res.module.modules())


def test_no_bf16_cpu_gives_warning_and_the_fp32_model(monkeypatch):
    monkeypatch.setattr(
        kb, "bf16_unavailable_reason", lambda target=None: "this CPU has no native bf16 instructions (simulated)"
    )
    model, x = ResBlock().eval(), torch.randn(1, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match="bf16 requested but this CPU has no native bf16"):
        res = gml.optimize(model, x, precision="bf16")
    assert res.precision.requested == "bf16" and res.precision.effective == "fp32"
    assert "simulated" in res.precision.warnings[0] and "fp32 model" in res.precision.summary()
    assert not any(isinstance(m, kb.bf16_kernel_modules()) for m in res.module.modules())
    assert any(isinstance(m, k32.FusedConv) for m in res.module.modules())
    # nothing emulated anywhere: the fp32 model runs on the fp32 engine (or torch), no bf16 node in it
    assert res.runtime is not None and "Bf16" not in str(res.runtime)
    # the pass itself refuses too, clearly
    with pytest.raises(UnsupportedError, match="bf16 is not available"):
        LowerToBf16()(res.module)


def test_unknown_precision_is_an_input_error():
    with pytest.raises(InputError, match="unknown precision"):
        gml.optimize(nn.Linear(2, 2).eval(), torch.randn(1, 2), precision="fp16")


def test_pass_without_fused_kernels_leaves_graph_unchanged():
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    result = LowerToBf16(check_cpu=False)(gm)
    assert not result.modified and "no fused conv/linear" in result.notes[0]


@needs_bf16
def test_model_without_conv_or_linear_says_it_stays_fp32():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = gml.optimize(nn.Sequential(nn.ReLU()).eval(), torch.randn(2, 3), precision="bf16")
    assert res.precision.effective == "fp32" and "no fused conv/linear" in res.precision.warnings[0]


@needs_bf16
def test_lower_bf16_needs_shapes():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)).eval())
    gm = PassManager(fp32_passes(), check_numerics=False, propagate_shapes=False).run(gm).graph_module
    from gml.errors import GMLError

    fused = any(isinstance(m, k32.FusedLinear) for m in gm.modules())
    if fused:
        with pytest.raises(GMLError, match="tensor_meta"):
            LowerToBf16()(gm)


@needs_bf16
def test_bf16_model_saves_and_loads_bit_exact(tmp_path):
    from gml.io import load

    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4)).eval()
    x = torch.randn(2, 3, 6, 6)
    res = gml.optimize(model, x, precision="bf16", runtime="torch")
    res.save(str(tmp_path / "m.pt2"))
    loaded = load(str(tmp_path / "m.pt2"), runtime="torch")
    assert _types(loaded)["Bf16Conv"] == 1 and _types(loaded)["Bf16Linear"] == 1  # lifted to the bf16 twins
    on_engine = load(str(tmp_path / "m.pt2"))  # the default: the plan rebuilt for this CPU
    with torch.no_grad():
        assert torch.equal(loaded(x), res.module(x))
        torch.testing.assert_close(on_engine(x), res.module(x), rtol=2e-2, atol=2e-2)


def test_a_bf16_linear_with_a_gelu_saves(tmp_path):
    """Bf16Linear checked its input for NaN / Inf (GELU maps them to numbers) before it knew it was
    being exported: the data-dependent branch made torch.export refuse every bf16 model with a
    fused Linear + GELU (torchvision ConvNeXt's MLPs). The trace now takes the export branch first."""
    from gml.io import load

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(384, 1536), nn.GELU(), nn.Linear(1536, 4)).eval()  # ConvNeXt-T's first MLP
    x = torch.randn(16, 384)
    res = gml.optimize(model, x, precision="bf16", runtime="torch")
    assert "gelu" in [str(getattr(m, "post_op", "")) for m in res.module.modules()]
    res.save(str(tmp_path / "g.pt2"))
    loaded = load(str(tmp_path / "g.pt2"), runtime="torch")
    with torch.no_grad():
        assert torch.equal(loaded(x), res.module(x))
        nan = x.clone()
        nan[0, 0] = float("nan")
        assert loaded(nan)[0].isnan().all()  # the NaN check still runs outside a trace


@needs_bf16
def test_a_loaded_bf16_transformer_is_one_engine_plan_as_before_saving(tmp_path):
    """The bf16 casts are ATen ``to`` calls in the file: raised back to ``to_bf16`` / ``to_fp32`` on
    load, the engine plans a small BERT as one segment, as it did before saving (6 before the fix)."""
    transformers = pytest.importorskip("transformers")
    from gml.io import load
    from gml.runtime import unavailable_reason

    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000
    )
    model = transformers.BertModel(config).eval()
    x = (torch.randint(5, 1000, (1, 9)), torch.ones(1, 9, dtype=torch.long))
    res = gml.optimize(model, x, precision="bf16")
    res.save(str(tmp_path / "b.pt2"))
    loaded = load(str(tmp_path / "b.pt2"))
    if unavailable_reason() is None and res.engine is not None:
        assert len(loaded.segments()) == len(res.engine.segments()) == 1, str(loaded.runtime)
    with torch.no_grad():
        torch.testing.assert_close(loaded(*x)["last_hidden_state"], res.executable(*x)["last_hidden_state"])


class _OptionalMask(nn.Module):
    """``forward(x, mask=None)`` like timm's ViT blocks: the capture keeps ``mask`` as a placeholder
    with its default, no tensor behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(x)
        return h if mask is None else h + mask


@needs_bf16
def test_an_optional_input_left_at_its_default_does_not_stop_bf16():
    torch.manual_seed(0)
    model, x = _OptionalMask().eval(), torch.randn(2, 16)
    res = gml.optimize(model, x, precision="bf16")
    assert res.precision.effective == "bf16", res.precision.warnings
    with torch.no_grad():
        assert _rel_err(res.executable(x), model(x)) < 2.0**-6


@needs_bf16
def test_one_frame_conv3d_with_depth_padding_stays_fp32_with_the_reason():
    """oneDNN's bf16 Conv3d is wrong on a one-frame clip with depth padding (the bf16 fuzz property,
    seed 20261128: relative error 0.7); the pass declines that conv alone, the next one runs bf16."""

    class Clip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.one_frame = nn.Conv3d(3, 8, 3, padding=1)  # depth 1, depth padding 1: declined
            self.after = nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1))  # no depth padding: bf16

        def forward(self, x):
            return self.after(self.one_frame(x))

    torch.manual_seed(0)
    model, x = Clip().eval(), torch.randn(1, 3, 1, 6, 6)
    res = gml.optimize(model, x, precision="bf16", runtime="torch")
    rec = next(r for r in res.report.records if r.name == "lower_bf16")
    assert rec.status == "applied" and rec.matches == 1
    (skip,) = [s for s in rec.skips if s.node == "one_frame"]
    assert "one-frame Conv3d with depth padding" in skip.reason
    kinds = {name: type(m).__name__ for name, m in res.module.named_modules() if name in ("one_frame", "after")}
    assert kinds == {"one_frame": "FusedConv", "after": "Bf16Conv"}
    with torch.no_grad():
        assert _rel_err(res.module(x), model(x)) <= BF16_TOLERANCE.rtol


def test_conv_refusal_names_only_the_one_frame_padded_conv3d():
    conv = k32.FusedConv.from_conv(nn.Conv3d(2, 2, 3, padding=1))
    assert kb.conv_refusal(conv, (1, 2, 1, 4, 4)) is not None
    assert kb.conv_refusal(conv, (1, 2, 2, 4, 4)) is None  # two frames: exact
    no_depth_pad = k32.FusedConv.from_conv(nn.Conv3d(2, 2, (1, 3, 3), padding=(0, 1, 1)))
    assert kb.conv_refusal(no_depth_pad, (1, 2, 1, 4, 4)) is None
    assert kb.conv_refusal(k32.FusedConv.from_conv(nn.Conv2d(2, 2, 3, padding=1)), (1, 2, 1, 4)) is None


def test_conv2d_refusal_names_only_one_column_shapes_with_a_width_stride():
    """oneDNN's AMX bf16 Conv2d is wrong over a one-column input with width padding and on a one-column
    output, both with a width stride > 1 (kernels/bf16._conv2d_refusal); ordinary strided convs pass."""

    def conv(**kw):
        return k32.FusedConv.from_conv(nn.Conv2d(3, 4, **kw))

    dilated = conv(kernel_size=2, stride=2, padding=1, dilation=2)
    assert "one-column output" in kb.conv_refusal(dilated, (1, 3, 9, 2))  # output width 1 (the fuzz case)
    assert kb.conv_refusal(dilated, (1, 3, 9, 6)) is None  # output width 3
    padded = conv(kernel_size=2, stride=2, padding=1)
    assert "one-column input" in kb.conv_refusal(padded, (1, 3, 8, 1))
    assert kb.conv_refusal(conv(kernel_size=3, stride=1, padding=1), (1, 3, 8, 1)) is None  # width stride 1
    assert kb.conv_refusal(conv(kernel_size=3, stride=2, padding=1), (1, 3, 56, 56)) is None  # ResNet's
    assert kb.conv_refusal(conv(kernel_size=(3, 1), stride=(2, 1)), (1, 3, 9, 1)) is None  # no width stride
