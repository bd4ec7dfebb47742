"""INT8 frontend: BackendConfig fusions, observers, calibration errors, reference graph quality."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F
from torch import fx, nn

from gml import nn as gnn
from gml.errors import InputError
from gml.quant.backend_config import (
    OBSERVERS,
    VNNI_INT8,
    PercentileObserver,
    get_backend_config,
    int8_ops,
    qconfig_mapping,
)
from gml.quant.calibrate import calibrate, generate_batches
from gml.quant.frontend import keep_outputs_fp32, prepare, prepare_reference, run_fp32_passes

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


class ResBlockNet(nn.Module):
    """Every pattern of the BackendConfig in the spellings users write (functional relu, +=, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn0(self.stem(x)))
        y = self.bn1(self.conv1(x))
        y += x  # conv + add + relu
        y = y.relu()
        z = self.pool(y) + self.pool(x)  # add (no conv) → fp32-free quantized add
        z = torch.cat([self.avg(z), self.avg(self.conv2(z))], 1)
        return self.fc2(F.relu(self.fc1(torch.flatten(z, 1))))


def _net() -> ResBlockNet:
    torch.manual_seed(0)
    m = ResBlockNet()
    for bn in (m.bn0, m.bn1):  # non-trivial statistics so folding matters
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def _types(gm: fx.GraphModule) -> list[str]:
    mods = dict(gm.named_modules())
    return [type(mods[str(n.target)]).__name__ for n in gm.graph.nodes if n.op == "call_module"]


@pytest.fixture(scope="module")
def ref_result():
    m = _net()
    x = torch.randn(2, 3, 16, 16)
    calib = generate_batches((torch.randn(4, 3, 16, 16),), 6, seed=1)
    return m, prepare_reference(m, (x,), calib, progress=False)


def test_reference_graph_fuses_and_quantizes_every_pattern(ref_result):
    _, res = ref_result
    types = _types(res.graph_module)
    assert types.count("ConvReLU2d") == 1  # stem (+BN folded) + relu
    assert types.count("ConvAddReLU2d") == 1  # conv1 (+BN) + residual add + relu
    assert types.count("Conv2d") == 1  # conv2 alone
    assert types.count("LinearReLU") == 1 and types.count("Linear") == 1
    assert "BatchNorm2d" not in types
    ops = {o.node: o for o in res.report.ops}
    assert not res.report.fp32, [(o.node, o.detail) for o in res.report.fp32]
    assert ops["stem"].detail == "fused Conv2d + ReLU"
    assert ops["conv1"].detail == "fused Conv2d + Add + ReLU"
    assert {o.op for o in res.report.quantized} >= {"Add", "MaxPool2d", "AdaptiveAvgPool2d", "torch.cat", "Flatten"}
    # q/dq pairs around every INT8 value; the logits stay fp32 (fc2 writes them directly)
    code = res.graph_module.code
    n_q = code.count("torch.quantize_per_tensor(")
    assert n_q == code.count(".dequantize()") and n_q >= 10
    out = next(n for n in res.graph_module.graph.nodes if n.op == "output")
    assert out.args[0].name == "fc2"
    assert res.report.notes == ["model outputs kept fp32 (INT8 kernel writes fp32): fc2"]


def test_reference_graph_is_close_to_fp32_and_float_twin_is_fp32(ref_result):
    m, res = ref_result
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        want, got, twin = m(x), res.graph_module(x), res.float_module(x)
    assert _cos(got, want) > 0.999
    assert 0 < (got - want).abs().max() < 0.1  # quantized, not identical
    torch.testing.assert_close(twin, want, atol=1e-5, rtol=1e-4)  # BN folded: fp32 up to rounding
    # the twin and the reference graph share node names op for op
    twin_names = {n.name for n in res.float_module.graph.nodes if n.op == "call_module"}
    ref_names = {n.name for n in res.graph_module.graph.nodes if n.op == "call_module"}
    assert ref_names == twin_names


