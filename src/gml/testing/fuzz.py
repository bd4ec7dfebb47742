"""The properties the fuzz tests check, as functions a pass author can call on any spec.

:func:`check_fp32` builds the model a :class:`~gml.testing.graphgen.ModelSpec` describes, runs the
fp32 pipeline on it and raises :class:`FuzzFailure` (an ``AssertionError``) naming what broke:

* a pass the :class:`~gml.passes.manager.PassManager` rolled back: it produced a graph that failed
  ``lint()``, crashed, or moved the outputs beyond its tolerance. The rollback keeps users safe,
  but in a fuzz run it is a bug in that pass;
* the final module's outputs differ from eager beyond ``FP32_RTOL`` of the output's magnitude, on
  inputs the pipeline never saw (plus :data:`NOISE_FACTOR` times eager's own distance from a
  float64 run, which matters only where eager returns rounding noise);
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
#: An ill-conditioned graph (BN with batch statistics over a constant channel) returns rounding
#: noise even in eager fp32; the optimized model may then differ by this many times eager's own
#: distance from a float64 run, on top of ``FP32_RTOL``.
NOISE_FACTOR = 8.0
#: A rewrite's rounding is a few ulps of the *intermediate* values it reassociates: when a graph
#: cancels O(1) activations down to a tiny output (BN subtracting a mean, then ReLU: seed 424242,
#: output 4.6e-4, folded-BN error 2.2e-7 = 2 ulps of the O(1) convT output), the error relative to
#: the output is large and still only rounding. The bound also allows this many fp32 ulps of the
#: largest intermediate activation; a wrong rewrite moves outputs by O(signal), far above it.
ULPS_OF_INTERMEDIATES = 16


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


def _eager_noise(model: nn.Module, inputs: Sequence[torch.Tensor], eager: list[torch.Tensor]) -> float:
    """How far eager fp32 itself is from a float64 run of the same model (:func:`rel_err` units)."""
    try:
        exact = _run(copy.deepcopy(model).double(), [x.double() if x.is_floating_point() else x for x in inputs])
    except Exception:  # an op without a float64 kernel: no noise estimate, the plain bound applies
        return 0.0
    return rel_err([e.to(r.dtype) for e, r in zip(exact, eager)], eager)


def _largest_intermediate(model: nn.Module, inputs: Sequence[torch.Tensor]) -> float:
    """The largest |value| of any floating activation while ``model`` runs on ``inputs``."""
    from torch.fx import Interpreter, symbolic_trace

    peak = 0.0

    class _Peak(Interpreter):
        def run_node(self, n: Any) -> Any:
            nonlocal peak
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                finite = out[torch.isfinite(out)]
                if finite.numel():
                    peak = max(peak, float(finite.abs().max()))
            return out

    try:
        with torch.no_grad():
            _Peak(symbolic_trace(copy.deepcopy(model))).run(*[x.clone() for x in inputs])
    except Exception:  # not traceable here: no allowance beyond the plain bound
        return 0.0
    return peak


def _other_batch(spec: ModelSpec, model: nn.Module) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]] | None:
    """Inputs with one more item in dim 0 than the example's (seeded), and eager's outputs on them;
    None where eager itself cannot take them (a reshape to the example's batch)."""
    gen = torch.Generator().manual_seed(101)
    x = tuple(torch.randn((s[0] + 1, *s[1:]), generator=gen) for s in spec.inputs)
    try:
        return x, _run(model, x)
    except Exception:  # any error of the user's model on this batch: nothing to compare
        return None


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
        # the runtime gml.optimize chose (the native engine where it covers the graph)
        return getattr(res, "executable", res.module), res.report
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
    ulp: float | None = None,
) -> Outcome:
    """Run the fp32 pipeline on ``build(spec)`` and check every property (module docstring).

    ``ulp``: the unit of the intermediates' allowance (default fp32's eps; the bf16 property run
    passes bf16's, 2^-8, with ``rtol`` its own bound)."""
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
    graph_module = getattr(gm, "graph_module", gm)  # an EngineModule runs a partitioned GraphModule
    try:
        graph_module.graph.lint()
    except Exception as exc:
        raise FuzzFailure(f"final graph fails lint: {exc}\n{spec.pretty()}") from exc
    # and at another batch: the engine makes a new plan for it, which the example never exercised
    # (a batch-1 addend summed in place read out of bounds at batch 2: visformer, session 21)
    other = _other_batch(spec, model)
    if other is not None:
        try:
            got_other = _run(gm, other[0])
        except GMLError:  # a model captured for its example's shapes refuses others: allowed
            got_other = None
        if got_other is not None:
            checks, eager = [*checks, other[0]], [*eager, other[1]]
    for i, (x, ref) in enumerate(zip(checks, eager)):
        err = rel_err(ref, got_other if i == n_check else _run(gm, x))
        outcome.max_rel_err = max(outcome.max_rel_err, err)
        allowed = rtol
        if err > rtol:  # before failing, see whether eager itself only returns rounding noise here
            allowed = rtol + NOISE_FACTOR * _eager_noise(model, x, ref)
        if err > allowed:  # or whether the output is a tiny remainder of much larger intermediates
            scale = min(max(float(r.abs().max()), 1e-3) for r in ref if r.numel()) if ref else 1e-3
            unit = ulp if ulp is not None else torch.finfo(torch.float32).eps
            allowed += ULPS_OF_INTERMEDIATES * unit * _largest_intermediate(model, x) / scale
        if err > allowed:
            shapes = ", ".join(str(tuple(t.shape)) for t in x)
            raise FuzzFailure(
                f"fp32 pipeline output differs from eager on inputs {shapes}: max error {err:.3g} of the "
                f"output magnitude (allowed {allowed:.3g})\n{spec.pretty()}\n{graph_module.code}"
            )
    after = _state(model)
    changed = [k for k in state if not torch.equal(state[k], after.get(k, torch.empty(0)))]
    if changed or set(after) != set(state):
        raise FuzzFailure(f"the caller's model was modified: {changed or sorted(set(after) ^ set(state))}")
    if rel_err(eager[0], _run(model, checks[0])) != 0.0:
        raise FuzzFailure("the caller's model computes something else after optimize")
    return outcome


