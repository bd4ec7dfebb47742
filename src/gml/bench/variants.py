"""The benchmark's contestants: one builder per way of running the same model.

Every variant turns the eager fp32 model into something callable, built under the same rules:

* it starts from its own ``copy.deepcopy`` of the eager model (no builder sees another's changes);
* INT8 variants calibrate on the *same* generated batches (``BuildContext.calib``);
* the runtime is pinned to ``BuildContext.threads`` threads (torch, ONNX Runtime, OpenVINO);
* shapes are static (the benchmark builds each batch size separately), which is every tool's
  best case.

A builder that cannot run here raises :class:`VariantSkipped` with a one-line reason (a peer
runtime is not installed, or a GML stage is not implemented yet); anything else it raises is
reported as a failure of that variant and the others go on.

Peer-specific choices, stated so the comparison can be judged:

* ``compile``: ``torch.compile(backend="inductor", dynamic=False)`` with
  ``torch._inductor.config.freezing=True`` (weights become constants, conv weights are prepacked
  for oneDNN, Conv+BN is folded), i.e. Inductor's CPU inference mode.
* ``ao-int8``: FX graph mode PTQ, ``prepare_fx``/``convert_fx`` with
  ``get_default_qconfig_mapping("x86")`` (reference path lowered to ``torch.ops.quantized`` fbgemm/
  oneDNN kernels). ``ao-int8-jit`` additionally ``torch.jit.trace`` + ``torch.jit.freeze``\\s it.
* ``ort-*``: ``torch.onnx.export`` (dynamo exporter, falling back to the TorchScript one),
  all graph optimisations on; INT8 is ``quantize_static`` in QDQ format, U8 activations / S8
  per-channel weights, MinMax calibration, after ``quant_pre_process``.
* ``ov-*``: ``openvino.convert_model`` from the torch module. ``ov-fp32`` pins
  ``INFERENCE_PRECISION_HINT=f32``: on CPUs with AVX-512 BF16 OpenVINO otherwise runs fp32 models
  in bf16, which is a different precision; ``ov-bf16`` is that default, measured separately.
  ``ov-int8`` is NNCF ``nncf.quantize`` (default mixed preset, fast bias correction) with the
  non-quantized remainder also pinned to f32.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import io
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

BENCH_EXTRA_HINT = "pip install 'gml-lab[bench]'"


class VariantSkipped(Exception):
    """This variant cannot run here; the message is the one line the report shows."""


@dataclass
class BuildContext:
    """What every builder gets. ``model`` is the shared eager model: deep-copy before changing it."""

    model: nn.Module
    example: tuple[torch.Tensor, ...]
    calib: list[tuple[torch.Tensor, ...]]
    threads: int
    workdir: Path
    cache: dict[str, Any] = field(default_factory=dict)
    #: submodules GML's own variants keep opaque while tracing (``gml bench --leaf``)
    leaf_modules: tuple[str | type, ...] = ()
    #: the CPU GML's variants plan for (gml.ir.target.Target; detected once by the runner)
    target: Any = None


@dataclass
class Built:
    """A ready variant.

    ``native(inputs)`` converts torch inputs into what ``run`` takes (numpy feeds for ONNX Runtime,
    ...) outside the timed region; ``run(native_inputs)`` is the timed call; ``output(result)``
    turns its result into tensors/arrays for the accuracy check. ``shared_build_s`` is time spent in
    a step shared with another variant (an ONNX export) that an earlier variant ran; it is counted
    into both build times.
    """

    run: Callable[[Any], Any]
    native: Callable[[tuple[torch.Tensor, ...]], Any] = lambda args: args
    output: Callable[[Any], Any] = lambda out: out
    graph_module: fx.GraphModule | None = None
    notes: list[str] = field(default_factory=list)
    shared_build_s: float = 0.0
    keepalive: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class VariantSpec:
    name: str
    label: str
    precision: str  # "fp32" | "int8" | "bf16": which measured peak bounds it
    build: Callable[[BuildContext], Built]
    group: str = "torch"


def require(module: str, what: str | None = None) -> None:
    """Skip with the install hint when an optional peer runtime is missing."""
    if importlib.util.find_spec(module) is None:
        raise VariantSkipped(f"{what or module} not installed: {BENCH_EXTRA_HINT}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence deprecation chatter and stdout banners of third-party builders."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _torch_built(module: Callable[..., Any], gm: fx.GraphModule | None = None, notes: list[str] | None = None) -> Built:
    return Built(run=lambda args: module(*args), graph_module=gm, notes=notes or [])


# --- torch -----------------------------------------------------------------------------------


def build_eager(ctx: BuildContext) -> Built:
    return _torch_built(ctx.model)


def _gml_api() -> Any:
    try:
        return importlib.import_module("gml.api")
    except ImportError as exc:
        raise VariantSkipped(f"not available: gml.api cannot be imported ({exc})") from None


def _gml_fn(fn_name: str) -> Callable[..., Any]:
    """``gml.api.<fn_name>``, or a skip saying that stage has not landed yet."""
    fn = getattr(_gml_api(), fn_name, None)
    if fn is None:
        raise VariantSkipped(f"not available: gml.{fn_name} is not implemented yet")
    return fn


def _gml_call(fn_name: str, *args: Any, **kwargs: Any) -> Any:
    fn = _gml_fn(fn_name)
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise VariantSkipped(f"not available: gml.{fn_name}: {exc or 'not implemented yet'}") from None
    except ImportError as exc:
        if not (exc.name or "").startswith("gml"):
            raise
        # a stage the API calls into has not landed yet
        raise VariantSkipped(f"not available: gml.{fn_name} needs {exc.name}, which does not exist yet") from None


def _report_notes(report: Any) -> list[str]:
    records = getattr(report, "records", None)
    if not records:
        return []
    applied = [f"{r.name}×{r.matches}" if r.matches else r.name for r in records if r.status == "applied"]
    notes = [f"passes applied: {', '.join(applied) or 'none'}"]
    rolled = [r.name for r in records if r.status == "rolled back"]
    if rolled:
        notes.append(f"rolled back: {', '.join(rolled)}")
    return notes


def build_gml_fp32(ctx: BuildContext) -> Built:
    _gml_fn("optimize")  # before the deep copy: a missing stage costs nothing
    res = _gml_call(
        "optimize", copy.deepcopy(ctx.model), ctx.example, leaf_modules=ctx.leaf_modules, target=ctx.target
    )
    mod = res.module
    runtime = getattr(res, "runtime", None)  # the native engine where it covers the graph (gml.runtime)
    notes = _report_notes(res.report) + ([f"runtime: {runtime.path}"] if runtime is not None else [])
    return _torch_built(getattr(res, "executable", mod), mod if isinstance(mod, fx.GraphModule) else None, notes)


def build_gml_bf16(ctx: BuildContext) -> Built:
    """``gml.optimize(precision="bf16")``: skipped (with the reason) on a CPU without native bf16,
    where GML returns the fp32 model: measuring that as "bf16" would be a mislabelled row."""
    _gml_fn("optimize")
    from gml.kernels.bf16 import bf16_unavailable_reason

    why = bf16_unavailable_reason(ctx.target)
    if why is not None:
        raise VariantSkipped(f"no native bf16 here: {why}")
    res = _gml_call(
        "optimize", copy.deepcopy(ctx.model), ctx.example, leaf_modules=ctx.leaf_modules, precision="bf16",
        target=ctx.target,
    )  # fmt: skip
    if res.precision is None or res.precision.effective != "bf16":
        reason = "; ".join(res.precision.warnings) if res.precision is not None else "no precision report"
        raise VariantSkipped(f"bf16 not applied: {reason}")
    mod = res.module
    runtime = getattr(res, "runtime", None)
    notes = [*_report_notes(res.report), res.precision.summary()]
    notes += [f"runtime: {runtime.path}"] if runtime is not None else []
    return _torch_built(res.executable, mod if isinstance(mod, fx.GraphModule) else None, notes)


def build_gml_int8(ctx: BuildContext) -> Built:
    _gml_fn("quantize")
    res = _gml_call(
        "quantize", copy.deepcopy(ctx.model), ctx.calib, example_inputs=ctx.example, leaf_modules=ctx.leaf_modules,
        target=ctx.target,
    )  # fmt: skip
    mod = res.module
    runtime = getattr(res, "runtime", None)  # the native engine where it covers the graph (gml.runtime)
    notes = _report_notes(res.report) + ([f"runtime: {runtime.path}"] if runtime is not None else [])
    if ctx.target is not None and getattr(res, "precision", "int8") == "int8":
        notes.append(f"INT8 arithmetic: {ctx.target.describe()}")
    if getattr(res, "scheme", "static") != "static":  # #15: a transformer gets the transformer scheme
        notes.append(f"scheme: {res.scheme} ({res.frontend.summary()})")
    if getattr(res, "precision", "int8") != "int8":  # #16: the whole-model guard returned gml.optimize's model
        notes.append(f"INT8 slower than GML fp32 here: gml.quantize returned gml.optimize's {res.precision} model")
    return _torch_built(getattr(res, "executable", mod), mod if isinstance(mod, fx.GraphModule) else None, notes)


def build_compile(ctx: BuildContext) -> Built:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    # A fresh dynamo cache: a second batch size would otherwise recompile with dynamic shapes.
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(ctx.model), backend="inductor", dynamic=False)
    with inductor_config.patch(freezing=True), _quiet():
        compiled(*ctx.example)  # compiles here, so the build time includes Inductor's codegen
    return _torch_built(compiled, notes=["inductor, freezing=True, dynamic=False"])


def _shared_step(ctx: BuildContext, key: str, make: Callable[[], Any]) -> tuple[Any, float]:
    """Run a step several variants share (an export, a conversion, a calibration) once per batch
    size. Returns ``(value, seconds to charge)``: the variant that runs the step pays for it inside
    its own timed build (0 here); a variant reusing it is charged the step's time on top."""
    if key in ctx.cache:
        return ctx.cache[key]
    t0 = time.perf_counter()
    value = make()
    ctx.cache[key] = (value, time.perf_counter() - t0)
    return value, 0.0