def test_report_lists_fp32_passes_and_calibration(ref_result):
    _, res = ref_result
    rep = res.report
    assert [r.name for r in rep.fp32_passes.records] == [
        "fold_constants",
        "normalize",
        "recognize_gelu",
        "untie",
        "fold_bn",
        "merge_branches",
        "fold_bn",
        "fold_pad",
        "fold_self_add_into_conv",
        "conv_operand_first",
    ]
    assert rep.fp32_passes.record("fold_bn").matches == 2
    assert rep.calibration.batches == 6 and rep.calibration.samples == 24
    assert "ops INT8" in rep.summary() and "observer=minmax" in rep.summary()
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(rep.table())
    text = console.export_text()
    assert "ConvAddReLU2d" in text and "fused Conv2d + Add + ReLU" in text


def test_op_without_pattern_stays_fp32_with_reason():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.c2(F.gelu(self.c1(x)))

    x = torch.randn(1, 3, 8, 8)
    res = prepare_reference(Net().eval(), (x,), 2, progress=False)
    (gelu,) = res.report.fp32
    assert gelu.op == "GELU"
    assert gelu.detail == "no INT8 pattern for this op in the GML BackendConfig: runs in fp32"
    assert len(res.report.quantized) == 2


def test_fp32_output_false_keeps_the_final_quantize():
    m = nn.Sequential(nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    res = prepare_reference(m, (x,), 2, progress=False, fp32_output=False)
    out = next(n for n in res.graph_module.graph.nodes if n.op == "output")
    assert out.args[0].target == "dequantize"
    assert keep_outputs_fp32(res.graph_module) == ["_0"]
    out = next(n for n in res.graph_module.graph.nodes if n.op == "output")
    assert out.args[0].op == "call_module"
    assert res.graph_module.code.count("quantize_per_tensor(") == 1  # only the input quantize left


def test_backend_config_is_small_and_covers_the_normalized_ops():
    config = get_backend_config("onednn")
    assert len(config.configs) <= 60  # torch's own onednn config has well over 100
    types, fns = int8_ops(config)
    for t in (nn.Conv2d, nn.Linear, nn.ReLU, nn.ReLU6, gnn.Add, gnn.Mul, nn.MaxPool2d, nn.AdaptiveAvgPool2d):
        assert t in types
    # Conv1d on the 2-D kernel everywhere; Conv3d only where a 5-D kernel exists (oneDNN)
    assert {nn.Conv1d, nni.ConvReLU1d, nn.Conv3d, nni.ConvReLU3d} <= set(types)
    fb_types, _ = int8_ops(get_backend_config("fbgemm"))
    assert nn.Conv1d in fb_types and nn.Conv3d not in fb_types
    assert nni.ConvAddReLU2d in types and fns[:3] == (torch.cat, torch.mean, "mean")
    assert {"view", "transpose", torch.transpose} <= set(fns)  # data movement shares qparams
    # BN is folded into a conv before prepare where one precedes it; the rest (DenseNet's
    # pre-activation BN) is quantized on its own, with its ReLU
    assert nn.BatchNorm2d in types and nni.BNReLU2d in types
    with pytest.raises(InputError, match="unknown backend 'tensorrt'"):
        get_backend_config("tensorrt")


class RightConvNet(nn.Module):
    """``x + conv(...)`` where ``x`` is itself a conv output read twice (MobileNetV2's blocks)."""

    def __init__(self, alpha: float = 1) -> None:
        super().__init__()
        self.alpha = alpha
        self.stem = nn.Conv2d(3, 4, 1)
        self.expand, self.project = nn.Conv2d(4, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = self.stem(x)
        return torch.add(x, self.project(F.relu(self.expand(x))), alpha=self.alpha)


def test_conv_on_the_right_of_add_is_fused_with_the_right_conv():
    m = RightConvNet().eval()
    x = torch.randn(2, 3, 8, 8)
    res = prepare_reference(m, (x,), [x], progress=False)
    assert res.report.fp32_passes.record("conv_operand_first").matches == 1
    (fused,) = [mod for mod in res.float_module.modules() if isinstance(mod, nni.ConvAdd2d)]
    assert fused[0].weight.shape == (4, 8, 1, 1)  # the projection conv, not the stem
    torch.testing.assert_close(res.float_module(x), m(x), atol=1e-5, rtol=1e-4)
    assert _cos(res.graph_module(x), m(x)) > 0.999


def test_conv_on_the_right_of_add_with_alpha_is_left_unfused():
    m = RightConvNet(alpha=0.5).eval()
    x = torch.randn(2, 3, 8, 8)
    res = prepare_reference(m, (x,), [x], progress=False)
    rec = res.report.fp32_passes.record("conv_operand_first")
    assert rec.matches == 0 and [s.reason for s in rec.skips] == ["conv on the right of an add with alpha=0.5"]
    assert not [mod for mod in res.graph_module.modules() if isinstance(mod, nni.ConvAdd2d)]
    ops = {o.node: o for o in res.report.ops}
    assert ops["add"].int8 and ops["project"].int8  # still INT8, as two ops
    assert _cos(res.graph_module(x), m(x)) > 0.999


@pytest.mark.parametrize("observer", OBSERVERS)
def test_every_observer_builds_a_working_reference_graph(observer):
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)).eval()
    x = torch.randn(2, 3, 8, 8)
    res = prepare_reference(m, (x,), [x, x], observer=observer, progress=False)
    assert res.report.observer == observer
    assert _cos(res.graph_module(x), m(x)) > 0.995


