"""Lower an fp32-fused graph to bf16: bf16 weights and activations, fp32 where accuracy needs it.

:class:`LowerToBf16` runs after the fp32 pipeline (fold BN, fuse), on the fused kernel modules
of :mod:`gml.kernels.fp32`. Before → after::

    y = FusedConv[relu](x)                  y = Bf16Conv[relu](x)          # x: fp32 → bf16 once
    z = FusedConvAdd(y, skip)         →     z = Bf16ConvAdd(y, skip)       # bf16 in, bf16 out
    p = AdaptiveAvgPool2d(z)                p = AdaptiveAvgPool2d(to_fp32(z))   # a reduction: fp32
    o = FusedLinear(flatten(p))             o = Bf16Linear(flatten(p))
    return o                                return to_fp32(o)              # outputs are fp32

Every compute node falls in one of four classes (the report, ``node.meta["gml_precision"]``, says
which and why):

* **bf16 kernel** — the fused conv / linear modules (and the plain ``nn.Linear`` s the fp32 fusion
  left on ATen for speed) become their bf16 twins
  (:mod:`gml.kernels.bf16`): weights stored in bf16 and prepacked once, fp32 accumulation and bias
  inside oneDNN, bf16 output. Activation × activation matmuls and ``gml.attention`` run on bf16
  operands too (oneDNN / MKL bf16 GEMM, torch's CPU flash attention: fp32 accumulators and fp32
  softmax statistics inside); an fp32 operand is converted first (``to_bf16``).
* **follows its input** — data movement (views, flatten, cat, max pool) is exact in any dtype;
  element-wise ops (activations, add, mul) round once to the input's dtype (ATen computes bf16
  element-wise ops in fp32 internally). A bf16 + fp32 add promotes to fp32.
* **fp32** — LayerNorm/GroupNorm/BatchNorm (mean and variance of many values), softmax, reductions
  (mean, sum, average pools) and every op this pass has no rule for: a bf16 input is converted to
  fp32 first (``to_fp32``), the op runs as in the fp32 model.
* **outputs** — the model's outputs are converted back to fp32.

**Numerics.** bf16 keeps 8 significant bits: each rounding moves a value by at most
``u = 2^-8`` relative (:data:`~gml.kernels.bf16.BF16_UNIT_ROUNDOFF`). A kernel rounds its two
operands and its output (``3u`` relative to ``|W||x|``, see
:func:`~gml.kernels.bf16.bf16_dot_bound`); errors of successive layers add up roughly as a random
walk, and a network amplifies them by its conditioning, so the pass's end-to-end check is a bound on
the outputs relative to their largest magnitude, :data:`BF16_TOLERANCE`. A graph whose outputs move
further (an ill-conditioned model) is rolled back to fp32 by the pass manager, with the error in
the report.

Which dtype each value has is decided by running the graph once on inputs shaped like its
placeholders' ``tensor_meta`` (the pass manager refreshes it): casts are inserted only where a
value's actual dtype and its consumer's class disagree, so no conversion is ever a no-op call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from gml.errors import GMLError
from gml.ir.attention import is_attention
from gml.ir.ops import SPECS, op_kind
from gml.ir.target import Target
from gml.kernels import bf16 as kb
from gml.kernels import fp32 as k32
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.fuse_common import shape_of
from gml.passes.utils import modules_of, replace_module

#: bf16 vs fp32 outputs: ``max|a - b| <= atol + rtol * max|fp32|`` per output. ``rtol = 2^-4`` is 16
#: bf16 roundings (u = 2^-8) of the largest output: a few roundings per layer of a deep network
#: (ResNet18 measured 2^-7..2^-6, MiniLM 2^-8; docs/adr/007-bf16.md), with room for the random
#: inputs the manager also checks.
BF16_TOLERANCE = Tolerance(atol=1e-3, rtol=2.0**-4)

BF16 = "bf16"
FP32 = "fp32"

#: canonical ops (gml.ir.ops) that compute in fp32 whatever their inputs, and why.
FP32_OPS: dict[str, str] = {
    "layernorm": "LayerNorm statistics (mean/variance) in fp32",
    "batchnorm": "BatchNorm (not folded) in fp32",
    "softmax": "softmax in fp32",
    "mean": "reduction in fp32",
    "adaptive_avg_pool": "average (a reduction) in fp32",
    "avg_pool": "average (a reduction) in fp32",
}
_FP32_FUNCTIONS: dict[Any, str] = {
    torch.sum: "reduction in fp32",
    torch.log_softmax: "softmax in fp32",
    nn.functional.log_softmax: "softmax in fp32",
    nn.functional.group_norm: "GroupNorm statistics in fp32",
    nn.functional.normalize: "norm (a reduction) in fp32",
    torch.norm: "norm (a reduction) in fp32",
    torch.var: "reduction in fp32",
    torch.std: "reduction in fp32",
    torch.cumsum: "reduction in fp32",
}
_FP32_MODULES: dict[type[nn.Module], str] = {
    nn.GroupNorm: "GroupNorm statistics in fp32",
    nn.LogSoftmax: "softmax in fp32",
    nn.Embedding: "embedding table kept fp32 (a gather: no math to speed up)",
}
_FP32_METHODS = {
    "sum": "reduction in fp32",
    "log_softmax": "softmax in fp32",
    "norm": "reduction in fp32",
    "var": "reduction in fp32",
    "std": "reduction in fp32",
    "cumsum": "reduction in fp32",
}

#: canonical ops that run in their input's dtype.
FOLLOW_TAGS = ("view", "activation", "elementwise")
FOLLOW_OPS = frozenset({"flatten", "cat", "max_pool", "identity", "dropout"})
#: metadata-only methods / functions (no math at all)
_META_METHODS = frozenset({"size", "dim", "numel", "to", "type_as", "float", "bfloat16", "clone"})
_META_FUNCTIONS = (getattr, operator.getitem, len)

_BF16_MATMUL = frozenset({"matmul"})


def _follow_modules() -> tuple[type[nn.Module], ...]:
    from gml import nn as gnn

    return (gnn.Add, gnn.AddScalar, gnn.Mul, gnn.MulScalar, k32.AddReLU, nn.Flatten)


@dataclass(frozen=True)
class NodePrecision:
    """One node of the bf16 report: the dtype it computes in and why."""

    node: str
    op: str
    precision: str
    reason: str


@dataclass
class PrecisionReport:
    """Which precision each op runs in, and why (what ``gml.optimize(precision=...)`` returns)."""

    requested: str
    #: the precision the returned model runs in ("fp32" when bf16 was refused or rolled back)
    effective: str
    entries: list[NodePrecision] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cpu: str = ""

    def count(self, precision: str) -> int:
        return sum(1 for e in self.entries if e.precision == precision)

    def summary(self) -> str:
        if self.effective != self.requested:
            return f"precision: {self.effective} (requested {self.requested}: {'; '.join(self.warnings)})"
        if self.effective == BF16:
            return (
                f"precision: bf16 on {self.cpu}: {self.count(BF16)} ops in bf16, {self.count(FP32)} in fp32 "
                "(weights bf16, fp32 accumulation; outputs fp32)"
            )
        return f"precision: {self.effective}"

    def __str__(self) -> str:
        lines = [self.summary(), *(f"  warning: {w}" for w in self.warnings if self.effective == self.requested)]
        lines += [f"  {e.node:<32} {e.op:<28} {e.precision:<5} {e.reason}" for e in self.entries]
        return "\n".join(lines)

    def table(self, title: str = "Precision per op"):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=title, caption=self.summary())
        for col in ("node", "op", "precision", "why"):
            t.add_column(col)
        for e in self.entries:
            style = "green" if e.precision == BF16 else ""
            t.add_row(e.node, e.op, f"[{style}]{e.precision}[/]" if style else e.precision, e.reason)
        return t


def precision_report(gm: fx.GraphModule, requested: str = BF16) -> PrecisionReport:
    """The report of a graph :class:`LowerToBf16` rewrote (from ``node.meta["gml_precision"]``)."""
    entries = [
        NodePrecision(n.name, n.meta["gml_precision"][0], *n.meta["gml_precision"][1:])
        for n in gm.graph.nodes
        if "gml_precision" in n.meta
    ]
    effective = BF16 if any(e.precision == BF16 for e in entries) else FP32
    return PrecisionReport(requested, effective, entries, cpu=kb.cpu_description())


def bf16_outcome(gm: fx.GraphModule, report: Any, refusal: str | None) -> PrecisionReport:
    """The precision report of a ``precision="bf16"`` pipeline run: what the returned model runs in,
    with a warning when it is not bf16 (CPU refused, the pass rolled back, nothing to lower)."""
    cpu = kb.cpu_description()
    if refusal is not None:
        return PrecisionReport(BF16, FP32, warnings=[refusal], cpu=cpu)
    rec = next((r for r in report.records if r.name == LowerToBf16.name), None)
    if rec is None:
        return PrecisionReport(BF16, FP32, warnings=["the pass list has no lower_bf16 pass"], cpu=cpu)
    if rec.status == "rolled back":
        return PrecisionReport(BF16, FP32, warnings=[f"bf16 rolled back, the model stays fp32: {rec.error}"], cpu=cpu)
    out = precision_report(gm)
    if out.effective != BF16:
        out.warnings.append("no fused conv/linear to run in bf16: the model stays fp32")
    return out


def _label(node: fx.Node, mod: nn.Module | None) -> str:
    if mod is not None:
        return type(mod).__name__
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def _example(node: fx.Node) -> Any:
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        if node.args:  # an optional argument the capture left at its default (timm ViT: attn_mask=None)
            return node.args[0]
        raise GMLError(
            f"LowerToBf16 needs the shape of input {node.name} (tensor_meta).",
            hint="run it through gml's PassManager with sample inputs, or ShapeProp the graph first.",
        )
    if meta.dtype.is_floating_point:
        return torch.randn(tuple(meta.shape), dtype=meta.dtype)
    return torch.zeros(tuple(meta.shape), dtype=meta.dtype)


class LowerToBf16(GraphPass):
    """fp32 fused kernels → bf16 kernels; casts where a consumer's precision differs (module doc).

    Args:
        check_cpu: refuse (raise :class:`~gml.errors.UnsupportedError`) on a CPU without native
            bf16 (:func:`~gml.kernels.bf16.bf16_unavailable_reason`); ``False`` lowers anyway
            (tests of the graph rewrite on any machine).
        target: the CPU checked (:class:`~gml.ir.target.Target`; default: this process's).
    """

    name = "lower_bf16"
    tolerance = BF16_TOLERANCE

    def __init__(self, *, check_cpu: bool = True, target: Target | None = None) -> None:
        self.check_cpu = check_cpu
        self.target = target

    def requires(self, gm: fx.GraphModule) -> None:
        from gml.errors import UnsupportedError

        why = kb.bf16_unavailable_reason(self.target) if self.check_cpu else None
        if why is not None:
            raise UnsupportedError(f"bf16 is not available: {why}.", hint="use precision='fp32'.")

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        matches = 0
        for node in gm.graph.nodes:
            if node.op != "call_module":
                continue
            mod = modules[str(node.target)]
            if type(mod) is nn.Linear:  # fp32 fusion kept it on ATen (fast enough there): bf16 it too
                mod = k32.FusedLinear.from_linear(mod, backend="onednn")
            twin = kb.BF16_TWINS.get(type(mod))
            if twin is None:
                continue
            if not getattr(mod, "fused", True):
                skips.append(Skip(node.name, "oneDNN kernels unavailable (ATen fallback)", type(mod).__name__))
                continue
            refusal = kb.conv_refusal(mod, shape_of(node.args[0])) if node.args else None
            if refusal is not None:
                skips.append(Skip(node.name, refusal, type(mod).__name__))
                continue
            replace_module(gm, str(node.target), twin.from_fused(mod))
            matches += 1
        if not matches:
            return PassResult(gm, False, skips=skips, notes=["no fused conv/linear to run in bf16"])
        casts = self._insert_casts(gm)
        gm.graph.lint()
        gm.recompile()
        notes = [f"{matches} conv/linear kernel(s) in bf16; {casts} dtype conversion(s) inserted"]
        return PassResult(gm, True, matches, skips, notes)

    # ------------------------------------------------------------------ classification
    def _classify(self, node: fx.Node, mod: nn.Module | None, modules: dict[str, nn.Module]) -> tuple[str, str]:
        """``(class, reason)``; class is ``bf16`` (kernel), ``bf16_in`` (bf16 operands), ``follow``, ``fp32``."""
        if isinstance(mod, kb.bf16_kernel_modules()):
            return "bf16", "oneDNN bf16 kernel: bf16 weights (prepacked) and activations, fp32 accumulate + bias"
        if is_attention(node):
            return "bf16_in", "attention on bf16 q/k/v: fp32 softmax statistics and accumulators inside"
        kind = op_kind(node, modules)
        if kind in _BF16_MATMUL:
            return "bf16_in", "bf16 GEMM of activations, fp32 accumulation"
        if kind in FP32_OPS:
            return FP32, FP32_OPS[kind]
        if mod is not None and type(mod) in _FP32_MODULES:
            return FP32, _FP32_MODULES[type(mod)]
        if node.op == "call_function" and node.target in _FP32_FUNCTIONS:
            return FP32, _FP32_FUNCTIONS[node.target]
        if node.op == "call_method" and str(node.target) in _FP32_METHODS:
            return FP32, _FP32_METHODS[str(node.target)]
        if kind is not None and "view" in SPECS[kind].tags:
            return "follow", "no math"  # views and reshapes: not listed in the report
        if kind is not None and (kind in FOLLOW_OPS or any(t in SPECS[kind].tags for t in FOLLOW_TAGS)):
            return "follow", "data movement / element-wise: runs in its input's dtype"
        if mod is not None and isinstance(mod, _follow_modules()):
            return "follow", "element-wise: runs in its input's dtype"
        if node.op == "call_method" and str(node.target) in _META_METHODS:
            return "follow", "no math"
        if node.op == "call_function" and node.target in _META_FUNCTIONS:
            return "follow", "no math"
        if kind in ("conv", "linear"):
            return FP32, f"{kind} not fused (see the fusion passes' skips): no bf16 kernel"
        return FP32, f"no bf16 rule for {_label(node, mod)}: computed in fp32"

    # ------------------------------------------------------------------ casts from one run
    def _insert_casts(self, gm: fx.GraphModule) -> int:
        modules = modules_of(gm)
        env: dict[fx.Node, Any] = {}
        cast_of: dict[tuple[fx.Node, str], fx.Node] = {}
        n_casts = 0

        def cast(arg: fx.Node, to: str, before: fx.Node) -> fx.Node:
            nonlocal n_casts
            key = (arg, to)
            if key not in cast_of:
                fn = kb.to_fp32 if to == FP32 else kb.to_bf16
                with gm.graph.inserting_before(before):
                    c = gm.graph.call_function(fn, (arg,))
                c.meta["gml_cast"] = to
                env[c] = fn(env[arg])
                cast_of[key] = c
                n_casts += 1
            return cast_of[key]

        def want(v: Any, to: str) -> bool:
            if not isinstance(v, torch.Tensor):
                return False
            return v.dtype == (torch.bfloat16 if to == FP32 else torch.float32)

        def recast(node: fx.Node, to: str) -> None:
            """Convert ``node``'s tensor arguments whose dtype is not ``to``'s (casts go before it)."""

            def one(a: fx.Node) -> fx.Node:
                return cast(a, to, node) if want(env[a], to) else a

            node.args = fx.node.map_arg(node.args, one)
            node.kwargs = fx.node.map_arg(node.kwargs, one)

        with torch.no_grad():
            for node in list(gm.graph.nodes):
                if node.meta.get("gml_cast"):
                    continue
                if node.op == "placeholder":
                    env[node] = _example(node)
                    continue
                if node.op == "get_attr":
                    value: Any = gm
                    for part in str(node.target).split("."):
                        value = getattr(value, part)
                    env[node] = value
                    continue
                if node.op == "output":
                    recast(node, FP32)
                    continue
                mod = modules.get(str(node.target)) if node.op == "call_module" else None
                cls, reason = self._classify(node, mod, modules)
                if cls in (FP32, "bf16_in"):
                    recast(node, FP32 if cls == FP32 else BF16)
                args = fx.node.map_arg(node.args, lambda a: env[a])
                kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
                if node.op == "call_module":
                    out = mod(*args, **kwargs)
                elif node.op == "call_function":
                    out = node.target(*args, **kwargs)
                else:
                    out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
                env[node] = out
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    prec = BF16 if out.dtype == torch.bfloat16 else FP32
                    leaves = tree_flatten((args, kwargs))[0]
                    if (
                        cls == "follow"
                        and prec == FP32
                        and any(isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 for v in leaves)
                    ):
                        reason = "bf16 and fp32 inputs: promoted to fp32"
                    if reason != "no math":
                        node.meta["gml_precision"] = (_label(node, mod), prec, reason)
        return n_casts


__all__ = ["BF16_TOLERANCE", "FP32_OPS", "LowerToBf16", "NodePrecision", "PrecisionReport", "precision_report"]
