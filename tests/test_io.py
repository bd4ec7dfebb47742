from __future__ import annotations

from collections import Counter

import pytest
import torch
import torchvision
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from gml import io
from gml.capture import capture
from gml.errors import GMLError, ModelLoadError
from gml.kernels import fp32 as k32
from gml.passes.fuse_conv import FuseConvActivation, FuseConvAdd
from gml.passes.fuse_elementwise import FuseElementwise
from gml.passes.fuse_linear import FuseLinearActivation
from gml.passes.manager import PassManager
from gml.passes.pipeline import canonical_passes

needs_onednn = pytest.mark.skipif(not k32.kernels_available(), reason="oneDNN fp32 kernels unavailable")
FUSIONS = [FuseConvAdd(), FuseConvActivation(), FuseLinearActivation(backend="onednn"), FuseElementwise()]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 8, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        s = torch.relu(self.bn(self.stem(x)))
        # the 1x1 reads s / 2, not s: two convs of one input summed would merge into one (MergeBranches)
        y = torch.relu(self.conv(s) + self.down(s * 0.5))
        return torch.nn.functional.gelu(self.fc(torch.flatten(self.pool(y), 1)))


def optimized(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    gm = capture(model.eval(), (x,))
    return PassManager([*canonical_passes(), *FUSIONS], strict=True).run(gm, [(x,)]).graph_module


def kernel_types(gm: nn.Module) -> Counter[str]:
    return Counter(type(m).__name__ for m in gm.modules() if type(m).__module__ == k32.__name__)


@needs_onednn
def test_round_trip_rebuilds_fused_kernels_and_keeps_state_dict(tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3, 8, 8)
    gm = optimized(model, x)
    path = io.save(gm, tmp_path / "net.pt2")
    loaded = io.load(path, runtime="torch")
    assert loaded.runtime.path == "torch"
    assert kernel_types(loaded) == kernel_types(gm) == Counter({"FusedConv": 2, "FusedConvAdd": 1, "FusedLinear": 1})
    assert set(loaded.state_dict()) == set(gm.state_dict())
    assert loaded.get_submodule("fc").post_op == k32.PostOp("gelu", (), "none")
    with torch.no_grad():
        assert (loaded(x) - model(x)).abs().max().item() < 1e-4
        x5 = torch.randn(5, 3, 8, 8)  # the batch dimension was exported as dynamic
        assert (loaded(x5) - model(x5)).abs().max().item() < 1e-4


@needs_onednn
def test_a_conv1d_model_saves_and_loads_its_fused_kernels(tmp_path):
    """A fused Conv1d (Whisper's and Wav2Vec2's front ends) exports as the 2-D call it runs as: the
    oneDNN op takes no 3-D tensor, and torch.export refused the save. Load lifts it back (its weight
    through the ``unsqueeze``), under the weight's own name, and the engine runs it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(16, 32, 3, padding=1), nn.GELU(), nn.Conv1d(32, 32, 3, stride=2, padding=1))
    x = torch.randn(2, 16, 40)
    gm = optimized(model.eval(), x)
    assert kernel_types(gm)["FusedConv"] == 2
    loaded = io.load(io.save(gm, tmp_path / "c1d.pt2"), runtime="torch")
    assert kernel_types(loaded)["FusedConv"] == 2 and set(loaded.state_dict()) == set(gm.state_dict())
    assert not any(n.op == "get_attr" for n in loaded.graph.nodes)  # no dense weight left beside the kernels
    with torch.no_grad():
        for n in (2, 3):
            xn = torch.randn(n, 16, 40)
            torch.testing.assert_close(loaded(xn), model(xn), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(io.load(tmp_path / "c1d.pt2")(xn), model(xn), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_a_dashed_module_name_and_an_average_pool_load_onto_one_plan(tmp_path):
    """torchvision's RegNet names blocks ``block1-0``: its files were refused as "not a dotted attribute
    path". DenseNet's ``avg_pool2d`` transitions were ATen calls the engine left to torch (4 segments)."""
    import gml

    torch.manual_seed(0)
    body = nn.Sequential()
    body.add_module("block1-0", nn.Conv2d(3, 8, 3, padding=1))
    body.add_module("act", nn.ReLU())
    body.add_module("pool", nn.AvgPool2d(2))
    body.add_module("block1-1", nn.Conv2d(8, 8, 3, padding=1))
    model, x = body.eval(), torch.randn(2, 3, 8, 8)
    path = tmp_path / "dashed.pt2"
    gml.optimize(model, (x,)).save(str(path))
    loaded = io.load(path)
    assert loaded.runtime.path == "engine", str(loaded.runtime)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_fp32_load_rebuilds_the_engine_by_default(tmp_path):
    from gml.runtime import EngineModule, unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3, 8, 8)
    loaded = io.load(io.save(optimized(model, x), tmp_path / "net.pt2"))
    assert isinstance(loaded, EngineModule), str(loaded.runtime)
    # the whole graph runs in the engine: the fused kernels, and the pool and flatten that the file
    # holds as ATen calls, raised back to the modules the engine's rules read (io.raise_exported_ops)
    assert loaded.runtime.path == "engine", str(loaded.runtime)
    engine_ops = Counter(n.op for n in loaded.runtime.nodes if n.runs_in == "engine")
    assert {"FusedConv": 2, "FusedConvAdd": 1, "FusedLinear": 1, "AdaptiveAvgPool2d": 1}.items() <= engine_ops.items()
    with torch.no_grad():
        for n in (1, 5):  # the plan for each new batch size is compiled on its first call
            xn = torch.randn(n, 3, 8, 8)
            assert (loaded(xn) - model(xn)).abs().max().item() < 1e-4


