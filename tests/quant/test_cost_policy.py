"""The INT8 cost policy (gml.quant.cost_policy): regions, the rule on injected costs, the reference
rewrite that keeps a region fp32, and gml.quantize applying it (costs injected: deterministic)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import gml
from gml.errors import InputError
from gml.ir import library
from gml.ir.qdq import is_dequantize, is_quantize_any
from gml.kernels.fp32 import FusedConv
from gml.quant.cost_policy import (
    Region,
    RegionCost,
    decide,
    find_regions,
    keep_fp32,
    plan_regions,
    record,
)
from gml.quant.frontend import prepare_reference
from gml.quant.lower import KEPT_FP32

X = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))


class Islands(nn.Module):
    """conv+relu | GELU | depthwise conv | GELU | conv | mean → linear: GELU has no INT8 kernel,
    so every conv is an INT8 island between a quantize and a dequantize."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(F.relu(self.c1(x)))
        y = F.gelu(self.c2(y))
        y = self.c3(y)
        return self.fc(y.mean((2, 3)))


@pytest.fixture(autouse=True)
def _whole_model_pays(monkeypatch):
    """The whole-model guard times the real executable; here it reports INT8 2x faster, so that
    the decisions under test come from the injected region costs only (one test overrides it)."""
    import gml.quant.cost_policy as cp

    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (1.0, 2.0))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Islands().eval()


def _ops(gm: fx.GraphModule) -> Counter[str]:
    return Counter(library.gml_op_name(n) for n in gm.graph.nodes if library.gml_op_name(n))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _slow(names: set[str]):
    """A cost function: regions covering any of ``names`` are 2 ms in INT8 vs 1 ms fp32, others win."""

    def cost(region: Region) -> RegionCost:
        return RegionCost(2.0, 1.0) if names & set(region.covered) else RegionCost(1.0, 3.0)

    return cost


def test_regions_of_a_lowered_graph_are_the_int8_islands():
    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy="off", per_layer=False)
    regions = find_regions(q.module, record(q.module, (X,)))
    # c1 (+relu) and c2 between GELUs; c3 → mean → fc (the linear writes fp32): one per fp32 gap
    assert [sorted(r.covered) for r in regions] == [["c1"], ["c2"], ["c3", "fc", "mean"]]
    assert [r.ops for r in regions] == [["qconv"], ["qconv"], ["qconv", "qmean", "qlinear"]]
    # each island starts at a quantize; the first two end at a dequantize (the last: fp32 logits)
    names = {n.name: n for n in q.module.graph.nodes}
    assert all(library.gml_op_name(names[r.nodes[0]]) == "quantize" for r in regions)
    assert all(library.gml_op_name(names[r.nodes[-1]]) == "dequantize" for r in regions[:2])
    assert library.gml_op_name(names[regions[2].nodes[-1]]) == "qlinear"


def test_decide_keeps_int8_only_where_it_is_not_slower():
    regions = [Region(i, [f"n{i}"], [f"op{i}"], ["qconv"]) for i in range(4)]
    costs = {0: RegionCost(1.0, 2.0), 1: RegionCost(2.0, 1.0), 2: RegionCost(1.0, 1.0), 3: RegionCost(None, None, "x")}
    out = decide(regions, lambda r: costs[r.index])
    assert [d.int8 for d in out] == [True, False, True, True]  # a tie is not slower; unmeasured stays
    assert "INT8 2.000 ms" in out[1].reason and "fp32 1.000 ms" in out[1].reason and "kept fp32" in out[1].reason
    assert out[3].reason == "x"
    # a required speed-up: 1.0 / 1.0 no longer qualifies
    assert [d.int8 for d in decide(regions, lambda r: costs[r.index], min_speedup=1.5)] == [True, False, False, True]


