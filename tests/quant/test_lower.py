"""LowerToGML: reference Q/DQ graphs → GML INT8 modules passing uint8 tensors.

Reference graphs come from torch.ao (``prepare_fx`` → calibrate → ``convert_to_reference_fx``) with
two configs that spell residuals differently: oneDNN's fuses conv+add(+relu) into one
``ConvAddReLU2d`` module; x86's quantizes the conv output and adds separately (the lowering then
fuses ``QConv2d → QAdd`` itself). ResNet18 runs through GML's own frontend, as ``gml.quantize`` will.

oneDNN's config gets this process's target's weight range (``qmap_for``: 7-bit weights without
VNNI, ADR 011), so its reference and the lowered graph compute the same integers on every tier;
x86's has 7-bit activations, with which 8-bit weights cannot saturate a kernel's int16 pairs.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import fx, nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.backend_config import get_onednn_backend_config
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
from torch.ao.quantization.quantize_fx import convert_to_reference_fx, prepare_fx
from torch.testing import FileCheck

from gml.ir import library
from gml.ir.ops import op_kind
from gml.ir.target import Target
from gml.passes.manager import PassManager
from gml.quant.backend_config import weight_observer
from gml.quant.fuse_int8 import FuseQConvAdd
from gml.quant.lower import LowerToGML, coverage_of
from gml.runtime.target import detect_target

SHAPE = (1, 3, 32, 32)
#: ResNet18 INT8 vs fp32 (issue 4's bar with 8-bit weights; 7-bit weights double their rounding error)
RESNET18_MIN_COS = 0.9998 if detect_target().int8.weight_bits == 8 else 0.9995


def qmap_for(config: str):
    """torch.ao's default qconfig mapping of ``config``; oneDNN's with the target's weight range."""
    qmap = get_default_qconfig_mapping(config)
    if config == "onednn":
        qc = qmap.global_qconfig
        qmap.set_global(type(qc)(activation=qc.activation, weight=weight_observer(per_channel=True)))
    return qmap