def _ao_int8(ctx: BuildContext) -> tuple[fx.GraphModule, float]:
    """torch.ao FX PTQ module, shared with the jit variant."""

    def make() -> fx.GraphModule:
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        with _quiet():
            prepared = prepare_fx(copy.deepcopy(ctx.model), get_default_qconfig_mapping("x86"), ctx.example)
            for batch in ctx.calib:
                prepared(*batch)
            return convert_fx(prepared)

    return _shared_step(ctx, "ao-int8", make)


def build_ao_int8(ctx: BuildContext) -> Built:
    module, _ = _ao_int8(ctx)
    return _torch_built(module, module, ["prepare_fx/convert_fx, qconfig_mapping x86"])


def build_ao_int8_jit(ctx: BuildContext) -> Built:
    module, ao_s = _ao_int8(ctx)
    with _quiet():
        frozen = torch.jit.freeze(torch.jit.trace(module, ctx.example).eval())
    built = _torch_built(frozen, notes=["torch.jit.trace + torch.jit.freeze of ao-int8"])
    built.shared_build_s = ao_s
    return built


# --- ONNX Runtime ----------------------------------------------------------------------------


def _onnx_file(ctx: BuildContext) -> tuple[tuple[Path, str], float]:
    """``((path, exporter), seconds to charge)``: the export runs once per batch size."""

    def make() -> tuple[Path, str]:
        require("onnx")
        path = ctx.workdir / "model.onnx"
        try:
            if importlib.util.find_spec("onnxscript") is None:
                raise ImportError("onnxscript missing")
            with _quiet():
                torch.onnx.export(copy.deepcopy(ctx.model), ctx.example, str(path), dynamo=True, verbose=False)
            return path, "dynamo exporter"
        except Exception:  # the dynamo exporter needs onnxscript and fails on some models
            with _quiet():
                torch.onnx.export(copy.deepcopy(ctx.model), ctx.example, str(path), dynamo=False)
            return path, "TorchScript exporter"

    return _shared_step(ctx, "onnx", make)


