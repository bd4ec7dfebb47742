"""Open bugs the fuzzer found, as predicates over a spec, so the fuzz runs skip them and keep
looking for new ones.

Each predicate names an ``xfail(strict=True)`` case in test_regressions.py. When a fix lands, that
case passes, the strict xfail turns into a failure, and whoever fixed it deletes the case's
marker and the check here (so the fuzz run covers the pattern again).
"""

from __future__ import annotations

from gml.testing.graphgen import ModelSpec


def known_fp32_bug(spec: ModelSpec) -> bool:
    """None open. (FuseConvAdd on ``y + y`` was one; fixed, now a case in FP32_CASES.)"""
    return False


def known_int8_bug(spec: ModelSpec) -> bool:
    """None open. (y + y of a conv output, in-place ReLU read through an in-place result, sigmoid of
    an input, 1x1 adaptive pool upsampling and conv windows entirely in padding were; fixed, now
    cases in INT8_CASES.)"""
    return False
