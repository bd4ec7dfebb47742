"""gml.rms_norm on the engine: its own kernel step (native/rms_norm.h) through the generic rule of an
op that names its engine step (gml.runtime.rules.kernel), vs the op's Python kernel; and in a model
from gml.optimize to gml.load."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import gml
from gml.ir.rms_norm import rms_norm_op
from gml.runtime import compile_engine, unavailable_reason
from gml.runtime.rules import read_call, rule_for

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _graph(d: int, *, weight: bool = True, transpose: bool = False) -> fx.GraphModule:
    root = nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    if transpose:  # a strided input: the rule copies it dense first
        x = g.call_method("transpose", (x, -1, -2))
    w = None
    if weight:
        root.register_buffer("w", torch.empty(d).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1)))
        w = g.get_attr("w")
    y = g.call_function(rms_norm_op(), (x, w, 1e-6))
    g.output(y)
    return fx.GraphModule(root, g)


def _engine(gm: fx.GraphModule, x: torch.Tensor):
    eng = compile_engine(gm, [x])
    assert eng.report.path == "engine", str(eng.report)
    assert [impl for _, impl in eng.step_impls()].count("gml:rms_norm") == 1
    return eng


@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 100), (2, 2, 3, 17), (5, 1)])
@pytest.mark.parametrize("weight", [True, False])
def test_matches_the_python_kernel(shape, weight):
    gm = _graph(shape[-1], weight=weight)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4
    eng = _engine(gm, x)
    torch.testing.assert_close(eng(x), gm(x), rtol=2e-6, atol=1e-6)


def test_a_strided_input_is_copied_dense_first():
    gm = _graph(24, transpose=True)
    x = torch.randn(3, 24, 5)  # transposed to [3, 5, 24]: features strided
    eng = compile_engine(gm, [x])
    assert eng.report.path == "engine", str(eng.report)
    torch.testing.assert_close(eng(x), gm(x), rtol=2e-6, atol=1e-6)


def test_the_generic_rule_says_why_it_declines():
    gm = _graph(8)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    gm.w = gm.w.to(torch.bfloat16)
    rule, reason = rule_for(read_call(gm, node))
    assert rule is None and "constant weight is torch.bfloat16" in reason


class LlamaishBlock(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(d, 2 * d), nn.RMSNorm(2 * d, eps=1e-5), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.norm(self.up(x)))


def test_optimize_runs_it_in_one_engine_segment_and_it_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model, x = LlamaishBlock().eval(), torch.randn(2, 9, 64)
    res = gml.optimize(model, x, runtime="engine")
    eng = res.executable
    assert eng.report.segments == 1 and eng.report.path == "engine", str(eng.report)
    assert "gml:rms_norm" in [impl for _, impl in eng.step_impls()]
    torch.testing.assert_close(eng(x), model(x), rtol=1e-5, atol=1e-5)
    res.save(str(tmp_path / "block.pt2"))
    loaded = gml.load(str(tmp_path / "block.pt2"))
    assert "gml:rms_norm" in [impl for _, impl in loaded.step_impls()]
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
