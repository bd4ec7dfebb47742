"""The transformer INT8 scheme: INT8 GEMMs with per-token dynamic activation scales, the rest fp32.

Why not the static scheme ``gml quantize`` uses for CNNs: a transformer's residual stream carries
a few channels with values hundreds of times larger than the rest, and one static per-tensor scale
for them (the residual add that feeds LayerNorm) wipes out the small channels (#15: cosine 0.881 on
all-MiniLM-L6-v2). Here

* every ``nn.Linear`` (Q/K/V — merged —, attention output, MLP) becomes :class:`DynamicQuantLinear`:
  weights int8, symmetric, one scale per output channel; activations int8, symmetric, one scale
  **per token** (row), computed from that row at run time; ``int8 x int8 -> int32`` GEMM
  (exact: ``gml.kernels.dynamic_int8``), then ``acc * s_x[row] * s_w[col] + bias`` in fp32;
* the residual stream, LayerNorm, softmax, GELU and attention (``gml.attention``: q·kᵀ and p·v in
  fp32 inside the fused SDPA) stay fp32.

Accuracy-driven fallback: on calibration batches the pass measures each GEMM's own SQNR (its INT8
output against its fp32 output, on the inputs the fp32 model feeds it); a GEMM below
``min_sqnr_db`` stays fp32 and the precision table says so with the number. With ``smooth_alpha``
(SmoothQuant) each GEMM may instead migrate activation outliers into the weights:
``s_i = max|x_i|^α / max_o|W[o, i]|^(1-α)`` per input channel, ``x' = x / s``, ``W' = W · diag(s)``
(``x' W'ᵀ = x Wᵀ`` exactly in real numbers); it is kept for a GEMM only where it raises that GEMM's
measured SQNR. A channel that calibration never saw non-zero keeps ``s_i = 1``.

Math of one output: ``y[t, o] = sum_i x[t, i] W[o, i] + b[o]
≈ s_x[t] s_w[o] sum_i q_x[t, i] q_w[o, i] + b[o]``, ``q_x = round(x / s_x)``, ``s_x[t] = max_i |x[t, i]| / 127``,
``q_w = round(W / s_w)``, ``s_w[o] = max_i |W[o, i]| / 127``. A token's rounding error is relative
to that token's own largest value, never to the whole batch's.

:func:`quantize_transformer` runs capture → Normalize → untie → fold BN → FuseAttention →
HorizontalMerge → the conv fusions of ``gml.optimize`` (:func:`fp32_conv_passes`) →
:class:`QuantizeLinearsDynamic` under the PassManager and reports every GEMM with
the precision it got and why.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gml.ir.library import gml_op_name, op, op_args
from gml.kernels import dynamic_int8
from gml.memory import release, returns_memory, shared_copy
from gml.passes.base import GraphPass, PassResult, Skip
from gml.passes.utils import modules_of

#: Default of ``min_sqnr_db``: a GEMM whose INT8 output is below this SQNR on the calibration data
#: stays fp32. Per-token INT8 GEMMs of real all-MiniLM-L6-v2 measure 29-43 dB; a GEMM fed by an
#: outlier channel (one input channel ~200x the rest in every token, small weights) falls to ~1 dB.
DEFAULT_MIN_SQNR_DB = 20.0
#: ``node.meta`` key: the :class:`GemmPrecision` :class:`QuantizeLinearsDynamic` decided for a GEMM
PRECISION = "gml_precision"


class DynamicQuantLinear(nn.Module):
    """``nn.Linear`` with int8 per-channel weights and per-token dynamic int8 activations: the
    constants of one ``gml::dynamic_linear`` call, run by its kernel (:mod:`gml.kernels.dynamic_int8`
    holds the math). Calibration uses it to measure a GEMM's INT8 error; the quantized graph holds
    the op call itself, not this module.

    ``smooth`` (one positive factor per input channel, SmoothQuant) is folded into the weights
    before they are quantized and divided out of the activations at run time.
    """

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor | None = None, weight_qmax: int = 127) -> None:
        super().__init__()
        q, scale = dynamic_int8.quantize_weight(linear.weight, smooth, weight_qmax)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)  # int8 [out, in], contiguous
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.register_buffer("smooth_inv", None if smooth is None else (1.0 / smooth).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dynamic_int8.dynamic_linear(x, self.weight, self.weight_scale, self.bias, self.smooth_inv)

    def extra_repr(self) -> str:
        smooth = ", SmoothQuant" if self.smooth_inv is not None else ""
        return f"{self.in_features}->{self.out_features}, int8 weights per channel, int8 activations per token{smooth}"


def is_dynamic_linear(node: fx.Node) -> bool:
    """Whether ``node`` calls ``torch.ops.gml.dynamic_linear``."""
    return gml_op_name(node) == "dynamic_linear"


def _register_constants(gm: fx.GraphModule, prefix: str, q: DynamicQuantLinear) -> list[str | None]:
    """``q``'s tensors as buffers of ``gm`` (fresh names); ``None`` for an absent bias / smooth_inv."""
    from gml.quant.lower import _constant_node

    names: list[str | None] = []
    for name in ("weight", "weight_scale", "bias", "smooth_inv"):
        t = getattr(q, name)
        if t is None:
            names.append(None)
            continue
        node = _constant_node(gm, f"{prefix}_{name}", t)  # registers the buffer
        names.append(str(node.target))
        gm.graph.erase_node(node)  # each call site reads it with its own get_attr
    return names