def test_keep_fp32_rewrites_the_reference_graph_golden():
    """Keep c2 (between two GELUs, fp32 neighbours): its Q/DQ pairs vanish and it runs the float
    module; keep c3 (an INT8 reader after it: mean): its output keeps its quantize."""
    model = _model()
    ref = prepare_reference(model, (X,), 2, progress=False)
    new = keep_fp32(ref.graph_module, ref.float_module, {"c2": "slow", "c3": "slow"}, {"c1", "c2", "c3", "mean", "fc"})
    nodes = {n.name: n for n in new.graph.nodes}
    assert nodes["c2"].args[0] is nodes["gelu"]  # reads the fp32 GELU output directly
    assert nodes["gelu_1"].args[0] is nodes["c2"]
    assert nodes["c3"].args[0] is nodes["gelu_1"]
    q_users = [u for u in nodes["c3"].users if is_quantize_any(u)]
    assert len(q_users) == 1  # mean stays INT8: c3's result is quantized for it
    assert all(is_dequantize(a) for a in nodes["mean"].all_input_nodes)
    assert type(new.get_submodule("c2")) is nn.Conv2d  # the float twin's module: no fake-quant weight
    assert nodes["c2"].meta[KEPT_FP32].reason == "slow"
    # the rewrite is exact where it removes Q/DQ: fp32 ops on the twin's values
    with torch.no_grad():
        assert _cos(new(X), ref.graph_module(X)) > 0.999
    # the caller's reference graph is untouched
    assert (
        not isinstance(ref.graph_module.get_submodule("c2"), nn.Conv2d)
        or type(ref.graph_module.get_submodule("c2")) is not nn.Conv2d
    )


def test_quantize_keeps_the_slower_region_fp32_and_says_why():
    model = _model()
    q = gml.quantize(model, 2, example_inputs=(X,), cost_policy=_slow({"c2"}), per_layer=False, keep_intermediates=True)
    assert _ops(q.module)["qconv"] == 2  # c1 and c3; c2 is fp32 on GML's fused kernel (gml.optimize's)
    nodes = {n.name: n for n in q.module.graph.nodes}
    assert type(q.module.get_submodule(str(nodes["c2"].target))) is FusedConv
    kept = [e for e in q.coverage.kept_fp32 if e.nodes == ["c2"]]
    assert len(kept) == 1 and "INT8 2.000 ms" in kept[0].reason and "fp32 1.000 ms" in kept[0].reason
    assert [d.region.covered for d in q.cost.kept_fp32] == [["c2"]]
    assert "kept fp32" in str(q.cost) and "whole model" in str(q.cost)
    # the report describes the module returned
    assert Counter(e.result for e in q.coverage.lowered)["qconv"] == _ops(q.module)["qconv"]
    with torch.no_grad():
        assert _cos(q.executable(X), model(X)) > 0.99
        assert _cos(q.module(X), q.reference(X)) > 0.99


def test_quantize_without_a_slower_region_keeps_everything_int8():
    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy=_slow(set()), per_layer=False)
    off = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy="off", per_layer=False)
    assert _ops(q.module) == _ops(off.module)
    assert q.cost.kept_fp32 == [] and len(q.cost.decisions) == 3
    assert str(off.cost).startswith("cost policy: off")


def test_measured_costs_are_real_numbers():
    """The default measurement times both sides of every region (values are machine-dependent:
    only their presence is checked)."""
    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy="off", per_layer=False)
    ref = prepare_reference(_model(), (X,), 2, progress=False)
    _, report = plan_regions(q.module, ref.graph_module, ref.float_module, (X,), rounds=1)
    assert len(report.decisions) == 3
    for d in report.decisions:
        assert d.cost.int8_ms is not None and d.cost.int8_ms > 0 and d.cost.fp32_ms is not None


def test_unknown_cost_policy_is_a_clear_error():
    with pytest.raises(InputError, match="unknown cost_policy 'fast'"):
        gml.quantize(_model(), 2, example_inputs=(X,), cost_policy="fast")


def test_a_failing_cost_policy_keeps_the_lowering_and_says_so():
    def broken(region: Region) -> RegionCost:
        raise RuntimeError("timer exploded")

    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy=broken, per_layer=False)
    assert _ops(q.module)["qconv"] == 3
    assert "cost policy failed (RuntimeError: timer exploded)" in str(q.cost)
    with pytest.raises(RuntimeError, match="timer exploded"):
        gml.quantize(_model(), 2, example_inputs=(X,), cost_policy=broken, per_layer=False, strict=True)


