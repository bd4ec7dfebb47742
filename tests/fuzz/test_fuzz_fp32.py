"""Fuzz the fp32 pipeline (gml.optimize) with random valid models.

Property (gml.testing.fuzz.check_fp32): no pass is rolled back (a rollback means the pass produced
a graph that failed lint, crashed or changed the numbers), the result matches eager within 1e-4 of
the output magnitude on inputs the pipeline never saw, the caller's model is untouched, and only
GMLError escapes. 200 seeded graphs in CI; `make fuzz` runs 10,000.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, assume, event, given, settings, target
from hypothesis import strategies as st

import gml.passes.fold_bn as fold_bn_module
from fuzz.known_bugs import known_fp32_bug
from gml.capture import capture
from gml.passes.fuse_conv import FuseConvActivation, FuseConvAdd
from gml.passes.fuse_elementwise import FuseElementwise
from gml.passes.fuse_linear import FuseLinearActivation
from gml.passes.fuse_matmul import FuseMatmulAddRelu
from gml.passes.horizontal_merge import HorizontalMerge
from gml.passes.manager import PassManager
from gml.passes.pipeline import canonical_passes
from gml.testing.fuzz import FuzzFailure, check_fp32
from gml.testing.graphgen import L, ModelSpec
from gml.testing.strategies import fuzz_seed, fuzz_settings, model_specs


@fuzz_seed
@fuzz_settings(200)
@given(spec=model_specs())
def test_fp32_pipeline_matches_eager(spec):
    assume(not known_fp32_bug(spec))
    outcome = check_fp32(spec)
    if outcome.refused is not None:
        event(f"refused: {type(outcome.refused).__name__}")
    for record in outcome.report.records if outcome.report else []:
        if record.matches:
            event(f"{record.name} rewrote something")
    target(outcome.max_rel_err, label="error vs eager, relative to output magnitude")


def forced_fusion_passes(linear_backend: str) -> list:
    """The fp32 pipeline with every opt-in fusion on: conv siblings merged, and every Linear fused on
    the given backend even where the default would keep ATen's kernel for speed. The default
    pipeline declines most fusions on tiny fuzzed shapes, so this is what exercises the kernels."""
    return [
        *canonical_passes(),
        HorizontalMerge(convs=True),
        FuseConvAdd(),
        FuseConvActivation(),
        FuseLinearActivation(backend=linear_backend),
        FuseMatmulAddRelu(),
        FuseElementwise(),
    ]


@fuzz_seed
@fuzz_settings(100, share=0.25)
@given(spec=model_specs(), linear_backend=st.sampled_from(["onednn", "mkl"]))
def test_fp32_with_every_fusion_forced(spec, linear_backend):
    assume(not known_fp32_bug(spec))
    outcome = check_fp32(spec, passes=forced_fusion_passes(linear_backend))
    for record in outcome.report.records if outcome.report else []:
        if record.matches and record.name.startswith(("fuse", "horizontal")):
            event(f"{record.name} rewrote something")


# ------------------------------------------------------------------ the fuzzer catches a broken pass
def _wrong_sign_fold(real):
    """BN folding with the mean added instead of subtracted: b' = s(b + μ) + β."""

    def fold(conv_w, conv_b, bn_rm, bn_rv, bn_eps, bn_w, bn_b, transpose=False):
        return real(conv_w, conv_b, -bn_rm, bn_rv, bn_eps, bn_w, bn_b, transpose)

    return fold


@pytest.fixture
def broken_bn_fold(monkeypatch):
    """Toggle a deliberately broken FoldBatchNorm for the duration of one test."""
    monkeypatch.setattr(fold_bn_module, "fuse_conv_bn_weights", _wrong_sign_fold(fold_bn_module.fuse_conv_bn_weights))


def _find_failure(check, n: int = 120, shrink: bool = True):
    """Run the fuzz property on up to ``n`` graphs; return (error, last failing spec) or None.

    With ``shrink`` the last failing spec is the smallest one hypothesis found (it replays it last).
    """
    seen: list[ModelSpec] = []
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=phases)
    @given(spec=model_specs())
    def prop(spec):
        seen.append(spec)
        check(spec)

    try:
        prop()
    except FuzzFailure as exc:
        return exc, seen[-1]
    return None


def _canonical(spec: ModelSpec):
    """The property on the passes up to BN folding only: the fusion passes add time, not coverage here."""
    return check_fp32(spec, passes=canonical_passes())


def test_fuzzer_catches_wrong_sign_bn_folding(broken_bn_fold):
    found = _find_failure(_canonical)
    assert found is not None, "a BN fold with the wrong sign went unnoticed"
    exc, smallest = found
    assert "pass rolled back" in str(exc) and "fold_bn: numerics" in str(exc)
    # shrinking leaves the essence: a conv (or convT) feeding a BatchNorm
    assert [layer.op for layer in smallest.layers][-2:] in (["conv", "bn"], ["convT", "bn"])
    assert len(smallest.layers) == 2


def test_fuzzer_catches_it_even_without_the_managers_safety_net(broken_bn_fold):
    """With the PassManager's per-pass numeric check off, the final comparison with eager catches it."""

    def unchecked(model, inputs, passes):
        res = PassManager(canonical_passes(), check_numerics=False).run(capture(model, inputs), [inputs])
        return res.graph_module, res.report

    found = _find_failure(lambda spec: check_fp32(spec, optimize=unchecked), shrink=False)
    assert found is not None
    assert "fp32 pipeline output differs from eager" in str(found[0])


def test_correct_fold_passes_the_same_graphs():
    spec = ModelSpec(inputs=[(1, 2, 3, 3)], layers=[L("conv", 0, out=3, k=3, pad=1), L("bn", 1)])
    outcome = check_fp32(spec)
    assert outcome.report.record("fold_bn").matches == 1
    assert outcome.max_rel_err < 1e-5