def _emit_dynamic_linear(gm: fx.GraphModule, node: fx.Node, constants: list[str | None]) -> fx.Node:
    """Replace the ``nn.Linear`` call ``node`` by ``gml.dynamic_linear(x, <constants>, "none", [], "")``."""
    with gm.graph.inserting_before(node):
        args = [None if c is None else gm.graph.get_attr(c) for c in constants]
        new = gm.graph.call_function(op("dynamic_linear"), (node.args[0], *args, "none", [], ""))
    new.meta.update({k: v for k, v in node.meta.items() if k in ("tensor_meta", "stack_trace", "val", PRECISION)})
    node.replace_all_uses_with(new)
    name = node.name
    gm.graph.erase_node(node)
    new.name = name  # the precision table and the per-layer accuracy report pair nodes by name
    return new


def smooth_factors(x_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``s = max|x|^α / max|W|^(1-α)`` (1 where x was never seen)."""
    x = x_absmax.float().clamp_min(1e-5)
    w = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    s = (x.pow(alpha) / w.pow(1.0 - alpha)).clamp_min(1e-5)
    return torch.where(x_absmax > 0, s, torch.ones_like(s))


def _sqnr_db(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


@dataclass
class _GemmStats:
    """What calibration measured of one ``nn.Linear`` (local to one pass call)."""

    signal: float = 0.0
    noise: float = 0.0
    noise_smooth: float = 0.0
    x_absmax: torch.Tensor | None = None

    def sqnr(self, smooth: bool = False) -> float:
        return _sqnr_db(self.signal, self.noise_smooth if smooth else self.noise)


def _run_batches(gm: fx.GraphModule, batches: Sequence[tuple], hooks: dict[str, Any]) -> None:
    handles = [gm.get_submodule(t).register_forward_hook(h) for t, h in hooks.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                gm(*batch)
    finally:
        for h in handles:
            h.remove()


def _measure(
    gm: fx.GraphModule, targets: list[str], batches: Sequence[tuple], alpha: float | None, weight_qmax: int = 127
) -> dict[str, _GemmStats]:
    """Each GEMM's INT8 error on the calibration batches (and, with ``alpha``, with SmoothQuant)."""
    stats = {t: _GemmStats() for t in targets}
    plain = {t: DynamicQuantLinear(gm.get_submodule(t), weight_qmax=weight_qmax) for t in targets}

    def first_pass(target: str):
        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            st, x = stats[target], args[0]
            ref = out.double()
            st.signal += float(ref.pow(2).sum())
            st.noise += float((ref - plain[target](x).double()).pow(2).sum())
            amax = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0)
            st.x_absmax = amax if st.x_absmax is None else torch.maximum(st.x_absmax, amax)

        return hook

    _run_batches(gm, batches, {t: first_pass(t) for t in targets})
    if alpha is None:
        return stats
    smoothed = {
        t: DynamicQuantLinear(
            gm.get_submodule(t), smooth_factors(st.x_absmax, gm.get_submodule(t).weight, alpha), weight_qmax
        )
        for t, st in stats.items()
        if st.x_absmax is not None
    }

    def second_pass(target: str):
        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            got = smoothed[target](args[0]).double()
            stats[target].noise_smooth += float((out.double() - got).pow(2).sum())

        return hook

    _run_batches(gm, batches, {t: second_pass(t) for t in smoothed})
    return stats


@dataclass
class GemmPrecision:
    """One row of the precision table: an op, the precision it runs in, and why."""

    node: str
    op: str
    precision: str
    why: str


def _op(lin: nn.Linear) -> str:
    return f"linear {lin.in_features}->{lin.out_features}"


def check_smooth_alpha(smooth_alpha: float | None) -> None:
    """SmoothQuant's migration strength must lie in (0, 1) (:class:`~gml.errors.InputError` otherwise)."""
    from gml.errors import InputError

    if smooth_alpha is not None and not 0.0 < smooth_alpha < 1.0:
        raise InputError(f"smooth_alpha={smooth_alpha:g} is outside (0, 1).", hint="SmoothQuant uses 0.5 (0.3-0.8).")