def test_percentile_observer_clips_outliers_that_minmax_keeps():
    x = torch.randn(100_000)
    x[0] = 50.0  # one outlier
    pct = PercentileObserver(percentile=99.9)
    pct(x)
    scale, _ = pct.calculate_qparams()
    mm = torch.ao.quantization.MinMaxObserver()
    mm(x)
    mm_scale, _ = mm.calculate_qparams()
    assert float(mm_scale) > (50 + 4) / 255  # min/max spans the outlier
    assert float(scale) < 10 / 255  # ~[-3.3, 3.3] at 99.9%
    with pytest.raises(InputError, match="percentile"):
        PercentileObserver(percentile=30)


def test_fbgemm_uses_reduced_range_and_per_tensor_option():
    qmap = qconfig_mapping("minmax", backend="fbgemm", per_channel=False)
    qc = qmap.global_qconfig
    act, w = qc.activation(), qc.weight()
    assert (act.quant_min, act.quant_max) == (0, 127)
    assert w.qscheme == torch.per_tensor_symmetric and w.dtype == torch.qint8
    onednn = qconfig_mapping("minmax").global_qconfig
    assert onednn.activation().quant_max == 255
    assert onednn.weight().qscheme == torch.per_channel_symmetric
    with pytest.raises(InputError, match="unknown observer 'best'"):
        qconfig_mapping("best")


def test_calibrate_rejects_empty_data_and_nan_with_batch_index():
    gm, _ = run_fp32_passes(nn.Sequential(nn.Linear(4, 2)).eval(), (torch.randn(1, 4),))
    prepared = prepare(gm, (torch.randn(1, 4),))
    with pytest.raises(InputError, match="calibration data is empty"):
        calibrate(prepared, [], progress=False)
    with pytest.raises(InputError, match="calibration data of type float is not iterable"):
        calibrate(prepared, 3.0, progress=False)  # type: ignore[arg-type]
    bad = [torch.randn(2, 4), torch.randn(2, 4), torch.full((2, 4), float("nan"))]
    with pytest.raises(InputError, match=r"calibration batch 2 \(input 0, shape \(2, 4\)\) contains 8 NaN/Inf"):
        calibrate(prepared, bad, progress=False)
    with pytest.raises(InputError, match=r"calibration batch 0 \(shapes \(2, 5\)\) does not fit the model"):
        calibrate(prepared, [torch.randn(2, 5)], progress=False)


