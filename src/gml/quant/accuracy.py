"""How much accuracy INT8 costs: output agreement and per-layer SQNR, fp32 vs INT8.

Model level, on held-out inputs: cosine similarity of all outputs, max abs difference, top-1
agreement (same argmax on dim 1), and with labels the top-1 accuracy of both models.

Layer level: SQNR (signal-to-quantization-noise ratio) of each INT8 activation against the fp32
activation of the same node::

    SQNR = 10·log10( Σ fp32² / Σ (fp32 − int8)² )  dB      (+6 dB per extra bit; 8-bit ≈ 30-45 dB)

Matching is by node *name*: the frontend's float twin (:attr:`ReferenceResult.float_module`) has
the same fused modules and node names as the reference graph, so every op pairs up without
guessing. The INT8 value of a node is taken after its quantize op when it has one (the rounding is
part of the layer's error); a quantized or GML uint8 output (``output_scale``/``output_zp``
buffers, ADR 002) is dequantized first. A lowering that replaces nodes keeps the pairing through
``node.meta["gml_coverage"].nodes`` (the fp32 nodes it covered; the last one's output is the
module's output), as :class:`~gml.quant.lower.LowerToGML` records, or ``node.meta["gml_source"]``.

torch.ao's numeric suite (``torch.ao.ns``) is not used: it matches subgraphs of torch.ao's own
quantized modules and does not know GML's lowered modules, while name matching works for both.
The error accumulates batch by batch, so only one batch's activations are held at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from gml.capture import MutableArgsInterpreter
from gml.errors import InputError
from gml.ir.library import output_qparams_args
from gml.passes.oplib import node_label
from gml.quant.calibrate import batch_misfit


@dataclass
class LayerError:
    """fp32-vs-INT8 error of one node's activation over all batches."""

    node: str
    op: str
    sqnr_db: float
    max_abs_diff: float

    @property
    def bits(self) -> float:
        """Effective bits (SQNR of an ideal b-bit quantizer of a full-scale uniform signal is ~6.02·b dB)."""
        return self.sqnr_db / 6.02 if math.isfinite(self.sqnr_db) else math.inf


#: Output cosine below which an INT8 result is reported BROKEN: a working INT8 model agrees with its
#: fp32 source to 0.99+ (ResNet/MobileNet/ViT: 0.995-0.9999 here); 0.9 means the signal is mostly
#: noise. ``gml quantize --min-cosine`` / ``quantize(min_cosine=...)`` set a stricter bar that fails.
BROKEN_COSINE = 0.9

#: An INT8 result is also BROKEN when it is far from *exact integer arithmetic with the same qparams*
#: (the reference Q/DQ graph, ``exact_model`` of :func:`accuracy_report`): its cosine distance to
#: fp32 more than ``EXACT_FACTOR`` times the exact arithmetic's plus ``EXACT_SLACK`` (a kernel that
#: saturates, a wrong lowering: measured 1000x on the issue's layers, ADR 011; the kernels GML runs
#: stay within 1-3x), or ``EXACT_TOP1_DROP`` more of the samples changing their top-1 class (and
#: at least ``EXACT_TOP1_MIN`` samples). Rounding differences between executors never come close.
EXACT_FACTOR = 10.0
EXACT_SLACK = 1e-3
EXACT_TOP1_DROP = 0.05
EXACT_TOP1_MIN = 3