class QuantizeLinearsDynamic(GraphPass):
    """Lower each ``nn.Linear`` to ``gml.dynamic_linear`` (INT8 GEMM, per-token activation scales).

    Before → after: ``%y = linear(%x)`` → ``%y = gml.dynamic_linear(%x, %w_s8, %w_scale, %bias,
    %smooth_inv?, "none", [], "")`` with the int8 weights and scales as ``get_attr`` constants (the
    lowered graph is data: the Python executor, the native engine and ``torch.export`` read it); the
    math is in the module docstring and :mod:`gml.kernels.dynamic_int8`. Changes numerics on
    purpose (tolerance ``None``: shapes and finiteness are checked).

    Options: ``calib_data`` (batches of the graph's inputs) turns on the accuracy-driven fallback:
    a GEMM whose measured SQNR is below ``min_sqnr_db`` stays ``nn.Linear`` (fp32); ``smooth_alpha``
    lets each GEMM use SmoothQuant where that raises its SQNR. Each GEMM's decision, with the
    numbers, is in ``node.meta[PRECISION]`` (:func:`precisions` reads it).

    ``weight_qmax``: the int8 weights' range ``[-weight_qmax, weight_qmax]``: the target's
    ``Target.dynamic_weight_qmax`` (127 with VNNI / AMX, 64 without: ADR 011).

    Skipped, with the reason: non-fp32 weights; inputs that are not floating point; SQNR below
    ``min_sqnr_db``.
    """

    name = "quantize_linears_dynamic"
    tolerance = None

    def __init__(
        self,
        calib_data: Sequence[tuple] = (),
        *,
        min_sqnr_db: float | None = DEFAULT_MIN_SQNR_DB,
        smooth_alpha: float | None = None,
        weight_qmax: int = 127,
    ) -> None:
        check_smooth_alpha(smooth_alpha)
        self.calib_data = [tuple(b) for b in calib_data]
        self.min_sqnr_db = min_sqnr_db
        self.smooth_alpha = smooth_alpha
        self.weight_qmax = weight_qmax

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        candidates: list[fx.Node] = []
        for node in gm.graph.nodes:
            if node.op != "call_module" or type(modules.get(str(node.target))) is not nn.Linear:
                continue
            lin = modules[str(node.target)]
            why = None
            if lin.weight.dtype != torch.float32:
                why = f"{lin.weight.dtype} weights, not fp32"
            meta = node.args[0].meta.get("tensor_meta") if isinstance(node.args[0], fx.Node) else None
            if meta is not None and hasattr(meta, "dtype") and not meta.dtype.is_floating_point:
                why = f"{meta.dtype} input"
            if why is not None:
                skips.append(Skip(node.name, why, "linear → int8"))
                node.meta[PRECISION] = GemmPrecision(node.name, _op(lin), "fp32", f"declined: {why}")
                continue
            candidates.append(node)
        targets = sorted({str(n.target) for n in candidates})
        stats = (
            _measure(gm, targets, self.calib_data, self.smooth_alpha, self.weight_qmax)
            if self.calib_data and targets
            else {}
        )
        from gml.kernels.int8_ops import register

        register()  # the graph will call torch.ops.gml.dynamic_linear: its schema and Python kernel
        done = smoothed = fallback = 0
        constants: dict[str, list[str | None]] = {}  # per nn.Linear: the buffers its op calls read
        for node in candidates:
            target = str(node.target)
            lin = modules[target]
            st = stats.get(target)
            why = "weights per channel, activations per token"
            smooth = None
            if st is None or st.x_absmax is None:
                why += "; SQNR not measured (no calibration data)"
            else:
                sq = st.sqnr()
                use_smooth = self.smooth_alpha is not None and st.sqnr(smooth=True) > sq
                best = st.sqnr(smooth=True) if use_smooth else sq
                if self.min_sqnr_db is not None and best < self.min_sqnr_db:
                    reason = f"accuracy fallback: INT8 SQNR {best:.1f} dB < {self.min_sqnr_db:g} dB on calibration data"
                    skips.append(Skip(node.name, reason, "linear → int8"))
                    node.meta[PRECISION] = GemmPrecision(node.name, _op(lin), "fp32", reason)
                    fallback += 1
                    continue
                why += f"; SQNR {best:.1f} dB on calibration data"
                if use_smooth:
                    assert self.smooth_alpha is not None
                    smooth = smooth_factors(st.x_absmax, lin.weight, self.smooth_alpha)
                    why += f" with SmoothQuant α={self.smooth_alpha:g} ({sq:.1f} dB without)"
                    smoothed += 1
            node.meta[PRECISION] = GemmPrecision(node.name, _op(lin), "int8", why)
            if target not in constants:
                with gm.graph.inserting_before(node):
                    q = DynamicQuantLinear(lin, smooth, self.weight_qmax)
                    constants[target] = _register_constants(gm, target, q)
            _emit_dynamic_linear(gm, node, constants[target])
            done += 1
        if done:
            gm.delete_all_unused_submodules()
            gm.recompile()
        notes = [f"{done} linear(s) now INT8 GEMMs with per-token scales"]
        if stats:
            notes.append(f"SQNR measured on {len(self.calib_data)} calibration batch(es)")
        if smoothed:
            notes.append(f"{smoothed} with SmoothQuant (α={self.smooth_alpha:g})")
        if fallback:
            notes.append(f"{fallback} kept fp32 (SQNR below {self.min_sqnr_db:g} dB)")
        return PassResult(gm, done > 0, done, skips, notes)


