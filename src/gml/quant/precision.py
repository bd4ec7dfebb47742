"""Which precision each op of a returned static-scheme model runs in, why, and which runtime runs it.

Read off the module ``gml.quantize`` returns (never off a plan), so the table always describes that
module: an INT8 op is a ``torch.ops.gml`` call (its entry names the reference op it covers); an fp32
or bf16 op is whatever else computes (GML's fused fp32 kernel after the fusion passes, a bf16 twin
after :class:`~gml.passes.bf16.LowerToBf16`, a torch op), with the reason it is not INT8 (the
lowering's or the cost policy's ``coverage.kept_fp32`` entry, the bf16 pass's reason, or the reason
given by the caller when the whole model is fp32). Conversions (``gml.quantize`` / ``dequantize`` /
``requantize``, bf16 casts) and ops without math (views, shape queries) are counted, not listed.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from gml.ir.library import SCHEMAS, gml_op_name
from gml.ir.ops import SPECS, node_label, op_kind

INT8, FP32, BF16 = "int8", "fp32", "bf16"
_CONVERSIONS = frozenset({"quantize", "dequantize", "requantize"})
_NO_MATH_METHODS = frozenset({"size", "dim", "numel", "contiguous"})


@dataclass(frozen=True)
class OpPrecision:
    """One row: a node, what computes it, its precision, why, and the runtime that runs it."""

    node: str
    op: str
    precision: str
    why: str
    runs_in: str = ""


@dataclass
class PrecisionTable:
    """Every op of a returned model with its precision (see the module docstring)."""

    rows: list[OpPrecision] = field(default_factory=list)
    conversions: int = 0
    note: str = ""

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def counts(self) -> Counter[str]:
        return Counter(r.precision for r in self.rows)

    def summary(self) -> str:
        c = self.counts()
        parts = ", ".join(f"{c[p]} {p}" for p in (INT8, BF16, FP32) if c[p])
        tail = f"; {self.note}" if self.note else ""
        return f"precision per op: {parts or 'no ops'} ({self.conversions} conversion(s)){tail}"

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  {r.node:<28} {r.op:<24} {r.precision:<5} {r.runs_in:<6} {r.why}" for r in self.rows]
        return "\n".join(lines)

    def table(self, title: str = "Precision per op"):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=title, caption=self.summary())
        for col in ("node", "op", "precision", "runs in", "why"):
            t.add_column(col)
        style = {INT8: "green", BF16: "cyan", FP32: "yellow"}
        for r in self.rows:
            t.add_row(r.node, r.op, f"[{style[r.precision]}]{r.precision}[/]", r.runs_in, r.why)
        return t


def _no_math(node: fx.Node, modules: dict[str, Any]) -> bool:
    if node.op == "call_method" and str(node.target) in _NO_MATH_METHODS:
        return True
    if node.op == "call_function" and node.target in (getattr, operator.getitem, len):
        return True
    if node.meta.get("gml_cast"):
        return True
    kind = op_kind(node, modules)
    return kind is not None and "view" in SPECS[kind].tags


def precision_table(
    gm: fx.GraphModule, runtime: Any = None, *, fp32_reason: str = "", note: str = ""
) -> PrecisionTable:
    """The :class:`PrecisionTable` of ``gm``. ``runtime``: its :class:`~gml.runtime.compile.RuntimeReport`
    (fills ``runs_in``); ``fp32_reason``: why an op without a recorded reason is not INT8."""
    from gml.quant.lower import KEPT_FP32, LOWERED

    modules = dict(gm.named_modules(remove_duplicate=False))
    where = {n.name: n.runs_in for n in getattr(runtime, "nodes", [])}
    default_where = "torch" if runtime is None or getattr(runtime, "path", "torch") == "torch" else ""
    out = PrecisionTable(note=note)
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method") or _no_math(node, modules):
            continue
        runs_in = where.get(node.name, default_where)
        name = gml_op_name(node)
        if name in _CONVERSIONS:
            out.conversions += 1
            continue
        if name in SCHEMAS:  # an INT8 op (gml.attention is an fp32 / bf16 op of the same namespace)
            entry = node.meta.get(LOWERED)
            covers = f"{entry.op} ({', '.join(entry.nodes)})" if entry is not None else "INT8 op"
            out.rows.append(OpPrecision(node.name, name, INT8, f"INT8 kernel for {covers}", runs_in))
            continue
        label = node_label(node, modules)
        kept = node.meta.get(KEPT_FP32)
        precision, why = FP32, kept.reason if kept is not None else ""
        recorded = node.meta.get("gml_precision")  # set by LowerToBf16: (label, precision, reason)
        if recorded is not None:
            precision = recorded[1]
            why = f"{why}; {recorded[2]}" if why and precision == BF16 else why or recorded[2]
        out.rows.append(OpPrecision(node.name, label, precision, why or fp32_reason or "fp32 op", runs_in))
    return out


__all__ = ["BF16", "FP32", "INT8", "OpPrecision", "PrecisionTable", "precision_table"]
