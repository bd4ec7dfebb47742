"""LowerToGML on MobileNet / EfficientNet-style graphs: activations other than ReLU stay INT8.

Models go through GML's own frontend (normalize → fold BN → prepare with the GML BackendConfig →
calibrate → reference graph), as ``gml.quantize`` runs them, then through ``LowerToGML``. Checked:
which GML module every op became (golden node-type counts and post-ops), the numerics against the
reference Q/DQ graph and the fp32 model, and the cases that stay fp32 with their reason.
"""

from __future__ import annotations

import copy
import operator
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.ir import library
from gml.ir.ops import op_kind
from gml.ir.values import NO_POST_OP, PostOp, QParams
from gml.quant.frontend import ReferenceResult, prepare_reference
from gml.quant.fuse_int8 import FuseQConvAdd
from gml.quant.lower import LOWERED, LoweringResult, LowerToGML, coverage_of
from gml.quant.modules import QMean, QMove, RuntimeArg

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


def lower(ref: ReferenceResult, backend: str = "onednn") -> tuple[fx.GraphModule, LoweringResult]:
    """The INT8 pipeline's lowering steps: LowerToGML, then FuseQConvAdd."""
    result = LowerToGML(backend)(copy.deepcopy(ref.graph_module))
    assert isinstance(result, LoweringResult)
    gm = FuseQConvAdd()(result.graph_module).graph_module
    return gm, result


def op_counts(gm: fx.GraphModule) -> Counter[str]:
    """What each compute node of a lowered graph runs: the gml op, or the torch op (by kind / label)."""
    mods = dict(gm.named_modules())
    return Counter(
        library.gml_op_name(n) or op_kind(n, mods) or _label(n, mods) for n in gm.graph.nodes if n.op.startswith("call")
    )


def _label(n: fx.Node, mods: dict[str, nn.Module]) -> str:
    return type(mods[str(n.target)]).__name__ if n.op == "call_module" else str(getattr(n.target, "__name__", n.target))


class Call:
    """A gml op call read through its schema (argument names, docs/ir.md)."""

    def __init__(self, node: fx.Node) -> None:
        self.node, self.args = node, library.op_args(node)

    @property
    def post_op(self) -> PostOp:
        a = self.args
        if "op" in a:  # qactivation
            return PostOp(a["op"], tuple(a["scalars"]))
        return PostOp(a["post_op"], tuple(a.get("post_op_scalars", ())), a.get("post_op_algorithm", ""))

    @property
    def input_qparams(self) -> QParams:
        return QParams(self.args["x_scale"], self.args["x_zero_point"])

    @property
    def output_qparams(self) -> QParams | None:
        qp = library.output_qparams_args(self.node)
        return None if qp is None else QParams(*qp)

    @property
    def ndim(self) -> int:
        return len(self.args["stride"])


def calls(gm: fx.GraphModule, op: str, ndim: int | None = None) -> list[Call]:
    """The calls of gml op ``op`` (convs: of spatial rank ``ndim``), in graph order."""
    found = [Call(n) for n in gm.graph.nodes if library.gml_op_name(n) == op]
    return [c for c in found if ndim is None or c.ndim == ndim]


def fp32_ops(gm: fx.GraphModule, shape: tuple[int, ...] = SHAPE) -> list[str]:
    """Nodes computing an fp32 tensor that no gml op computes (run once on an input of ``shape``)."""
    out: list[str] = []

    class Run(fx.Interpreter):
        def run_node(self, n: fx.Node):
            y = super().run_node(n)
            fp = isinstance(y, torch.Tensor) and y.is_floating_point()
            if n.op.startswith("call") and fp and library.gml_op_name(n) is None:
                out.append(n.name)
            return y

    with torch.no_grad():
        Run(gm).run(torch.randn(shape))
    return out


def moves(gm: fx.GraphModule) -> list[tuple[str, int | None]]:
    """``(op, item)`` of each data movement the lowering replayed on uint8 values."""
    out = []
    for n in gm.graph.nodes:
        entry = n.meta.get(LOWERED)
        if entry is None or library.gml_op_name(n) not in (None, "requantize"):
            continue
        node = n.args[0] if library.gml_op_name(n) == "requantize" else n
        out.append((entry.result, node.args[1] if node.target is operator.getitem else None))
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
    gm, result = lower(mbv2_ref)
    assert fp32_ops(gm) == []
    assert result.skips == [] and coverage_of(gm).kept_fp32 == []
    assert op_counts(gm) == {
        "quantize": 1,
        "qconv": 4,  # stem, expand, depthwise, head: each with ReLU6 fused as hardtanh(0, 6)
        "qconv_add": 1,  # project + the identity skip (oneDNN sum post-op)
        "qadaptive_avg_pool": 1,
        "flatten": 1,
        "qlinear": 1,  # fp32 logits
    }
    convs = calls(gm, "qconv")
    assert [c.post_op for c in convs] == [RELU6] * 4
    assert sorted(c.args["groups"] for c in convs) == [1, 1, 1, 32]
    # the frontend fused conv + ReLU6 into one observed op and says so
    fused = [o.detail for o in mbv2_ref.report.ops if "ReLU6" in o.detail]
    assert fused == ["fused Conv2d + ReLU6"] * 4


