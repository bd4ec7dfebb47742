"""gml.group_norm on the engine: its own kernel step (native/group_norm.h) through the generic rule of
an op that names its engine step, vs the op's Python kernel (F.group_norm); and in models from
gml.optimize (timm's BiT and PoolFormer norms) to gml.load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import gml
from gml.ir.group_norm import group_norm_op
from gml.runtime import compile_engine, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _graph(c: int, groups: int, *, affine: bool = True, eps: float = 1e-5) -> fx.GraphModule:
    root = nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    w = b = None
    if affine:
        gen = torch.Generator().manual_seed(1)
        root.register_buffer("w", torch.empty(c).uniform_(-1.5, 1.5, generator=gen))
        root.register_buffer("b", torch.randn(c, generator=gen))
        w, b = g.get_attr("w"), g.get_attr("b")
    g.output(g.call_function(group_norm_op(), (x, groups, w, b, eps)))
    return fx.GraphModule(root, g)


@pytest.mark.parametrize(
    "shape, groups",
    [((1, 16, 7, 9), 4), ((3, 12, 5, 5), 1), ((2, 8, 4, 4), 8), ((2, 6, 11), 3), ((4, 6), 2), ((1, 4, 2, 3, 5), 2)],
    ids=str,
)
@pytest.mark.parametrize("affine", [True, False])
def test_matches_the_python_kernel(shape, groups, affine):
    gm = _graph(shape[1], groups, affine=affine)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3 + 5  # a mean far from 0
    eng = compile_engine(gm, [x])
    assert eng.report.path == "engine", str(eng.report)
    assert [impl for _, impl in eng.step_impls()].count("gml:group_norm") == 1
    torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_a_channels_last_input_is_read_in_place(groups):
    """The convs' layout: no copy to plain rows before the step, none after it."""
    gm = _graph(16, groups)
    x = (torch.randn(2, 16, 6, 5) * 2 - 3).contiguous(memory_format=torch.channels_last)
    eng = compile_engine(gm, [x])
    assert [impl for _, impl in eng.step_impls()] == ["gml:group_norm"], list(eng.step_impls())
    torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)


def test_a_strided_input_is_copied_first():
    gm = _graph(8, 2)
    x = torch.randn(2, 8, 6, 10)[..., ::2]  # every other column: neither plain nor channels-last
    eng = compile_engine(gm, [x])
    assert eng.report.path == "engine", str(eng.report)
    torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)


def test_a_constant_group_is_its_bias():
    """Zero variance: (x - mean) is 0 and rsqrt(eps) finite, so the output is the bias (not NaN), up
    to the rounding of ``x * a + (bias - mean * a)`` with ``a = w / sqrt(eps)`` (~300 here)."""
    gm = _graph(4, 2)
    x = torch.ones(1, 4, 3, 3)
    eng = compile_engine(gm, [x])
    got = eng(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, gm.b.view(1, 4, 1, 1).expand_as(got), rtol=0, atol=1e-4)


class BiTBlock(nn.Module):
    """timm resnetv2's pre-activation unit: GroupNormAct (F.group_norm + ReLU) between convs."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(8, c)
        self.pool_norm = nn.GroupNorm(1, c)  # PoolFormer's GroupNorm1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        y = self.conv2(torch.relu(F.group_norm(y, 8, self.norm.weight, self.norm.bias, 1e-5)))
        return y + self.pool_norm(y)


def test_optimize_runs_it_in_one_engine_segment_and_it_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model, x = BiTBlock().eval(), torch.randn(2, 3, 12, 10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 0.1)
    res = gml.optimize(model, x, runtime="engine")
    eng = res.executable
    assert eng.report.segments == 1 and eng.report.path == "engine", str(eng.report)
    assert [impl for _, impl in eng.step_impls()].count("gml:group_norm") == 2
    with torch.no_grad():
        torch.testing.assert_close(eng(x), model(x), rtol=1e-5, atol=1e-5)
        res.save(str(tmp_path / "bit.pt2"))
        loaded = gml.load(str(tmp_path / "bit.pt2"))
        assert [impl for _, impl in loaded.step_impls()].count("gml:group_norm") == 2
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)


def test_an_int8_graphs_group_norm_runs_inside_its_plan():
    """GroupNorm has no INT8 kernel: it stays fp32 between a dequantize and a quantize, and the fp32
    remainder passes make it gml.group_norm, so the INT8 plan is not cut there (BiT: 50 segments)."""
    import copy

    from gml.ir.library import gml_op_name
    from gml.passes.manager import PassManager
    from gml.quant.frontend import prepare_reference
    from gml.quant.pipeline import lowering_passes

    torch.manual_seed(0)
    model, x = BiTBlock().eval(), torch.randn(2, 3, 12, 10)
    ref = prepare_reference(model, (x,), [(x,), (torch.randn_like(x),)], progress=False)
    lowered = PassManager(lowering_passes("onednn")).run(copy.deepcopy(ref.graph_module), [(x,)]).graph_module
    assert [gml_op_name(n) for n in lowered.graph.nodes].count("group_norm") == 2
    eng = compile_engine(lowered, [x])
    assert eng.report.segments == 1 and eng.report.path == "engine", str(eng.report)
    with torch.no_grad():  # the same integers up to a rounding tie (one INT8 step somewhere)
        got, want = eng(x).flatten().double(), lowered(x).flatten().double()
    assert float(got @ want / (got.norm() * want.norm())) > 0.9999
