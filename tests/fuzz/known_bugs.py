"""Open bugs the fuzzer found, as predicates over a spec, so the fuzz runs skip them and keep
looking for new ones.

Each predicate names an ``xfail(strict=True)`` case in test_regressions.py. When a fix lands, that
case passes, the strict xfail turns into a failure, and whoever fixed it deletes the case's
marker and the check here (so the fuzz run covers the pattern again).
"""

from __future__ import annotations

from gml.testing.graphgen import L, ModelSpec


def _empty_window(layer: L, shape: tuple[int, ...]) -> bool:
    """Whether some output of this conv reads nothing but padding (every tap outside the input)."""
    k, s, p, d = layer["k"], layer["stride"], layer["pad"], layer["dil"]
    for n in shape[2:]:
        out = (n + 2 * p - d * (k - 1) - 1) // s + 1
        if any(all(not 0 <= o * s - p + j * d < n for j in range(k)) for o in range(out)):
            return True
    return False


def has_a_conv_window_entirely_in_padding(spec: ModelSpec) -> bool:
    shapes = spec.shapes()
    for layer in spec.layers:
        conv = spec.layers[layer["of"]] if layer.op == "reuse" else layer
        if conv.op == "conv" and _empty_window(conv, shapes[layer.src[0]]):
            return True
    return False


def known_fp32_bug(spec: ModelSpec) -> bool:
    """None open. (FuseConvAdd on ``y + y`` was one; fixed, now a case in FP32_CASES.)"""
    return False


def known_int8_bug(spec: ModelSpec) -> bool:
    return (
        # oneDNN's INT8 conv returns garbage where a window lies entirely in the padding
        # (test_regressions.py::test_int8_open_bug[conv_window_entirely_in_padding])
        has_a_conv_window_entirely_in_padding(spec)
    )


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