def _batches(n: int, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def ao_reference(model: nn.Module, config: str = "onednn", shape: tuple[int, ...] = SHAPE) -> fx.GraphModule:
    """torch.ao reference graph of an eval model (conv+BN folded by prepare_fx's fusion)."""
    backend_config = get_onednn_backend_config() if config == "onednn" else get_x86_backend_config()
    qmap = qmap_for(config)
    calib = _batches(4, shape)
    prepared = prepare_fx(copy.deepcopy(model).eval(), qmap, (calib[0],), backend_config=backend_config)
    with torch.no_grad():
        for x in calib:
            prepared(x)
    return convert_to_reference_fx(prepared, backend_config=backend_config)


def op_counts(gm: fx.GraphModule) -> Counter[str]:
    """What each compute node of a lowered graph runs: the gml op, or the torch op on uint8 (``flatten``)."""
    mods = dict(gm.named_modules())
    return Counter(
        library.gml_op_name(n) or op_kind(n, mods) or str(n.target) for n in gm.graph.nodes if n.op.startswith("call")
    )


#: the target to lower x86-config references for: their 7-bit activations keep 8-bit weights exact
#: on every tier (127·128·2 fits in int16), so LowerToGML must not halve them
SEVEN_BIT_ACTIVATIONS = Target("avx512_core_vnni")


def lowered(ref: fx.GraphModule, backend: str = "onednn", fuse: bool = True, target: Target | None = None):
    """LowerToGML, then (``fuse``) FuseQConvAdd: the INT8 pipeline's lowering steps."""
    gm = LowerToGML(backend, target)(copy.deepcopy(ref)).graph_module
    return FuseQConvAdd()(gm).graph_module if fuse else gm


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


class ResidualCNN(nn.Module):
    """Stem, an identity residual block (add → relu), a strided block whose skip is a 1x1 conv
    (add without relu), pools and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        self.conv3, self.relu3 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU()
        self.down = nn.Conv2d(16, 32, 1, stride=2)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)
        for bn in (self.stem[1], self.bn1, self.bn2):  # non-trivial BN statistics to fold
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.2, 0.2)
            bn.running_mean.uniform_(-0.1, 0.1)
            bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem(x))
        y = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(y)) + x)
        z = self.relu3(self.conv3(x)) + self.down(x)
        return self.fc(torch.flatten(self.avg(z), 1))


@pytest.fixture(scope="module")
def cnn() -> nn.Module:
    torch.manual_seed(0)
    return ResidualCNN().eval()


# ---------------------------------------------------------------- golden graphs
@pytest.mark.parametrize("config", ["onednn", "x86"])
def test_residual_cnn_golden_module_counts(cnn: nn.Module, config: str):
    ref = ao_reference(cnn, config)
    result = LowerToGML("onednn")(copy.deepcopy(ref))
    fusion = FuseQConvAdd()(result.graph_module)
    gm = fusion.graph_module
    assert op_counts(gm) == {
        "quantize": 1,  # the model input, once
        "qconv": 3,  # stem (+relu), conv1 (+relu), conv3 (+relu)
        "qconv_add": 2,  # conv2 + x → relu; down(x) + relu3(conv3(x))
        "qmax_pool": 1,
        "qadaptive_avg_pool": 1,
        "flatten": 1,  # of the uint8 value
        "qlinear": 1,
        "dequantize": 1,  # the logits, once
    }
    assert result.skips == []
    assert result.matches == 9 + (2 if config == "x86" else 0)  # x86: adds lowered first, then fused
    assert fusion.matches == (2 if config == "x86" else 0)
    # uint8 flows between gml ops: no torch quantize/dequantize op, no module call is left anywhere
    FileCheck().check_not("quantize_per_tensor").check_not("dequantize()").run(gm.code)
    FileCheck().check_count("torch.ops.gml.", 10, exactly=True).run(gm.code)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    # the fused residual of the identity block reads the maxpool output as its skip tensor
    fused = [n for n in gm.graph.nodes if library.gml_op_name(n) == "qconv_add"]
    skip_producers = sorted(library.gml_op_name(library.op_args(n)["other"]) for n in fused)
    assert skip_producers == ["qconv", "qmax_pool"]
    assert coverage_of(gm).counts()["qconv_add"] == 2
    if config == "x86":
        assert any("fused 2 qconv → qadd" in note for note in fusion.notes)


@pytest.mark.parametrize(
    ("config", "fuse", "min_cos_ref"),
    [
        ("onednn", True, 0.9999),  # the reference already has conv+add as one op: same math
        ("x86", False, 0.99999),  # one INT8 module per reference op: the reference, up to ties
        ("x86", True, 0.999),  # conv+add fused across the conv's own quantize: one rounding fewer
    ],
)
def test_residual_cnn_matches_the_reference_graph(cnn: nn.Module, config: str, fuse: bool, min_cos_ref: float):
    ref = ao_reference(cnn, config)
    gm = lowered(ref, fuse=fuse, target=SEVEN_BIT_ACTIVATIONS if config == "x86" else None)
    with torch.no_grad():
        for x in _batches(3, seed=7):
            out, expected, fp32 = gm(x), ref(x), cnn(x)
            assert out.dtype == torch.float32 and out.shape == expected.shape
            assert cosine(out, expected) > min_cos_ref
            assert cosine(out, fp32) > 0.999


def test_lowered_values_are_uint8_channels_last(cnn: nn.Module):
    gm = lowered(ao_reference(cnn))
    seen: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            out = super().run_node(n)
            if n.op.startswith("call") and library.gml_op_name(n) != "dequantize":
                seen[n.name] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(_batches(1)[0])
    assert len(seen) == 10
    for name, t in seen.items():
        assert t.dtype == torch.uint8, name
        if t.dim() == 4:
            assert t.is_contiguous(memory_format=torch.channels_last), name


def test_runs_under_the_pass_manager(cnn: nn.Module):
    ref = ao_reference(cnn)
    samples = [(x,) for x in _batches(2, seed=3)]
    result = PassManager([LowerToGML()], strict=True).run(ref, samples)
    record = result.report.record("lower_to_gml")
    assert record.status == "applied" and record.matches == 9
    assert record.notes[0].startswith("lowered to INT8: 1 flatten, 1 qadaptive_avg_pool, 3 qconv, 2 qconv_add")
    assert LowerToGML.tolerance is None


def test_lowered_graph_survives_deepcopy_and_state_dict(cnn: nn.Module):
    gm = lowered(ao_reference(cnn))
    x = _batches(1, seed=5)[0]
    clone = copy.deepcopy(gm)
    clone.load_state_dict(gm.state_dict())
    with torch.no_grad():
        assert torch.equal(clone(x), gm(x))
    keys = gm.state_dict().keys()
    assert not any(k.endswith(("_scale_0", "_zero_point_0")) for k in keys)  # reference qparams dropped
    # the state is the dense constants the ops read: int8 weights, their scales, fp32 biases
    assert all(k.endswith(("_weight", "_weight_scale", "_bias")) for k in keys)
    assert sum(k.endswith("_weight") for k in keys) == 6 and gm.q_fc_weight.dtype == torch.int8


# ---------------------------------------------------------------- what stays fp32, and why
class WithGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.GELU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act(self.conv(x)))


def _gelu_reference() -> fx.GraphModule:
    torch.manual_seed(1)
    model = WithGelu().eval()
    qmap = qmap_for("onednn")
    qmap.set_object_type(nn.GELU, qmap.global_qconfig)  # quantize GELU's output, so it sits DQ → GELU → Q
    bc = get_onednn_backend_config()
    calib = _batches(2)
    prepared = prepare_fx(copy.deepcopy(model), qmap, (calib[0],), backend_config=bc)
    with torch.no_grad():
        for x in calib:
            prepared(x)
    return convert_to_reference_fx(prepared, backend_config=bc)


def test_op_without_int8_kernel_stays_fp32_with_the_reason():
    ref = _gelu_reference()
    result = LowerToGML()(copy.deepcopy(ref))
    gm = result.graph_module
    assert [(s.node, s.reason) for s in result.skips] == [("act", "no INT8 kernel for GELU; kept in fp32")]
    assert [(e.nodes, e.reason) for e in result.coverage.kept_fp32] == [
        (["act"], "no INT8 kernel for GELU; kept in fp32")
    ]
    assert coverage_of(gm).kept_fp32 == result.coverage.kept_fp32  # read off the graph, not a pass object
    # DQ → GELU → Q, with gml's own boundary ops; both convs still INT8
    gelu = next(n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.GELU))
    assert library.gml_op_name(gelu.args[0]) == "dequantize"
    (user,) = gelu.users
    assert library.gml_op_name(user) == "quantize"
    assert op_counts(gm)["qconv"] == 2
    with torch.no_grad():
        x = _batches(1, seed=9)[0]
        assert cosine(gm(x), ref(x)) > 0.9999


def test_fbgemm_backend_declines_the_fused_residual_with_the_reason(cnn: nn.Module):
    ref = ao_reference(cnn, "onednn")  # conv+add fused into one ConvAddReLU2d module
    result = LowerToGML("fbgemm")(copy.deepcopy(ref))
    reasons = {s.reason for s in result.skips}
    assert reasons == {"the fbgemm backend has no fused conv+add kernel; kept in fp32"}
    assert len(result.skips) == 2
    with torch.no_grad():
        x = _batches(1, seed=2)[0]
        assert cosine(result.graph_module(x), ref(x)) > 0.9999


def test_fbgemm_backend_lowers_separate_conv_and_add(cnn: nn.Module):
    ref = ao_reference(cnn, "x86")  # conv output quantized, add separate: no fused kernel needed
    result = LowerToGML("fbgemm")(copy.deepcopy(ref))
    assert result.skips == []
    fusion = FuseQConvAdd()(result.graph_module)
    assert not fusion.modified and {s.reason for s in fusion.skips} == {
        "the fbgemm backend has no conv kernel with a residual-add post-op"
    }
    counts = op_counts(result.graph_module)
    assert (counts["qconv"], counts["qadd"], counts["qconv_add"]) == (5, 2, 0)
    with torch.no_grad():
        x = _batches(1, seed=2)[0]
        assert cosine(result.graph_module(x), ref(x)) > 0.9999


# ---------------------------------------------------------------- residual buffer safety
class SkipReadTwice(nn.Module):
    """``a`` is the skip of the fused conv+add *and* is read again afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.tail = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.stem(x))
        b = self.conv(a) + a
        return self.tail(a) + b


