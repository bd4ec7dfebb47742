"""fp32 fused kernels (gml.kernels.fp32) through the engine vs the Python executor."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import gml
from gml.kernels.fp32 import FusedConv, FusedConvAdd, FusedLinear, PostOp
from gml.runtime import compile_engine, unavailable_reason
from runtime.helpers import check_engine, graph_of

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _conv(cin, cout, k, **kw) -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(cin, cout, k, **kw).eval()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "cin,cout,k,kw",
    [
        (3, 8, 3, dict(padding=1)),
        (8, 8, 3, dict(padding=1, groups=8)),
        (6, 9, (3, 5), dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1))),
        (4, 4, 3, dict(padding=3, stride=2)),
    ],
)
def test_fused_conv(cin, cout, k, kw, channels_last):
    x = torch.randn(2, cin, 9, 11)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    check_engine(graph_of(FusedConv.from_conv(_conv(cin, cout, k, **kw), PostOp("relu"))), x)


POST_OPS = [PostOp(), PostOp("hardtanh", (0.0, 6.0)), PostOp("swish"), PostOp("gelu", (), "none")]


@pytest.mark.parametrize("post_op", POST_OPS, ids=str)
def test_fused_conv_post_ops(post_op):
    x = torch.randn(1, 5, 7, 7)
    check_engine(graph_of(FusedConv.from_conv(_conv(5, 6, 3, padding=1), post_op)), x)


@pytest.mark.parametrize("relu", [False, True])
def test_fused_conv_add(relu):
    x, other = torch.randn(1, 6, 8, 8), torch.randn(1, 8, 8, 8)
    mod = FusedConvAdd.from_conv(_conv(6, 8, 3, padding=1), relu=relu, inplace=False)
    check_engine(graph_of(mod, n_inputs=2, wiring=[(0, 1)]), x, other)


@pytest.mark.parametrize("post_op", [PostOp(), PostOp("relu")], ids=str)
def test_fused_linear(post_op):
    torch.manual_seed(0)
    x = torch.randn(3, 20)
    check_engine(graph_of(FusedLinear.from_linear(nn.Linear(20, 7), post_op)), x)


@pytest.mark.slow
def test_optimized_resnet18_through_the_engine():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    gm = gml.optimize(model, (x,)).module
    eng = compile_engine(gm, (x,))
    # every node, one plan: convs (residual adds fused), max pool, average pool, flatten, fc
    assert eng.report.path == "engine" and eng.report.segments == 1, str(eng.report)
    assert eng.report.engine_nodes == 24, str(eng.report)
    with torch.no_grad():
        torch.testing.assert_close(eng(x), gm(x), rtol=1e-4, atol=1e-4)
    plan = next(iter(eng.segments()[0]._plans.values()))[0]
    # free layouts: the convs read and write the layout they pick, no step falls back to oneDNN's
    # reference kernels (a plain NCHW input with an NHWC output did: 13 s per ResNet18 call)
    assert not [i for i in plan.step_impls() if i.startswith("ref")], plan.step_impls()


# ---------------------------------------------------------------- free layouts (gml.runtime.plan)
def _fconv(cin: int, cout: int, *, seed: int = 0, **kw) -> FusedConv:
    torch.manual_seed(seed)
    return FusedConv.from_conv(nn.Conv2d(cin, cout, 3, padding=1, **kw).eval(), PostOp("relu"))


@pytest.mark.parametrize(
    "pool",
    [
        nn.MaxPool2d(3, 2, 1),
        nn.MaxPool2d(2, 2, ceil_mode=True),
        nn.MaxPool2d(3, 1, 1, dilation=2),
        nn.AvgPool2d(3, 2, 1),
        nn.AvgPool2d(3, 2, 1, count_include_pad=False),
        # ceil_mode: the last window at the edge divides by the input elements in it (timm ResNet-D's
        # shortcut pool; 9 x 11 leaves a partial window in both dims)
        nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False),
        nn.AvgPool2d(2, 2, ceil_mode=True),
        nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False),
        nn.AdaptiveAvgPool2d(1),
        nn.AdaptiveAvgPool2d((3, 1)),
    ],
    ids=repr,
)
@pytest.mark.parametrize("cout", [16, 20])  # a whole channel block, and a padded one
def test_fp32_pools_between_convs(pool, cout):
    # conv -> pool -> conv: the pool reads and writes the convs' NHWC layout; the last conv's
    # output goes back to the caller's plain layout
    x = torch.randn(2, 3, 9, 11)
    gm = graph_of(_fconv(3, cout), pool, _fconv(cout, 8, seed=1))
    check_engine(gm, x)


@pytest.mark.parametrize("pool", [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2)], ids=repr)
def test_fp32_pool_first_on_an_nchw_input(pool):
    # the caller's NCHW input is read by a pool writing an NHWC value: reordered to NHWC first (an
    # NCHW -> NHWC primitive would find only oneDNN's reference kernel)
    x = torch.randn(2, 5, 9, 7)
    eng = check_engine(graph_of(pool, _fconv(5, 6)), x)
    plan = next(iter(eng.segments()[0]._plans.values()))[0]
    # reorder to NHWC, pool, conv writing the (channels-last) output directly: no copy after it
    assert plan.num_steps == 3 and not [i for i in plan.step_impls() if i.startswith("ref")], plan.step_impls()


@pytest.mark.parametrize(
    "size,out", [((5, 5), (7, 7)), ((9, 11), (4, 5)), ((9, 11), (7, 7)), ((6, 13), (6, 3))], ids=str
)
def test_fp32_adaptive_pool_with_uneven_windows_is_a_matmul(size, out):
    """VGG's ``AdaptiveAvgPool2d(7)`` of a 5 x 5 map (a 160-pixel input): windows of 1 and 2 rows. No
    oneDNN pooling has such windows; the pool is one matmul by a constant averaging matrix. Before,
    the plan for this shape fell back to torch whole ("not a regular pooling window")."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size)
    head = [nn.AdaptiveAvgPool2d(out), nn.Flatten(1), nn.Linear(16 * out[0] * out[1], 5).eval()]
    for gm in (
        graph_of(_fconv(3, 16), nn.AdaptiveAvgPool2d(out), _fconv(16, 8, seed=1)),
        graph_of(_fconv(3, 16), *head),
    ):
        eng = check_engine(gm, x)
        assert not eng.report.shape_fallbacks, eng.report.shape_fallbacks
        assert not eng.report.reference_steps, eng.report.reference_steps