def _ort_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _ort_built(sess: Any, notes: list[str], shared_s: float) -> Built:
    names = [i.name for i in sess.get_inputs()]

    def native(args: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        return {n: a.detach().numpy() for n, a in zip(names, args)}

    return Built(run=lambda feed: sess.run(None, feed), native=native, notes=notes, shared_build_s=shared_s)


def build_ort_fp32(ctx: BuildContext) -> Built:
    require("onnxruntime")
    (path, how), export_s = _onnx_file(ctx)
    return _ort_built(_ort_session(path, ctx.threads), [f"torch.onnx.export ({how})"], export_s)


def build_ort_int8(ctx: BuildContext) -> Built:
    require("onnxruntime")
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    (path, how), export_s = _onnx_file(ctx)
    pre = ctx.workdir / "model.pre.onnx"
    qpath = ctx.workdir / "model.int8.onnx"
    names = [i.name for i in _ort_session(path, 1).get_inputs()]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{n: a.numpy() for n, a in zip(names, b)} for b in ctx.calib])

        def get_next(self) -> dict[str, Any] | None:
            return next(self._it, None)

    with _quiet():
        logging.getLogger("onnxruntime").setLevel(logging.ERROR)
        quant_pre_process(str(path), str(pre))
        quantize_static(
            str(pre),
            str(qpath),
            Reader(),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
        )
    notes = [f"torch.onnx.export ({how}) + quantize_static QDQ U8S8 per-channel"]
    return _ort_built(_ort_session(qpath, ctx.threads), notes, export_s)