@needs_onednn
@pytest.mark.slow
def test_resnet18_round_trip(tmp_path):
    model, x = torchvision.models.resnet18(weights=None).eval(), torch.randn(1, 3, 64, 64)
    gm = optimized(model, x)
    loaded = io.load(io.save(gm, tmp_path / "r18.pt2"), runtime="torch")
    assert kernel_types(loaded) == Counter({"FusedConv": 12, "FusedConvAdd": 8, "FusedLinear": 1})
    # in-place residual accumulation is re-derived after loading
    assert sum(m.inplace for m in loaded.modules() if isinstance(m, k32.FusedConvAdd)) == 8
    with torch.no_grad():
        assert (loaded(x) - model(x)).abs().max().item() < 1e-4


def test_lift_false_runs_the_exported_ops_with_dense_weights(tmp_path):
    model, x = Net(), torch.randn(1, 3, 8, 8)
    gm = optimized(model, x)
    loaded = io.load(io.save(gm, tmp_path / "net.pt2"), lift=False, runtime="torch")
    assert not kernel_types(loaded)
    with torch.no_grad():
        assert (loaded(x) - model(x)).abs().max().item() < 1e-4


def test_pickle_format_needs_explicit_trust(tmp_path):
    model, x = Net(), torch.randn(1, 3, 8, 8)
    gm = optimized(model, x)
    path = io.save(gm, tmp_path / "net.pkl", format="pickle")
    with pytest.raises(ModelLoadError, match="was refused: it is a pickled model") as err:
        io.load(path)
    assert "trust_pickle=True" in err.value.hint
    loaded = io.load(path, trust_pickle=True)
    with torch.no_grad():
        assert (loaded(x) - model(x)).abs().max().item() < 1e-4


def test_errors_are_actionable(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        io.load(tmp_path / "missing.pt2")
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))  # no shape metadata
    with pytest.raises(GMLError, match="has no shape metadata") as err:
        io.save(gm, tmp_path / "x.pt2")
    assert "example_inputs" in err.value.hint
    ShapeProp(gm).propagate(torch.randn(3, 2))
    with pytest.raises(GMLError, match="unknown save format"):
        io.save(gm, tmp_path / "x.bin", format="onnx")
    torch.save({"not": "gml"}, tmp_path / "other.pt")
    with pytest.raises(ModelLoadError, match=r"not a file written by gml\.io\.save"):
        io.load(tmp_path / "other.pt", trust_pickle=True)


def test_dict_and_list_outputs_come_back_as_plain_containers(tmp_path):
    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = self.conv(x)
            return {"a": y, "b": [y.relu(), (y.sum(), y.mean())]}

    model, x = DictOut().eval(), torch.randn(1, 3, 8, 8)
    gm = optimized(model, x)
    for lift in (True, False):
        out = io.load(io.save(gm, tmp_path / f"d{lift}.pt2"), lift=lift)(x)
        assert type(out) is dict and type(out["b"]) is list and type(out["b"][1]) is tuple
        out["c"] = 1  # fx's immutable_dict refused this
        assert torch.allclose(out["a"], model(x)["a"], atol=1e-5)


# ---------------------------------------------------------------- a graph specialised to its input's size
@pytest.fixture(scope="module")
def specialised(tmp_path_factory):
    """ShapeCheckNet reads heights and widths in Python (gml.capture pins them, not the batch), saved."""
    import gml
    from assets.timm_like import ShapeCheckNet

    torch.manual_seed(0)
    model = ShapeCheckNet().eval()
    res = gml.optimize(model, (torch.randn(1, 3, 28, 28),))
    path = tmp_path_factory.mktemp("specialised") / "m.pt2"
    res.save(str(path))
    return model, path


def test_a_specialised_model_keeps_its_input_guard_through_save_and_load(specialised):
    from gml.errors import InputError

    model, path = specialised
    loaded = io.load(path)
    x = torch.randn(3, 3, 28, 28)  # another batch: the graph is not specialised to it
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(loaded(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # another height: the graph's pads and branch were decided for 28 (it ran 11% off before the guard
    # was saved)
    with pytest.raises(InputError, match=r"captured for \(\*, 3, 28, 28\)"):
        loaded(torch.randn(1, 3, 27, 27))


@pytest.mark.parametrize(
    "guard",
    [
        "(1, 3, 28, 28)",
        {"shapes": [[None, 3, -28, 28]], "why": "x"},
        {"shapes": [[None, 3, 28.5, 28]], "why": "x"},
        {"shapes": [[None, 3, "28", 28]], "why": "x"},
        {"shapes": [[None, 3, 28, 28], [1]], "why": "x"},
        {"shapes": [], "why": "x"},
        {"shapes": [[None, 3, 28, 28]], "why": 5},
        {"shapes": [[None, 3, 28, 28]], "why": "x", "module": "os.system"},
        {"shapes": [[True, 3, 28, 28]], "why": "x"},
    ],
)
def test_a_tampered_input_guard_is_refused(specialised, tmp_path, guard):
    from archive_edit import rewrite_header

    _, path = specialised
    bad = rewrite_header(path, tmp_path / "bad.pt2", lambda h: h.__setitem__("input_guard", guard))
    with pytest.raises(ModelLoadError, match="was refused: the input guard"):
        io.load(bad)
