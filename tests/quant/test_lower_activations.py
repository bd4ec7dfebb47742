"""LowerToGML on MobileNet / EfficientNet-style graphs: activations other than ReLU stay INT8.

Models go through GML's own frontend (normalize → fold BN → prepare with the GML BackendConfig →
calibrate → reference graph), as ``gml.quantize`` runs them, then through ``LowerToGML``. Checked:
which GML module every op became (golden node-type counts and post-ops), the numerics against the
reference Q/DQ graph and the fp32 model, and the cases that stay fp32 with their reason.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.kernels.backend import QParams
from gml.kernels.fp32 import NO_POST_OP, PostOp
from gml.quant.frontend import ReferenceResult, prepare_reference
from gml.quant.lower import LoweringResult, LowerToGML
from gml.quant.modules import (
    GML_MODULES,
    QActivation,
    QCat,
    QConv1d,
    QConv2d,
    QConv3d,
    QHardtanh,
    QLinear,
    QMean,
    QMove,
    RuntimeArg,
)

SHAPE = (1, 3, 16, 16)
RELU6 = PostOp("hardtanh", (0.0, 6.0))


def _batches(n: int, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics to fold (a fresh BN is the identity)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data = torch.rand(m.num_features, generator=g) + 0.5
            m.bias.data = torch.rand(m.num_features, generator=g) * 0.4 - 0.2
            m.running_mean = torch.rand(m.num_features, generator=g) * 0.2 - 0.1
            m.running_var = torch.rand(m.num_features, generator=g) + 0.5
    return model.eval()


def reference(model: nn.Module, backend: str = "onednn", shape: tuple[int, ...] = SHAPE) -> ReferenceResult:
    return prepare_reference(model, (torch.randn(*shape),), _batches(4, shape), backend=backend, progress=False)


def lower(ref: ReferenceResult, backend: str = "onednn") -> tuple[fx.GraphModule, LoweringResult, LowerToGML]:
    pass_ = LowerToGML(backend)
    result = pass_(copy.deepcopy(ref.graph_module))
    assert isinstance(result, LoweringResult)
    return result.graph_module, result, pass_


def module_counts(gm: fx.GraphModule) -> Counter[str]:
    return Counter(type(gm.get_submodule(str(n.target))).__name__ for n in gm.graph.nodes if n.op == "call_module")


def modules_of_type(gm: fx.GraphModule, cls: type[nn.Module]) -> list[Any]:
    """The ``cls`` modules the graph calls, in graph order."""
    called = (gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module")
    return [m for m in called if type(m) is cls]


def fp32_ops(gm: fx.GraphModule) -> list[str]:
    """Nodes that compute in fp32: anything but a GML module, placeholders and the output."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), GML_MODULES):
            continue
        out.append(n.name)
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def check_numerics(gm: fx.GraphModule, ref: ReferenceResult, model: nn.Module, min_ref: float, min_fp32: float):
    with torch.no_grad():
        for x in _batches(2, seed=7):
            out, expected, fp32 = gm(x), ref.graph_module(x), model(x)
            assert out.dtype == torch.float32 and out.shape == expected.shape
            assert cosine(out, expected) > min_ref
            assert cosine(out, fp32) > min_fp32


