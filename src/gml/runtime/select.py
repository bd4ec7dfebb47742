"""Choosing the runtime of a lowered model: the native engine where it covers the graph, else torch.

:func:`attach_runtime` is what ``gml.quantize`` and ``gml.optimize`` call. The engine's outputs on the example inputs
are checked against the Python executor's before it is chosen: a disagreement (a miscompile) keeps
the model on the Python executor and the report says so, it never returns wrong numbers silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from gml.errors import GMLError, InputError
from gml.ir.target import Target
from gml.ir.values import cloned
from gml.kernels.packs import drop_packed
from gml.runtime import timing
from gml.runtime.compile import EngineModule, RuntimeReport, compile_engine, python_executor
from gml.runtime.options import EngineOptions, resolve_options

RUNTIMES = ("engine", "torch")
#: An output may differ from the Python executor's by this fraction of its largest magnitude.
#: INT8: one rounding step flipped here and there moves an fp32 output by ~1% of its range.
INT8_TOLERANCE = 0.05
#: fp32: the engine and the executor run the same math in another summation order (blocked
#: layouts), a few ulps apart; 1e-3 still catches any wrong kernel or layout.
FP32_TOLERANCE = 1e-3


def check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise InputError(f"unknown runtime {runtime!r}.", hint=f"use one of: {', '.join(RUNTIMES)}.")


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in _flat(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flat(o)]
    return []


def agreement_error(ref: Any, got: Any, tolerance: float = INT8_TOLERANCE) -> str | None:
    """Why the engine's outputs differ from the Python executor's beyond rounding, or None."""
    a, b = _flat(ref), _flat(got)
    if len(a) != len(b):
        return f"{len(b)} outputs instead of {len(a)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i} is {y.dtype} {tuple(y.shape)}, expected {x.dtype} {tuple(x.shape)}"
        if not x.is_floating_point():
            if x.numel() and int((x.int() - y.int()).abs().max()) > 1:
                return f"output {i} differs by more than one integer step"
            continue
        if not x.numel():
            continue
        scale = float(x.abs().max()) or 1.0
        err = float((x - y).abs().max())
        # below float32's smallest normal number oneDNN's kernels flush to zero (FTZ / DAZ) where
        # torch keeps denormals: a random-init HF MobileViT's outputs of ~7e-40 differed by 3e-41
        if not (err <= tolerance * scale or err < torch.finfo(torch.float32).tiny):
            return f"output {i} differs by {err:.3g} (outputs reach {scale:.3g})"
    return None


#: With an fp32 reference: the engine may differ from the Python executor by more than the
#: tolerance if it is as close to fp32 as the executor is (relative L2 error at most this × the
#: executor's). Needed where float ops sit between INT8 GEMMs that quantize per row at run time
#: (the transformer scheme): an ulp of difference in a LayerNorm flips an int8 rounding, and the
#: flips compound through the layers; on real all-MiniLM-L6-v2 the engine and the executor then
#: differ by 8% of the pooler's range while both keep cosine 0.995 with fp32. A miscompile is
#: far from fp32, not as close as the executor. gml.quantize gives the fp32 outputs in both INT8
#: schemes (static INT8 of a random-init model has outputs so small that 5% of them is one flip).
AS_CLOSE_TO_FP32 = 1.25


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def fp32_closeness_error(py: Any, got: Any, fp32: Any) -> str | None:
    """Why the engine's outputs ``got`` are further from the fp32 model's ``fp32`` than the Python
    executor's ``py`` are (relative L2, :data:`AS_CLOSE_TO_FP32`), or None."""
    a, b, f = _flat(py), _flat(got), _flat(fp32)
    if not len(a) == len(b) == len(f):
        return "output counts differ"
    for i, (x, y, r) in enumerate(zip(a, b, f)):
        if not x.is_floating_point() or x.shape != r.shape or not x.numel():
            continue
        ex, ey = _rel_l2(x, r), _rel_l2(y, r)
        if not ey <= AS_CLOSE_TO_FP32 * ex + 1e-6:
            return f"output {i} is further from fp32 than the executor's (relative L2 {ey:.3g} vs {ex:.3g})"
    return None


