"""The properties the fuzz tests check, as functions a pass author can call on any spec.

:func:`check_fp32` builds the model a :class:`~gml.testing.graphgen.ModelSpec` describes, runs the
fp32 pipeline on it and raises :class:`FuzzFailure` (an ``AssertionError``) naming what broke:

* a pass the :class:`~gml.passes.manager.PassManager` rolled back: it produced a graph that failed
  ``lint()``, crashed, or moved the outputs beyond its tolerance. The rollback keeps users safe,
  but in a fuzz run it is a bug in that pass;
* the final module's outputs differ from eager beyond ``FP32_RTOL`` of the output's magnitude, on
  inputs the pipeline never saw;
* the caller's model changed (parameters, buffers or outputs): passes must work on a copy;
* any exception other than a :class:`~gml.errors.GMLError` (a documented refusal, returned in
  :attr:`Outcome.refused` so the caller can count it).

:func:`check_int8` does the same for the INT8 pipeline with the bound derived in docs/fuzzing.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gml.errors import GMLError
from gml.passes.base import GraphPass
from gml.testing.graphgen import ModelSpec, build

# fp32 rewrites (BN folding, fused oneDNN kernels) only reassociate float arithmetic; across ~10
# layers that moves outputs by a few ulps of the largest intermediate (measured: < 2e-6 relative,
# docs/fuzzing.md). 1e-4 of the output magnitude is 50x that and still catches any real error.
FP32_RTOL = 1e-4


class FuzzFailure(AssertionError):
    """A fuzzed model broke a pipeline property; the message says which and how."""


@dataclass
class Outcome:
    """What happened to one fuzzed model."""

    spec: ModelSpec
    max_rel_err: float = 0.0  # max |got - eager| / max(|eager|, 1e-3), over all outputs and inputs
    refused: GMLError | None = None
    report: Any = None
    notes: list[str] = field(default_factory=list)


def _flat(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple | list) else (out,)
    return [o.dequantize() if o.is_quantized else o for o in outs]


def _run(module: nn.Module, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [o.detach().clone() for o in _flat(module(*[x.clone() for x in inputs]))]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def default_fp32_passes() -> list[GraphPass]:
    """The project's fp32 pipeline (``gml.passes.pipeline.fp32_passes``), else the passes that exist."""
    try:
        from gml.passes.pipeline import fp32_passes

        return list(fp32_passes())
    except ImportError:
        pass
    passes: list[GraphPass] = []
    for module, cls in (
        ("gml.passes.normalize", "Normalize"),
        ("gml.passes.untie", "UntieSharedModules"),
        ("gml.passes.fold_bn", "FoldBatchNorm"),
    ):
        try:
            passes.append(getattr(__import__(module, fromlist=[cls]), cls)())
        except (ImportError, AttributeError):
            continue
    return passes


def _optimize(model: nn.Module, inputs: tuple[torch.Tensor, ...], passes: Sequence[GraphPass] | None) -> Any:
    """``gml.optimize`` when it exists, else capture + PassManager (same contract)."""
    chosen = list(passes) if passes is not None else default_fp32_passes()
    try:
        import gml.passes.pipeline  # noqa: F401 - gml.optimize needs it
        from gml.api import optimize
    except ImportError:
        optimize = None
    if optimize is not None:
        res = optimize(model, inputs, passes=chosen)
        return res.module, res.report
    from gml.capture import capture
    from gml.passes.manager import PassManager

    gm = capture(copy.deepcopy(model), inputs)
    res = PassManager(chosen).run(gm, [inputs])
    return res.graph_module, res.report


def rel_err(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> float:
    """Max abs difference over all outputs, relative to each output's magnitude (at least 1e-3)."""
    if len(ref) != len(got):
        return math.inf
    worst = 0.0
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            return math.inf
        if r.numel() == 0:
            continue
        g = g.to(r.dtype)
        if not torch.isfinite(g).all() and torch.isfinite(r).all():
            return math.inf
        scale = max(float(r.abs().max()), 1e-3)
        worst = max(worst, float((r - g).abs().max()) / scale)
    return worst


def check_fp32(
    spec: ModelSpec,
    *,
    passes: Sequence[GraphPass] | None = None,
    rtol: float = FP32_RTOL,
    optimize: Callable[..., Any] | None = None,
    n_check: int = 2,
) -> Outcome:
    """Run the fp32 pipeline on ``build(spec)`` and check every property (module docstring)."""
    model = build(spec)
    inputs = spec.example_inputs(seed=0)
    checks = [spec.example_inputs(seed=s) for s in range(1, 1 + n_check)]  # inputs the pipeline never saw
    state = _state(model)
    eager = [_run(model, x) for x in checks]
    outcome = Outcome(spec)
    try:
        gm, report = (optimize or _optimize)(model, inputs, passes)
    except GMLError as exc:
        outcome.refused = exc
        return outcome
    outcome.report = report
    rolled = [r for r in getattr(report, "records", []) if r.status == "rolled back"]
    if rolled:
        raise FuzzFailure(
            "pass rolled back (it produced a wrong graph): "
            + "; ".join(f"{r.name}: {r.error}" for r in rolled)
            + f"\n{spec.pretty()}"
        )
    try:
        gm.graph.lint()
    except Exception as exc:
        raise FuzzFailure(f"final graph fails lint: {exc}\n{spec.pretty()}") from exc
    for x, ref in zip(checks, eager):
        err = rel_err(ref, _run(gm, x))
        outcome.max_rel_err = max(outcome.max_rel_err, err)
        if err > rtol:
            raise FuzzFailure(
                f"fp32 pipeline output differs from eager: max error {err:.3g} of the output magnitude "
                f"(allowed {rtol:g})\n{spec.pretty()}\n{gm.code}"
            )
    after = _state(model)
    changed = [k for k in state if not torch.equal(state[k], after.get(k, torch.empty(0)))]
    if changed or set(after) != set(state):
        raise FuzzFailure(f"the caller's model was modified: {changed or sorted(set(after) ^ set(state))}")
    if rel_err(eager[0], _run(model, checks[0])) != 0.0:
        raise FuzzFailure("the caller's model computes something else after optimize")
    return outcome


__all__ = ["FP32_RTOL", "FuzzFailure", "Outcome", "check_fp32", "default_fp32_passes", "rel_err"]