@dataclass
class AccuracyReport:
    """Model-level agreement and per-layer SQNR of an INT8 model against its fp32 source."""

    samples: int
    cosine: float
    max_abs_diff: float
    top1_agreement: float | None = None  # fraction of samples with the same argmax
    fp32_top1: float | None = None  # accuracy (fraction) against labels, when given
    int8_top1: float | None = None
    fp32_top5: float | None = None  # top-5 accuracy (label among the 5 largest outputs), 5+ classes
    int8_top5: float | None = None
    layers: list[LayerError] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # INT8 nodes with no fp32 counterpart
    fp32_max_abs: float | None = None  # largest |output| of each model: says which side is zero
    int8_max_abs: float | None = None
    fp32_nonfinite: int = 0  # NaN/Inf output elements of each model
    int8_nonfinite: int = 0
    #: the same measures of exact integer arithmetic with the same qparams (``exact_model``), if given
    exact_cosine: float | None = None
    exact_top1_agreement: float | None = None
    classified: int = 0  # samples counted in the top-1 agreements
    #: what the report measured on (gml.quantize: the given eval_data, the user's last calibration
    #: batches, or generated batches); "" when the caller did not say
    source: str = ""

    @property
    def far_from_exact(self) -> str | None:
        """Why the result is far from exact integer arithmetic with the same qparams (module
        constants), or ``None`` when it is close (or no exact model was compared)."""
        if self.exact_cosine is not None and math.isfinite(self.exact_cosine) and math.isfinite(self.cosine):
            err, exact = 1.0 - self.cosine, max(0.0, 1.0 - self.exact_cosine)
            if err > EXACT_FACTOR * exact + EXACT_SLACK:
                return (
                    f"output cosine {self.cosine:.6f} is far from exact integer arithmetic with the same qparams "
                    f"({self.exact_cosine:.6f}): the kernels do not compute what the qparams say (saturation?)"
                )
        if self.exact_top1_agreement is not None and self.top1_agreement is not None and self.classified:
            flips = round((self.exact_top1_agreement - self.top1_agreement) * self.classified)
            if flips >= max(EXACT_TOP1_MIN, EXACT_TOP1_DROP * self.classified):
                return (
                    f"top-1 agreement {100 * self.top1_agreement:.2f}% vs {100 * self.exact_top1_agreement:.2f}% "
                    "for exact integer arithmetic with the same qparams"
                )
        return None

    @property
    def broken(self) -> str | None:
        """Why this INT8 result must not be used (cosine below :data:`BROKEN_COSINE`, NaN/Inf that
        one model has and the other not, far from exact integer arithmetic: :attr:`far_from_exact`),
        naming the worst layer; ``None`` when it is not broken."""
        why = self.below(BROKEN_COSINE) or self.far_from_exact
        if why is None:
            return None
        worst = self.worst(1)
        if worst:
            e = worst[0]
            sq = f"{e.sqnr_db:.1f} dB" if math.isfinite(e.sqnr_db) else str(e.sqnr_db)
            why += f"; worst layer {e.node} ({e.op}): SQNR {sq}, max |diff| {e.max_abs_diff:.3g}"
        return why

    def below(self, min_cosine: float) -> str | None:
        """Why the result fails the bar ``cosine >= min_cosine``, or ``None`` when it passes."""
        if self.fp32_nonfinite or self.int8_nonfinite:
            if self.fp32_nonfinite == self.int8_nonfinite and not math.isnan(self.cosine):
                pass  # both sides agree on where NaN/Inf are; the cosine of the rest decides
            else:
                return f"non-finite outputs: {self.fp32_nonfinite} NaN/Inf in fp32, {self.int8_nonfinite} in INT8"
        if math.isnan(self.cosine):
            return None if self.fp32_max_abs == 0 and self.int8_max_abs == 0 else self._why_no_cosine()
        if self.cosine < min_cosine:
            return f"output cosine {self.cosine:.6f} is below {min_cosine}"
        return None

    @property
    def accuracy_drop(self) -> float | None:
        """fp32 minus INT8 top-1 accuracy, in percentage points."""
        if self.fp32_top1 is None or self.int8_top1 is None:
            return None
        return 100.0 * (self.fp32_top1 - self.int8_top1)

    def worst(self, k: int = 5) -> list[LayerError]:
        return sorted(self.layers, key=lambda e: e.sqnr_db)[:k]

    def summary(self) -> str:
        cos = f"output cosine {self.cosine:.6f}" if math.isfinite(self.cosine) else self._why_no_cosine()
        parts = [f"{self.samples} samples", cos, f"max |diff| {self.max_abs_diff:.4g}"]
        if self.fp32_nonfinite or self.int8_nonfinite:
            parts.append(f"NaN/Inf outputs: fp32 {self.fp32_nonfinite}, INT8 {self.int8_nonfinite}")
        broken = self.broken
        if broken:
            parts.insert(0, f"BROKEN ({broken})")
        if self.top1_agreement is not None:
            parts.append(f"top-1 agreement {100 * self.top1_agreement:.2f}%")
        if self.exact_cosine is not None:
            exact = f"exact integer arithmetic: cosine {self.exact_cosine:.6f}"
            if self.exact_top1_agreement is not None:
                exact += f", top-1 agreement {100 * self.exact_top1_agreement:.2f}%"
            parts.append(exact)
        if self.fp32_top1 is not None and self.int8_top1 is not None:
            parts.append(f"top-1 accuracy fp32 {100 * self.fp32_top1:.2f}% / int8 {100 * self.int8_top1:.2f}%")
        if self.fp32_top5 is not None and self.int8_top5 is not None:
            parts.append(f"top-5 accuracy fp32 {100 * self.fp32_top5:.2f}% / int8 {100 * self.int8_top5:.2f}%")
        if self.source:
            parts.append(f"on {self.source}")
        return ", ".join(parts)

    def _why_no_cosine(self) -> str:
        if self.fp32_nonfinite:
            return f"output cosine undefined: the fp32 outputs hold {self.fp32_nonfinite} NaN/Inf values"
        if self.int8_nonfinite:
            return f"output cosine undefined: the INT8 outputs hold {self.int8_nonfinite} NaN/Inf values"
        if self.fp32_max_abs == 0:
            return "output cosine undefined (the fp32 outputs are all zero, e.g. a zero-initialised head)"
        if self.int8_max_abs == 0:
            # observers never pick a scale below float32 eps (~1.2e-7): smaller values round to 0
            return (
                f"output cosine undefined: the INT8 outputs are all zero while the fp32 ones reach only "
                f"{self.fp32_max_abs:.3g} (activations this small round to zero in INT8, as in a "
                "random-init network whose signal vanished; calibrate the trained model)"
            )
        return "output cosine undefined (the fp32 or INT8 outputs are all zero)"

    def table(self, title: str = "INT8 accuracy (fp32 vs INT8)"):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=title, caption=self.summary())
        for col in ("node", "op", "SQNR dB", "max |diff|"):
            t.add_column(col, justify="right" if col in ("SQNR dB", "max |diff|") else "left")
        for e in self.layers:
            style = "red" if e.sqnr_db < 20 else "yellow" if e.sqnr_db < 30 else ""
            sq = f"{e.sqnr_db:.1f}" if math.isfinite(e.sqnr_db) else "inf"
            t.add_row(e.node, e.op, f"[{style}]{sq}[/]" if style else sq, f"{e.max_abs_diff:.3g}")
        return t


