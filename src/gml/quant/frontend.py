"""INT8 frontend: an fp32 model in, a calibrated *reference* Q/DQ graph out.

Pipeline (each step is a function here, :func:`prepare_reference` runs them in order)::

    model ─ capture ─ Normalize → UntieSharedModules → FoldBatchNorm → conv_operand_first
                      (fp32 PassManager, every pass checked against the one before)
          ─ prepare  (torch.ao prepare_fx + GML BackendConfig: fuse conv+relu, conv+add+relu, ...;
                      insert observers)
          ─ calibrate (user batches or generated ones; progress bar)
          ─ convert_reference (torch.ao convert_to_reference_fx)

The result is torch.ao's reference representation: every INT8 tensor is spelled
``torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)`` followed by ``.dequantize()``,
and each quantized op is an fp32 op between them (weighted ops are reference modules whose
weights quantize→dequantize inside). That graph simulates the INT8 model closely and is what
the INT8 lowering pattern-matches.

This is the *only* module that drives ``torch.ao.quantization`` (with
:mod:`gml.quant.backend_config` for its config objects). torch.ao's FX quantization is
deprecated upstream; a torchao PT2E frontend can replace this file behind the same functions.
Its deprecation warnings are silenced with filters that match only those messages: the
"torch.ao.quantization is deprecated" notice around our calls into it, and torch's one-time
notice about quantized-tensor creation functions when a reference graph runs.

Also produced: the *float twin* of the reference graph (the prepared model with its observers
removed): the same fused modules in fp32 and the same node names, so per-layer accuracy can be
matched node by node (:mod:`gml.quant.accuracy`).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gml.capture import MUTATES
from gml.errors import InputError, UnsupportedError
from gml.ir.layers import behaves_as
from gml.ir.qdq import is_dequantize, is_quantize_any
from gml.ir.target import Int8Arithmetic
from gml.memory import returns_memory, shared_copy
from gml.passes.manager import PassManager, PipelineReport
from gml.quant.backend_config import (
    NORMALIZED_MODULES,
    activation_observer,
    exact_linear_names,
    get_backend_config,
    int8_ops,
    qconfig_mapping,
)
from gml.quant.calibrate import CalibrationStats, calibrate, describe_generated, generate_batches

# torch.ao.quantization's removal notice starts with this sentence (torch/ao/quantization/utils.py).
_DEPRECATION = re.compile(r"torch\.ao\.quantization is deprecated", re.IGNORECASE)


_QTENSOR_NOTICE = r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation"


def silence_qtensor_notice() -> None:
    """Filter torch's one-time "quantized tensor creation functions are deprecated" warning.

    Running a reference graph triggers it, and the graphs this frontend returns are meant to be
    run, so the filter is process-wide; it matches only that message. Called on import and again
    by :func:`prepare_reference` (a second identical filter replaces the first).
    """
    warnings.filterwarnings("ignore", message=_QTENSOR_NOTICE, category=UserWarning)


silence_qtensor_notice()


@contextlib.contextmanager
def quiet_torch_ao() -> Iterator[None]:
    """Hide torch.ao.quantization's deprecation notice (and nothing else) while we call it, and
    make it forget the modules it saw when the call returns.

    torch.ao's ``fx.utils.assert_and_get_unique_device`` is memoized with an unbounded
    ``functools.cache`` keyed by the module, so every graph ``prepare_fx`` / ``convert_to_reference_fx``
    looked at (the prepared graph, with a full fp32 copy of the weights and its observers) stayed
    alive for the life of the process: 45 MB per ``gml.quantize`` of ResNet18 (issue #28)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATION.pattern, category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=_DEPRECATION.pattern, category=FutureWarning)
            yield
    finally:
        _forget_torch_ao_modules()


def _forget_torch_ao_modules() -> None:
    from torch.ao.quantization.fx import utils

    cached = getattr(utils, "assert_and_get_unique_device", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


# ---------------------------------------------------------------- report
@dataclass
class OpStatus:
    """How one op of the reference graph ended up."""

    node: str
    op: str  # module type / function label, e.g. "ConvReLU2d", "Add", "torch.cat"
    int8: bool
    detail: str = ""  # fused pattern, or why the op stays fp32


@dataclass
class FrontendReport:
    """What the frontend did: fp32 passes, fusions, quantized and fp32 ops, calibration."""

    backend: str
    observer: str
    per_channel: bool
    ops: list[OpStatus] = field(default_factory=list)
    calibration: CalibrationStats | None = None
    fp32_passes: PipelineReport | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fused(self) -> list[OpStatus]:
        return [o for o in self.ops if o.detail.startswith("fused")]

    @property
    def quantized(self) -> list[OpStatus]:
        return [o for o in self.ops if o.int8]

    @property
    def fp32(self) -> list[OpStatus]:
        return [o for o in self.ops if not o.int8]

    def summary(self) -> str:
        cal = self.calibration
        seen = f"{cal.batches} batches / {cal.samples} samples ({cal.source})" if cal else "not calibrated"
        if cal and cal.warnings:
            seen += " (warning: " + "; ".join(cal.warnings) + ")"
        return (
            f"{len(self.quantized)} ops INT8 ({len(self.fused)} fused), {len(self.fp32)} fp32; "
            f"observer={self.observer}, weights per-{'channel' if self.per_channel else 'tensor'}, "
            f"backend={self.backend}; calibration: {seen}"
        )

    def table(self, title: str = "INT8 frontend: reference graph"):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=title, caption=self.summary())
        for col in ("node", "op", "precision", "detail"):
            t.add_column(col)
        for o in self.ops:
            t.add_row(o.node, o.op, "[green]int8[/]" if o.int8 else "[yellow]fp32[/]", o.detail)
        return t


@dataclass
class ReferenceResult:
    """The calibrated reference Q/DQ graph, its float twin and the report."""

    graph_module: fx.GraphModule
    float_module: fx.GraphModule
    report: FrontendReport
    #: the graph after the fp32 passes, before torch.ao touched it (sharing its tensors with
    #: ``float_module``): where ``gml.quantize``'s whole-model guard builds GML's fp32 model from
    #: without capturing the model again (issue #25)
    fp32_graph: fx.GraphModule | None = None


# ---------------------------------------------------------------- fp32 passes
def fp32_passes() -> list:
    """The fp32 passes before ``prepare``: :func:`gml.quant.pipeline.reference_passes`."""
    from gml.quant.pipeline import reference_passes

    return reference_passes()


def run_fp32_passes(
    model: nn.Module, example_inputs: Sequence[Any], *, copy_graph: bool = True
) -> tuple[fx.GraphModule, PipelineReport]:
    """Capture (if needed) and run :func:`fp32_passes` under the PassManager's checks. A graph is
    copied first unless ``copy_graph=False`` (a graph the caller hands over: ``gml.quantize``'s one
    capture, already a copy of the user's model)."""
    from gml.capture import check_eval_mode

    check_eval_mode(model, what="INT8 quantization")
    _check_float32(model)
    if isinstance(model, fx.GraphModule):
        gm = copy.deepcopy(model) if copy_graph else model
    else:
        gm = capture_for_ao(model, example_inputs)
    result = PassManager(fp32_passes()).run(gm, [tuple(example_inputs)])
    _refuse_kept_inplace_ops(result.graph_module, result.report)
    return result.graph_module, result.report


def capture_for_ao(
    model: nn.Module, example_inputs: Sequence[Any], *, leaf_modules: Sequence[str | type] = ()
) -> fx.GraphModule:
    """The graph torch.ao's static INT8 starts from: torch.fx's, as ``gml.optimize`` prefers it,
    except that fx's preference for torch.export when it keeps torch.nn attention layers opaque does
    not apply (those models take the transformer scheme). When fx cannot trace the model at all,
    the torch.export graph (ATen raised to modules and torch calls, as ``gml.optimize`` uses it) is
    taken, as ``gml.optimize`` does: a model optimize captured no longer fails in quantize (issue
    #24: timm ConViT, a forward that iterates over a tensor)."""
    from gml.capture import capture
    from gml.errors import TraceFailure

    try:
        return capture(model, example_inputs, leaf_modules=leaf_modules, export=False)
    except TraceFailure as fx_error:
        try:
            return capture(model, example_inputs, leaf_modules=leaf_modules)
        except TraceFailure:
            raise fx_error from None


def _check_float32(model: nn.Module) -> None:
    """INT8 quantization starts from fp32 weights: torch.ao's observers and quantize ops take no other."""
    odd = sorted({str(t.dtype).removeprefix("torch.") for t in (*model.parameters(), *model.buffers())
                  if t.is_floating_point() and t.dtype != torch.float32})  # fmt: skip
    if odd:
        raise UnsupportedError(
            f"INT8 quantization starts from an fp32 model; this one has {', '.join(odd)} parameters or buffers.",
            hint="convert it first: model.float() (and feed fp32 inputs).",
        )


def _refuse_kept_inplace_ops(gm: fx.GraphModule, report: PipelineReport) -> None:
    """torch.ao's prepare/convert treat every op as pure, so an in-place op whose write is read
    through a view would be silently lost in the INT8 model. Normalize turns every other in-place
    op out-of-place, and points later readers of a tensor an opaque call overwrote at that call;
    the ones it had to keep stop quantization here."""
    from gml.passes.normalize import OPAQUE_WRITE_KEPT, writes_in_place
    from gml.passes.utils import modules_of

    modules = modules_of(gm)
    reasons = {s.node: s.reason for r in report.records for s in r.skips}
    # an opaque call whose write Normalize could not make a data dependence (read through a view)
    unexposed = {name for name, why in reasons.items() if why.startswith(OPAQUE_WRITE_KEPT)}
    kept = [n for n in gm.graph.nodes if writes_in_place(n, modules) or (n.meta.get(MUTATES) and n.name in unexposed)]
    if kept:
        first = kept[0]
        why = f" ({reasons[first.name]})" if first.name in reasons else ""
        raise UnsupportedError(
            f"INT8 quantization cannot keep the in-place op {first.name}{why}; "
            f"{len(kept)} in-place op(s) left in the model after normalization.",
            hint="write the op out-of-place (e.g. `y = torch.relu(x)` instead of `x.relu_()`) or stop "
            "reading the overwritten tensor through a view; `gml optimize` (fp32) keeps such ops as they are.",
        )


# ---------------------------------------------------------------- torch.ao steps
def prepare(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    observer: str = "minmax",
    per_channel: bool = True,
    backend: str = "onednn",
    percentile: float = 99.99,
    arithmetic: Int8Arithmetic | None = None,
) -> fx.GraphModule:
    """Fuse with the GML BackendConfig and insert observers (``gm`` is not modified: torch.ao works
    on a copy of its graph and submodules that shares its weights, :func:`gml.memory.shared_copy`); the
    observers' ranges are ``arithmetic``'s (the target's INT8 arithmetic: ``Target.int8``; default: this
    process's target's).

    Every ``call_module`` of ``gm`` stays a leaf: torch.ao re-traces the module and would
    otherwise inline modules outside ``torch.nn`` (the normalized ``gml.nn.Add``, user leaves).
    """
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig
    from torch.ao.quantization.quantize_fx import prepare_fx

    gm = shared_copy(gm)
    _check_outputs_are_tensors(gm)
    leaves = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_module"})
    custom = (
        PrepareCustomConfig()
        .set_non_traceable_module_classes(list(NORMALIZED_MODULES))
        .set_non_traceable_module_names(leaves)
    )
    qmap = qconfig_mapping(
        observer, per_channel=per_channel, backend=backend, percentile=percentile, arithmetic=arithmetic,
        exact_linears=exact_linear_names(gm),
    )  # fmt: skip
    with quiet_torch_ao():
        prepared = prepare_fx(
            gm,
            qmap,
            tuple(example_inputs),
            prepare_custom_config=custom,
            backend_config=get_backend_config(backend),
        )
    act = activation_observer(observer, backend=backend, percentile=percentile, arithmetic=arithmetic)
    _observe_fixed_qparams_inputs(prepared, act)
    return prepared


def _check_outputs_are_tensors(gm: fx.GraphModule) -> None:
    """torch.ao's prepare takes tensors (in tuples, lists, dicts) and ``None`` as outputs; a constant
    among them (an int, a string) made it raise a bare ``Exception``."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    odd: list[Any] = []
    fx.node.map_aggregate(out.args[0], lambda a: a if isinstance(a, fx.Node) or a is None else odd.append(a))
    if odd:
        raise UnsupportedError(
            f"INT8 quantization needs forward() to return tensors (in tuples, lists or dicts); this model also "
            f"returns the constant {odd[0]!r} ({type(odd[0]).__name__}).",
            hint="return the constant from somewhere else (an attribute, a second method), or quantize the "
            "part of the model that returns tensors (--submodule); `gml optimize` (fp32) keeps such outputs.",
        )


def _observe_fixed_qparams_inputs(prepared: fx.GraphModule, observer_ctor: Any) -> int:
    """Give every value a sigmoid did not compute an ordinary observer where torch.ao gave it the
    sigmoid's fixed [0, 1] one; return how many observers were replaced.

    torch.ao observes a value nobody else observed (a model input, an fp32 op's output) with the
    consumer's QConfig activation, which for a sigmoid is its fixed *output* observer (1/256, 0):
    every negative input would clamp to 0 and the INT8 sigmoid would return 0.5. And ops that share
    one observer among their inputs and output (``cat``, ``relu``) spread a sigmoid's fixed observer
    to values outside [0, 1]. So a fixed observer that watches anything but a fixed-qparams op's
    output is replaced, under every name it has (keeping what shares it shared). A sigmoid whose
    output then gets ordinary qparams is still right: the INT8 kernel's 1/256 grid is requantized.
    """
    from torch.ao.quantization.observer import FixedQParamsObserver

    from gml.quant.backend_config import FIXED_QPARAMS_OPS

    modules = dict(prepared.named_modules(remove_duplicate=False))

    def is_fixed_op(n: Any) -> bool:
        return (
            isinstance(n, fx.Node)
            and n.op == "call_module"
            and isinstance(modules.get(str(n.target)), FIXED_QPARAMS_OPS)
        )

    watches_other: dict[int, bool] = {}
    for node in prepared.graph.nodes:
        obs = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(obs, FixedQParamsObserver) and node.args:
            watches_other[id(obs)] = watches_other.get(id(obs), False) or not is_fixed_op(node.args[0])
    fresh: dict[int, nn.Module] = {}
    for name, mod in modules.items():
        if isinstance(mod, FixedQParamsObserver) and watches_other.get(id(mod)):
            parent, _, attr = name.rpartition(".")
            setattr(
                prepared.get_submodule(parent) if parent else prepared, attr, fresh.setdefault(id(mod), observer_ctor())
            )
    return len(fresh)


def _is_observer(mod: nn.Module | None) -> bool:
    from torch.ao.quantization.observer import ObserverBase

    return isinstance(mod, ObserverBase)


def float_twin(prepared: fx.GraphModule) -> fx.GraphModule:
    """The prepared model without observers: fp32, same fused modules and node names as the
    reference graph that :func:`convert_reference` makes from it. It shares the weights with
    ``prepared`` (:func:`gml.memory.shared_copy`): torch.ao's reference modules take the float
    weights as they are, nothing writes them, and a copy cost a full fp32 copy of the model."""
    twin = shared_copy(prepared)
    modules = dict(twin.named_modules(remove_duplicate=False))
    for node in list(twin.graph.nodes):
        if node.op == "call_module" and _is_observer(modules.get(str(node.target))):
            node.replace_all_uses_with(node.args[0])
            twin.graph.erase_node(node)
    twin.delete_all_unused_submodules()
    twin.graph.lint()
    twin.recompile()
    return drop_torch_ao_meta(twin)


def convert_reference(prepared: fx.GraphModule, *, backend: str = "onednn") -> fx.GraphModule:
    """torch.ao ``convert_to_reference_fx``: observers become quantize_per_tensor → dequantize."""
    from torch.ao.quantization.quantize_fx import convert_to_reference_fx

    with quiet_torch_ao():
        return drop_torch_ao_meta(convert_to_reference_fx(prepared, backend_config=get_backend_config(backend)))


def drop_torch_ao_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` without the metadata torch.ao's ``prepare_fx`` leaves on it (``gm`` itself, changed).

    ``node.meta["target_dtype_info"]`` holds observer constructors whose closures hold the module
    they were made for, and ``gm.meta["_observed_graph_module_attrs"]`` the qconfigs: node metadata
    is copied along with every rewritten node, so the INT8 graph lowered from the reference graph
    kept the prepared model's fp32 modules alive (a full fp32 copy of the weights, issue #28).
    Nothing after ``convert`` reads either."""
    for node in gm.graph.nodes:
        node.meta.pop("target_dtype_info", None)
    gm.meta.pop("_observed_graph_module_attrs", None)
    return gm


# ---------------------------------------------------------------- graph helpers
def keep_outputs_fp32(gm: fx.GraphModule) -> list[str]:
    """Drop quantize → dequantize pairs right before the graph output when the quantized value
    comes from a weighted op (conv/linear): their INT8 kernels can write fp32 directly, and
    rounding the logits to 8 bits only costs accuracy. Returns the nodes whose output stays fp32."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    kept: list[str] = []
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for dq in list(output.all_input_nodes):
        if not is_dequantize(dq) or len(dq.users) != 1:
            continue
        q = dq.args[0]
        if not (isinstance(q, fx.Node) and is_quantize_any(q) and len(q.users) == 1):
            continue
        src = q.args[0]
        mod = modules.get(str(src.target)) if isinstance(src, fx.Node) and src.op == "call_module" else None
        root = mod[0] if isinstance(mod, nn.Sequential) and len(mod) else mod  # fused nni modules
        if not behaves_as(root, (nn.Conv2d, nn.Linear)):
            continue
        output.replace_input_with(dq, src)
        for n in (dq, q, *[a for a in q.args[1:] if isinstance(a, fx.Node)]):
            if not n.users:
                gm.graph.erase_node(n)
        kept.append(src.name)
    if kept:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return kept


def _label(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    from gml.passes.oplib import node_label

    return node_label(node, modules)


def summarize_reference(gm: fx.GraphModule, backend: str = "onednn") -> list[OpStatus]:
    """Which ops of a reference graph are INT8 and which stay fp32, with fused patterns spelled out.

    An op is INT8 when the BackendConfig has a pattern for it *and* it sits in the quantized
    region (reads a dequantize or feeds a quantize). Other ops between a dequantize and a
    quantize run in fp32 there (torch.ao quantizes their output because an INT8 op reads it).
    """
    from torch.ao.nn.intrinsic import _FusedModule

    types, fns = int8_ops(get_backend_config(backend))
    modules = dict(gm.named_modules(remove_duplicate=False))
    out: list[OpStatus] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        if is_quantize_any(node) or is_dequantize(node) or node.target is operator.getitem:
            continue
        reads_dq = any(is_dequantize(a) for a in node.all_input_nodes)
        feeds_q = _feeds_quantize(node)
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        detail = ""
        if isinstance(mod, _FusedModule):
            parts = [type(c).__name__ for c in mod.children()]
            detail = "fused " + " + ".join(parts)
        has_pattern = isinstance(mod, types) if mod is not None else node.target in fns
        int8 = has_pattern and (reads_dq or feeds_q)
        if not has_pattern:
            detail = "no INT8 pattern for this op in the GML BackendConfig: runs in fp32"
        elif not int8:
            detail = "outside the quantized region (no quantized input or output)"
        elif not feeds_q and not any(u.op == "output" for u in node.users):
            detail = (detail + "; " if detail else "") + "output stays fp32"
        elif not feeds_q:
            detail = (detail + "; " if detail else "") + "model output kept fp32"
        out.append(OpStatus(node.name, _label(node, modules), int8, detail))
    return out


def _feeds_quantize(node: fx.Node) -> bool:
    """Output reaches a quantize directly or through a single-user chain (Add → ReLU → quantize)."""
    current = node
    for _ in range(4):
        if any(is_quantize_any(u) for u in current.users):
            return True
        if len(current.users) != 1:
            return False
        current = next(iter(current.users))
        if current.op == "output" or is_dequantize(current):
            return False
    return False


# ---------------------------------------------------------------- the whole frontend
def _calibration_source(
    calib_data: Iterable[Any] | int | None,
    example_inputs: Sequence[Any],
    seed: int,
    token_range: tuple[int, int] | None = None,
) -> tuple[Iterable[Any], str]:
    if calib_data is None:
        calib_data = 8
    if isinstance(calib_data, int) and not isinstance(calib_data, bool):
        batches = generate_batches(example_inputs, calib_data, seed=seed, token_range=token_range)
        return batches, describe_generated(example_inputs, token_range)
    if isinstance(calib_data, torch.Tensor):
        raise InputError(
            "calib_data is a single tensor; GML-Lab needs an iterable of batches.",
            hint="wrap it: [x], or split it: list(x.split(32)).",
        )
    return calib_data, "user data"


@returns_memory  # its garbage (replaced weights, timing graphs) handed back before the next stage (#28)
def prepare_reference(
    model: nn.Module,
    example_inputs: Sequence[Any],
    calib_data: Iterable[Any] | int | None = None,
    *,
    observer: str = "minmax",
    per_channel: bool = True,
    backend: str = "onednn",
    percentile: float = 99.99,
    fp32_output: bool = True,
    progress: bool = True,
    max_batches: int | None = None,
    seed: int = 0,
    token_range: tuple[int, int] | None = None,
    arithmetic: Int8Arithmetic | None = None,
    copy_graph: bool = True,
) -> ReferenceResult:
    """fp32 model → calibrated reference Q/DQ graph (see the module docstring).

    Args:
        model: an ``nn.Module`` in eval mode, or an ``fx.GraphModule`` (e.g. from :func:`gml.capture`).
        example_inputs: one tuple of example tensors (shapes, dtypes).
        calib_data: iterable of batches (tensors or tuples; ``(x, label)`` pairs are fine), or an
            ``int`` N to calibrate on N seeded random batches shaped like ``example_inputs``
            (default 8). Real data gives better scales than random data.
        observer: ``minmax`` | ``moving_average`` | ``histogram`` | ``percentile``.
        per_channel: per-output-channel symmetric weights (default) or per-tensor.
        backend: ``onednn`` (u8 activations, full range) or ``fbgemm`` (reduce_range).
        percentile: clipping percentile of the ``percentile`` observer.
        fp32_output: keep conv/linear results that are model outputs in fp32
            (see :func:`keep_outputs_fp32`).
        token_range: the ids generated integer inputs are drawn from (the model's vocabulary).
        arithmetic: the target's INT8 arithmetic (``Target.int8``): the weight and activation
            ranges every kernel on that CPU computes exactly (docs/adr/011-int8-on-every-isa.md);
            default: this process's target's.
        copy_graph: ``False``: ``model`` is a graph handed over (``gml.quantize``'s one capture), not
            copied but rewritten in place.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    silence_qtensor_notice()
    gm, fp32_report = run_fp32_passes(model, example_inputs, copy_graph=copy_graph)
    del model  # the caller's copy: its weights the fp32 passes replaced (BN folded) die here (#28)
    # prepare works on a copy sharing gm's tensors, so gm stays the fp32 graph (no weight copy)
    fp32_graph = gm
    prepared = prepare(
        gm, example_inputs, observer=observer, per_channel=per_channel, backend=backend, percentile=percentile,
        arithmetic=arithmetic,
    )  # fmt: skip
    del gm
    data, source = _calibration_source(calib_data, example_inputs, seed, token_range)
    stats = calibrate(prepared, data, progress, max_batches=max_batches, source=source)
    twin = float_twin(prepared)
    ref = convert_reference(prepared, backend=backend)
    report = FrontendReport(backend, observer, per_channel, calibration=stats, fp32_passes=fp32_report)
    if fp32_output:
        kept = keep_outputs_fp32(ref)
        if kept:
            report.notes.append(f"model outputs kept fp32 (INT8 kernel writes fp32): {', '.join(kept)}")
    report.ops = summarize_reference(ref, backend)
    return ReferenceResult(ref, twin, report, fp32_graph)


__all__ = [
    "FrontendReport",
    "OpStatus",
    "ReferenceResult",
    "calibrate",
    "convert_reference",
    "float_twin",
    "fp32_passes",
    "keep_outputs_fp32",
    "prepare",
    "prepare_reference",
    "quiet_torch_ao",
    "run_fp32_passes",
    "silence_qtensor_notice",
    "summarize_reference",
]
