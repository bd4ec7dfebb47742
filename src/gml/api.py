"""The small public API: ``optimize``, ``quantize``, ``verify``, ``benchmark``.

Each takes an ``nn.Module`` (eval mode) and example inputs, never mutates the caller's model, and
returns a result object carrying the rewritten module *and* the report that explains it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from gml.capture import capture, check_deterministic, check_eval_mode
from gml.passes.base import GraphPass
from gml.passes.manager import PassManager, PipelineReport, compare_outputs, run_outputs
from gml.verify.harness import random_inputs, verify_pass

verify = verify_pass


@dataclass
class OptimizeResult:
    """An optimized fp32 module and the per-pass report; ``max_abs_err`` is vs the eager model."""

    module: fx.GraphModule
    report: PipelineReport
    max_abs_err: float
    #: largest |output| of the eager model: the scale ``max_abs_err`` is to be read against
    max_abs_ref: float = 0.0

    @property
    def rel_err(self) -> float:
        """``max_abs_err`` relative to the largest eager output magnitude."""
        return self.max_abs_err / self.max_abs_ref if self.max_abs_ref else self.max_abs_err

    def save(self, path: str) -> None:
        from gml.io import save

        save(self.module, path)


def _as_tuple(example_inputs: Any) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, list | tuple) else (example_inputs,)


def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    passes: Sequence[GraphPass] | None = None,
    strict: bool = False,
    leaf_modules: Sequence[str | type] = (),
    n_check_inputs: int = 3,
) -> OptimizeResult:
    """Run the fp32 pipeline (normalize → untie → fold BN → fuse) on a copy of ``model``.

    Every pass is checked against the outputs before it on ``example_inputs`` plus seeded random
    inputs of the same shapes; a pass that breaks numerics or lint is rolled back (``strict``: raised).
    """
    from gml.passes.pipeline import fp32_passes

    inputs = _as_tuple(example_inputs)
    check_eval_mode(model)
    check_deterministic(model, inputs)
    gm = capture(copy.deepcopy(model), inputs, leaf_modules=leaf_modules)
    samples = [inputs, *random_inputs(inputs, max(0, n_check_inputs - 1), seed=1)]
    ref = run_outputs(model, samples[:1])
    result = PassManager(list(passes) if passes is not None else fp32_passes(), strict=strict).run(gm, samples)
    err, _ = compare_outputs(ref, run_outputs(result.graph_module, samples[:1]), None)
    scale = max(
        (float(t.abs().max()) for outs in ref for t in outs if t.numel() and t.is_floating_point()), default=0.0
    )
    return OptimizeResult(result.graph_module, result.report, err, scale)


@dataclass
class QuantizeResult:
    """An INT8 module lowered onto GML kernel modules, with everything that explains it.

    ``report``: the post-convert passes (lowering, quantize clean-up) with per-pass checks;
    ``frontend``: the fp32 passes, fusions, which ops are INT8 and which stay fp32, calibration;
    ``coverage``: which nodes became which GML INT8 module, which stayed fp32 and why;
    ``accuracy``: output cosine / max diff / top-1 agreement and per-layer SQNR vs fp32;
    ``reference``: torch.ao's reference Q/DQ graph the lowering started from;
    ``seconds``: wall time of each stage.
    """

    module: fx.GraphModule
    report: PipelineReport
    frontend: Any
    coverage: Any
    accuracy: Any
    reference: fx.GraphModule
    seconds: dict[str, float]

    def save(self, path: str) -> None:
        """Pickle the INT8 GraphModule (torch.export cannot capture the uint8 views between the INT8
        kernels yet, docs/adr/004); ``gml.io.load(path, trust_pickle=True)`` reads it back."""
        from gml.io import save

        save(self.module, path, format="pickle")


def quantize(
    model: nn.Module,
    calib_data: Any = None,
    *,
    example_inputs: Any = None,
    backend: str = "onednn",
    observer: str = "minmax",
    per_channel: bool = True,
    eval_data: Any = None,
    eval_labels: Sequence[Any] | None = None,
    per_layer: bool = True,
    progress: bool = False,
    strict: bool = False,
    leaf_modules: Sequence[str | type] = (),
) -> QuantizeResult:
    """Quantize ``model`` to INT8 and lower it onto fused INT8 kernels.

    Args:
        calib_data: iterable of batches (tensors, tuples, or ``(x, label)`` pairs), or an int N for
            N generated batches shaped like ``example_inputs`` (default 8 generated batches).
        example_inputs: one input tuple; defaults to the first calibration batch.
        backend: ``onednn`` (oneDNN INT8 kernels, VNNI) or ``fbgemm`` (``quantized::*`` ops).
        observer: ``minmax`` | ``moving_average`` | ``histogram`` | ``percentile``.
        eval_data / eval_labels: held-out batches for the accuracy report (default: 2 generated
            batches that the calibration did not see).
        leaf_modules: submodule names or classes kept as opaque calls, as in :func:`gml.capture`.
    """
    import time

    from gml.errors import InputError
    from gml.passes.lift_combine_quant import LiftCombineQuant
    from gml.quant.accuracy import accuracy_report
    from gml.quant.calibrate import generate_batches
    from gml.quant.frontend import prepare_reference
    from gml.quant.lower import CoverageEntry, LowerToGML, coverage_of

    check_eval_mode(model, what="INT8 quantization")
    if example_inputs is None:
        if calib_data is None or isinstance(calib_data, int):
            raise InputError(
                "example_inputs are needed when calib_data is not a list of batches.",
                hint="pass example_inputs=(x,) with the model's input shape.",
            )
        calib_data = list(calib_data)
        if not calib_data:
            raise InputError("calib_data is empty.", hint="give at least one calibration batch.")
        first = calib_data[0]
        example_inputs = first if isinstance(first, torch.Tensor) else first[0]
    inputs = _as_tuple(example_inputs)
    check_deterministic(model, inputs, what="INT8 quantization")
    seconds: dict[str, float] = {}

    t0 = time.perf_counter()
    traced = capture(copy.deepcopy(model), inputs, leaf_modules=leaf_modules) if leaf_modules else model
    ref = prepare_reference(
        traced, inputs, calib_data, observer=observer, per_channel=per_channel, backend=backend, progress=progress
    )
    seconds["prepare + calibrate + convert"] = time.perf_counter() - t0

    # Lower first (it reads the reference Q/DQ form), then clean up the quantize ops it leaves.
    lower = LowerToGML(backend)
    samples = [inputs]
    t0 = time.perf_counter()
    result = PassManager([lower, LiftCombineQuant()], strict=strict).run(copy.deepcopy(ref.graph_module), samples)
    seconds["lower + clean up"] = time.perf_counter() - t0
    # the coverage of the module returned, not of what the lowering planned (it may be rolled back)
    coverage = coverage_of(result.graph_module)
    for r in result.report.rolled_back:
        coverage.kept_fp32.append(CoverageEntry([f"(pass {r.name})"], r.name, "fp32", f"rolled back: {r.error}"))

    if eval_data is None:
        eval_data = generate_batches(inputs, 2, seed=12345)
    t0 = time.perf_counter()
    acc = accuracy_report(
        model, result.graph_module, eval_data, labels=eval_labels, fp32_graph=ref.float_module, per_layer=per_layer
    )
    seconds["accuracy report"] = time.perf_counter() - t0
    return QuantizeResult(
        result.graph_module, result.report, ref.report, coverage, acc, ref.graph_module, seconds
    )
