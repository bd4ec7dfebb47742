"""The whole-plan check of GML's own convs (``EngineSegment._whole_plan_check``).

The plan build takes each of GML's own convs where it timed faster than oneDNN's direct conv alone;
the segment then times the whole plan against the plan of direct convs only and keeps the faster
(on an Intel Xeon under the AVX2 mask, a plan holding GML's depthwise kernel ran every other step
slower). Which plan wins is the CPU's answer, so these tests fix the timer's answer and hold the
logic: the faster plan is kept and reported, its output is the model's, and nothing is timed where
the plan build timed nothing (``winograd`` other than ``auto``) or timing is off (``cost_policy``).
Every step is declared "own" here (the real kernels are only taken where they time faster, so a
test cannot count on one); ``is_own_conv_impl`` itself is checked on the implementation names.
"""

from __future__ import annotations

import pytest
import torch

from gml.runtime import compile as compile_mod
from gml.runtime import compile_engine, unavailable_reason
from gml.runtime.options import EngineOptions
from runtime.helpers import assert_close_int, graph_of, qconv, rand_u8

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

TIMED = EngineOptions(winograd="auto", cost_policy="measure")


def _model():
    return qconv(8, 8, 3, padding=(1, 1))


def _timer(own_ms: float, direct_ms: float, calls: list):
    """A stand-in for timing.median_ms_interleaved: runs each plan once (the check's callables must
    run) and answers ``[own_ms, direct_ms]``."""

    def fake(fns, rounds=5, **_):
        assert len(fns) == 2
        for f in fns:
            f()
        calls.append(rounds)
        return [own_ms, direct_ms]

    return fake


def _compile(monkeypatch, options: EngineOptions, own_ms: float, direct_ms: float):
    calls: list = []
    monkeypatch.setattr(compile_mod, "is_own_conv_impl", lambda impl: True)
    monkeypatch.setattr(compile_mod.timing, "median_ms_interleaved", _timer(own_ms, direct_ms, calls))
    mod, x = _model(), rand_u8(1, 8, 9, 9)
    with torch.no_grad():
        eng = compile_engine(graph_of(mod), [x.clone()], options=options)
        got, ref = eng(x.clone()), mod(x.clone())
    assert eng.report.path == "engine", str(eng.report)
    assert_close_int(ref, got)
    return eng, calls


def test_the_direct_plan_is_kept_where_the_whole_plan_times_faster_without_own_convs(monkeypatch):
    eng, calls = _compile(monkeypatch, TIMED, own_ms=2.0, direct_ms=1.0)
    assert calls, "the two plans were not timed"
    (why,) = eng.report.own_convs_dropped.values()
    assert "2.00x as slow" in why and "2.00 vs 1.00 ms" in why
    assert "GML's own convs left out of a plan" in str(eng.report) and "winograd='1'" in str(eng.report)


def test_the_plan_with_own_convs_is_kept_where_it_times_faster(monkeypatch):
    eng, calls = _compile(monkeypatch, TIMED, own_ms=1.0, direct_ms=2.0)
    assert calls
    assert not eng.report.own_convs_dropped
    assert "left out of a plan" not in str(eng.report)


@pytest.mark.parametrize(
    "options",
    [
        EngineOptions(winograd="1", cost_policy="measure"),  # forced: the user's choice stands
        EngineOptions(winograd="0", cost_policy="measure"),  # no own convs to weigh
        EngineOptions(winograd="auto", cost_policy="off"),  # runs that must not depend on timing
    ],
    ids=["forced", "direct", "cost-policy-off"],
)
def test_nothing_is_timed_unless_the_plan_build_timed_and_timing_is_allowed(monkeypatch, options):
    eng, calls = _compile(monkeypatch, options, own_ms=2.0, direct_ms=1.0)
    assert not calls and not eng.report.own_convs_dropped


def test_a_plan_without_own_convs_is_not_timed(monkeypatch):
    calls: list = []
    monkeypatch.setattr(compile_mod.timing, "median_ms_interleaved", _timer(2.0, 1.0, calls))
    mod, x = _model(), rand_u8(1, 8, 9, 9)
    with torch.no_grad():
        eng = compile_engine(graph_of(mod), [x], options=EngineOptions(winograd="0", cost_policy="measure"))
        eng(x)
    assert not calls and not eng.report.own_convs_dropped


@pytest.mark.parametrize(
    ("impl", "own"),
    [
        ("gml:winograd_f2x3+brg:avx512_core", True),
        ("gml:winograd_f4x3+s16:avx2", True),
        ("gml:im2col+u8s7:avx2", True),
        ("gml:dw+s16:avx2", True),
        ("jit_uni_int8:avx2", False),
        ("gml:int8_gemm_avx2", False),  # a linear, not a conv
        ("brg:avx512_core_vnni", False),
    ],
)
def test_own_conv_implementations_are_named_by_their_prefix(impl, own):
    assert compile_mod.is_own_conv_impl(impl) is own
