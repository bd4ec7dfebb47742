"""Fuzz the INT8 pipeline (gml.quantize) with random valid models.

Property (gml.testing.fuzz.check_int8): only GMLError escapes, no pass is rolled back, the caller's
model is untouched, outputs keep their count and shapes, and every output is within
INT8_FACTOR x the deviation that simulated rounding noise (±half a quantization step on every
value and weight) causes. The derivation and the measured ratios are in docs/fuzzing.md.
INT8 graphs are slower (torch.ao prepare/convert): CI runs 100, `make fuzz` 5,000.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, assume, event, given, settings, target

import gml.quant.lower_rules as lower_rules
from fuzz.known_bugs import known_int8_bug
from gml.testing.fuzz import FuzzFailure, check_int8
from gml.testing.graphgen import L, ModelSpec
from gml.testing.strategies import fuzz_seed, fuzz_settings, model_specs


@fuzz_seed
@fuzz_settings(100, share=0.5)
@given(spec=model_specs(max_layers=8))
def test_int8_pipeline_within_quantization_noise(spec):
    assume(not known_int8_bug(spec))
    outcome = check_int8(spec)
    if outcome.refused is not None:
        event(f"refused: {type(outcome.refused).__name__}: {outcome.refused.message[:60]}")
    target(outcome.max_rel_err, label="INT8 error / allowed")


# ------------------------------------------------------------------ the INT8 property catches a broken lowering
@pytest.fixture
def broken_int8_bias(monkeypatch):
    """Lowering that hands the INT8 conv/linear kernels the negated bias."""
    real = lower_rules._weights

    def negated(mod):
        w, ws, b = real(mod)
        return w, ws, None if b is None else -b

    monkeypatch.setattr(lower_rules, "_weights", negated)


def test_int8_property_catches_a_wrong_bias_sign(broken_int8_bias):
    failures: list[str] = []

    @settings(max_examples=25, derandomize=True, database=None, deadline=None, phases=[Phase.generate])
    @given(spec=model_specs(max_layers=4))
    def prop(spec):
        assume(not known_int8_bug(spec))
        try:
            check_int8(spec)
        except FuzzFailure as exc:
            failures.append(str(exc))
            raise

    with pytest.raises(FuzzFailure):
        prop()
    assert "more than 4 x the" in failures[-1] and "that rounding noise moves it" in failures[-1]


def test_a_plain_conv_relu_quantizes_within_the_bound():
    spec = ModelSpec(inputs=[(1, 3, 8, 8)], layers=[L("conv", 0, out=8, k=3, pad=1), L("bn", 1), L("act", 2)])
    outcome = check_int8(spec)
    assert outcome.refused is None
    assert 0 < outcome.max_rel_err < 0.5  # uses well under half the allowance
