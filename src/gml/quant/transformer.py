"""The transformer INT8 scheme: INT8 GEMMs with per-token dynamic activation scales, the rest fp32.

Why not the static scheme ``gml quantize`` uses for CNNs: a transformer's residual stream carries
a few channels with values hundreds of times larger than the rest, and one static per-tensor scale
for them (the residual add that feeds LayerNorm) wipes out the small channels (#15: cosine 0.881 on
all-MiniLM-L6-v2). Here

* every ``nn.Linear`` (Q/K/V — merged —, attention output, MLP) becomes :class:`DynamicQuantLinear`:
  weights int8, symmetric, one scale per output channel; activations int8, symmetric, one scale
  **per token** (row), computed from that row at run time; ``int8 x int8 -> int32`` GEMM
  (``torch._int_mm``), then ``acc * s_x[row] * s_w[col] + bias`` in fp32;
* the residual stream, LayerNorm, softmax, GELU and attention (``gml.attention``: q·kᵀ and p·v in
  fp32 inside the fused SDPA) stay fp32.

Math of one output: ``y[t, o] = sum_i x[t, i] W[o, i] + b[o]
≈ s_x[t] s_w[o] sum_i q_x[t, i] q_w[o, i] + b[o]``, ``q_x = round(x / s_x)``, ``s_x[t] = max_i |x[t, i]| / 127``,
``q_w = round(W / s_w)``, ``s_w[o] = max_i |W[o, i]| / 127``. A token's rounding error is relative
to that token's own largest value, never to the whole batch's.

:func:`quantize_transformer` runs capture → Normalize → untie → fold BN → FuseAttention →
HorizontalMerge → :class:`QuantizeLinearsDynamic` under the PassManager and reports every GEMM with
the precision it got and why.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gml.passes.base import GraphPass, PassResult, Skip
from gml.passes.utils import modules_of, replace_module

QMAX = 127


class DynamicQuantLinear(nn.Module):
    """``nn.Linear`` with int8 per-channel weights and per-token dynamic int8 activations (module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # [in, out] for x @ w; stored as the transpose of a contiguous [out, in] (what the GEMM reads best)
        self.register_buffer("weight_t", q.t())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        s_x = (rows.abs().amax(dim=1, keepdim=True) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
        q_x = torch.round(rows / s_x).clamp_(-QMAX, QMAX).to(torch.int8)
        acc = torch._int_mm(q_x, self.weight_t)
        out = acc.to(torch.float32).mul_(s_x).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, int8 weights per channel, int8 activations per token"


class QuantizeLinearsDynamic(GraphPass):
    """Replace each ``nn.Linear`` with :class:`DynamicQuantLinear` (INT8 GEMM, per-token activation scales).

    Before → after: ``%y = linear(%x)`` → ``%y = DynamicQuantLinear(linear)(%x)``; the math is in the
    module docstring. Changes numerics on purpose (tolerance ``None``: shapes and finiteness are checked).

    Skipped, with the reason: non-fp32 weights; inputs that are not floating point.
    """

    name = "quantize_linears_dynamic"
    tolerance = None

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        done = 0
        for node in gm.graph.nodes:
            if node.op != "call_module" or type(modules.get(str(node.target))) is not nn.Linear:
                continue
            lin = modules[str(node.target)]
            if lin.weight.dtype != torch.float32:
                skips.append(Skip(node.name, f"{lin.weight.dtype} weights, not fp32", "linear → int8"))
                continue
            meta = node.args[0].meta.get("tensor_meta") if isinstance(node.args[0], fx.Node) else None
            if meta is not None and hasattr(meta, "dtype") and not meta.dtype.is_floating_point:
                skips.append(Skip(node.name, f"{meta.dtype} input", "linear → int8"))
                continue
            replace_module(gm, str(node.target), DynamicQuantLinear(lin))
            done += 1
        if done:
            gm.recompile()
        return PassResult(gm, done > 0, done, skips, [f"{done} linear(s) now INT8 GEMMs with per-token scales"])


@dataclass
class GemmPrecision:
    """One row of the precision table: an op, the precision it runs in, and why."""

    node: str
    op: str
    precision: str
    why: str


@dataclass
class TransformerQuantResult:
    """The INT8 transformer, the per-pass report, and every GEMM/LayerNorm/softmax/attention with its precision."""

    module: fx.GraphModule
    report: Any
    precisions: list[GemmPrecision] = field(default_factory=list)

    def table(self):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title="Precision of each GEMM, attention, LayerNorm, softmax")
        for col in ("node", "op", "precision", "why"):
            t.add_column(col)
        for p in self.precisions:
            t.add_row(p.node, p.op, p.precision, p.why)
        return t


def _precisions(gm: fx.GraphModule) -> list[GemmPrecision]:
    from gml.ops_attention import is_attention
    from gml.passes.oplib import op_kind

    modules = modules_of(gm)
    rows = []
    for node in gm.graph.nodes:
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(mod, DynamicQuantLinear):
            rows.append(GemmPrecision(node.name, f"linear {mod.in_features}->{mod.out_features}", "int8",
                                      "weights per channel, activations per token"))  # fmt: skip
        elif type(mod) is nn.Linear:
            rows.append(GemmPrecision(node.name, "linear", "fp32", "declined (see the pass report)"))
        elif is_attention(node):
            rows.append(GemmPrecision(node.name, "attention (q·kᵀ, softmax, p·v)", "fp32",
                                      "fused SDPA; softmax needs fp32 range"))  # fmt: skip
        elif op_kind(node, modules) in ("layernorm", "softmax", "matmul"):
            why = {"layernorm": "row statistics need fp32", "softmax": "exp needs fp32 range",
                   "matmul": "activation x activation GEMM"}[op_kind(node, modules)]  # fmt: skip
            rows.append(GemmPrecision(node.name, op_kind(node, modules), "fp32", why))
    return rows


def quantize_transformer(
    model: nn.Module, example_inputs: Sequence[Any], *, strict: bool = False
) -> TransformerQuantResult:
    """Quantize a transformer with the scheme of this module; ``model`` is not modified."""
    from gml.capture import capture, check_eval_mode
    from gml.passes.attention import FuseAttention
    from gml.passes.horizontal_merge import HorizontalMerge
    from gml.passes.manager import PassManager
    from gml.passes.pipeline import canonical_passes

    inputs = tuple(example_inputs)
    check_eval_mode(model, what="INT8 quantization")
    gm = capture(copy.deepcopy(model), inputs)
    passes = [*canonical_passes(), FuseAttention(), HorizontalMerge(), QuantizeLinearsDynamic()]
    result = PassManager(passes, strict=strict).run(gm, [inputs])
    return TransformerQuantResult(result.graph_module, result.report, _precisions(result.graph_module))