def test_skip_tensor_read_after_the_fused_add_is_protected():
    torch.manual_seed(3)
    model = SkipReadTwice().eval()
    ref = ao_reference(model, "x86")
    gm = lowered(ref, target=SEVEN_BIT_ACTIVATIONS)
    unfused = lowered(ref, fuse=False, target=SEVEN_BIT_ACTIVATIONS)
    assert op_counts(gm)["qconv_add"] == 2
    # conv(a) + a runs before tail(a) reads `a`: gml.qconv_add is functional (it never writes its
    # residual operand), so `a` is intact when tail reads it
    x = _batches(1, seed=4)[0]
    with torch.no_grad():
        assert cosine(gm(x), unfused(x)) > 0.999


def test_requires_reference_graphs():
    g = fx.Graph()
    x = g.placeholder("x")
    q = g.call_function(torch.quantize_per_tensor, (x, 0.1, 0, torch.quint8))
    g.output(q)  # a quantized output read directly: not a reference graph
    gm = fx.GraphModule(nn.Module(), g)
    with pytest.raises(Exception, match="read directly by output"):
        LowerToGML()(gm)


# ---------------------------------------------------------------- ResNet18, end to end
def test_resnet18_every_conv_linear_add_relu_pool_is_int8():
    from gml.quant.frontend import prepare_reference

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    example = (torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1)),)
    ref = prepare_reference(model, example, 2, progress=False).graph_module
    result = LowerToGML("onednn")(copy.deepcopy(ref))
    gm = FuseQConvAdd()(result.graph_module).graph_module
    counts = op_counts(gm)
    assert counts == {
        "quantize": 1,
        "qconv": 12,  # 20 convs: 12 alone (+relu) ...
        "qconv_add": 8,  # ... and 8 fused with their block's residual add + relu
        "qmax_pool": 1,
        "qadaptive_avg_pool": 1,
        "flatten": 1,
        "qlinear": 1,  # writes the fp32 logits itself: no dequantize at all
    }
    assert result.skips == [] and result.coverage.kept_fp32 == []
    fc = next(n for n in gm.graph.nodes if library.gml_op_name(n) == "qlinear")
    assert library.op_args(fc)["out_dtype"] == torch.float32  # the frontend keeps the logits fp32
    with torch.no_grad():
        xs = _batches(2, (2, 3, 224, 224), seed=11)
        cos_fp32 = min(cosine(gm(x), model(x)) for x in xs)
        cos_ref = min(cosine(gm(x), ref(x)) for x in xs)
    print(f"ResNet18 INT8 (GML, oneDNN): cosine vs fp32 {cos_fp32:.6f}, vs reference graph {cos_ref:.6f}")
    assert cos_ref > 0.9999
    assert cos_fp32 >= RESNET18_MIN_COS  # issue 4 acceptance (8-bit); OpenVINO INT8 gets 0.99989 here