def test_calibrate_accepts_labelled_pairs_and_counts_samples():
    gm, _ = run_fp32_passes(nn.Sequential(nn.Linear(4, 2)).eval(), (torch.randn(1, 4),))
    prepared = prepare(gm, (torch.randn(1, 4),))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(10, 4), torch.arange(10)), batch_size=4
    )
    stats = calibrate(prepared, loader, progress=True)  # the labels are dropped; the bar is transient
    assert (stats.batches, stats.samples) == (3, 10)
    assert stats.seconds > 0


def test_prepare_reference_rejects_a_single_tensor_and_training_mode():
    m = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(InputError, match="single tensor"):
        prepare_reference(m.eval(), (torch.randn(1, 4),), torch.randn(8, 4), progress=False)
    from gml.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="training mode"):
        prepare_reference(m.train(), (torch.randn(1, 4),), 2, progress=False)


def test_no_torch_ao_deprecation_warning_reaches_the_user():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = prepare_reference(m, (x,), 2, progress=False)
        res.graph_module(x)
    messages = [str(w.message) for w in caught]
    assert not [msg for msg in messages if "deprecated" in msg], messages


@pytest.mark.slow
def test_resnet18_reference_graph_reaches_cosine_target():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m = torchvision.models.resnet18(weights=None).eval()
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(4, 3, 224, 224, generator=g) for _ in range(4)]
    test = torch.randn(4, 3, 224, 224, generator=g)
    # the 8-bit arithmetic of a VNNI target: the reference graph is float math, no kernel runs
    res = prepare_reference(m, (test[:1],), calib, progress=False, arithmetic=VNNI_INT8)
    types = _types(res.graph_module)
    assert (types.count("ConvReLU2d"), types.count("ConvAddReLU2d"), types.count("Conv2d")) == (9, 8, 3)
    assert not res.report.fp32
    with torch.no_grad():
        cos = _cos(res.graph_module(test), m(test))
    assert cos >= 0.9998, cos


class _ReluThroughView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        y = self.lin(x)
        v = y.view(-1, 4)
        y.relu_()  # the write is read through the view `v`
        return self.out(v)


def test_an_inplace_op_read_through_a_view_stops_quantization_with_a_reason():
    from gml.errors import UnsupportedError

    x = torch.randn(2, 8)
    with pytest.raises(UnsupportedError, match=r"in-place op relu_ \(in-place op kept: view shares storage"):
        prepare_reference(_ReluThroughView().eval(), (x,), 2, progress=False)