def test_the_default_policy_comes_from_the_environment(monkeypatch):
    # read once, at the API boundary (gml.runtime.options), and carried down as a value
    from gml.runtime.options import EngineOptions

    monkeypatch.delenv("GML_COST_POLICY", raising=False)
    assert EngineOptions.from_env().cost_policy == "measure"
    monkeypatch.setenv("GML_COST_POLICY", "off")
    assert EngineOptions.from_env().cost_policy == "off"
    monkeypatch.setenv("GML_COST_POLICY", "fastest")
    with pytest.raises(InputError, match="GML_COST_POLICY='fastest'"):
        EngineOptions.from_env()
    with pytest.raises(InputError, match="cost_policy='fastest'"):
        EngineOptions(cost_policy="fastest")


def test_timing_stops_early_when_one_side_is_far_slower():
    from gml.runtime.timing import median_ms_interleaved

    calls = {"fast": 0, "slow": 0}

    def fast() -> None:
        calls["fast"] += 1

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.03)

    t_fast, t_slow = median_ms_interleaved([fast, slow], rounds=5, min_ms=0.5)
    assert t_slow > 10 * t_fast
    assert calls["slow"] == 2  # warm-up and one timed call: no rounds spent on a decided comparison


def test_a_whole_model_within_the_margin_returns_the_gml_fp32_model(monkeypatch):
    """INT8 measured 5% faster is inside the guard's margin (WHOLE_MARGIN = 0.9): a speed-up that
    small does not pay for INT8's accuracy loss and is within a guard's noise, so fp32 comes back;
    10% faster or more keeps INT8."""
    import gml.quant.cost_policy as cp

    assert cp.WHOLE_MARGIN == 0.9
    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (0.95, 1.0))
    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy=_slow(set()), per_layer=False)
    assert q.cost.all_fp32 and q.precision == "fp32" and "INT8 cannot pay here" in str(q.cost)
    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (0.9, 1.0))
    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy=_slow(set()), per_layer=False)
    assert not q.cost.all_fp32 and q.precision == "int8"


def test_a_whole_model_slower_in_int8_returns_the_gml_fp32_model(monkeypatch):
    """The last guard: regions that each won (injected costs) but a whole model measured slower than
    gml.optimize's (a patched timer) — gml.optimize's model is returned, and the report says why
    (tests/quant/test_kept_fp32.py checks that model in detail)."""
    import gml.quant.cost_policy as cp

    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (3.0, 1.0))
    q = gml.quantize(_model(), 2, example_inputs=(X,), cost_policy=_slow(set()), per_layer=False)
    assert q.cost.all_fp32 and q.precision == "fp32" and "gml.optimize's model is returned" in str(q.cost)
    assert not _ops(q.module)
    kept = {n for e in q.coverage.kept_fp32 for n in e.nodes}
    assert {"c1", "c2", "c3", "fc"} <= kept
    assert all("the INT8 model ran 3.00 ms vs 1.00 ms" in e.reason for e in q.coverage.kept_fp32)
    assert q.cost.whole == (3.0, 1.0)
    with torch.no_grad():
        assert _cos(q.executable(X), _model()(X)) > 0.9999  # fp32 again


def test_a_single_region_is_left_to_the_whole_model_guard(monkeypatch):
    """One INT8 region is the whole INT8 model: it is not timed against its fp32 ops (a second fp32
    model built only to repeat what the guard measures: the quantize peak of #28); the guard decides."""
    import gml.quant.cost_policy as cp

    def no_region_timing(*a, **k):
        raise AssertionError("a single region was timed on its own")

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = torch.randn(1, 3, 16, 16)
    monkeypatch.setattr(cp, "MeasuredCost", no_region_timing)
    for times, precision in (((1.0, 3.0), "int8"), ((3.0, 1.0), "fp32")):
        monkeypatch.setattr(cp, "guard_whole_model", lambda *a, _t=times, **k: _t)
        q = gml.quantize(model, [(x,)] * 2, cost_policy="measure", per_layer=False)
        assert q.precision == precision
        (only,) = q.cost.decisions
        assert only.int8 and only.cost.int8_ms is None and "whole-model guard decides it" in only.reason
        assert q.cost.whole == times