def test_the_adaptive_pool_matrix_is_torchs_pool():
    from gml.runtime.rules.pool import adaptive_pool_matrix

    x = torch.randn(3, 4, 9, 11, dtype=torch.float64)
    for out in [(7, 7), (4, 5), (9, 11), (1, 1), (12, 3)]:
        k = adaptive_pool_matrix((9, 11), out).double()
        got = (x.flatten(2) @ k).view(3, 4, *out)
        torch.testing.assert_close(got, torch.nn.functional.adaptive_avg_pool2d(x, out), rtol=1e-6, atol=1e-6)


def test_an_uneven_adaptive_pool_over_a_large_map_keeps_its_reason():
    """The averaging matrix grows as ``in x out`` positions: past :data:`MAX_POOL_MATRIX` the matmul
    would do far more work than the pool, and that shape runs in torch with the reason."""
    x = torch.randn(1, 3, 300, 301)
    eng = check_engine(graph_of(_fconv(3, 4), nn.AdaptiveAvgPool2d(7), _fconv(4, 4, seed=1)), x, expect_engine=False)
    assert "uneven windows over 90300 positions" in str(eng.report.shape_fallbacks), eng.report.shape_fallbacks


def test_fp32_pool_then_flatten_and_linear():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, 8)
    gm = graph_of(_fconv(4, 24), nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(24, 5).eval())
    eng = check_engine(gm, x)
    assert eng.report.engine_nodes == 4


