"""The small public API: ``optimize``, ``quantize``, ``verify``, ``benchmark``.

Each takes an ``nn.Module`` (eval mode) and example inputs, never mutates the caller's model, and
returns a result object carrying the rewritten module *and* the report that explains it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from gml.capture import capture, check_eval_mode
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
    gm = capture(copy.deepcopy(model), inputs, leaf_modules=leaf_modules)
    samples = [inputs, *random_inputs(inputs, max(0, n_check_inputs - 1), seed=1)]
    ref = run_outputs(model, samples[:1])
    result = PassManager(list(passes) if passes is not None else fp32_passes(), strict=strict).run(gm, samples)
    err, _ = compare_outputs(ref, run_outputs(result.graph_module, samples[:1]), None)
    return OptimizeResult(result.graph_module, result.report, err)