def test_mobilenet_v2_block_numerics(mbv2: nn.Module, mbv2_ref: ReferenceResult):
    gm, _ = lower(mbv2_ref)
    check_numerics(gm, mbv2_ref, mbv2, min_ref=0.9999, min_fp32=0.999)


def test_relu6_output_observer_stays_inside_zero_six(mbv2_ref: ReferenceResult):
    """The fused conv + ReLU6 uses the ordinary min/max observer: its range is never wider than [0, 6]."""
    gm, _ = lower(mbv2_ref)
    for c in calls(gm, "qconv"):
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
    gm, result = lower(ref)
    assert fp32_ops(gm) == [] and result.skips == []
    assert op_counts(gm) == {
        "quantize": 1,
        "qconv": 5,  # c1 + ReLU6, c2 + hardswish, c3 + swish, se conv + relu, se conv
        "qadaptive_avg_pool": 1,
        "qactivation": 2,  # hardsigmoid; the standalone ReLU6 (a clamp of the integers)
        "qmul": 1,  # the SE gate [N, C, 1, 1] times the map, broadcast
        "qmean": 1,
        "qlinear": 2,  # fc1 + ReLU6, fc2 (fp32 logits)
    }
    assert [c.post_op for c in calls(gm, "qconv")] == [
        RELU6,
        PostOp("hardswish"),
        PostOp("swish"),
        PostOp("relu"),
        NO_POST_OP,
    ]
    assert [lin.post_op for lin in calls(gm, "qlinear")] == [RELU6, NO_POST_OP]
    act, clamp = calls(gm, "qactivation")
    assert act.post_op == PostOp("hardsigmoid")
    # torch's quantized sigmoids write fixed qparams: the frontend observes them with exactly those
    assert (act.output_qparams.scale, act.output_qparams.zero_point) == (1 / 256, 0)
    assert clamp.post_op == RELU6
    assert clamp.input_qparams == clamp.output_qparams  # shares its input's observer
    (mean,) = calls(gm, "qmean")
    assert mean.args["dim"] == [2, 3] and not mean.args["keepdim"]
    check_numerics(gm, ref, zoo, min_ref=0.9999, min_fp32=0.99)


