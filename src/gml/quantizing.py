"""``gml.quantize``: one driver, and the INT8 schemes it hands the captured graph to.

The driver (:func:`quantize`) checks the arguments, captures the model once, picks a scheme
(:func:`choose_scheme`) and hands the graph over to it. A scheme lowers that graph and guards its
result against ``gml.optimize``'s model continued from the same graph (:func:`_fp32_from`; ADR 013).
Public names are re-exported by :mod:`gml.api`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from gml.capture import capture, check_deterministic, check_eval_mode, check_finite_parameters
from gml.inference import refuse_autograd, refuse_nonfinite
from gml.ir.target import Target
from gml.kernels.packs import drop_packed
from gml.memory import release, returns_memory, shared_copy, trim_malloc
from gml.optimizing import (
    _as_tuple,
    _bf16_refusal,
    _inputs_of_batch,
    check_precision,
    optimize_graph,
    positional_batches,
)
from gml.passes.base import GraphPass
from gml.passes.manager import PassManager, run_outputs
from gml.quant.calibrate import KeepLast
from gml.quant.transformer import DEFAULT_MIN_SQNR_DB as _DEFAULT_MIN_SQNR_DB
from gml.results import OptimizeResult, QuantizeResult
from gml.runtime.options import EngineOptions, resolve_options
from gml.runtime.rules.attention import mask_only_inputs


@dataclass(frozen=True)
class QuantizeJob:
    """One :func:`quantize` call as values, checked and resolved by the driver: what a scheme reads
    (nothing of it is read from the environment further down)."""

    model: nn.Module  # the caller's, never written
    inputs: tuple  # example inputs
    calib_data: Any  # batches, or an int N (generated)
    reason: str  # why this scheme (choose_scheme)
    token_range: tuple[int, int] | None  # generated token ids' range (the model's vocabulary)
    eval_data: Any
    eval_labels: Sequence[Any] | None
    per_layer: bool
    min_cosine: float | None
    max_accuracy_drop: float | None
    strict: bool
    runtime: str  # engine | torch
    cost_policy: Any  # measure | off | a function
    fallback: str  # fp32 | bf16: what INT8 leaves out runs in
    refusal: str | None  # why bf16 was refused on this CPU (the fallback is fp32 then)
    keep_intermediates: bool
    keep_broken: bool
    target: Target
    options: EngineOptions
    leaf_modules: tuple
    # the static scheme's
    backend: str
    observer: str
    per_channel: bool
    progress: bool
    # the transformer scheme's
    min_sqnr_db: float | None
    smooth_alpha: float | None


class Scheme(Protocol):
    """An INT8 scheme: ``quantize(job, captured)`` lowers the captured graph (the one item of
    ``captured``, popped where it is used) and guards the result against ``gml.optimize``'s model
    continued from that graph."""

    name: str

    def quantize(self, job: QuantizeJob, captured: list[Any]) -> QuantizeResult: ...


def check_min_cosine(acc: Any, min_cosine: float) -> None:
    """Raise :class:`~gml.errors.AccuracyError` when the accuracy report falls below ``min_cosine``."""
    from gml.errors import AccuracyError, GMLError

    if not -1.0 <= min_cosine <= 1.0:
        raise GMLError(f"min_cosine={min_cosine} is not a cosine.", hint="give a value in [-1, 1], e.g. 0.99.")
    why = acc.below(min_cosine)
    if why is None:
        return
    worst = acc.worst(1)
    where = f" The worst layer is {worst[0].node} ({worst[0].op}), SQNR {worst[0].sqnr_db:.1f} dB." if worst else ""
    raise AccuracyError(
        f"The INT8 model is below the required accuracy: {why}.{where}",
        hint="calibrate on real data (more batches), try --observer histogram or percentile, or keep the "
        "worst layer in fp32; docs/bad-inputs.md lists what each exit code means.",
    )


@returns_memory
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
    runtime: str = "engine",
    min_cosine: float | None = None,
    leaf_modules: Sequence[str | type] = (),
    scheme: str = "auto",
    min_sqnr_db: float | None = _DEFAULT_MIN_SQNR_DB,
    smooth_alpha: float | None = None,
    cost_policy: str | Callable[[Any], Any] | None = None,
    fallback_precision: str = "fp32",
    max_accuracy_drop: float | None = None,
    keep_intermediates: bool = False,
    target: Target | None = None,
    keep_broken: bool = False,
    options: EngineOptions | None = None,
) -> QuantizeResult:
    """Quantize ``model`` to INT8 and lower it onto fused INT8 kernels.

    ``scheme="auto"`` (default) picks the transformer scheme (:mod:`gml.quant.transformer`: INT8
    GEMMs with per-token dynamic activation scales, residual stream / LayerNorm / softmax /
    attention fp32, GEMMs below ``min_sqnr_db`` on the calibration data kept fp32, SmoothQuant with
    ``smooth_alpha``) for a transformer — a transformers model, or one holding ``torch.nn``
    attention layers — and the static scheme (torch.ao calibration of per-tensor activation
    ranges, lowered onto gml INT8 ops) for everything else; ``"static"`` / ``"transformer"`` force
    one. ``result.scheme`` / ``result.scheme_reason`` say which and why. ``backend``, ``observer``
    and ``per_channel`` concern the static scheme only.

    Args:
        calib_data: iterable of batches (tensors, tuples, or ``(x, label)`` pairs), a
            :class:`gml.data.DataSource` (``gml.data.open_data(path, ...)``: image folder, text lines,
            tensor files; every sample, batches of 8; ``source.calibration(64)`` for a seeded subset),
            or an int N for N generated batches shaped like ``example_inputs`` (default 8 generated batches).
        example_inputs: one input tuple; defaults to the first calibration batch: the items its
            ``forward`` takes positionally, optional ones included (an HF ``(input_ids,
            attention_mask)`` batch), without a trailing integer label of rank <= 1 (``(x, label)``).
            ``None`` skips a parameter (``(ids, None, mask)`` for GPT-2, whose second is its cache).
        backend: ``onednn`` (oneDNN INT8 kernels, VNNI) or ``fbgemm`` (``quantized::*`` ops).
        observer: ``minmax`` | ``moving_average`` | ``histogram`` | ``percentile``.
        eval_data / eval_labels: held-out batches for the accuracy report. Default: the last 2
            batches of the given ``calib_data`` (the user's own data, seen by the calibration:
            generated N(0, 1) inputs would misjudge a model fed e.g. [0, 1] pixels), or 2 generated
            batches the calibration did not see when ``calib_data`` is generated too; the report's
            ``source`` says which. ``eval_data`` may be a
            :class:`gml.data.DataSource`, whose labels (an ImageFolder's class folders) then give
            fp32 and INT8 top-1 / top-5 accuracy.
        max_accuracy_drop: raise :class:`~gml.errors.AccuracyDropError` when INT8's top-1 accuracy
            on the labelled ``eval_data`` is more than this many percentage points below fp32's.
        runtime: ``engine`` (default: the native oneDNN engine, ``result.engine``, where it covers
            the graph; ``result.runtime`` says which path runs each node) or ``torch`` (the Python
            executor only).
        min_cosine: raise :class:`~gml.errors.AccuracyError` when the INT8 outputs' cosine with
            fp32 on ``eval_data`` is below this (or NaN/Inf differ). Without it, a result below
            :data:`~gml.quant.accuracy.BROKEN_COSINE` is returned with ``accuracy.broken`` set.
        leaf_modules: submodule names or classes kept as opaque calls, as in :func:`gml.capture`.
        cost_policy: ``measure`` (default; ``None`` takes ``options.cost_policy``: ``GML_COST_POLICY``):
            time each INT8 region against its fp32 ops on
            ``example_inputs`` with the chosen runtime and keep fp32 the regions where INT8 is
            slower (``coverage.kept_fp32`` gives the numbers; ``result.cost`` the whole report,
            including the whole-model INT8 vs fp32 guard); ``off``: every op with an INT8 kernel
            runs INT8; or a function ``region -> RegionCost`` that replaces the measurement (the
            same rule on given costs). See :mod:`gml.quant.cost_policy`. Last, the whole INT8
            executable is timed against ``gml.optimize``'s model (GML fp32 on the engine); when INT8
            is slower, that model is returned instead (``result.precision == "fp32"``,
            ``result.cost.all_fp32``, every op in ``coverage.kept_fp32`` and ``precisions`` with both
            numbers as the reason, ``report`` / ``runtime`` those of the fp32 pipeline).
        fallback_precision: what the ops INT8 leaves out run in: ``fp32`` (default: GML's fused
            fp32 kernels, as in ``gml.optimize``) or ``bf16``. Static scheme: their bf16 twins
            (:class:`~gml.passes.bf16.LowerToBf16`: bf16 weights and activations, fp32 accumulation;
            LayerNorm/softmax/reductions/outputs fp32). Transformer scheme: attention on bf16 q/k/v
            (:class:`~gml.quant.transformer.AttentionInBf16`; the engine's fused bf16 attention), the
            residual stream and LayerNorm fp32. A CPU without native bf16 gets a ``RuntimeWarning``
            and fp32. ``result.precisions`` lists every op's precision and why.
        keep_intermediates: keep the fp32 graph INT8 was made from as ``result.reference`` (a full
            fp32 copy of the weights; for debugging, e.g. ``accuracy_report(result.reference, ...)``).
            By default the result holds only what runs it: the lowered module, the engine and the
            reports; the caller's model, the torch.ao graphs, the calibration batches and the pass
            snapshots are released when the call returns (docs/memory.md).
        target: the CPU to quantize and plan for (:class:`~gml.ir.target.Target`; default: this
            process's, detected once here — ``ONEDNN_MAX_CPU_ISA`` honoured). It decides the INT8
            arithmetic (``target.int8``: 8-bit weights with VNNI/AMX, 7-bit weights without, so no
            kernel's int16 pairs saturate; docs/adr/011-int8-on-every-isa.md).
        keep_broken: return the INT8 model even when the accuracy report flags it BROKEN (cosine
            below :data:`~gml.quant.accuracy.BROKEN_COSINE`, NaN/Inf, or far from exact integer
            arithmetic with the same qparams). By default a BROKEN result is not returned:
            ``gml.optimize``'s model comes back (``result.precision == "fp32"``, the reason in
            ``result.precision_reason``, the refused INT8 report in ``result.rejected_int8_accuracy``).
    """

    from gml.errors import InputError
    from gml.quant.cost_policy import check_policy
    from gml.quant.transformer import check_smooth_alpha
    from gml.runtime.select import check_runtime
    from gml.runtime.target import resolve

    check_runtime(runtime)
    check_precision(fallback_precision)
    calib_data, eval_data, eval_labels = _from_sources(calib_data, eval_data, eval_labels, max_accuracy_drop)
    check_smooth_alpha(smooth_alpha)
    target, options = resolve(target), resolve_options(options)
    cost_policy = options.cost_policy if cost_policy is None else cost_policy
    check_policy(cost_policy)
    check_eval_mode(model, what="INT8 quantization")
    check_finite_parameters(model, what="INT8 quantization")
    # batches given by name (a tokenizer's dicts) become forward's positional inputs, here once
    calib_data, eval_data = positional_batches(model, calib_data), positional_batches(model, eval_data)
    if example_inputs is None:
        if calib_data is None or isinstance(calib_data, int):
            raise InputError(
                "example_inputs are needed when calib_data is not a list of batches.",
                hint="pass example_inputs=(x,) with the model's input shape.",
            )
        calib_data = list(calib_data)
        if not calib_data:
            raise InputError("calib_data is empty.", hint="give at least one calibration batch.")
        example_inputs = _inputs_of_batch(model, calib_data[0])
    inputs = _as_tuple(example_inputs, model)
    check_deterministic(model, inputs, what="INT8 quantization")
    if eval_data is None and calib_data is not None and not isinstance(calib_data, int | torch.Tensor):
        # the accuracy report measures on the user's own data, not on generated N(0, 1) batches
        calib_data = KeepLast(calib_data)
    from gml.models_hf import token_range as vocab_range

    token_range = vocab_range(model)  # generated token ids come from the vocabulary (#15)
    # The one capture of this call (issue #25): the scheme is read from it, the scheme quantizes it,
    # the whole-model guard's fp32 model is built from its fp32-passed form. On a copy: forward()
    # may update buffers (a running max) that must stay as the caller left them.
    # (held in a list: handed over below as a temporary, so no local pins what the passes replace)
    captured = [_capture_once(model, inputs, scheme, leaf_modules)]
    chosen, why = choose_scheme(model, scheme, graph=captured[0])
    if chosen == "static" and smooth_alpha is not None:
        raise InputError(
            f"smooth_alpha={smooth_alpha:g} applies to the transformer scheme only; this model is quantized with the "
            f"static scheme ({why}).",
            hint="drop smooth_alpha (--smooth-alpha), or force scheme='transformer' (--scheme transformer).",
        )
    # What INT8 leaves out (static scheme: the fp32 kernels; transformer scheme: attention) runs bf16
    # only where the CPU has native bf16 (else a warning, and fp32)
    refusal = _bf16_refusal(target) if fallback_precision == "bf16" else None
    fallback = "bf16" if fallback_precision == "bf16" and refusal is None else "fp32"
    job = QuantizeJob(
        model=model, inputs=inputs, calib_data=calib_data, reason=why, token_range=token_range,
        eval_data=eval_data, eval_labels=eval_labels, per_layer=per_layer, min_cosine=min_cosine,
        max_accuracy_drop=max_accuracy_drop, strict=strict, runtime=runtime, cost_policy=cost_policy,
        fallback=fallback, refusal=refusal, keep_intermediates=keep_intermediates, keep_broken=keep_broken,
        target=target, options=options, leaf_modules=tuple(leaf_modules), backend=backend, observer=observer,
        per_channel=per_channel, progress=progress, min_sqnr_db=min_sqnr_db, smooth_alpha=smooth_alpha,
    )  # fmt: skip
    return SCHEMES[chosen].quantize(job, captured)


def _gml_fp32_instead(
    job: QuantizeJob,
    opt: OptimizeResult,
    ref: Any,
    cost: Any,
    seconds: dict[str, float],
    *,
    fallback: str,
    refusal: str | None,
    scheme: str = "static",
    reason: str | None = None,
) -> QuantizeResult:
    """The :class:`QuantizeResult` of a model INT8 could not speed up (or, with ``reason``, whose
    INT8 result was BROKEN): ``gml.optimize``'s model (``opt``: its module, engine, pass report and
    runtime report, in ``fallback`` precision), with a coverage and a precision table that list every
    op as fp32 (or bf16) with the whole-model guard's numbers (or ``reason``) as the reason."""

    from gml.quant.lower import CoverageEntry, LoweringCoverage
    from gml.quant.precision import precision_table

    if reason is not None:
        why = reason
    else:
        i8, f32 = cost.whole if cost.whole is not None else (float("nan"), float("nan"))
        from gml.quant.cost_policy import WHOLE_MARGIN

        why = (
            f"whole-model guard: the INT8 model ran {i8:.2f} ms vs {f32:.2f} ms for gml.optimize's {fallback} "
            f"model on {cost.shapes or 'the example input'} (INT8 must take at most {WHOLE_MARGIN:.0%} of its "
            f"time to pay for its rounding); returning the {fallback} model"
        )
    table = precision_table(opt.module, opt.runtime, fp32_reason=why, note=refusal or "")
    coverage = LoweringCoverage(kept_fp32=[CoverageEntry([r.node], r.op, r.precision, why) for r in table])
    # per-layer SQNR pairs INT8 nodes with the float twin's: there are none here
    acc = _accuracy(job, opt.module, ref.float_module, seconds, per_layer=False)
    if opt.engine is not None:  # the report ran the Python executor, which packed its weights again (#28)
        drop_packed(opt.module)
    reference = ref.graph_module if job.keep_intermediates else None
    return QuantizeResult(
        opt.module, opt.report, ref.report, coverage, acc, reference, seconds, opt.engine, opt.runtime,
        scheme=scheme, scheme_reason=job.reason, precisions=table, cost=cost, precision=fallback,
        fallback_precision=fallback, precision_reason=why, target=job.target, example_inputs=job.inputs,
    )  # fmt: skip


@returns_memory
def _accuracy(
    job: QuantizeJob,
    returned: nn.Module,
    fp32_graph: nn.Module,
    seconds: dict[str, float],
    *,
    per_layer: bool,
    exact_model: nn.Module | None = None,
) -> Any:
    """The accuracy report of the module ``quantize`` returns against the eager model (on
    ``job.eval_data``, or two generated batches shaped like its inputs), timed into ``seconds``;
    ``min_cosine`` and ``max_accuracy_drop`` are enforced here."""
    import time

    from gml.quant.accuracy import accuracy_report
    from gml.quant.calibrate import _as_args, describe_generated, generate_batches

    eval_data, source = job.eval_data, "the given eval_data"
    if eval_data is None and isinstance(job.calib_data, KeepLast) and job.calib_data.last:
        eval_data = [_as_args(b, len(job.inputs)) for b in job.calib_data.last]
        source = f"the last {len(eval_data)} calibration batch(es) (no eval_data given: not held out)"
    elif eval_data is None:
        eval_data = generate_batches(job.inputs, 2, seed=12345, token_range=job.token_range)
        source = f"2 held-out {describe_generated(job.inputs, job.token_range)}"
    t0 = time.perf_counter()
    acc = accuracy_report(
        copy.deepcopy(job.model), returned, eval_data, labels=job.eval_labels, fp32_graph=fp32_graph,
        per_layer=per_layer, exact_model=exact_model,
    )  # fmt: skip
    acc.source = source
    seconds["accuracy report"] = time.perf_counter() - t0
    if job.min_cosine is not None:
        check_min_cosine(acc, job.min_cosine)
    if job.max_accuracy_drop is not None:
        check_accuracy_drop(acc, job.max_accuracy_drop)
    return acc


def _from_sources(calib_data: Any, eval_data: Any, eval_labels: Any, max_accuracy_drop: float | None) -> tuple:
    """``calib_data`` / ``eval_data`` given as :class:`gml.data.DataSource`\\ s as batches (and the
    eval source's labels); ``max_accuracy_drop`` checked to have labels to work on."""
    from gml.data.source import DataSource
    from gml.errors import InputError

    if isinstance(calib_data, DataSource):
        calib_data = calib_data.calibration()
    if isinstance(eval_data, DataSource):
        eval_data, labels = eval_data.evaluation()
        eval_labels = eval_labels if eval_labels is not None else labels
    if max_accuracy_drop is not None:
        if not max_accuracy_drop >= 0:
            raise InputError(f"max_accuracy_drop={max_accuracy_drop} is not a number of points >= 0.")
        if eval_data is None:
            raise InputError(
                "max_accuracy_drop needs labelled evaluation data: generated inputs have no right answer.",
                hint="pass eval_data (e.g. gml.data.open_data('val/', ...) on an ImageFolder) or --eval-data PATH.",
            )
    return calib_data, eval_data, eval_labels


def check_accuracy_drop(acc: Any, max_drop: float) -> None:
    """Raise :class:`~gml.errors.AccuracyDropError` when INT8's top-1 accuracy is more than
    ``max_drop`` points below fp32's (:class:`InputError` when the report has no labels)."""
    from gml.errors import AccuracyDropError, InputError

    drop = acc.accuracy_drop
    if drop is None:
        raise InputError(
            "the accuracy drop needs labels, and the evaluation data has none (or the model is not a classifier "
            "with one output of shape (N, classes)).",
            hint="evaluate on an ImageFolder (class sub-folders) or tensors saved with 'labels'.",
        )
    if drop > max_drop + 1e-9:  # percentages of counts: 100 * (0.9 - 0.85) is 5.000000000000004
        raise AccuracyDropError(
            f"INT8 loses {drop:.2f} points of top-1 accuracy (fp32 {100 * acc.fp32_top1:.2f}%, INT8 "
            f"{100 * acc.int8_top1:.2f}% on {acc.samples} labelled samples), more than the {max_drop:g} allowed.",
            hint="calibrate on more (or more representative) real data (--calib-samples), try --observer histogram "
            "or percentile, or keep the worst layers fp32; nothing was saved.",
        )


#: what ``scheme=`` takes: ``auto`` (choose_scheme) or a scheme of :data:`SCHEMES`
SCHEME_CHOICES = ("auto", "static", "transformer")


def _capture_once(model: nn.Module, inputs: tuple, scheme: str, leaf_modules: Sequence[str | type]) -> Any:
    """A copy of ``model`` captured, for :func:`quantize`: torch.fx first (torch.ao's static INT8
    needs it) and torch.export where fx fails; outside a forced static scheme also where fx hides
    ``torch.nn`` attention layers as opaque leaves (such a model takes the transformer scheme)."""
    from gml.errors import InputError
    from gml.quant.frontend import capture_for_ao

    if scheme not in SCHEME_CHOICES:  # before a capture that may take a while
        raise InputError(f"unknown INT8 scheme {scheme!r}.", hint=f"use one of {', '.join(SCHEME_CHOICES)}.")
    if scheme == "static":
        return capture_for_ao(copy.deepcopy(model), inputs, leaf_modules=leaf_modules)
    return capture(copy.deepcopy(model), inputs, leaf_modules=leaf_modules)


def _fp32_from(
    graph: Any, inputs: tuple, precision: str, runtime: str, strict: bool, target: Target, options: EngineOptions
) -> OptimizeResult:
    """``gml.optimize``'s model (``precision`` fp32 or bf16) built from ``graph``, an fp32 graph
    :func:`quantize` made from its one capture (the canonical passes already ran on it): a copy
    sharing its tensors, the passes replace them, never write them. Its outputs stand for the
    eager model's (the PassManager checked them against the capture's)."""
    trim_malloc()  # the INT8 build's garbage handed back first: this model is built beside it (#28)
    run = shared_copy(graph)
    eager = run_outputs(run, [inputs])
    release(run)
    return optimize_graph(
        shared_copy(graph), inputs, eager, precision=precision, runtime=runtime, strict=strict, target=target,
        options=options,
    )  # fmt: skip


def choose_scheme(
    model: nn.Module, scheme: str = "auto", inputs: Sequence[Any] | None = None, *, graph: Any = None
) -> tuple[str, str]:
    """``(scheme, why)``: the INT8 scheme :func:`quantize` uses for ``model`` and the reason; a plain
    module is looked at in its captured ``graph`` (or, given ``inputs``, captured here) for attention."""
    from gml.errors import InputError
    from gml.quant.transformer import WHY_SCHEME, auto_scheme

    if scheme not in SCHEME_CHOICES:
        raise InputError(f"unknown INT8 scheme {scheme!r}.", hint=f"use one of {', '.join(SCHEME_CHOICES)}.")
    if scheme != "auto":
        return scheme, f"scheme={scheme!r} requested"
    found, static_why = auto_scheme(model, inputs, graph=graph)
    if found is not None:
        return "transformer", f"transformer scheme: {found}; {WHY_SCHEME}"
    if static_why is not None:
        return "static", f"static scheme: {static_why} (calibrated per-tensor activation ranges)"
    return "static", "static scheme: no transformer layers found (calibrated per-tensor activation ranges)"


class StaticScheme:
    """The static scheme: torch.ao calibrates per-tensor activation ranges on the captured graph
    (after the fp32 passes), the lowering makes ``torch.ops.gml`` INT8 ops of it, the cost policy
    keeps fp32 the regions INT8 does not speed up, and the whole-model guard compares the result
    with ``gml.optimize``'s model continued from the same graph."""

    name = "static"

    def quantize(self, job: QuantizeJob, captured: list[Any]) -> QuantizeResult:
        """The :class:`QuantizeResult` of ``job``'s model from its captured graph, the one item of
        ``captured``, taken over (popped where it is used: no local pins what the passes replace, #28)."""
        import time

        from gml.quant.cost_policy import run_policy
        from gml.quant.frontend import prepare_reference
        from gml.quant.lower import CoverageEntry, coverage_of
        from gml.quant.pipeline import lowering_passes
        from gml.runtime.select import attach_runtime

        seconds: dict[str, float] = {}

        t0 = time.perf_counter()
        # The frontend runs the fp32 passes on the captured graph and calibrates it
        # (handed over, not a local: its weights the fp32 passes replace die there, #28)
        ref = prepare_reference(
            captured.pop(),
            job.inputs,
            job.calib_data,
            observer=job.observer,
            per_channel=job.per_channel,
            backend=job.backend,
            progress=job.progress,
            token_range=job.token_range,
            arithmetic=job.target.int8,
            copy_graph=False,
        )
        seconds["prepare + calibrate + convert"] = time.perf_counter() - t0

        # The post-convert half of the INT8 pipeline (gml.quant.pipeline: lower, fuse, clean up, and
        # gml.optimize's fusion passes on what stays fp32).
        samples = [job.inputs]
        t0 = time.perf_counter()

        def passes_again() -> list[GraphPass]:
            return lowering_passes(job.backend, fallback=job.fallback, target=job.target)

        passes = passes_again()
        # the lowering rewrites a copy of the reference graph sharing its weights (it replaces tensors)
        result = PassManager(passes, strict=job.strict).run(shared_copy(ref.graph_module), samples)
        seconds["lower + fuse + clean up"] = time.perf_counter() - t0
        # INT8 regions slower than their fp32 ops stay fp32 (lowered again); picks the runtime too. The
        # whole-model guard compares with gml.optimize's model (built once, only if the guard runs).
        optimized: list[OptimizeResult] = []

        def gml_fp32() -> OptimizeResult:
            if not optimized:  # from the graph captured above, sharing its weights (#25, #28)
                optimized.append(
                    _fp32_from(
                        ref.fp32_graph, job.inputs, job.fallback, job.runtime, job.strict, job.target, job.options
                    )
                )
            return optimized[0]

        t0 = time.perf_counter()
        result, engine, runtime_report, cost = run_policy(
            result,
            ref.graph_module,
            ref.float_module,
            job.inputs,
            policy=job.cost_policy,
            runtime=job.runtime,
            relower=lambda gm: PassManager(passes_again(), strict=job.strict).run(gm, samples),
            attach=lambda gm: attach_runtime(
                gm, job.inputs, job.runtime, fp32_model=ref.float_module, target=job.target, options=job.options
            ),
            strict=job.strict,
            fp32=lambda: gml_fp32().executable,
        )
        seconds["cost policy + engine compile"] = time.perf_counter() - t0
        if cost.all_fp32:  # INT8 could not pay on this model: gml.optimize's model, and reason
            result = engine = None  # the INT8 model and its engine are not returned: freed before the report (#28)
            return _gml_fp32_instead(job, gml_fp32(), ref, cost, seconds, fallback=job.fallback, refusal=job.refusal)
        optimized.clear()  # the guard's fp32 model: freed before the report (a BROKEN result rebuilds it, #28)
        # the coverage of the module returned, not of what the lowering planned (it may be rolled back)
        coverage = coverage_of(result.graph_module)
        for r in result.report.rolled_back:
            coverage.kept_fp32.append(CoverageEntry([f"(pass {r.name})"], r.name, "fp32", f"rolled back: {r.error}"))

        acc = _accuracy(
            job, result.graph_module, ref.float_module, seconds, per_layer=job.per_layer, exact_model=ref.graph_module
        )
        if acc.broken and not job.keep_broken:  # never return a model the report calls BROKEN (keep_broken: inspect it)
            broken = f"the INT8 model is BROKEN ({acc.broken}); returning gml.optimize's {job.fallback} model"
            result = engine = None
            out = _gml_fp32_instead(
                job, gml_fp32(), ref, cost, seconds, fallback=job.fallback, refusal=job.refusal, reason=broken
            )
            out.rejected_int8_accuracy = acc
            return out
        if engine is not None:  # the report ran the Python executor, which packed its weights again (#28)
            drop_packed(result.graph_module)
        refuse_autograd(result.graph_module)
        masks = mask_only_inputs(result.graph_module)  # (an attention mask's -inf is a value)
        for int8_model in (result.graph_module, engine):  # INT8 has no NaN / Inf (gml.inference)
            if int8_model is not None:
                refuse_nonfinite(int8_model, masks)

        from gml.quant.precision import precision_table

        return QuantizeResult(
            result.graph_module,
            result.report,
            ref.report,
            coverage,
            acc,
            ref.graph_module if job.keep_intermediates else None,
            seconds,
            engine,
            runtime_report,
            scheme="static",
            scheme_reason=job.reason,
            precisions=precision_table(
                result.graph_module,
                runtime_report,
                fp32_reason="reads an fp32 value (outside the INT8 regions)",
                note=job.refusal or "",
            ),
            cost=cost,
            fallback_precision=job.fallback,
            target=job.target,
            example_inputs=job.inputs,
        )


class TransformerScheme:
    """The transformer scheme (:mod:`gml.quant.transformer`), in :func:`quantize`'s result type:
    ``coverage`` lists every GEMM (INT8 or fp32 and why) and what stays fp32 (attention, LayerNorm,
    softmax, opaque blocks); ``reference`` is the fp32 graph the GEMMs were quantized from. Unless the
    cost policy is off, the whole-model guard of the static scheme applies: an INT8 executable not
    ``WHOLE_MARGIN`` faster than ``gml.optimize``'s (a hybrid CNN whose convs stay fp32 between a few
    INT8 GEMMs: timm CoAtNet, EfficientFormer, MobileViT) returns that fp32 model instead."""

    name = "transformer"

    def quantize(self, job: QuantizeJob, captured: list[Any]) -> QuantizeResult:
        """As :meth:`StaticScheme.quantize`."""
        import time

        from gml.quant.lower import CoverageEntry, LoweringCoverage
        from gml.quant.transformer import quantize_transformer
        from gml.runtime.select import attach_runtime

        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        res = quantize_transformer(
            job.model,
            job.inputs,
            calib_data=job.calib_data if job.calib_data is not None else 8,
            min_sqnr_db=job.min_sqnr_db,
            smooth_alpha=job.smooth_alpha,
            leaf_modules=job.leaf_modules,
            strict=job.strict,
            token_range=job.token_range,
            attention_bf16=job.fallback == "bf16",
            weight_qmax=job.target.dynamic_weight_qmax,
            graph=captured.pop(),
        )
        seconds["capture + fp32 passes + measure + quantize"] = time.perf_counter() - t0
        coverage = LoweringCoverage()
        for p in res.precisions:
            if p.precision == "int8":
                # named by the gml op that runs it, like the static scheme's entries (qconv, qlinear, ...)
                coverage.lowered.append(CoverageEntry([p.node], p.op, "dynamic_linear", p.why))
            else:
                coverage.kept_fp32.append(CoverageEntry([p.node], p.op, p.precision, p.why))
        acc = _accuracy(job, res.module, res.fp32_module, seconds, per_layer=job.per_layer)
        refuse_autograd(res.module)
        masks = mask_only_inputs(res.module)  # (an attention mask's -inf is a value)
        refuse_nonfinite(res.module, masks)
        # the native engine runs the gml.dynamic_linear GEMMs (and what else it covers), checked against
        # the Python executor on the example first (gml.runtime.select)
        t0 = time.perf_counter()
        engine, runtime_report = attach_runtime(
            res.module, job.inputs, job.runtime, fp32_model=res.fp32_module, target=job.target, options=job.options
        )
        seconds["engine compile"] = time.perf_counter() - t0
        cost = None
        if job.cost_policy != "off":
            from types import SimpleNamespace

            from gml.quant.cost_policy import WHOLE_MARGIN, CostReport, guard_whole_model
            from gml.runtime.compile import python_executor

            t0 = time.perf_counter()
            # gml.optimize's pipeline continued from the graph the GEMMs were quantized from (#25, #28)
            opt = _fp32_from(res.fp32_module, job.inputs, "fp32", job.runtime, job.strict, job.target, job.options)
            shapes = " ".join("x".join(map(str, x.shape)) for x in job.inputs if isinstance(x, torch.Tensor))
            cost = CostReport("measure", shapes=shapes)
            cost.whole = guard_whole_model(
                engine if engine is not None else python_executor(res.module), lambda: opt.executable, job.inputs
            )
            seconds["whole-model guard"] = time.perf_counter() - t0
            i8, f32 = cost.whole
            if i8 > WHOLE_MARGIN * f32:
                cost.all_fp32 = True
                cost.notes.append(
                    f"whole model INT8 {i8:.2f} ms vs GML fp32 {f32:.2f} ms (more than {WHOLE_MARGIN:.0%}): "
                    "INT8 cannot pay here; "
                    "gml.optimize's model is returned"
                )
                ref = SimpleNamespace(report=res, graph_module=res.fp32_module, float_module=res.fp32_module)
                engine = None  # the INT8 engine nobody returns: freed before the accuracy report runs
                if not job.keep_intermediates:
                    # the result's report (``frontend``) would otherwise hold the INT8 model nobody
                    # returns: BERT-base's 81 MB of int8 weights beside the fp32 model (#28)
                    res.fp32_module = res.module = None
                return _gml_fp32_instead(
                    job, opt, ref, cost, seconds, fallback="fp32", refusal=None, scheme="transformer"
                )
        if engine is not None:
            refuse_nonfinite(engine, masks)
        reference = res.fp32_module
        if not job.keep_intermediates:
            res.fp32_module = reference = None
        return QuantizeResult(
            res.module,
            res.report,
            res,
            coverage,
            acc,
            reference,
            seconds,
            engine,
            runtime_report,
            "transformer",
            job.reason,
            res.precisions,
            cost=cost,
            fallback_precision=job.fallback,
            target=job.target,
        )


#: The schemes :func:`quantize` hands a captured graph to, by name (``scheme=``, or choose_scheme's pick).
SCHEMES: dict[str, Scheme] = {"static": StaticScheme(), "transformer": TransformerScheme()}