def build_ort_int8_dynamic(ctx: BuildContext) -> Built:
    """ONNX Runtime's dynamic INT8 (``quantize_dynamic``: int8 weights, activations quantized at run
    time, no calibration): its recommended scheme for transformers, the #15 comparison."""
    require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    (path, how), export_s = _onnx_file(ctx)
    qpath = ctx.workdir / "model.int8dyn.onnx"
    with _quiet():
        logging.getLogger("onnxruntime").setLevel(logging.ERROR)
        quantize_dynamic(str(path), str(qpath), weight_type=QuantType.QInt8, per_channel=True)
    notes = [f"torch.onnx.export ({how}) + quantize_dynamic S8 per-channel weights"]
    return _ort_built(_ort_session(qpath, ctx.threads), notes, export_s)


# --- OpenVINO --------------------------------------------------------------------------------


def _ov_model(ctx: BuildContext) -> tuple[Any, float]:
    def make() -> Any:
        import openvino as ov

        with _quiet():
            return ov.convert_model(copy.deepcopy(ctx.model), example_input=ctx.example)

    return _shared_step(ctx, "ov", make)


def _ov_compile(model: Any, threads: int, precision: str) -> Any:
    import openvino as ov

    config = {
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "INFERENCE_PRECISION_HINT": precision,
    }
    return ov.Core().compile_model(model, "CPU", config)


def _ov_built(compiled: Any, notes: list[str], shared_s: float) -> Built:
    request = compiled.create_infer_request()

    def native(args: tuple[torch.Tensor, ...]) -> list[Any]:
        return [a.detach().numpy() for a in args]

    return Built(
        run=lambda inputs: request.infer(inputs),
        native=native,
        output=lambda res: [v for v in res.values()],
        notes=notes,
        shared_build_s=shared_s,
        keepalive=[compiled],
    )


def _ov_precision_variant(precision: str) -> Callable[[BuildContext], Built]:
    def build(ctx: BuildContext) -> Built:
        if precision == "bf16":
            from gml.runtime.target import resolve

            target = resolve(ctx.target)
            if not target.native_bf16:
                # OpenVINO reads bf16 from CPUID: on a CPU without it the row would be f32 under a
                # bf16 label, and under ONEDNN_MAX_CPU_ISA on a bf16 CPU its Softmax fails to build
                raise VariantSkipped(
                    f"no native bf16 on this target ({target.isa}): OpenVINO's default here is f32 (ov-fp32)"
                )
        require("openvino")
        model, convert_s = _ov_model(ctx)
        compiled = _ov_compile(model, ctx.threads, precision)
        return _ov_built(compiled, [f"convert_model, INFERENCE_PRECISION_HINT={precision}"], convert_s)

    build.__name__ = f"build_ov_{precision}"
    return build


def build_ov_int8(ctx: BuildContext) -> Built:
    require("openvino")
    require("nncf")
    import nncf

    model, convert_s = _ov_model(ctx)
    with _quiet():
        nncf.set_log_level(logging.ERROR)
        data = nncf.Dataset([[a.numpy() for a in b] for b in ctx.calib])
        # clone: the converted model is shared with ov-fp32/ov-bf16
        quantized = nncf.quantize(model.clone(), data, subset_size=len(ctx.calib))
    compiled = _ov_compile(quantized, ctx.threads, "f32")
    return _ov_built(compiled, ["NNCF PTQ (nncf.quantize), remainder f32"], convert_s)