def test_zoo_fbgemm_keeps_silu_fp32_with_the_reason(zoo: nn.Module):
    """FBGEMM has no hardswish / SiLU epilogue: hardswish becomes its own INT8 op after the conv,
    SiLU (no quantized kernel at all) stays fp32 and the lowering says why."""
    ref = reference(zoo, backend="fbgemm")
    gm, result = lower(ref, backend="fbgemm")
    counts = op_counts(gm)
    assert counts["qconv"] == 5 and counts["qactivation"] == 3  # hardswish, hardsigmoid, ReLU6 clamp
    assert counts["silu"] == 1 and counts["quantize"] == 2 and counts["dequantize"] == 1
    assert [c.post_op for c in calls(gm, "qactivation")][:2] == [PostOp("hardswish"), PostOp("hardsigmoid")]
    assert [c.post_op for c in calls(gm, "qconv")] == [
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
    assert [e.op for e in result.coverage.kept_fp32] == ["SiLU"]
    check_numerics(gm, ref, zoo, min_ref=0.9999, min_fp32=0.99)


def test_fused_activation_the_backend_cannot_run_is_declined_with_the_reason(zoo: nn.Module):
    """A oneDNN reference graph (conv + hardswish fused) lowered for fbgemm: that conv stays fp32."""
    ref = reference(zoo, backend="onednn")
    gm, result = lower(ref, backend="fbgemm")
    reasons = {s.node: s.reason for s in result.skips}
    assert reasons["c2_0"] == "the fbgemm backend has no INT8 conv2d kernel with a hardswish post-op; kept in fp32"
    assert reasons["c3_0"] == "the fbgemm backend has no INT8 conv2d kernel with a swish post-op; kept in fp32"
    assert op_counts(gm)["ConvAct2d"] == 2  # the reference's fused modules run in fp32
    check_numerics(gm, ref, zoo, min_ref=0.9999, min_fp32=0.99)


def test_gelu_stays_fp32_with_the_reason():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GELU(), nn.Conv2d(8, 4, 1)).eval()
    ref = reference(model)
    gm, result = lower(ref)
    assert [(s.node, s.reason) for s in result.skips] == [("_1", "no INT8 kernel for GELU; kept in fp32")]
    assert op_counts(gm)["gelu"] == 1


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
    gm, result = lower(ref)
    assert result.skips == []
    counts = op_counts(gm)
    assert counts["qmean"] == 1 and counts["dequantize"] == 1  # only the logits, before the reshape
    size = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size")
    assert library.gml_op_name(size.args[0]) == "qconv"
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
    gm, result = lower(ref)
    assert result.skips == [] and result.coverage.kept_fp32 == []
    counts = op_counts(gm)
    assert counts["qcat"] == 1 and counts["quantize"] == 1
    # `view` replays as `reshape` on uint8 (channels-last: a view valid in fp32 can fail there)
    assert sorted(moves(gm), key=str) == sorted(
        [("chunk", 0), ("chunk", 1), ("reshape", None), ("transpose", None), ("contiguous", None), ("reshape", None)],
        key=str,
    )
    # the sizes are read off the uint8 tensor and passed to the views at run time: no dequantize
    # anywhere (the head conv writes the fp32 output itself)
    assert "dequantize" not in counts
    size = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size")
    assert library.gml_op_name(size.args[0]) == "qcat"
    view = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "reshape" and len(n.args) == 5)
    assert isinstance(view.args[1], fx.Node) and isinstance(view.args[3], fx.Node)  # n, c // 2 from size()
    check_numerics(gm, ref, model, min_ref=0.9999, min_fp32=0.999)


class Res2Split(nn.Module):
    """Res2Net / MixNet / CSP: ``x.split(width, 1)``, a conv per piece, concatenated back."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 12, 1), nn.ReLU())
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(2))
        self.head = nn.Conv2d(12, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        pieces = s.split(4, 1)
        rest = torch.split(s, [8, 4], dim=1)[1]
        return self.head(torch.cat([self.convs[0](pieces[0]), self.convs[1](pieces[1]), rest], 1))


def test_split_pieces_move_uint8():
    torch.manual_seed(0)
    model = Res2Split().eval()
    ref = reference(model)
    gm, result = lower(ref)
    assert result.coverage.kept_fp32 == []
    assert sorted(m for m in moves(gm) if m[0] == "split") == [("split", 0), ("split", 1), ("split", 1)]
    assert "dequantize" not in op_counts(gm)
    check_numerics(gm, ref, model, min_ref=0.9999, min_fp32=0.999)


def test_qmove_replays_the_op_on_the_integers():
    qp = QParams(0.1, 128)
    x = torch.randint(0, 256, (2, 8, 3, 3), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    shuffle = QMove("view", [RuntimeArg(), 2, 4, 3, 3], qp, qp)
    assert torch.equal(shuffle(x, 2), x.reshape(2, 2, 4, 3, 3))  # channels-last: view would need reshape
    assert torch.equal(QMove("chunk", [2, 1], qp, qp, item=1)(x), x[:, 4:])
    assert torch.equal(QMove("split", [[3, 5], 1], qp, qp, item=1)(x), x[:, 3:])
    # other output qparams: requantized, exactly as the reference's quantize(dequantize(...)) would
    out = QParams(0.2, 128)
    y = QMove("permute", [[0, 2, 3, 1]], qp, out)(x)
    assert torch.equal(
        y, torch.quantize_per_tensor((x.permute(0, 2, 3, 1).float() - 128) * 0.1, 0.2, 128, torch.quint8).int_repr()
    )
    with pytest.raises(ValueError, match="chunk / split need the index"):
        QMove("chunk", [2, 1], qp, qp)


def test_data_movement_without_an_int8_replay_stays_fp32_with_the_reason():
    class Roll(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.roll(self.a(x), 1, 2))

    ref = reference(Roll().eval())
    gm, result = lower(ref)
    assert [(s.node, s.reason) for s in result.skips] == [("roll", "no INT8 kernel for torch.roll; kept in fp32")]
    assert op_counts(gm) == {"quantize": 2, "qconv": 2, "dequantize": 1, "roll": 1}


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
    gm, result = lower(ref)
    assert result.skips == []
    assert op_counts(gm) == {"quantize": 1, "qconv": 1, "sigmoid": 1}
    (conv,) = calls(gm, "qconv")
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
    gm, result = lower(ref)
    counts = op_counts(gm)
    assert counts["qbatch_norm"] == 2 and counts["qavg_pool2d"] == 2
    relus = sorted(c.args["post_op"] for c in calls(gm, "qbatch_norm"))
    assert relus == ["none", "relu"]  # norm1 took its ReLU along, norm2 stands alone
    assert not [e for e in result.coverage.kept_fp32 if e.op in ("BatchNorm2d", "AvgPool2d", "ReLU")]
    # three integer-domain steps in a row round a little differently from the reference's fp32 ones;
    # the lowered model stays as close to fp32 as the reference graph (both ~0.9996 here)
    check_numerics(gm, ref, model, min_ref=0.9995, min_fp32=0.999)


def test_bn_after_a_conv_is_folded_not_lowered_on_its_own():
    model = _randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    gm, _ = lower(reference(model))
    assert "qbatch_norm" not in op_counts(gm)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_is_one_int8_kernel_on_onednn(approximate: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate=approximate), nn.Linear(32, 8)).eval()
    shape = (4, 16)
    ref = reference(model, shape=shape)
    gm, result = lower(ref)
    assert "gelu" not in op_counts(gm) and result.skips == []
    first = calls(gm, "qlinear")[0]
    assert first.post_op == PostOp("gelu", (), approximate)
    check_numerics_shaped(gm, ref, model, shape)


def test_linear_gelu_stays_fp32_on_fbgemm_with_the_reason():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    gm, result = lower(reference(model, "fbgemm", shape=(4, 16)), "fbgemm")
    assert op_counts(gm)["gelu"] == 1
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
    act(conv(x)) + y, so the conv keeps its activation and the add stays a gml.qadd."""
    torch.manual_seed(0)
    model = _randomize_bn(FusedMBConvish(act))
    ref = reference(model)
    gm, _ = lower(ref)
    counts = op_counts(gm)
    assert (counts["qconv"], counts["qadd"], counts["qconv_add"]) == (3, 1, 0)
    assert [c.post_op for c in calls(gm, "qconv")] == [post_op, post_op, NO_POST_OP]
    check_numerics(gm, ref, model, min_ref=0.9999, min_fp32=0.999)