def _activation(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[str, str] | None:
    """``(post_op, algorithm)`` when ``node`` is a ReLU or GELU of its first argument alone, else None."""
    from gml.passes.oplib import op_kind

    kind = op_kind(node, modules)
    if kind == "relu":
        return "relu", ""
    if kind != "gelu":
        return None
    if node.op == "call_module":
        approximate = getattr(modules[str(node.target)], "approximate", "none")
    else:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return ("gelu", "tanh" if approximate == "tanh" else "none") if approximate in ("none", "tanh") else None


class FuseDynamicLinearActivation(GraphPass):
    """Fuse a ReLU / GELU that alone reads a ``gml.dynamic_linear`` into the op's post-op.

    Before → after: ``%y = gml.dynamic_linear(%x, ..., "none", [], ""); %z = gelu(%y)`` →
    ``%z = gml.dynamic_linear(%x, ..., "gelu", [], "none")`` (``"tanh"`` for ``approximate="tanh"``).
    The same fp32 function of the same fp32 GEMM output (the Python kernel applies ``F.gelu`` /
    ``relu`` to it; the engine uses oneDNN's eltwise post-op, equal within float rounding).

    Skipped, with the reason: the GEMM output has other readers (it must stay a value).
    """

    name = "fuse_dynamic_linear_activation"

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        done = 0
        for node in list(gm.graph.nodes):
            if not is_dynamic_linear(node) or op_args(node)["post_op"] != "none":
                continue
            acts = [(u, _activation(u, modules)) for u in node.users]
            acts = [(u, a) for u, a in acts if a is not None and u.args and u.args[0] is node]
            if not acts:
                continue
            if len(node.users) != 1:
                skips.append(Skip(node.name, "its output is also read by another node", "dynamic_linear → act"))
                continue
            act, (post_op, algorithm) = acts[0]
            node.args = (*node.args[:5], post_op, [], algorithm)
            node.meta["tensor_meta"] = act.meta.get("tensor_meta", node.meta.get("tensor_meta"))
            act.replace_all_uses_with(node)
            gm.graph.erase_node(act)
            done += 1
        if done:
            gm.delete_all_unused_submodules()
            gm.recompile()
        return PassResult(gm, done > 0, done, skips, [f"{done} activation(s) fused into INT8 GEMMs"] if done else [])


#: node.meta key: the attention runs on bf16 q / k / v (AttentionInBf16)
ATTENTION_BF16 = "gml_attention_bf16"


class AttentionInBf16(GraphPass):
    """The transformer scheme's mixed mode (``fallback_precision="bf16"``): attention on bf16 q / k / v.

    Before → after (``to_bf16`` / ``to_fp32``: :mod:`gml.kernels.bf16`'s casts)::

        %o = gml.attention(%q, %k, %v, %mask, ...)          (fp32: the GEMMs' fp32 outputs)
        →  %o16 = gml.attention(to_bf16(%q), to_bf16(%k), to_bf16(%v), %mask', ...); %o = to_fp32(%o16)

    ``%mask'``: a float mask in bf16 too (attention takes a mask of its q's dtype; a bool one stays).
    The math inside is unchanged: fp32 accumulators, fp32 softmax statistics; the operands and the
    probabilities are rounded to bf16 (2^-8 relative), the output once more. On the engine this is
    the fused bf16 attention step (native/attention.h, ADR 009) — on MiniLM it replaces the fp32
    primitives that took a quarter of the INT8 model's time. The GEMMs stay INT8, the residual stream,
    LayerNorm and outputs fp32. Like the INT8 GEMM pass it changes numerics on purpose (tolerance
    ``None``: shapes and finiteness are checked); the scheme's accuracy report measures the result
    against fp32 (a bf16 tolerance per output fails on small outputs such as BERT's pooler, whose
    error the INT8 GEMMs before it dominate anyway).

    Skipped, with the reason: attention whose q / k / v are not fp32.
    """

    name = "attention_bf16"
    tolerance = None

    def call(self, gm: fx.GraphModule) -> PassResult:
        from gml.ir.attention import is_attention
        from gml.kernels import bf16 as kb

        skips: list[Skip] = []
        done = 0
        for node in list(gm.graph.nodes):
            if not is_attention(node):
                continue
            metas = [a.meta.get("tensor_meta") for a in node.args[:3] if isinstance(a, fx.Node)]
            if len(metas) != 3 or any(m is None or m.dtype != torch.float32 for m in metas):
                skips.append(Skip(node.name, "q / k / v are not fp32 (or their dtype is unknown)", "attention"))
                continue
            mask = node.args[3] if len(node.args) > 3 else None
            mask_meta = mask.meta.get("tensor_meta") if isinstance(mask, fx.Node) else None
            with gm.graph.inserting_before(node):
                casts = [gm.graph.call_function(kb.to_bf16, (a,)) for a in node.args[:3]]
                if mask_meta is not None and mask_meta.dtype.is_floating_point:
                    mask = gm.graph.call_function(kb.to_bf16, (mask,))
            node.args = (*casts, mask, *node.args[4:])
            readers = list(node.users)
            with gm.graph.inserting_after(node):
                out = gm.graph.call_function(kb.to_fp32, (node,))
            for r in readers:
                r.replace_input_with(node, out)
            out.meta = dict(node.meta)
            node.meta[ATTENTION_BF16] = True
            done += 1
        note = f"{done} attention(s) on bf16 q / k / v (fp32 accumulators and softmax inside)"
        return PassResult.rewrote(gm, done, skips, note)


@dataclass
class TransformerQuantResult:
    """The INT8 transformer, the per-pass report, and every GEMM/LayerNorm/softmax/attention with its precision.

    ``fp32_module``: the graph right before the GEMMs were quantized (same node names: the per-layer
    accuracy report pairs nodes by name; ``gml.quantize`` drops it before returning unless
    ``keep_intermediates=True``); ``calibration``: what the SQNR was measured on.
    """

    module: fx.GraphModule | None  # None once the whole-model guard returned the fp32 model instead
    report: Any
    precisions: list[GemmPrecision] = field(default_factory=list)
    fp32_module: fx.GraphModule | None = None
    calibration: str = ""
    #: the example inputs the graph was captured with (saving exports the graph on them)
    example_inputs: tuple = ()

    def table(self):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title="Precision of each GEMM, attention, LayerNorm, softmax (and opaque block)")
        for col in ("node", "op", "precision", "why"):
            t.add_column(col)
        for p in self.precisions:
            t.add_row(p.node, p.op, p.precision, p.why)
        return t

    def summary(self) -> str:
        n8 = sum(p.precision == "int8" for p in self.precisions)
        gemms = sum(p.op.startswith("linear") for p in self.precisions)
        kept = [p for p in self.precisions if p.op.startswith("linear") and p.precision != "int8"]
        text = f"transformer scheme: {n8}/{gemms} GEMMs INT8 (per-token dynamic activations)"
        if kept:
            text += f", {len(kept)} kept fp32 ({kept[0].node}: {kept[0].why}{' ...' if len(kept) > 1 else ''})"
        return text + (f"; SQNR measured on {self.calibration}" if self.calibration else "")