def test_an_inplace_op_seen_through_its_own_result_is_quantized_correctly():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            a = self.lin(x)
            b = a.add_(x)  # b is a
            self.act(a)  # so b reads relu(lin(x) + x)
            return self.out(b)

    torch.manual_seed(0)
    m, x = M().eval(), torch.randn(16, 8)
    res = prepare_reference(m, (x,), 4, progress=False)
    ref = m(x.clone())
    # the relu must survive: dropping it changes the result far beyond INT8 noise
    err = (res.graph_module(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err


@pytest.mark.parametrize("returning", [True, False], ids=["returns-x", "returns-none"])
def test_an_opaque_call_that_overwrites_its_input_survives_int8(returning):
    """MViT's `_add_shortcut(x, q)` adds the residual in place and its result is unused: torch.ao
    treats ops as pure and dropped it (mvit_v2_s INT8 cosine 0.34) until Normalize made the write
    a data dependence."""
    import gml
    from assets.models import OpaqueShortcut

    torch.manual_seed(0)
    m, x = OpaqueShortcut(returning).eval(), torch.randn(32, 16) * 3
    q = gml.quantize(m, [x[:16], x[16:]], example_inputs=x[:4], per_layer=False)
    ref = m(x.clone())
    err = (q.module(x) - ref).abs().max() / ref.abs().max()
    dropped = m.out(torch.relu(m.lin(x)))  # what the INT8 model computed without the residual
    assert (dropped - ref).abs().max() / ref.abs().max() > 0.2  # the residual matters ...
    assert err < 0.05, err  # ... and the INT8 model keeps it


def test_an_opaque_write_read_through_a_view_stops_quantization_with_a_reason():
    from assets.models import OpaqueWriteThroughView
    from gml.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"add_tail_silently \(opaque call overwrites mul in place: view"):
        prepare_reference(OpaqueWriteThroughView().eval(), (torch.randn(3, 4),), 2, progress=False)


class _ConvTwice(nn.Module):
    def __init__(self, alpha: float = 1.0, share: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.alpha, self.share = alpha, share

    def forward(self, x):
        y = self.conv(x)
        z = torch.add(y, y, alpha=self.alpha)
        return (z, y) if self.share else z


def test_fold_self_add_into_conv_doubles_the_conv_exactly():
    from gml.quant.reference_rewrites import fold_self_add_into_conv

    torch.manual_seed(0)
    model, x = _ConvTwice().eval(), torch.randn(2, 3, 8, 8)
    weight = model.conv.weight.detach().clone()
    gm, report = run_fp32_passes(model, (x,))  # includes the fold
    assert report.record("fold_self_add_into_conv").matches == 1
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "output"]
    assert torch.equal(gm(x), model(x))  # bit-exact: doubling only moves the exponent
    assert torch.equal(model.conv.weight, weight)  # the user's conv is untouched

    # y + 0.5 * y folds too (factor 1.5, rounding differs by about an ulp)
    half = _ConvTwice(alpha=0.5).eval()
    g = _normalized(half)
    assert fold_self_add_into_conv(g).matches == 1
    torch.testing.assert_close(g(x), half(x), rtol=1e-5, atol=1e-6)

    # negative case: a conv whose output is also read elsewhere keeps its add
    g = _normalized(_ConvTwice(share=True).eval())
    assert fold_self_add_into_conv(g).matches == 0
    assert any(isinstance(mod, gnn.Add) for mod in g.modules())


def _normalized(model: nn.Module) -> fx.GraphModule:
    from gml.passes.normalize import Normalize

    g = fx.symbolic_trace(model)
    Normalize()(g)
    return g


def test_int8_of_a_conv_added_to_itself_lowers_and_matches_fp32():
    import gml
    from gml.runtime.target import detect_target

    torch.manual_seed(0)
    model, x = _ConvTwice().eval(), torch.randn(2, 3, 8, 8)
    calib = [torch.randn(2, 3, 8, 8) for _ in range(4)]
    res = gml.quantize(model, calib, example_inputs=(x,), progress=False, cost_policy="off", keep_intermediates=True)
    with torch.no_grad():
        ref, exact, out = model(x), res.reference(x), res.module(x)
    assert (out - exact).abs().max() <= 1e-4 * ref.abs().max()  # the kernels: exact arithmetic
    # 7-bit weights (a target without VNNI, ADR 011) double the weights' rounding error
    bound = 0.05 if detect_target().int8.weight_bits == 8 else 0.1
    assert (out - ref).abs().max() <= bound * ref.abs().max()


@pytest.mark.parametrize("act", [torch.sigmoid, F.hardsigmoid])
def test_a_sigmoid_of_a_model_input_observes_the_input_with_an_ordinary_observer(act):
    class M(nn.Module):
        def forward(self, x):
            return act(x)

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    # x is in the calibration data, so nothing is clipped and only rounding is left
    res = prepare_reference(M().eval(), (x,), [x, *(torch.randn(4, 16) for _ in range(3))], progress=False)
    scales = {
        n.target: getattr(res.graph_module, n.target).item()
        for n in res.graph_module.graph.nodes
        if n.op == "get_attr" and "scale" in str(n.target)
    }
    (in_scale,) = [s for name, s in scales.items() if "input" in name]
    assert in_scale > 4 / 256  # the range of N(0, 1) inputs, not the sigmoid's [0, 1] output grid
    assert (res.graph_module(x) - act(x)).abs().max() < 0.05  # was 0.5 off for negative inputs