def test_conv_without_activation_still_fuses_with_the_add():
    torch.manual_seed(0)
    model = _randomize_bn(FusedMBConvish(nn.Identity))
    # nn.Identity leaves conv -> bn -> add; with the head after it, the add is not the model output
    gm, _ = lower(reference(model))
    assert op_counts(gm)["qconv_add"] == 1


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
    gm, result = lower(ref)
    counts = op_counts(gm)
    # every conv, the renamed ones included (the tracer keeps them as nn.Conv3d leaves)
    convs = calls(gm, "qconv", ndim=3)
    assert len(convs) == 3 and counts["qadd"] == 1 and counts["qmax_pool"] == 1 and "conv" not in counts
    assert [c.args["post_op"] for c in convs] == ["relu", "relu", "none"]
    assert all(c.output_qparams.zero_point == 0 for c in convs if c.args["post_op"] == "relu")
    assert result.skips == [] and fp32_ops(gm, VIDEO) == [] and counts["qadaptive_avg_pool"] == 1
    assert [len(c.args["output_size"]) for c in calls(gm, "qadaptive_avg_pool")] == [3]
    check_numerics_shaped(gm, ref, r3d, VIDEO)


def test_conv3d_stays_fp32_on_fbgemm(r3d: nn.Module):
    ref = reference(r3d, backend="fbgemm", shape=VIDEO)
    gm, _ = lower(ref, backend="fbgemm")
    assert calls(gm, "qconv", ndim=3) == [] and op_counts(gm)["conv"] == 3


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
    gm, result = lower(ref, backend=backend)
    counts = op_counts(gm)
    convs = calls(gm, "qconv", ndim=1)
    assert len(convs) == 3 and counts["qconv_add"] == 0  # the residual stays a gml.qadd (3-D)
    assert fp32_ops(gm, SEQ) == [] and result.skips == []
    # the op is N-d: a 1-D conv keeps its 3-D weight [O, I, k] (the Python kernel runs it at height 1)
    weights = [getattr(gm, c.args["weight"].target) for c in convs]
    assert [w.dim() for w in weights] == [3, 3, 3]
    assert [c.args["dilation"] for c in convs] == [[1], [2], [1]]
    check_numerics_shaped(gm, ref, model, SEQ)