def _linears_inside(mod: nn.Module) -> int:
    return sum(1 for m in mod.modules() if isinstance(m, nn.Linear))


def _attr(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value


def fp32_conv_passes() -> list[GraphPass]:
    """What stays fp32 around the INT8 GEMMs gets ``gml.optimize``'s conv fusions (run on the fp32
    graph, before the GEMMs are quantized, so each is checked fp32 against fp32): a conv (with the
    activation or residual add after it) becomes GML's fused fp32 kernel, which the native engine
    runs. Without them a hybrid model's convs (timm pvt_v2: patch embeddings, the attention's
    spatial reduction, the MLP's depthwise conv) ran as plain ``nn.Conv2d`` in torch, between engine
    segments, and INT8 was 1.10x slower than ``gml.optimize``'s fp32 model (issue #16). Linears are
    left alone: an fp32 GEMM here is one the SQNR fallback kept, and the precision table names it."""
    from gml.passes.fuse_conv import FuseConvActivation, FuseConvAdd
    from gml.passes.leaf_format import LeafMemoryFormat

    return [FuseConvAdd(), FuseConvActivation(), LeafMemoryFormat()]


def precisions(gm: fx.GraphModule) -> list[GemmPrecision]:
    """Every GEMM, attention, LayerNorm, softmax and opaque block of ``gm`` with its precision and why."""
    from gml.ir.attention import is_attention
    from gml.passes.oplib import op_kind

    modules = modules_of(gm)
    rows = []
    for node in gm.graph.nodes:
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        kind = op_kind(node, modules) if node.op.startswith("call") else None
        if is_dynamic_linear(node):
            row = node.meta.get(PRECISION)
            if row is None:
                n, k = _attr(gm, op_args(node)["weight"]).shape
                row = GemmPrecision(node.name, f"linear {k}->{n}", "int8", "weights per channel, activations per token")
            post = op_args(node)["post_op"]
            if post != "none" and "post-op" not in row.why:
                row = GemmPrecision(row.node, row.op, row.precision, f"{row.why}; {post} fused as its post-op")
            rows.append(row)
        elif PRECISION in node.meta and isinstance(mod, DynamicQuantLinear | nn.Linear):
            rows.append(node.meta[PRECISION])
        elif isinstance(mod, DynamicQuantLinear):
            rows.append(GemmPrecision(node.name, _op(mod), "int8", "weights per channel, activations per token"))  # type: ignore[arg-type]
        elif isinstance(mod, nn.Linear):
            rows.append(GemmPrecision(node.name, _op(mod), "fp32", "not quantized (see the pass report)"))
        elif is_attention(node) and node.meta.get(ATTENTION_BF16):
            rows.append(GemmPrecision(node.name, "attention (q·kᵀ, softmax, p·v)", "bf16",
                                      "fallback_precision=bf16: bf16 q/k/v and probabilities, "
                                      "fp32 accumulators and softmax statistics"))  # fmt: skip
        elif is_attention(node):
            rows.append(GemmPrecision(node.name, "attention (q·kᵀ, softmax, p·v)", "fp32",
                                      "fused SDPA; softmax needs fp32 range"))  # fmt: skip
        elif kind in ("layernorm", "softmax", "matmul", "linear"):
            why = {"layernorm": "row statistics need fp32 (and the residual stream it reads is fp32)",
                   "softmax": "exp needs fp32 range", "matmul": "activation x activation GEMM",
                   "linear": "functional linear: its weight is not a constant parameter"}[kind]  # fmt: skip
            rows.append(GemmPrecision(node.name, kind, "fp32", why))
        elif (
            mod is not None
            and kind is None
            and not isinstance(mod, nn.Embedding | nn.EmbeddingBag)  # a table lookup: nothing to quantize
            and any(True for _ in mod.parameters())
        ):
            n = _linears_inside(mod)
            inside = f"; its {n} GEMM(s) stay fp32" if n else ""
            rows.append(GemmPrecision(node.name, f"opaque block ({type(mod).__name__})", "fp32",
                                      f"kept opaque (a leaf): eager PyTorch runs it{inside}"))  # fmt: skip
    return rows


def transformer_reason(
    model: nn.Module, inputs: Sequence[Any] | None = None, *, graph: fx.GraphModule | None = None
) -> str | None:
    """Why ``model`` gets the transformer scheme, or ``None`` (:func:`auto_scheme`'s first item)."""
    return auto_scheme(model, inputs, graph=graph)[0]


#: convolutions holding at least this share of a plain module's multiply-adds make it a CNN for the
#: scheme choice, attention or not (a transformers model with attention keeps the transformer
#: scheme: the audio models' conv front-ends hold most of their multiply-adds, and WavLM's attention
#: reads integer position buckets the static scheme does not take): the transformer scheme quantizes
#: GEMMs only, so its INT8 ran at fp32's
#: speed on timm botnet26t / shvit_s1 / efficientformerv2_s0 (conv shares 0.99-1.00; the static
#: scheme's INT8 took 0.41-0.71x of GML fp32's time there), while the hybrids it pays on have 0.10-0.66
#: (ViT 0.03, LeViT 0.17, MaxViT 0.33, MobileViT 0.66)
CONV_DOMINATED = 0.9


def auto_scheme(
    model: nn.Module, inputs: Sequence[Any] | None = None, *, graph: fx.GraphModule | None = None
) -> tuple[str | None, str | None]:
    """``(why transformer, why static)`` for ``scheme="auto"``, one of them None. The transformer
    scheme: a transformers model (one with convolutions only if its graph holds attention: an HF
    ResNet / MobileNet / ConvNeXt is a CNN), or one holding ``torch.nn`` attention/transformer
    layers, or a graph that calls attention — unless convolutions hold :data:`CONV_DOMINATED` of the
    graph's multiply-adds. A plain
    module (timm's ViTs, a hand-written encoder) is looked at in its captured ``graph`` (given, as
    ``gml.quantize`` captures once; or, given ``inputs``, captured here), normalized to find
    attention the way the fp32 pipeline does: an SDPA call or the hand-written
    matmul → scale → mask → softmax → matmul chain (:class:`gml.passes.attention.FuseAttention`)."""
    from gml.capture_export import OPAQUE_TO_FX

    if isinstance(model, fx.GraphModule):
        return _graph_attention(model), None
    for name, m in model.named_modules():
        if isinstance(m, OPAQUE_TO_FX):
            return f"it holds torch.nn.{type(m).__name__} ('{name or type(model).__name__}')", None
    hf = None  # a transformers model (or a user's module around one, issue #24)
    if any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        hf = f"it is a transformers {type(model).__name__}"
    for name, m in model.named_modules():
        if hf is None and name and any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
                                       for c in type(m).__mro__):  # fmt: skip
            hf = f"it holds a transformers {type(m).__name__} ('{name}')"
    convs = any(isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d) for m in model.modules())
    if hf is not None and (not convs or (graph is None and inputs is None)):
        return hf, None
    # a transformers model with convolutions is a CNN (ResNet, MobileNet, ConvNeXt, PoolFormer: the
    # static scheme quantizes its convs; the transformer scheme left them fp32 and its INT8 was fp32's
    # speed) unless its graph holds attention (Wav2Vec2, Whisper, MobileViT, SegFormer)
    if graph is None and inputs is None:
        return None, None
    import copy

    from gml.errors import GMLError
    from gml.passes.attention import FuseAttention
    from gml.passes.normalize import Normalize
    from gml.quant.frontend import capture_for_ao

    try:  # the graph the static scheme would quantize (torch.export's when fx fails: timm ConViT)
        # (a copy sharing the graph's tensors: the passes replace tensors, never write them)
        gm = shared_copy(graph) if graph is not None else capture_for_ao(copy.deepcopy(model), inputs)
        gm = Normalize().call(gm).graph_module
        gm = FuseAttention().call(gm).graph_module
    except GMLError:  # the static path reports why the model does not capture
        return hf, None
    try:
        found = _graph_attention(gm) or _softmax_between_matmuls(gm)
        if found is None and hf is not None and _attention_modules(model):
            found = f"it holds {_attention_modules(model)} (an attention its graph does not spell out: WavLM's)"
        if found is None:
            return None, (f"{hf} with convolutions and no attention in its graph or modules" if hf else None)
        if hf is not None:  # a transformers model with attention (Wav2Vec2, WavLM, Whisper: conv front-ends)
            return f"{hf}; {found}", None
        share = _conv_share(gm)
        if share >= CONV_DOMINATED:
            why = f"{found}, but convolutions hold {share:.0%} of its multiply-adds"
            return None, f"{why} (the transformer scheme quantizes GEMMs only)"
        return found, None
    finally:  # an fx graph is a reference cycle: emptied now, it pins none of the weights the
        release(gm)  # scheme's passes replace until the next full garbage collection (#28)