def test_fp32_residual_sum_on_a_live_blocked_value():
    # y = conv1(x); z = conv2(y) + y; out = conv3(z) + y: y is still read after the first sum, so
    # the sum accumulates into a copy of y in y's (blocked) layout
    x = torch.randn(1, 16, 10, 10)
    add1 = FusedConvAdd.from_conv(_conv(16, 16, 3, padding=1), relu=True, inplace=False)
    add2 = FusedConvAdd.from_conv(_conv(16, 16, 3, padding=1), relu=False, inplace=False)
    gm = graph_of(_fconv(16, 16), add1, add2, n_inputs=1, wiring=[(0,), (1, 1), (2, 1)])
    check_engine(gm, x)


@pytest.mark.parametrize("channels_last", [False, True])
def test_fp32_values_between_convs_are_nhwc(channels_last):
    # between two convs the plan keeps fp32 values dense channels-last (plan.FP32_FREE_LAYOUT: the
    # layout oneDNN's brgconv runs on; ADR 006, "Layouts"): no step reorders between the convs,
    # none falls back to the reference kernels; an NCHW input is reordered once before the first
    # conv, and the last conv writes the caller's output directly (the executor's layout for it is
    # channels-last too, so no copy follows it)
    x = torch.randn(1, 3, 16, 16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    eng = check_engine(graph_of(_fconv(3, 32), _fconv(32, 32, seed=1), _fconv(32, 8, seed=2)), x)
    plan = next(iter(eng.segments()[0]._plans.values()))[0]
    assert plan.step_names() == ["m0"] * (1 if channels_last else 2) + ["m1", "m2"], plan.step_names()
    assert not [i for i in plan.step_impls() if i.startswith("ref")], plan.step_impls()


# ---------------------------------------------------------------- gml.optimize's runtime
def test_optimize_runs_on_the_engine_by_default():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    res = gml.optimize(model, (x,))
    assert res.engine is not None and res.executable is res.engine, str(res.runtime)
    assert res.runtime.path == "engine" and "runtime: engine" in str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-4, atol=1e-4)
    torch_only = gml.optimize(model, (x,), runtime="torch")
    assert torch_only.engine is None and torch_only.executable.graph_module is torch_only.module
    assert torch_only.runtime.path == "torch" and "runtime='torch'" in str(torch_only.runtime)


def test_optimize_refuses_an_unknown_runtime():
    with pytest.raises(gml.errors.InputError, match="unknown runtime"):
        gml.optimize(nn.Linear(3, 3).eval(), (torch.randn(1, 3),), runtime="onnx")


def test_optimize_keeps_torch_when_the_engine_disagrees(monkeypatch):
    # a wrong engine result (simulated: every weight doubled when the plan is built) is caught by the
    # check against the Python executor: the result runs torch and the report says why
    from gml.runtime import plan as plan_module

    real = plan_module.Builder.conv

    def doubled(self, src, dst, **kw):
        kw["weight"] = kw["weight"] * 2
        return real(self, src, dst, **kw)

    monkeypatch.setattr(plan_module.Builder, "conv", doubled)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    res = gml.optimize(model, (torch.randn(1, 3, 8, 8),))
    assert res.engine is None and res.runtime.path == "torch"
    assert "disagreed with the Python executor" in str(res.runtime)


def test_a_segment_whose_only_node_is_dead_code():
    # fp32 fuzz (gml.optimize on the engine): ``flatten(relu(x))`` computed and never used, between
    # torch nodes, made a segment with no output and no step; its plan reads no input at all
    class Dead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.flatten, self.conv = nn.Flatten(), nn.ConvTranspose1d(1, 1, 1)

        def forward(self, x):
            y = torch.relu(x)
            self.flatten(y)
            return self.conv(y)

    model = Dead().eval()
    x = torch.randn(1, 1, 1)
    res = gml.optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x))


