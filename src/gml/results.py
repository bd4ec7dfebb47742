"""What ``gml.optimize`` and ``gml.quantize`` return (re-exported by :mod:`gml.api` and :mod:`gml`):
the rewritten module *and* the reports that explain it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from gml.passes.manager import PipelineReport


@dataclass
class OptimizeResult:
    """An optimized fp32 module and the per-pass report; ``max_abs_err`` is the error of
    :attr:`executable` (the engine where it runs the graph) vs the eager model."""

    module: fx.GraphModule
    report: PipelineReport
    max_abs_err: float
    #: largest |output| of the eager model: the scale ``max_abs_err`` is to be read against
    max_abs_ref: float = 0.0
    #: which precision each op runs in and why (``precision="bf16"``; None for plain fp32)
    precision: Any = None
    #: the native engine running ``module``'s graph (gml.runtime), or None where torch runs it
    engine: Any = None
    #: which runtime runs each node and why (``str(result.runtime)``), when an engine was tried
    runtime: Any = None
    #: the example inputs the model was optimized for (what :meth:`save` exports with)
    example_inputs: tuple = ()

    @property
    def executable(self) -> Any:
        """What to call for inference: the engine where it covers the graph, else ``module``'s Python
        executor (``gml.runtime.compile.python_executor``: its size-only glue runs once per shape)."""
        from gml.runtime.compile import python_executor

        return self.engine if self.engine is not None else python_executor(self.module)

    @property
    def rel_err(self) -> float:
        """``max_abs_err`` relative to the largest eager output magnitude."""
        return self.max_abs_err / self.max_abs_ref if self.max_abs_ref else self.max_abs_err

    def save(self, path: str) -> None:
        """Save as a ``torch.export`` program (no pickle; ``gml.load`` reads it back). The batch dim
        stays dynamic; a model captured with ``torch.export`` (a transformer) keeps every dim its
        graph allows dynamic, the sequence length too — exporting it from its placeholders' shapes
        would trace a dynamic length at 1 and specialize the saved model to length 1."""
        from gml.capture_export import capture_info
        from gml.io import save

        info = capture_info(self.module)
        exported = info is not None and info.path == "torch.export"
        save(self.module, path, self.example_inputs or None, dynamic_dims="all" if exported else "batch")


@dataclass
class QuantizeResult:
    """An INT8 module lowered onto GML kernel modules, with everything that explains it.

    ``report``: the post-convert passes (lowering, quantize clean-up) with per-pass checks;
    ``frontend``: the fp32 passes, fusions, which ops are INT8 and which stay fp32, calibration;
    ``coverage``: which nodes became which GML INT8 module, which stayed fp32 and why;
    ``accuracy``: output cosine / max diff / top-1 agreement and per-layer SQNR vs fp32;
    ``reference``: torch.ao's reference Q/DQ graph the lowering started from (``keep_intermediates=True``;
    else None: it holds a full fp32 copy of the weights, issue #28);
    ``seconds``: wall time of each stage.

    With the transformer scheme (``scheme == "transformer"``): ``frontend`` is the
    :class:`~gml.quant.transformer.TransformerQuantResult` (its ``table()`` / ``summary()``), ``coverage``
    lists every GEMM as INT8 or fp32 (with why) and what stays fp32, ``reference`` (and
    ``frontend.fp32_module``) the fp32 graph the GEMMs were quantized from (``keep_intermediates=True``;
    else None); ``engine`` runs its ``gml.dynamic_linear`` GEMMs natively (ADR 008).
    """

    module: fx.GraphModule
    report: PipelineReport
    frontend: Any
    coverage: Any
    accuracy: Any
    reference: fx.GraphModule | None
    seconds: dict[str, float]
    #: the native engine running ``module``'s graph (gml.runtime), or None where torch runs it
    engine: Any = None
    #: which runtime runs each node and why (``str(result.runtime)``)
    runtime: Any = None
    #: ``static`` (torch.ao calibration, lowered onto gml INT8 ops) or ``transformer``
    #: (:mod:`gml.quant.transformer`: per-token dynamic INT8 GEMMs); ``scheme_reason`` says why
    scheme: str = "static"
    scheme_reason: str = ""
    #: every op with its precision (int8 / bf16 / fp32) and why: the transformer scheme's GEMMs,
    #: attention, LayerNorm, softmax, opaque blocks; the static scheme's
    #: :class:`~gml.quant.precision.PrecisionTable` (with the runtime that runs each op)
    precisions: Any = field(default_factory=list)
    #: the cost policy's measurements and decisions (gml.quant.cost_policy.CostReport)
    cost: Any = None
    #: ``int8``, or ``fp32`` / ``bf16`` when the whole-model guard found INT8 slower than
    #: ``gml.optimize``'s model and returned that model instead (``cost.all_fp32``)
    precision: str = "int8"
    #: the precision of the ops INT8 leaves out (``fallback_precision``), after the CPU check
    fallback_precision: str = "fp32"
    #: why ``precision`` is not ``int8`` (the whole-model guard's numbers, or the accuracy report's
    #: BROKEN reason); "" for an INT8 result
    precision_reason: str = ""
    #: the accuracy report of the INT8 model that was *not* returned (flagged BROKEN), else None
    rejected_int8_accuracy: Any = None
    #: the CPU the model was quantized and planned for, and its INT8 arithmetic (``target.describe()``)
    target: Any = None
    #: the example inputs the model was captured with: ``save`` exports on them and records them for
    #: the load check (a file saved without them is checked on generated inputs of its shapes)
    example_inputs: tuple = ()

    @property
    def executable(self) -> Any:
        """What to call for inference: the engine where it covers the graph, else ``module``'s Python
        executor (``gml.runtime.compile.python_executor``: its size-only glue runs once per shape)."""
        from gml.runtime.compile import python_executor

        return self.engine if self.engine is not None else python_executor(self.module)

    def save(self, path: str) -> None:
        """Save the INT8 model as a ``torch.export`` program of ``torch.ops.gml`` calls (no pickle);
        ``gml.load(path)`` reads it back without pickle or the model's source and rebuilds the native
        engine's plan on the machine it loads on (docs/adr/004, 005)."""
        from gml.io import save

        if self.scheme == "transformer":  # gml.dynamic_linear calls + int8 constants (ADR 008); the
            # example's batch and sequence length stay dynamic where the graph allows
            save(self.module, path, self.frontend.example_inputs, dynamic_dims="all")
            return
        save(self.module, path, self.example_inputs or None)


__all__ = ["OptimizeResult", "QuantizeResult"]