#: The engine is kept only if it is not slower than the Python executor by more than this factor on
#: the example (interleaved timing; a primitive oneDNN serves from a slow kernel for an unusual
#: layout must not make the default runtime slower than torch: timm mixnet_s fp32 once ran 3x eager).
ENGINE_SLOWER_LIMIT = 1.5


def _slower_than_executor(
    gm: fx.GraphModule, engine: EngineModule, inputs: Sequence[Any], options: EngineOptions
) -> str | None:
    """Why the engine is not worth it here (it times slower than the Python executor), or None.
    Skipped when ``options.cost_policy`` is ``off`` (runs that must not depend on timing: the test
    suite sets ``GML_COST_POLICY=off``, the default at the API boundary)."""
    if options.cost_policy == "off":
        return None

    def run(f: Any) -> Any:
        return lambda: f(*cloned(inputs))

    eng_ms, py_ms = timing.median_ms_interleaved([run(engine), run(python_executor(gm))], rounds=3)
    if eng_ms > ENGINE_SLOWER_LIMIT * py_ms:
        return (
            f"the engine ran slower than the Python executor on the example ({eng_ms:.2f} ms vs "
            f"{py_ms:.2f} ms); using torch"
        )
    return None


def _as_close_to_fp32(py: Any, got: Any, fp32_model: Any, inputs: Sequence[Any]) -> bool:
    try:
        with torch.no_grad():
            reference = fp32_model(*cloned(inputs))
    except Exception:  # a loaded file's float stand-in (gml.io) that cannot run proves nothing
        return False
    return fp32_closeness_error(py, got, reference) is None


def attach_runtime(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    runtime: str = "engine",
    *,
    tolerance: float = INT8_TOLERANCE,
    fp32_model: Any = None,
    target: Target | None = None,
    options: EngineOptions | None = None,
) -> tuple[EngineModule | None, RuntimeReport]:
    """``(engine module or None, report)`` for ``gm``: None means "run the Python executor".

    ``fp32_model`` (the fp32 graph ``gm`` was quantized from) allows an INT8 engine that differs
    from the executor beyond ``tolerance`` when it is as close to the fp32 model's outputs as the
    executor (:data:`AS_CLOSE_TO_FP32`); the report's note says so. ``target``: the CPU the
    plans are built for (the API boundary's; default: this process's); ``options``: the engine's
    switches (:class:`~gml.runtime.options.EngineOptions`; default: the ``GML_*`` variables')."""
    from gml.runtime.target import resolve

    check_runtime(runtime)
    target, options = resolve(target), resolve_options(options)
    if runtime == "torch":
        return None, RuntimeReport(
            "torch", note="runtime='torch' requested: the Python executor runs every node", target=target
        )
    try:
        # copies: compiling runs the graph once, and a graph may write its input (``x.add_(1)``)
        engine = compile_engine(gm, cloned(example_inputs), target, options)
    except GMLError as e:
        return None, RuntimeReport("torch", note=f"engine unavailable: {e.message}", target=target)
    if engine.report.engine_nodes == 0:
        return None, RuntimeReport("torch", nodes=engine.report.nodes, note=engine.report.note, target=target)
    with torch.no_grad():
        ref = gm(*cloned(example_inputs))
        got = engine(*cloned(example_inputs))
    problem = agreement_error(ref, got, tolerance)
    if problem and fp32_model is not None and _as_close_to_fp32(ref, got, fp32_model, example_inputs):
        engine.report.note = (
            f"the engine differs from the Python executor beyond INT8 rounding ({problem}) but is as "
            "close to the fp32 model (run-time INT8 rounding flips after float ops that round differently)"
        )
        problem = None
    if not problem:
        slower = _slower_than_executor(gm, engine, example_inputs, options)
        if slower:
            return None, RuntimeReport("torch", nodes=engine.report.nodes, note=slower, target=target)
        # The engine holds its own reordered weights: the packed copies the Python executor made
        # while it was checked and timed are a second copy nothing calls (repacked if it runs again)
        for segment in engine.segments():
            drop_packed(segment.reference)
        return engine, engine.report
    return None, RuntimeReport(
        "torch",
        nodes=engine.report.nodes,
        note=f"the engine disagreed with the Python executor ({problem}); using torch",
        target=target,
    )