class _SliceAndCat(nn.Module):
    """GhostNet / ReXNet / Inception shapes between convs: channel concatenations (of a conv's NHWC
    output with the caller's NCHW input too), basic-index slices of them (channels, a strided
    spatial slice, an int index with None) — views and copies the engine now plans instead of
    cutting the plan at each."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.c, self.d = nn.Conv2d(12, 6, 1), nn.Conv2d(10, 6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        z = torch.cat([y, self.b(y)], dim=1)[:, :12]  # GhostNet's primary + cheap features, cut to size
        w = z[:, :, 1:, ::2]
        out = self.c(torch.cat([w[:, 6:], w[:, :6]], 1))
        mixed = self.d(torch.cat((x, y[:, 2:]), 1))  # an NCHW input beside an NHWC conv output
        return out, mixed + mixed[:, 0, None]


@pytest.mark.parametrize("shape", [(2, 4, 9, 10), (1, 4, 7, 8)])
def test_slices_and_concatenations_between_convs_run_in_the_plan(shape):
    torch.manual_seed(0)
    model, x = _SliceAndCat().eval(), torch.randn(shape)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1, str(res.runtime)
    assert not [n for n in res.runtime.torch_nodes if n.op in ("cat", "getitem")], str(res.runtime)
    assert res.runtime.reference_steps == {} and not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        for got, want in zip(res.executable(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_advanced_index_and_an_int_cat_stay_in_torch_with_their_reasons():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(4, 4, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.a(x)
            ids = torch.cat([y.argmax(1), y.argmin(1)], 0)
            return self.a(y[:, [2, 0, 1, 3]]), ids

    model, x = M().eval(), torch.randn(1, 4, 5, 5)
    res = gml.optimize(model, x, runtime="engine")
    reasons = {n.op: n.reason for n in res.runtime.torch_nodes}
    assert reasons["getitem"] == "not a lowered GML op (runs in torch)", reasons
    assert reasons["cat"].startswith("cat of torch.int64 tensors"), reasons
    with torch.no_grad():
        for got, want in zip(res.executable(x), model(x)):
            torch.testing.assert_close(got, want)


class _DenseLayer(nn.Module):
    """DenseNet's pre-activation layer: BatchNorm → ReLU → conv over the concatenation of the
    features so far. The norm reads a concat, so no conv takes it (FoldBatchNorm keeps it)."""

    def __init__(self, track_running_stats: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(16, track_running_stats=track_running_stats)
        self.conv = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.cat([y, torch.relu(y)], 1)
        return torch.cat([y, self.conv(torch.relu(self.norm(y)))], 1)


def test_a_batch_norm_no_conv_took_is_a_depthwise_conv_in_the_plan():
    torch.manual_seed(0)
    model = _DenseLayer()
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    model.eval()
    x = torch.randn(2, 3, 10, 10)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.torch_nodes, str(res.runtime)
    assert "norm" in {name for name, _ in res.engine.step_impls()}
    assert res.runtime.reference_steps == {}, str(res.runtime)
    with torch.no_grad():
        for shape in ((2, 3, 10, 10), (1, 3, 7, 9)):
            x = torch.randn(shape)
            torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_batch_norm_with_batch_statistics_stays_in_torch_with_its_reason():
    model, x = _DenseLayer(track_running_stats=False).eval(), torch.randn(2, 3, 10, 10)
    res = gml.optimize(model, x, runtime="engine")
    reasons = {n.name: n.reason for n in res.runtime.torch_nodes}
    assert reasons == {"norm": "BatchNorm with batch statistics (training mode or no running statistics)"}, reasons
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_an_avg_pool_whose_ceil_mode_window_may_pass_its_counted_padding_stays_in_torch():
    x = torch.randn(2, 3, 8, 8)
    gm = graph_of(_fconv(3, 16), nn.AvgPool2d(3, 2, 1, ceil_mode=True), _fconv(16, 8, seed=1))
    eng = compile_engine(gm, (x,))
    assert [n.reason for n in eng.report.torch_nodes] == ["avg pool with ceil_mode counting its padding"]
    torch.testing.assert_close(eng(x), gm(x))


class _SplitSum(nn.Module):
    """SKNet / ResNeSt: a conv's output seen as ``[B, radix, C, H, W]``, summed over the radix."""

    def __init__(self, radix: int, spelling: str, keepdim: bool) -> None:
        super().__init__()
        self.radix, self.spelling, self.keepdim = radix, spelling, keepdim
        self.conv, self.after = nn.Conv2d(3, 4 * radix, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        y = y.view(x.shape[0], self.radix, 4, *x.shape[2:])
        s = y.sum(dim=1, keepdim=self.keepdim) if self.spelling == "method" else torch.sum(y, 1, self.keepdim)
        return self.after(s.flatten(1, 2) if self.keepdim else s)


@pytest.mark.parametrize("spelling", ["method", "torch.sum"])
@pytest.mark.parametrize("radix, batch, keepdim", [(2, 1, False), (2, 2, False), (3, 1, True), (4, 3, False)])
def test_a_sum_over_the_radix_dim_is_adds_of_its_slices(radix, batch, keepdim, spelling):
    """Before, every such sum ended an engine segment (skresnet18: 17 segments, resnest14d: 9; now 1)."""
    torch.manual_seed(0)
    model, x = _SplitSum(radix, spelling, keepdim).eval(), torch.randn(batch, 3, 6, 5)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    assert not [n for n in res.runtime.torch_nodes if n.op == "sum"], str(res.runtime)
    assert not res.runtime.reference_steps, res.runtime.reference_steps
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_sum_over_a_long_dim_runs_in_torch_with_its_reason():
    class Long(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.conv(x)).sum(dim=3)

    torch.manual_seed(0)
    model, x = Long().eval(), torch.randn(1, 3, 4, 16)
    res = gml.optimize(model, x, runtime="engine")
    assert "a sum over 16 values (the engine adds up to 8 slices)" in str(res.runtime.shape_fallbacks), str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


class _Affine(nn.Module):
    """timm's ResMLP ``Affine`` (``addcmul(beta, alpha, x)``) between two linears, or ``x.addcmul``
    with a scale and a broadcast second operand (ConvNeXt-V2's GRN: ``addcmul(bias, weight, x * g)``)."""

    def __init__(self, spelling: str, value: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.alpha, self.beta = nn.Parameter(torch.randn(1, 1, 8)), nn.Parameter(torch.randn(1, 1, 8))
        self.spelling, self.value = spelling, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.spelling == "function":
            y = torch.addcmul(self.beta, self.alpha, y)
        else:  # a method, a run-time gate of the broadcast shape (N, 1, C), a value
            y = y.addcmul(torch.sigmoid(y[:, :1]), self.alpha, value=self.value)
        return self.fc2(y)


@pytest.mark.parametrize(("spelling", "value"), [("function", 1.0), ("method", 1.0), ("method", -0.5)])
def test_addcmul_runs_in_the_plan(spelling, value):
    """Before, each ``torch.addcmul`` ran in torch and cut the plan there (timm ResMLP-12: 26 segments, 2 after)."""
    model, x = _Affine(spelling, value).eval(), torch.randn(2, 5, 8)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    assert not [n for n in res.runtime.torch_nodes if "addcmul" in n.name], str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_an_addcmul_the_engine_cannot_take_stays_in_torch_with_its_reason():
    from torch import fx
    from torch.fx.passes.shape_prop import ShapeProp

    g = fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("t")
    g.output(g.call_function(torch.addcmul, (x, t, t), {"value": float("inf")}))
    gm = fx.GraphModule(nn.Module(), g)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    ShapeProp(gm).propagate(a, b)
    eng = compile_engine(gm, [a, b])
    assert eng.report.path == "torch"
    assert [n.reason for n in eng.report.torch_nodes] == ["addcmul with value=inf (the engine takes a finite number)"]
