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


def forget_generated_fx_wraps() -> int:
    """Drop ``torch.fx.wrap`` registrations made by fx-generated code; return how many.

    Open bug (performance): FuseMatmulAddRelu traces its patterns and a replacement that calls the
    fx-wrapped ``fused_matmul_add_relu`` on every run, and fx's generated code re-registers the wrap
    (``wrap("...")`` at the top of each recompiled forward, with a fresh globals dict) every time:
    ``torch.fx._symbolic_trace._wrapped_fns_to_patch`` grows by ~37 entries per ``gml.optimize``,
    and every later ``symbolic_trace`` patches all of them. A fuzz run of hundreds of graphs in one
    process slowed down quadratically (same 20 graphs: 2.7 s, then 23.6 s on the 8th round). Real
    module-level wraps are kept: only registrations whose globals are not an imported module's go.
    """
    import sys

    from torch.fx import _symbolic_trace

    modules = {id(vars(m)) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    stale = [key for key in _symbolic_trace._wrapped_fns_to_patch if key[0] not in modules]
    for key in stale:
        del _symbolic_trace._wrapped_fns_to_patch[key]
    return len(stale)