# ---------------------------------------------------------------- MobileNetV2 block
class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand → BN → ReLU6, 3x3 depthwise → BN → ReLU6, 1x1 project → BN,
    plus the identity skip (torchvision's ``InvertedResidual`` with stride 1, in == out)."""

    def __init__(self, ch: int, expand: int = 4) -> None:
        super().__init__()
        hidden = ch * expand
        self.conv = nn.Sequential(
            nn.Conv2d(ch, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, ch, 1, bias=False),
            nn.BatchNorm2d(ch),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class MobileNetV2ish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.block = InvertedResidual(8)
        self.head = nn.Sequential(nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.block(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


@pytest.fixture(scope="module")
def mbv2() -> nn.Module:
    torch.manual_seed(0)
    return _randomize_bn(MobileNetV2ish())


@pytest.fixture(scope="module")
def mbv2_ref(mbv2: nn.Module) -> ReferenceResult:
    return reference(mbv2)


def test_mobilenet_v2_block_has_no_fp32_op(mbv2: nn.Module, mbv2_ref: ReferenceResult):
    gm, result, pass_ = lower(mbv2_ref)
    assert fp32_ops(gm) == []
    assert result.skips == [] and pass_.coverage.kept_fp32 == []
    assert module_counts(gm) == {
        "Quantize": 1,
        "QConv2d": 4,  # stem, expand, depthwise, head: each with ReLU6 fused as hardtanh(0, 6)
        "QConv2dAdd": 1,  # project + the identity skip (oneDNN sum post-op)
        "QAdaptiveAvgPool2d": 1,
        "QFlatten": 1,
        "QLinear": 1,  # fp32 logits
    }
    convs = modules_of_type(gm, QConv2d)
    assert [c.post_op for c in convs] == [RELU6] * 4
    assert sorted(c.spec.groups for c in convs) == [1, 1, 1, 32]
    # the frontend fused conv + ReLU6 into one observed op and says so
    fused = [o.detail for o in mbv2_ref.report.ops if "ReLU6" in o.detail]
    assert fused == ["fused Conv2d + ReLU6"] * 4


def test_mobilenet_v2_block_numerics(mbv2: nn.Module, mbv2_ref: ReferenceResult):
    gm, _, _ = lower(mbv2_ref)
    check_numerics(gm, mbv2_ref, mbv2, min_ref=0.9999, min_fp32=0.999)


def test_relu6_output_observer_stays_inside_zero_six(mbv2_ref: ReferenceResult):
    """The fused conv + ReLU6 uses the ordinary min/max observer: its range is never wider than [0, 6]."""
    gm, _, _ = lower(mbv2_ref)
    for c in modules_of_type(gm, QConv2d):
        qp = c.output_qparams
        assert qp.zero_point == 0 and 255 * qp.scale <= 6.0 + 1e-6


# ---------------------------------------------------------------- MobileNetV3 / EfficientNet zoo
class Zoo(nn.Module):
    """Conv + ReLU6 / Hardswish / SiLU / ReLU, a squeeze-excitation gate (avg pool → conv → ReLU →
    conv → Hardsigmoid, times the map), a standalone ReLU6, a spatial mean and Linear + ReLU6."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
        self.c2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.Hardswish())
        self.c3 = nn.Sequential(nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.SiLU())
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(16, 4, 1), nn.ReLU(), nn.Conv2d(4, 16, 1), nn.Hardsigmoid()
        )
        self.act = nn.ReLU6()
        self.fc1 = nn.Sequential(nn.Linear(16, 16), nn.ReLU6())
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c3(self.c2(self.c1(x)))
        x = self.act(x * self.se(x))
        return self.fc2(self.fc1(x.mean([2, 3])))


@pytest.fixture(scope="module")
def zoo() -> nn.Module:
    torch.manual_seed(0)
    return _randomize_bn(Zoo())


def test_zoo_golden_onednn(zoo: nn.Module):
    ref = reference(zoo)
    gm, result, _ = lower(ref)
    assert fp32_ops(gm) == [] and result.skips == []
    assert module_counts(gm) == {
        "Quantize": 1,
        "QConv2d": 5,  # c1 + ReLU6, c2 + hardswish, c3 + swish, se conv + relu, se conv
        "QAdaptiveAvgPool2d": 1,
        "QActivation": 1,  # hardsigmoid
        "QMul": 1,  # the SE gate [N, C, 1, 1] times the map, broadcast
        "QHardtanh": 1,  # the standalone ReLU6: a clamp of the integers
        "QMean": 1,
        "QLinear": 2,  # fc1 + ReLU6, fc2 (fp32 logits)
    }
    assert [c.post_op for c in modules_of_type(gm, QConv2d)] == [
        RELU6,
        PostOp("hardswish"),
        PostOp("swish"),
        PostOp("relu"),
        NO_POST_OP,
    ]
    assert [lin.post_op for lin in modules_of_type(gm, QLinear)] == [RELU6, NO_POST_OP]
    (act,) = modules_of_type(gm, QActivation)
    assert act.post_op == PostOp("hardsigmoid")
    # torch's quantized sigmoids write fixed qparams: the frontend observes them with exactly those
    assert (act.output_qparams.scale, act.output_qparams.zero_point) == (1 / 256, 0)
    (clamp,) = modules_of_type(gm, QHardtanh)
    assert clamp.input_qparams == clamp.output_qparams  # shares its input's observer
    (mean,) = modules_of_type(gm, QMean)
    assert mean.dims == (2, 3) and not mean.keepdim
    check_numerics(gm, ref, zoo, min_ref=0.9999, min_fp32=0.99)


def test_zoo_fbgemm_keeps_silu_fp32_with_the_reason(zoo: nn.Module):
    """FBGEMM has no hardswish / SiLU epilogue: hardswish becomes its own INT8 op after the conv,
    SiLU (no quantized kernel at all) stays fp32 and the lowering says why."""
    ref = reference(zoo, backend="fbgemm")
    gm, result, pass_ = lower(ref, backend="fbgemm")
    counts = module_counts(gm)
    assert counts["QConv2d"] == 5 and counts["QActivation"] == 2  # hardswish, hardsigmoid
    assert counts["SiLU"] == 1 and counts["Quantize"] == 2 and counts["Dequantize"] == 1
    assert [c.post_op for c in modules_of_type(gm, QConv2d)] == [
        RELU6,
        NO_POST_OP,
        NO_POST_OP,
        PostOp("relu"),
        NO_POST_OP,
    ]
    assert [s.node for s in result.skips] == ["c3_2"]
    assert (
        result.skips[0].reason == "no INT8 kernel for SiLU on its own (only fused after a conv or linear); kept in fp32"
    )
    assert [e.op for e in pass_.coverage.kept_fp32] == ["SiLU"]
    check_numerics(gm, ref, zoo, min_ref=0.9999, min_fp32=0.99)


def test_fused_activation_the_backend_cannot_run_is_declined_with_the_reason(zoo: nn.Module):
    """A oneDNN reference graph (conv + hardswish fused) lowered for fbgemm: that conv stays fp32."""
    ref = reference(zoo, backend="onednn")
    gm, result, _ = lower(ref, backend="fbgemm")
    reasons = {s.node: s.reason for s in result.skips}
    assert reasons["c2_0"] == "the fbgemm backend has no INT8 conv2d kernel with a hardswish post-op; kept in fp32"
    assert reasons["c3_0"] == "the fbgemm backend has no INT8 conv2d kernel with a swish post-op; kept in fp32"
    assert module_counts(gm)["ConvAct2d"] == 2  # the reference's fused modules run in fp32
    check_numerics(gm, ref, zoo, min_ref=0.9999, min_fp32=0.99)


def test_gelu_stays_fp32_with_the_reason():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GELU(), nn.Conv2d(8, 4, 1)).eval()
    ref = reference(model)
    gm, result, _ = lower(ref)
    assert [(s.node, s.reason) for s in result.skips] == [("_1", "no INT8 kernel for GELU; kept in fp32")]
    assert module_counts(gm)["GELU"] == 1


# ---------------------------------------------------------------- ShuffleNet head: mean and shape queries
class MeanHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n = y.size(0)  # a shape query on a quantized value: reads the uint8 tensor, no Dequantize
        return self.fc(y.mean([2, 3])).reshape(n, -1)


def test_spatial_mean_is_a_global_pool_and_shape_queries_read_uint8():
    torch.manual_seed(0)
    model = MeanHead().eval()
    ref = reference(model)
    gm, result, _ = lower(ref)
    assert result.skips == []
    counts = module_counts(gm)
    assert counts["QMean"] == 1 and counts["Dequantize"] == 1  # only the logits, before the reshape
    size = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size")
    assert isinstance(gm.get_submodule(str(size.args[0].target)), QConv2d)
    check_numerics(gm, ref, model, min_ref=0.9999, min_fp32=0.999)


def test_qmean_over_other_dims_matches_the_integer_mean():
    in_qp, out_qp = QParams(0.05, 100), QParams(0.051, 100)  # finer than the input grid, covers it
    x = torch.randint(0, 256, (2, 8, 5, 5), dtype=torch.uint8)
    xf = (x.float() - 100) * 0.05
    for dims, keepdim in (((2, 3), False), ((-1, -2), True), ((1,), False)):
        y = QMean(dims, keepdim, in_qp, out_qp)(x)
        ref = xf.mean(dims, keepdim)
        assert y.shape == ref.shape
        assert float(((y.float() - 100) * 0.051 - ref).abs().max()) <= 0.051 / 2 + 1e-6


# ---------------------------------------------------------------- ShuffleNet: channel shuffle and split
class ShuffleBlock(nn.Module):
    """torchvision ShuffleNetV2's stride-1 unit: split the channels in two, convolve one half,
    concatenate, shuffle the channels (view → transpose → contiguous → view with run-time sizes)."""

    def __init__(self, ch: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1), nn.ReLU())
        half = ch // 2
        self.branch = nn.Sequential(
            nn.Conv2d(half, half, 1),
            nn.ReLU(),
            nn.Conv2d(half, half, 3, padding=1, groups=half),
            nn.Conv2d(half, half, 1),
        )
        self.head = nn.Conv2d(ch, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        a, b = x.chunk(2, dim=1)
        x = torch.cat((a, self.branch(b)), dim=1)
        n, c, h, w = x.size()
        x = x.view(n, 2, c // 2, h, w)
        x = torch.transpose(x, 1, 2).contiguous()
        return self.head(x.view(n, -1, h, w))


def test_channel_shuffle_and_split_move_uint8():
    torch.manual_seed(0)
    model = ShuffleBlock().eval()
    ref = reference(model)
    gm, result, pass_ = lower(ref)
    assert result.skips == [] and pass_.coverage.kept_fp32 == []
    counts = module_counts(gm)
    assert counts["QMove"] == 6 and counts["QCat"] == 1 and counts["Quantize"] == 1
    moves = [(m.method, m.item) for m in modules_of_type(gm, QMove)]
    assert sorted(moves, key=str) == sorted(
        [("chunk", 0), ("chunk", 1), ("view", None), ("transpose", None), ("contiguous", None), ("view", None)],
        key=str,
    )
    # the sizes are read off the uint8 tensor and passed to the views at run time: no Dequantize
    # anywhere (the head conv writes the fp32 output itself)
    assert "Dequantize" not in counts
    size = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size")
    assert isinstance(gm.get_submodule(str(size.args[0].target)), QCat)
    view = next(
        n
        for n in gm.graph.nodes
        if n.op == "call_module" and getattr(gm.get_submodule(n.target), "method", "") == "view"
    )
    assert len(view.args) == 1 + 4  # the value, then n, c // 2, h, w computed from size()
    check_numerics(gm, ref, model, min_ref=0.9999, min_fp32=0.999)


def test_qmove_replays_the_op_on_the_integers():
    qp = QParams(0.1, 128)
    x = torch.randint(0, 256, (2, 8, 3, 3), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    shuffle = QMove("view", [RuntimeArg(), 2, 4, 3, 3], qp, qp)
    assert torch.equal(shuffle(x, 2), x.reshape(2, 2, 4, 3, 3))  # channels-last: view would need reshape
    assert torch.equal(QMove("chunk", [2, 1], qp, qp, item=1)(x), x[:, 4:])
    # other output qparams: requantized, exactly as the reference's quantize(dequantize(...)) would
    out = QParams(0.2, 128)
    y = QMove("permute", [[0, 2, 3, 1]], qp, out)(x)
    assert torch.equal(
        y, torch.quantize_per_tensor((x.permute(0, 2, 3, 1).float() - 128) * 0.1, 0.2, 128, torch.quint8).int_repr()
    )
    with pytest.raises(ValueError, match="chunk needs the index"):
        QMove("chunk", [2, 1], qp, qp)


def test_data_movement_without_an_int8_replay_stays_fp32_with_the_reason():
    class Roll(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.roll(self.a(x), 1, 2))

    ref = reference(Roll().eval())
    gm, result, _ = lower(ref)
    assert [(s.node, s.reason) for s in result.skips] == [("roll", "no INT8 kernel for torch.roll; kept in fp32")]
    assert module_counts(gm) == {"Quantize": 2, "QConv2d": 2, "Dequantize": 1}


def test_fp32_conv_output_read_by_an_activation_its_kernel_lacks():
    """conv → sigmoid → model output, all fp32 after the conv: the conv still gets an fp32-output
    INT8 kernel and sigmoid runs after it (oneDNN's conv has no sigmoid post-op)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sigmoid()).eval()
    ref = reference(model)
    g = ref.graph_module.graph
    sigmoid = next(
        n for n in g.nodes if n.op == "call_module" and isinstance(ref.graph_module.get_submodule(n.target), nn.Sigmoid)
    )
    dq = sigmoid.args[0]
    sigmoid.replace_input_with(dq, dq.args[0].args[0])  # read the conv's fp32 result directly
    out = next(n for n in g.nodes if n.op == "output")
    out.replace_input_with(out.args[0], sigmoid)  # and return sigmoid unquantized
    g.eliminate_dead_code()
    ref.graph_module.recompile()
    gm, result, _ = lower(ref)
    assert result.skips == []
    assert module_counts(gm) == {"Quantize": 1, "QConv2d": 1, "Sigmoid": 1}
    (conv,) = modules_of_type(gm, QConv2d)
    assert conv.output_qparams is None and conv.post_op == NO_POST_OP
    with torch.no_grad():
        x = _batches(1, seed=5)[0]
        assert cosine(gm(x), model(x)) > 0.9999


class _PreActivation(nn.Module):
    """DenseNet's pattern: BN → ReLU → conv (nothing before the BN to fold it into), a lone BN,
    an avg-pool transition, and Inception's functional 3x3 avg pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1, self.relu1 = nn.BatchNorm2d(8), nn.ReLU()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm2 = nn.BatchNorm2d(8)
        self.pool = nn.AvgPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.stem(x)
        y = torch.cat([y, self.conv1(self.relu1(self.norm1(y)))], 1)[:, :8]
        y = self.pool(self.norm2(y))
        return self.conv2(F.avg_pool2d(y, kernel_size=3, stride=1, padding=1))


def test_bn_without_a_conv_before_it_and_avg_pools_are_int8():
    torch.manual_seed(0)
    model = _randomize_bn(_PreActivation())
    ref = reference(model)
    gm, result, _ = lower(ref)
    counts = module_counts(gm)
    assert counts["QBatchNorm2d"] == 2 and counts["QAvgPool2d"] == 2
    relus = sorted(
        gm.get_submodule(str(n.target)).relu
        for n in gm.graph.nodes
        if "QBatchNorm2d" in str(type(gm.get_submodule(str(n.target))) if n.op == "call_module" else "")
    )
    assert relus == [False, True]  # norm1 took its ReLU along, norm2 stands alone
    assert not [e for e in result.coverage.kept_fp32 if e.op in ("BatchNorm2d", "AvgPool2d", "ReLU")]
    # three integer-domain steps in a row round a little differently from the reference's fp32 ones;
    # the lowered model stays as close to fp32 as the reference graph (both ~0.9996 here)
    check_numerics(gm, ref, model, min_ref=0.9995, min_fp32=0.999)


def test_bn_after_a_conv_is_folded_not_lowered_on_its_own():
    model = _randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    gm, _, _ = lower(reference(model))
    assert "QBatchNorm2d" not in module_counts(gm)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_is_one_int8_kernel_on_onednn(approximate: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate=approximate), nn.Linear(32, 8)).eval()
    shape = (4, 16)
    ref = reference(model, shape=shape)
    gm, result, _ = lower(ref)
    assert "GELU" not in module_counts(gm) and result.skips == []
    first = modules_of_type(gm, QLinear)[0]
    assert first.post_op == PostOp("gelu", (), approximate)
    check_numerics_shaped(gm, ref, model, shape)


def test_linear_gelu_stays_fp32_on_fbgemm_with_the_reason():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    gm, result, _ = lower(reference(model, "fbgemm", shape=(4, 16)), "fbgemm")
    assert module_counts(gm)["GELU"] == 1
    assert [s.reason for s in result.skips] == ["no INT8 kernel for GELU; kept in fp32"]


def check_numerics_shaped(gm: fx.GraphModule, ref: ReferenceResult, model: nn.Module, shape: tuple[int, ...]) -> None:
    with torch.no_grad():
        for x in _batches(2, shape, seed=7):
            assert cosine(gm(x), ref.graph_module(x)) > 0.9999  # the lowering adds no error of its own
            assert cosine(gm(x), model(x)) > 0.995  # the recipe's cost: 16 calibration rows


class FusedMBConvish(nn.Module):
    """EfficientNet-V2's Fused-MBConv with expand ratio 1: ``silu(bn(conv(x))) + x``, then a head."""

    def __init__(self, act: type[nn.Module]) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), act())
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(self.block(x) + x)


@pytest.mark.parametrize(("act", "post_op"), [(nn.SiLU, PostOp("swish")), (nn.Hardswish, PostOp("hardswish"))])
def test_conv_with_its_own_activation_does_not_fuse_with_the_add_after_it(act, post_op):
    """The sum post-op comes before the eltwise one in oneDNN's kernel: act(conv(x) + y) is not
    act(conv(x)) + y, so the conv keeps its activation and the add stays a QAdd."""
    torch.manual_seed(0)
    model = _randomize_bn(FusedMBConvish(act))
    ref = reference(model)
    gm, _, _ = lower(ref)
    counts = module_counts(gm)
    assert (counts["QConv2d"], counts["QAdd"], counts["QConv2dAdd"]) == (3, 1, 0)
    assert [c.post_op for c in modules_of_type(gm, QConv2d)] == [post_op, post_op, NO_POST_OP]
    check_numerics(gm, ref, model, min_ref=0.9999, min_fp32=0.999)


def test_conv_without_activation_still_fuses_with_the_add():
    torch.manual_seed(0)
    model = _randomize_bn(FusedMBConvish(nn.Identity))
    # nn.Identity leaves conv -> bn -> add; with the head after it, the add is not the model output
    gm, _, _ = lower(reference(model))
    assert module_counts(gm)["QConv2dAdd"] == 1


# ---------------------------------------------------------------- video: Conv3d
class Conv3DPlain(nn.Conv3d):
    """Like torchvision's ``Conv3DSimple``: an ``nn.Conv3d`` with its own constructor only."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(cin, cout, kernel_size=3, padding=1, bias=False)


class TinyR3D(nn.Module):
    """Stem conv3d → BN → ReLU → max pool, a residual block of two renamed convs, pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        stem = nn.Conv3d(3, 8, (3, 5, 5), padding=(1, 2, 2), bias=False)
        pool = nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1))
        self.stem = nn.Sequential(stem, nn.BatchNorm3d(8), nn.ReLU(), pool)
        self.conv1 = nn.Sequential(Conv3DPlain(8, 8), nn.BatchNorm3d(8), nn.ReLU())
        self.conv2 = nn.Sequential(Conv3DPlain(8, 8), nn.BatchNorm3d(8))
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.relu(self.conv2(self.conv1(x)) + x)
        return self.fc(torch.flatten(self.pool(x), 1))


VIDEO = (1, 3, 4, 12, 12)


@pytest.fixture(scope="module")
def r3d() -> nn.Module:
    torch.manual_seed(0)
    return _randomize_bn(TinyR3D())


def test_conv3d_lowers_to_qconv3d_with_relu_as_saturation(r3d: nn.Module):
    ref = reference(r3d, shape=VIDEO)
    gm, result, _ = lower(ref)
    counts = module_counts(gm)
    # every conv, the renamed ones included (the tracer keeps them as nn.Conv3d leaves)
    assert counts["QConv3d"] == 3 and counts["QAdd"] == 1 and counts["QMaxPool3d"] == 1 and "Conv3d" not in counts
    convs = modules_of_type(gm, QConv3d)
    assert [c.relu for c in convs] == [True, True, False]
    assert all(c.output_qparams.zero_point == 0 for c in convs if c.relu)
    assert result.skips == [] and fp32_ops(gm) == [] and counts["QAdaptiveAvgPool3d"] == 1
    check_numerics_shaped(gm, ref, r3d, VIDEO)


def test_conv3d_stays_fp32_on_fbgemm(r3d: nn.Module):
    ref = reference(r3d, backend="fbgemm", shape=VIDEO)
    gm, _, _ = lower(ref, backend="fbgemm")
    assert module_counts(gm)["QConv3d"] == 0 and module_counts(gm)["Conv3d"] == 3


# ---------------------------------------------------------------- Conv1d (audio / sequence CNNs)
class TinyTCN(nn.Module):
    """Conv1d → BN → ReLU, a dilated residual Conv1d block, a Hardswish conv, mean over time, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(4, 8, 5, padding=2, bias=False), nn.BatchNorm1d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv1d(8, 8, 3, padding=2, dilation=2), nn.BatchNorm1d(8))
        self.act = nn.ReLU()
        self.down = nn.Sequential(nn.Conv1d(8, 6, 3, stride=2, groups=2), nn.Hardswish())
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.act(self.block(x) + x)
        return self.fc(self.down(x).mean(-1))


SEQ = (1, 4, 32)


@pytest.mark.parametrize("backend", ["onednn", "fbgemm"])
def test_conv1d_runs_on_the_2d_kernel_at_height_one(backend: str):
    torch.manual_seed(0)
    model = _randomize_bn(TinyTCN())
    ref = reference(model, backend=backend, shape=SEQ)
    gm, result, _ = lower(ref, backend=backend)
    counts = module_counts(gm)
    assert counts["QConv1d"] == 3 and counts["QConv2dAdd"] == 0  # the residual stays a QAdd (3-D)
    assert fp32_ops(gm) == [] and result.skips == []
    convs = modules_of_type(gm, QConv1d)
    assert [c.weight.shape[2] for c in convs] == [1, 1, 1]  # [O, I, 1, k]: height 1
    assert [c.spec.dilation for c in convs] == [(1, 1), (1, 2), (1, 1)]
    check_numerics_shaped(gm, ref, model, SEQ)