# ---------------------------------------------------------------------------------------- INT8
# An INT8 output may differ from fp32 by at most INT8_FACTOR times what simulated rounding noise moves
# it (see quantization_noise and docs/fuzzing.md for the derivation and the measured ratios).
INT8_FACTOR = 4.0
NOISE_TRIALS = 6


def _weighted_params(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """(weight, output-channel axis) of every conv / convT / linear weight, module or functional."""
    out: list[tuple[torch.Tensor, int]] = []
    for mod in model.modules():
        if isinstance(mod, nn.modules.conv._ConvTransposeNd):
            out.append((mod.weight, 1))
        elif isinstance(mod, nn.modules.conv._ConvNd | nn.Linear):
            out.append((mod.weight, 0))
    spec: ModelSpec = model.spec  # type: ignore[assignment]
    for i, layer in enumerate(spec.layers):
        if layer.op in ("conv", "linear") and layer.kw.get("form") == "functional":
            out.append((getattr(model, f"w{i}"), 0))
        if layer.op == "matmul":
            out.append((getattr(model, f"m{i}"), 1))  # (in, out): output features on dim 1
    return out


# Layer ops whose INT8 output keeps (shares) the quantization grid of its inputs.
_SHARES_GRID = ("pool", "cat", "flatten", "merge", "split", "unsqueeze", "permute", "contiguous", "dropout")
_SHARING_ACTS = ("relu", "relu6", "hardtanh")


def _steps(spec: ModelSpec, ranges: dict[int, float]) -> dict[int, float]:
    """Quantization step of every value: its range / 255, or the widest range it shares a grid with."""
    n = len(spec.inputs)
    width = dict(ranges)
    for li, layer in enumerate(spec.layers):
        op = spec.layers[layer["of"]] if layer.op == "reuse" else layer
        if op.op in _SHARES_GRID or (op.op == "act" and op["kind"] in _SHARING_ACTS):
            width[n + li] = max([width[n + li], *(width[s] for s in layer.src)])
    return {i: w / 255 for i, w in width.items()}


def quantization_noise(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    trials: int = NOISE_TRIALS,
    seed: int = 0,
    weight_levels: float | None = None,
) -> list[float]:
    """How far INT8-sized rounding noise moves each output of a generated model (max abs, per output).

    Models INT8 as fp32 plus rounding noise: every value of the model (input and each layer's
    output) gets independent uniform noise of ±half its quantization step, ``step = range/255``
    (per-tensor uint8 over the value's calibration range, which includes 0, as the minmax observer
    does), and every conv/linear weight gets ±half its per-output-channel step ``max|w_c|/L``,
    ``L = weight_levels``: half the target's weight range (127.5 for 8-bit weights, 64 for the 7-bit
    weights of a target without VNNI, ADR 011; default: this process's target's).
    Ops that keep their input's scale in INT8 (pooling, ReLU-like clamps, views, cat) are given the
    step of the widest range they share: an average pool's output has a much narrower range than
    its input but is rounded on the input's grid. All of that over-approximates the real
    quantization points (ops left in fp32 and fused chains round less often). The result is the
    largest output deviation over ``trials`` noisy runs per batch.
    """
    if not hasattr(model, "probe"):
        raise TypeError("quantization_noise needs a model from gml.testing.graphgen.build")
    lo: dict[int, float] = {}
    hi: dict[int, float] = {}

    def record(i: int, v: torch.Tensor) -> None:
        lo[i] = min(lo.get(i, 0.0), float(v.min()))
        hi[i] = max(hi.get(i, 0.0), float(v.max()))

    clean = []
    model.probe = record  # type: ignore[assignment]
    try:
        clean = [_run(model, b) for b in batches]
    finally:
        model.probe = None  # type: ignore[assignment]

    step = _steps(model.spec, {i: hi[i] - lo[i] for i in hi})  # type: ignore[arg-type]
    noisy = copy.deepcopy(model)
    if weight_levels is None:
        from gml.runtime.target import detect_target

        arith = detect_target().int8
        weight_levels = (arith.weight_qmax - arith.weight_qmin) / 2
    gen = torch.Generator().manual_seed(seed)
    worst = [0.0] * len(clean[0])
    originals = [(w, w.detach().clone()) for w, _ in _weighted_params(noisy)]

    def perturb(i: int, v: torch.Tensor) -> None:
        # in place, so in-place ops and views of the value see the noise too (inputs are _run's clones)
        v.add_((torch.rand(v.shape, generator=gen) - 0.5) * step[i])

    noisy.probe = perturb  # type: ignore[assignment]
    with torch.no_grad():
        for _ in range(trials):
            for (w, w0), (_, axis) in zip(originals, _weighted_params(noisy)):
                dims = [d for d in range(w0.dim()) if d != axis]
                wstep = w0.abs().amax(dim=dims, keepdim=True) / weight_levels
                w.copy_(w0 + (torch.rand(w0.shape, generator=gen) - 0.5) * wstep)
            for b, ref in zip(batches, clean):
                for k, (r, y) in enumerate(zip(ref, _run(noisy, b))):
                    worst[k] = max(worst[k], float((r - y).abs().max()) if r.numel() else 0.0)
    return worst


def _quantize(model: nn.Module, calib: list[tuple[torch.Tensor, ...]]) -> Any:
    """``gml.quantize`` when it exists, else the INT8 frontend followed by the lowering pass."""
    try:
        from gml.api import quantize
    except ImportError:
        quantize = None
    if quantize is not None:
        import inspect

        params = inspect.signature(quantize).parameters
        extra = {"per_layer": False} if "per_layer" in params else {}
        if "keep_broken" in params:  # the property checks the INT8 model, never an fp32 fallback for it
            extra["keep_broken"] = True
        res = quantize(model, calib, example_inputs=calib[0], **extra)
        frontend = getattr(getattr(res, "frontend", None), "fp32_passes", None)
        # the runtime gml.quantize chose (the native engine where it covers the graph)
        return getattr(res, "executable", res.module), [r for r in (frontend, res.report) if r is not None]
    from gml.passes.manager import PassManager
    from gml.quant.frontend import prepare_reference
    from gml.quant.pipeline import lowering_passes

    ref = prepare_reference(model, calib[0], calib, progress=False)
    res = PassManager(lowering_passes(None)).run(copy.deepcopy(ref.graph_module), [calib[0]])
    return res.graph_module, [ref.report.fp32_passes, res.report]


def _rolled_back(reports: Any) -> list[Any]:
    """Rolled-back pass records of a pipeline report, or of a list of them."""
    reports = reports if isinstance(reports, list) else [reports]
    return [r for rep in reports for r in getattr(rep, "records", []) if r.status == "rolled back"]


def check_int8(
    spec: ModelSpec,
    *,
    factor: float = INT8_FACTOR,
    quantize: Callable[..., Any] | None = None,
    n_batches: int = 4,
) -> Outcome:
    """Quantize ``build(spec)`` (calibrated on ``n_batches`` seeded batches) and check it on them.

    Properties: only GMLError escapes; no pass rolled back; outputs keep count, shape and
    finiteness; every output is within ``factor`` × :func:`quantization_noise` of fp32 (plus 1e-5 of
    its magnitude, for outputs noise cannot move); the caller's model is untouched.
    ``Outcome.max_rel_err`` holds the worst error / noise ratio.
    """
    model = build(spec)
    calib = [spec.example_inputs(seed=s) for s in range(n_batches)]
    state = _state(model)
    outcome = Outcome(spec)
    try:
        qmodel, report = (quantize or _quantize)(model, calib)
    except GMLError as exc:
        outcome.refused = exc
        return outcome
    outcome.report = report
    rolled = _rolled_back(report)
    if rolled:
        raise FuzzFailure(
            "pass rolled back (it produced a wrong graph): "
            + "; ".join(f"{r.name}: {r.error}" for r in rolled)
            + f"\n{spec.pretty()}"
        )
    after = _state(model)
    if any(not torch.equal(state[k], after[k]) for k in state):
        raise FuzzFailure(f"the caller's model was modified by quantization\n{spec.pretty()}")
    noise = quantization_noise(model, calib)
    worst = 0.0
    for b in calib:
        ref, got = _run(model, b), _run(qmodel, b)
        if len(ref) != len(got) or any(r.shape != g.shape for r, g in zip(ref, got)):
            raise FuzzFailure(
                f"INT8 outputs {[tuple(g.shape) for g in got]} instead of {[tuple(r.shape) for r in ref]}"
                f"\n{spec.pretty()}"
            )
        for k, (r, g) in enumerate(zip(ref, got)):
            if r.numel() == 0:
                continue
            g = g.to(r.dtype)
            if not torch.isfinite(g).all():
                raise FuzzFailure(f"INT8 output {k} has NaN/Inf\n{spec.pretty()}")
            err = float((r - g).abs().max())
            allowed = factor * noise[k] + 1e-5 * max(float(r.abs().max()), 1.0)
            worst = max(worst, err / allowed)
            if err > allowed:
                raise FuzzFailure(
                    f"INT8 output {k} differs from fp32 by {err:.3g}, more than {factor:g} x the "
                    f"{noise[k]:.3g} that rounding noise moves it (output magnitude "
                    f"{float(r.abs().max()):.3g})\n{spec.pretty()}"
                )
    outcome.max_rel_err = worst
    return outcome


__all__ = [
    "FP32_RTOL",
    "INT8_FACTOR",
    "FuzzFailure",
    "Outcome",
    "check_fp32",
    "check_int8",
    "default_fp32_passes",
    "quantization_noise",
    "rel_err",
]
