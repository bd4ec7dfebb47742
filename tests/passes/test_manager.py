from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.errors import PassFailure
from gml.passes.base import FunctionPass, GraphPass, PassResult, Skip, Tolerance
from gml.passes.manager import PassManager


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.fc(x)) + x


def _gm() -> fx.GraphModule:
    torch.manual_seed(0)
    return fx.symbolic_trace(Block().eval())


SAMPLES = [(torch.randn(2, 8),), (torch.randn(3, 8),)]


class ReluToSigmoid(GraphPass):
    """Deliberately wrong: swaps ReLU for Sigmoid."""

    name = "relu_to_sigmoid"

    def call(self, gm):
        gm.relu = nn.Sigmoid()
        return PassResult(gm, True, matches=1)


class BreakLint(GraphPass):
    """Deliberately broken: inserts a node that reads a value defined after it."""

    name = "break_lint"

    def call(self, gm):
        first = next(iter(gm.graph.nodes))
        last_compute = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
        with gm.graph.inserting_after(first):
            bad = gm.graph.call_function(torch.neg, (last_compute,))
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = (bad,)
        return PassResult(gm, True, matches=1)


class Crash(GraphPass):
    """Mutates the graph half-way, then raises."""

    name = "crash"

    def call(self, gm):
        relu = next(n for n in gm.graph.nodes if n.target == "relu")
        relu.target = "fc"  # half-mutated state that must not survive
        raise RuntimeError("boom")


class NoOp(GraphPass):
    name = "noop"

    def call(self, gm):
        return PassResult(gm, False, skips=[Skip("fc", "nothing to do here", "demo")])


class DropRelu(GraphPass):
    """Legal when inputs to relu are positive; here it changes numerics only a little if tolerant."""

    name = "drop_relu"
    tolerance = None  # changes numerics on purpose: only shape/finiteness checked

    def call(self, gm):
        relu = next(n for n in gm.graph.nodes if n.target == "relu")
        relu.replace_all_uses_with(relu.args[0])
        gm.graph.erase_node(relu)
        gm.recompile()
        return PassResult(gm, True, matches=1)


def _eager(gm, x):
    with torch.no_grad():
        return gm(x)


def test_numerics_breaking_pass_is_rolled_back_and_reported():
    gm = _gm()
    before = _eager(gm, SAMPLES[0][0])
    res = PassManager([ReluToSigmoid(), NoOp()]).run(gm, SAMPLES)
    rec = res.report.record("relu_to_sigmoid")
    assert rec.status == "rolled back"
    assert rec.error.startswith("numerics:")
    assert rec.max_abs_err > 1e-2
    assert isinstance(res.graph_module.relu, nn.ReLU)
    torch.testing.assert_close(_eager(res.graph_module, SAMPLES[0][0]), before)
    # the pipeline goes on after a rollback
    assert res.report.record("noop").status == "unchanged"
    assert [r.name for r in res.report.rolled_back] == ["relu_to_sigmoid"]


def test_lint_breaking_pass_is_rolled_back():
    gm = _gm()
    before_code = gm.code
    res = PassManager([BreakLint()]).run(gm, SAMPLES)
    rec = res.report.record("break_lint")
    assert rec.status == "rolled back"
    assert "used before it has been defined" in rec.error
    assert res.graph_module.code == before_code
    res.graph_module.graph.lint()


def test_pass_raising_midway_restores_snapshot():
    gm = _gm()
    res = PassManager([Crash()]).run(gm, SAMPLES)
    rec = res.report.record("crash")
    assert rec.status == "rolled back"
    assert rec.error == "pass raised RuntimeError: boom"
    targets = [n.target for n in res.graph_module.graph.nodes if n.op == "call_module"]
    assert targets == ["fc", "relu"]


def test_strict_raises_instead_of_rolling_back():
    with pytest.raises(PassFailure, match="relu_to_sigmoid"):
        PassManager([ReluToSigmoid()], strict=True).run(_gm(), SAMPLES)


def test_report_counts_nodes_matches_and_skips():
    gm = _gm()
    res = PassManager([DropRelu(), NoOp()]).run(gm, SAMPLES)
    rec = res.report.record("drop_relu")
    assert rec.status == "applied"
    assert (rec.nodes_before, rec.nodes_after, rec.matches) == (5, 4, 1)
    assert rec.max_abs_err is not None and rec.max_abs_err > 0  # numerics moved, allowed by tolerance=None
    assert [str(s) for _, s in res.report.skips] == ["demo at fc: nothing to do here"]
    assert "tensor_meta" in next(iter(res.graph_module.graph.nodes)).meta
    d = res.report.to_dict()
    assert d["passes"][0]["name"] == "drop_relu"


def test_tolerance_is_per_pass():
    def scale(gm):
        gm.fc.weight.data.mul_(1 + 1e-3)
        return PassResult(gm, True, matches=1)

    tight = PassManager([FunctionPass(scale, "scale", Tolerance(1e-7, 0))]).run(_gm(), SAMPLES)
    loose = PassManager([FunctionPass(scale, "scale", Tolerance(1e-1, 0))]).run(_gm(), SAMPLES)
    assert tight.report.record("scale").status == "rolled back"
    assert loose.report.record("scale").status == "applied"


def test_numerics_check_needs_samples():
    with pytest.raises(ValueError, match="sample_inputs"):
        PassManager([NoOp()]).run(_gm())