# --- registry --------------------------------------------------------------------------------

VARIANTS: dict[str, VariantSpec] = {
    v.name: v
    for v in (
        VariantSpec("eager", "eager fp32", "fp32", build_eager),
        VariantSpec("gml-fp32", "GML fp32", "fp32", build_gml_fp32, "gml"),
        VariantSpec("gml-int8", "GML INT8", "int8", build_gml_int8, "gml"),
        VariantSpec("gml-bf16", "GML bf16", "bf16", build_gml_bf16, "gml"),
        VariantSpec("compile", "torch.compile (inductor)", "fp32", build_compile),
        VariantSpec("ao-int8", "torch.ao FX INT8 (x86)", "int8", build_ao_int8),
        VariantSpec("ao-int8-jit", "torch.ao INT8 + jit.freeze", "int8", build_ao_int8_jit),
        VariantSpec("ort-fp32", "ONNX Runtime fp32", "fp32", build_ort_fp32, "onnxruntime"),
        VariantSpec("ort-int8", "ONNX Runtime INT8 (QDQ)", "int8", build_ort_int8, "onnxruntime"),
        VariantSpec("ort-int8-dyn", "ONNX Runtime dynamic INT8", "int8", build_ort_int8_dynamic, "onnxruntime"),
        VariantSpec("ov-fp32", "OpenVINO fp32", "fp32", _ov_precision_variant("f32"), "openvino"),
        VariantSpec("ov-bf16", "OpenVINO bf16 (its default)", "bf16", _ov_precision_variant("bf16"), "openvino"),
        VariantSpec("ov-int8", "OpenVINO INT8 (NNCF)", "int8", build_ov_int8, "openvino"),
    )
}

# What `gml bench` runs when --variants is not given: every contestant of the issue, plus the
# jit-frozen torch.ao module (cheap once ao-int8 exists).
DEFAULT_VARIANTS: tuple[str, ...] = (
    "eager",
    "gml-fp32",
    "gml-int8",
    "compile",
    "ao-int8",
    "ao-int8-jit",
    "ort-fp32",
    "ort-int8",
    "ov-fp32",
    "ov-int8",
)


#: ``gml bench --precision bf16``: GML bf16 against its peer, OpenVINO bf16 (and both fp32 rows for scale).
BF16_VARIANTS: tuple[str, ...] = ("eager", "gml-fp32", "gml-bf16", "ov-fp32", "ov-bf16")

#: ``--precision`` → the default variant list.
PRECISION_DEFAULTS: dict[str, tuple[str, ...]] = {"fp32": DEFAULT_VARIANTS, "bf16": BF16_VARIANTS}


def resolve_variants(
    names: str | list[str] | tuple[str, ...] | None, precision: str = "fp32"
) -> list[str]:
    """``"eager,compile"`` / ``["eager", ...]`` / ``"all"`` / ``None`` (defaults) → ordered names.

    ``eager`` is always included (first): it is the reference for speedups and accuracy.
    ``precision="bf16"`` makes the default list :data:`BF16_VARIANTS` (``default`` too).
    """
    from gml.errors import InputError

    defaults = PRECISION_DEFAULTS.get(precision)
    if defaults is None:
        raise InputError(f"unknown precision {precision!r}.", hint=f"use one of: {', '.join(PRECISION_DEFAULTS)}.")
    if names is None:
        chosen = list(defaults)
    else:
        items = names.split(",") if isinstance(names, str) else list(names)
        items = [s.strip() for s in items if s.strip()]
        chosen = []
        for s in items:
            expanded = list(VARIANTS) if s == "all" else list(defaults) if s == "default" else [s]
            chosen.extend(expanded)
        unknown = [s for s in chosen if s not in VARIANTS]
        if unknown:
            raise InputError(
                f"Unknown benchmark variant(s): {', '.join(unknown)}.",
                hint=f"choose from {', '.join(VARIANTS)} (or 'all', 'default').",
            )
    ordered = ["eager"] + [s for s in dict.fromkeys(chosen) if s != "eager"]
    return ordered