def _attention_modules(model: nn.Module) -> str | None:
    """The attention layers of a transformers model by their class names (``WavLMAttention``,
    ``ViTSelfAttention``: every transformers attention class says so), e.g. "4 WavLMAttention"."""
    names = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")]
    return f"{len(names)} {names[0]}" if names else None


def _conv_share(gm: fx.GraphModule) -> float:
    """The convolutions' share of the multiply-adds of ``gm``'s convs and linears (output elements
    times the products each sums, from the capture's shape metadata; nodes without it count 0)."""
    modules = dict(gm.named_modules())
    conv = gemm = 0
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if mod is None or not hasattr(meta, "shape"):
            continue
        if isinstance(mod, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            conv += meta.shape.numel() * mod.weight[0].numel()
        elif isinstance(mod, nn.Linear):
            gemm += meta.shape.numel() * mod.in_features
    return conv / (conv + gemm) if conv + gemm else 0.0


def _softmax_between_matmuls(gm: fx.GraphModule, hops: int = 6) -> str | None:
    """Attention FuseAttention declined (a mask added on a view of the scores, issue #24): a softmax
    whose input comes from a matmul and whose output reaches a matmul, through at most ``hops``
    single-tensor nodes (views, scaling, a mask add, dropout) each way. It is still attention, which
    the static scheme's per-tensor activation ranges handle badly (WHY_SCHEME)."""
    from gml.ir.ops import op_kind

    modules = dict(gm.named_modules())

    def kind(n: fx.Node) -> str | None:
        return op_kind(n, modules) if n.op in ("call_module", "call_function", "call_method") else None

    def reaches(start: fx.Node, step: Any) -> bool:
        frontier = [start]
        for _ in range(hops):
            frontier = [m for n in frontier for m in step(n) if isinstance(m, fx.Node)]
            if any(kind(m) == "matmul" for m in frontier):
                return True
        return False

    n = sum(
        1
        for node in gm.graph.nodes
        if kind(node) == "softmax"
        and reaches(node, lambda x: x.all_input_nodes)
        and reaches(node, lambda x: list(x.users))
    )
    return f"its graph holds {n} hand-written attention block(s) (softmax between two matmuls)" if n else None


def _graph_attention(gm: fx.GraphModule) -> str | None:
    from gml.ir.attention import is_attention
    from gml.passes.attention import SDPA_TARGETS

    n = sum(is_attention(n) or (n.op == "call_function" and n.target in SDPA_TARGETS) for n in gm.graph.nodes)
    return f"its graph holds {n} attention op(s) (gml.attention / scaled_dot_product_attention)" if n else None


#: Why transformers get this scheme rather than the static one (reports quote it).
WHY_SCHEME = (
    "static per-tensor INT8 of the residual stream that feeds LayerNorm loses too much "
    "(#15: all-MiniLM-L6-v2 cosine 0.881); per-token dynamic INT8 GEMMs keep 0.997"
)


def _check_batches(batches: Sequence[tuple], inputs: tuple) -> None:
    """Calibration batches must look like the example inputs (count, dtype, rank): a clear error here,
    not a rolled-back pass."""
    from gml.errors import InputError

    def sig(args: Sequence[Any]) -> list[tuple[str, int] | str]:
        return [(str(a.dtype).removeprefix("torch."), a.dim()) if isinstance(a, torch.Tensor) else type(a).__name__
                for a in args]  # fmt: skip

    if not batches:
        raise InputError("calib_data is empty.", hint="give at least one calibration batch, or a number to generate.")
    want = sig(inputs)
    for i, b in enumerate(batches):
        if sig(b) != want:
            raise InputError(
                f"calibration batch {i} ({sig(b)}) does not look like the example inputs ({want}).",
                hint="give batches of the model's forward() arguments, e.g. (input_ids, attention_mask).",
            )


@returns_memory  # its garbage (replaced weights, timing graphs) handed back before the next stage (#28)
def quantize_transformer(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    calib_data: Any = None,
    min_sqnr_db: float | None = DEFAULT_MIN_SQNR_DB,
    smooth_alpha: float | None = None,
    leaf_modules: Sequence[str | type] = (),
    strict: bool = False,
    token_range: tuple[int, int] | None = None,
    attention_bf16: bool = False,
    weight_qmax: int = 127,
    graph: fx.GraphModule | None = None,
) -> TransformerQuantResult:
    """Quantize a transformer with the scheme of this module; ``model`` is not modified.

    ``graph``: ``model`` already captured (:func:`gml.capture`, on a copy), rewritten in place
    (``gml.quantize`` captures once); default: captured here.

    ``attention_bf16``: attention on bf16 q / k / v (:class:`AttentionInBf16`; the mixed mode of
    ``gml.quantize(..., fallback_precision="bf16")``; the caller checks the CPU has native bf16).
    ``weight_qmax``: the target's int8 weight range (``Target.dynamic_weight_qmax``; :class:`QuantizeLinearsDynamic`).

    ``calib_data``: batches the per-GEMM SQNR is measured on (the fallback and SmoothQuant need
    them); an int N generates N batches like ``example_inputs`` (token ids drawn from
    ``token_range``, the vocabulary); ``None``: 4 generated batches. ``min_sqnr_db=None`` turns the
    fallback off.
    """
    from gml.capture import capture, check_eval_mode
    from gml.passes.attention import FuseAttention
    from gml.passes.horizontal_merge import HorizontalMerge
    from gml.passes.manager import PassManager
    from gml.passes.pipeline import canonical_passes
    from gml.quant.calibrate import _as_args, describe_generated, generate_batches

    inputs = tuple(example_inputs)
    check_eval_mode(model, what="INT8 quantization")
    if token_range is None:
        from gml.models_hf import token_range as vocab

        token_range = vocab(model)
    if calib_data is None:
        calib_data = 4
    if isinstance(calib_data, int) and not isinstance(calib_data, bool):
        batches = generate_batches(inputs, calib_data, seed=7, token_range=token_range)
        source = f"{calib_data} {describe_generated(inputs, token_range)}"
    else:
        batches = [_as_args(b, len(inputs)) for b in calib_data]
        source = f"{len(batches)} user batch(es)"
    _check_batches(batches, inputs)
    quantize_pass = QuantizeLinearsDynamic(
        batches, min_sqnr_db=min_sqnr_db, smooth_alpha=smooth_alpha, weight_qmax=weight_qmax
    )  # checks options
    gm = graph if graph is not None else capture(copy.deepcopy(model), inputs, leaf_modules=leaf_modules)
    fp32_passes = [*canonical_passes(), FuseAttention(), HorizontalMerge(), *fp32_conv_passes()]
    fp32 = PassManager(fp32_passes, strict=strict).run(gm, [inputs])
    fp32_gm = shared_copy(fp32.graph_module)  # the INT8 passes replace the weights they quantize
    int8_passes: list[GraphPass] = [quantize_pass, FuseDynamicLinearActivation()]
    if attention_bf16:
        int8_passes.append(AttentionInBf16())
    q = PassManager(int8_passes, strict=strict).run(fp32.graph_module, [inputs])
    for r in q.report.rolled_back:  # never hand back an fp32 model labelled INT8 without saying so
        from gml.errors import GMLError

        raise GMLError(
            f"The transformer INT8 pass failed on this model: {r.error}",
            hint="run with --debug and report it; gml optimize (fp32) still serves the model.",
        )
    report = fp32.report
    report.records.extend(q.report.records)
    return TransformerQuantResult(q.graph_module, report, precisions(q.graph_module), fp32_gm, source, inputs)