# ---------------------------------------------------------------- helpers
def _to_float(value: Any, qparams: tuple[float, int] | None = None) -> torch.Tensor | None:
    """A dense fp32 view of an activation: QTensors are dequantized, GML uint8 outputs are mapped
    back with the op's output qparams (``(scale, zero_point)``); non-tensors give ``None``."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_quantized:
        return value.dequantize()
    if value.dtype in (torch.uint8, torch.int8) and qparams is not None:
        return (value.to(torch.float32) - qparams[1]) * qparams[0]
    return value.float() if value.is_floating_point() else None


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """``10·log10(signal/noise)``; ``inf`` when there is no noise, ``-inf`` for a zero signal."""
    if noise_power == 0:
        return math.inf
    return 10 * math.log10(signal_power / noise_power) if signal_power > 0 else -math.inf


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [x.dequantize() if x.is_quantized else x for x in leaves if isinstance(x, torch.Tensor)]


def _is_quantize(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch.quantize_per_tensor, torch.quantize_per_channel)


def _match_key(node: fx.Node) -> str:
    """The fp32 node name an INT8 node stands for: its own name, or what a lowering recorded."""
    if "gml_source" in node.meta:
        return str(node.meta["gml_source"])
    covered = getattr(node.meta.get("gml_coverage"), "nodes", None)  # LowerToGML's CoverageEntry
    return str(covered[-1]) if covered else node.name


class _Recorder(MutableArgsInterpreter):
    """Runs a graph and keeps the fp32 value of selected nodes (by match key)."""

    def __init__(self, gm: fx.GraphModule, keys: set[str] | None, *, after_quantize: bool) -> None:
        super().__init__(gm)
        self.keys = keys
        self.after_quantize = after_quantize
        self.values: dict[str, torch.Tensor] = {}
        self.modules = dict(gm.named_modules(remove_duplicate=False))

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op in ("placeholder", "output", "get_attr"):
            return result
        if self.after_quantize and _is_quantize(n) and isinstance(n.args[0], fx.Node):
            key = _match_key(n.args[0])  # the INT8 value of the op the quantize reads
        else:
            key = _match_key(n)
            if key in self.values:  # already holds the post-quantize value
                return result
        if self.keys is None or key in self.keys:
            value = _to_float(result, output_qparams_args(n))
            if value is not None:
                self.values[key] = value.detach()
        return result


def _compute_nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    out = {}
    for n in gm.graph.nodes:
        if n.op in ("call_module", "call_function", "call_method") and not _is_quantize(n):
            if n.op == "call_method" and n.target == "dequantize":
                continue
            out[_match_key(n)] = n
    return out


def _arity(model: nn.Module) -> int | None:
    if isinstance(model, fx.GraphModule):
        return sum(1 for n in model.graph.nodes if n.op == "placeholder")
    return None


def _as_args(batch: Any) -> tuple[Any, ...]:
    return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)


# ---------------------------------------------------------------- main entry
def accuracy_report(
    fp32_model: nn.Module,
    int8_model: nn.Module,
    inputs: Iterable[Any],
    *,
    labels: Sequence[torch.Tensor] | None = None,
    fp32_graph: fx.GraphModule | None = None,
    per_layer: bool = True,
    exact_model: nn.Module | None = None,
) -> AccuracyReport:
    """Compare ``int8_model`` with ``fp32_model`` on held-out ``inputs``.

    Args:
        fp32_model: the original model (eager or GraphModule); gives the reference outputs.
        int8_model: reference Q/DQ graph or lowered INT8 GraphModule.
        inputs: batches (tensors or tuples of tensors), *not* the calibration data.
        labels: one label tensor per batch, for top-1 accuracy of both models.
        fp32_graph: the fp32 graph whose node names match ``int8_model`` (the frontend's float
            twin); defaults to ``fp32_model`` if that is a GraphModule. Needed for per-layer SQNR.
        per_layer: compute per-layer SQNR (runs both graphs node by node: slower).
        exact_model: exact integer arithmetic with ``int8_model``'s qparams (the reference Q/DQ
            graph it was lowered from: dequantized values, exact products); its cosine and top-1
            agreement with fp32 are reported, and a result far from them is BROKEN
            (:attr:`AccuracyReport.far_from_exact`).
    """
    fp32_graph = (
        fp32_graph if fp32_graph is not None else fp32_model if isinstance(fp32_model, fx.GraphModule) else None
    )
    layer_graphs = per_layer and fp32_graph is not None and isinstance(int8_model, fx.GraphModule)
    int8_nodes = _compute_nodes(int8_model) if layer_graphs else {}  # type: ignore[arg-type]
    fp32_nodes = _compute_nodes(fp32_graph) if layer_graphs else {}  # type: ignore[arg-type]
    keys = set(int8_nodes) & set(fp32_nodes)
    sig = dict.fromkeys(keys, 0.0)
    noise = dict.fromkeys(keys, 0.0)
    worst = dict.fromkeys(keys, 0.0)
    compared = dict.fromkeys(keys, 0)  # batches in which both values existed with one shape

    dot = na = nb = 0.0
    e_dot = e_n = e_nr = 0.0  # the exact model's dot with fp32, its squared norm, fp32's
    e_agree = 0
    max_diff = max_r = max_q = 0.0
    bad_r = bad_q = 0
    samples = agree = 0
    correct_fp32 = correct_int8 = 0
    top5_fp32 = top5_int8 = 0
    classified = 0
    labels_list = list(labels) if labels is not None else None
    arity = _arity(int8_model)
    labelled = 0  # samples whose top-1 accuracy was counted
    batches = 0
    with torch.no_grad():
        for i, batch in enumerate(inputs):
            args = _as_args(batch)
            y = labels_list[i] if labels_list is not None and i < len(labels_list) else None
            if arity is not None and len(args) > arity:
                # (inputs, labels) pairs, as a DataLoader yields them: the extra item is the label
                extra = args[arity]
                if y is None and isinstance(extra, torch.Tensor) and not extra.is_floating_point():
                    y = extra
                args = args[:arity]
            try:
                ref_out = _flat_outputs(fp32_model(*args))
            except Exception as exc:
                raise batch_misfit("evaluation", i, args, exc, "tensors or (inputs, labels) pairs") from None
            if layer_graphs:
                rec_q = _Recorder(int8_model, keys, after_quantize=True)  # type: ignore[arg-type]
                q_out = _flat_outputs(rec_q.run(*args))
                rec_f = _Recorder(fp32_graph, keys, after_quantize=False)  # type: ignore[arg-type]
                rec_f.run(*args)
                for k in keys:
                    a, b = rec_f.values.get(k), rec_q.values.get(k)
                    if a is None or b is None or a.shape != b.shape:
                        continue
                    d = a - b
                    compared[k] += 1
                    sig[k] += float((a.double() ** 2).sum())
                    noise[k] += float((d.double() ** 2).sum())
                    worst[k] = max(worst[k], float(d.abs().max()) if d.numel() else 0.0)
                # every recorded value of both graphs: freed now, not while the next batch records (#28)
                del rec_q, rec_f
            else:
                q_out = _flat_outputs(int8_model(*args))
            e_out = _flat_outputs(exact_model(*args)) if exact_model is not None else None
            if len(ref_out) != len(q_out):
                raise InputError(
                    f"batch {i}: the INT8 model returns {len(q_out)} outputs, the fp32 model {len(ref_out)}.",
                    hint="compare a model with the INT8 graph made from it.",
                )
            for r, q in zip(ref_out, q_out):
                r64, q64 = r.double().flatten(), q.double().flatten()
                fin_r, fin_q = torch.isfinite(r64), torch.isfinite(q64)
                bad_r += int((~fin_r).sum())
                bad_q += int((~fin_q).sum())
                if not (fin_r.all() and fin_q.all()):
                    if not torch.equal(fin_r, fin_q) or not torch.equal(r64[~fin_r], q64[~fin_q]):
                        # NaN/Inf in one model where the other has a number (or another NaN/Inf)
                        dot, max_diff = math.nan, math.inf
                    both = fin_r & fin_q  # the rest is compared as usual
                    r64, q64 = r64[both], q64[both]
                dot += float(r64 @ q64)
                na += float(r64 @ r64)
                nb += float(q64 @ q64)
                if r64.numel():
                    max_diff = max(max_diff, float((r64 - q64).abs().max()))
                    max_r = max(max_r, float(r64.abs().max()))
                    max_q = max(max_q, float(q64.abs().max()))
            if e_out is not None and len(e_out) == len(ref_out):
                for r, e in zip(ref_out, e_out):
                    r64, e64 = r.double().flatten(), e.double().flatten()
                    fin = torch.isfinite(r64) & torch.isfinite(e64)
                    e_dot += float(r64[fin] @ e64[fin])
                    e_n += float(e64[fin] @ e64[fin])
                    e_nr += float(r64[fin] @ r64[fin])
            first_r, first_q = ref_out[0], q_out[0]
            n = int(first_r.shape[0]) if first_r.dim() else 1
            samples += n
            if first_r.dim() == 2 and first_r.shape[1] > 1:
                pr, pq = first_r.argmax(1), first_q.argmax(1)
                agree += int((pr == pq).sum())
                if e_out is not None:
                    e_agree += int((pr == e_out[0].argmax(1)).sum())
                classified += n
                if y is not None:
                    labelled += n
                    correct_fp32 += int((pr == y).sum())
                    correct_int8 += int((pq == y).sum())
                    if first_r.shape[1] >= 5:
                        top5_fp32 += int((first_r.topk(5, dim=1).indices == y[:, None]).any(1).sum())
                        top5_int8 += int((first_q.topk(5, dim=1).indices == y[:, None]).any(1).sum())
            batches += 1
    if batches == 0:
        raise InputError("no inputs to compare on.", hint="pass at least one held-out batch.")
    classes_5 = labelled and ref_out[0].shape[1] >= 5
    cosine = dot / math.sqrt(na * nb) if na > 0 and nb > 0 and not math.isnan(dot) else float("nan")
    exact_cosine = None
    if exact_model is not None:
        exact_cosine = e_dot / math.sqrt(e_nr * e_n) if e_nr > 0 and e_n > 0 else float("nan")
    layers = []
    if layer_graphs:
        modules = dict(int8_model.named_modules(remove_duplicate=False))
        for key, node in int8_nodes.items():  # graph order
            if key not in keys or not compared[key]:
                continue
            layers.append(LayerError(key, node_label(node, modules), sqnr_db(sig[key], noise[key]), worst[key]))
    unmatched = [k for k in int8_nodes if k not in keys or not compared[k]]
    return AccuracyReport(
        samples=samples,
        cosine=cosine,
        max_abs_diff=max_diff,
        top1_agreement=agree / classified if classified else None,
        fp32_top1=correct_fp32 / labelled if labelled else None,
        int8_top1=correct_int8 / labelled if labelled else None,
        fp32_top5=top5_fp32 / labelled if labelled and classes_5 else None,
        int8_top5=top5_int8 / labelled if labelled and classes_5 else None,
        layers=layers,
        unmatched=unmatched,
        fp32_max_abs=max_r,
        int8_max_abs=max_q,
        fp32_nonfinite=bad_r,
        int8_nonfinite=bad_q,
        exact_cosine=exact_cosine,
        exact_top1_agreement=e_agree / classified if classified and exact_model is not None else None,
        classified=classified,
    )


def top1_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y`` (argmax over dim 1)."""
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            out = _flat_outputs(model(x[i : i + batch_size]))[0]
            correct += int((out.argmax(1) == y[i : i + batch_size]).sum())
    return correct / len(x)


__all__ = [
    "BROKEN_COSINE",
    "EXACT_FACTOR",
    "AccuracyReport",
    "LayerError",
    "accuracy_report",
    "sqnr_db",
    "top1_accuracy",
]
