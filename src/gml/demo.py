"""``gml demo``: a guided tour of the lab, in the order of the operator-fusion practice.

1. **Trace basics**: capture ResNet18 with torch.fx; what kinds of nodes a graph holds.
2. **Manual fusion**: the project's ``FuseLinearActivation`` walks the graph and fuses every
   ``Linear → ReLU`` into one oneDNN kernel call, declining (with a reason) a Linear read twice.
3. **Pattern rewrite**: ``FuseMatmulAddRelu`` does it with ``torch.fx.subgraph_rewriter`` on
   ``relu(matmul(x, W) + b)``.
4. **Fused vs unfused**: latency in interleaved rounds, and the activation bytes fusion removes.
5. **Conv+BN folding** on ResNet18 with the project's ``FoldBatchNorm`` pass.
6. **INT8**: ``gml.quantize`` calibrates, quantizes and lowers ResNet18 to fused INT8 kernels.
7. **Summary**.

Everything is generated locally (random weights, random inputs): the demo runs offline. A stage
of the project that has not landed yet is announced as "not available yet" and the tour goes on.
It runs in about a minute or two on 2 cores.
"""

from __future__ import annotations

import copy
import importlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.rule import Rule
from rich.table import Table
from torch import fx, nn

from gml.bench.memory import activation_footprint
from gml.bench.runner import time_interleaved
from gml.bench.stats import cosine, flat_output, max_abs_diff, summarize, top1_agreement
from gml.passes.oplib import node_label, op_kind
from gml.passes.utils import modules_of

NODE_KINDS = ("placeholder", "get_attr", "call_module", "call_function", "call_method", "output")


class DemoMLP(nn.Module):
    """Linear → ReLU twice, then a Linear whose output is read twice (so it cannot be fused), then a head."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(width, width), nn.ReLU()
        self.fc2, self.act2 = nn.Linear(width, width), nn.ReLU()
        self.fc3, self.act3 = nn.Linear(width, width), nn.ReLU()
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act2(self.fc2(self.act1(self.fc1(x))))
        h = self.fc3(x)
        return self.head(self.act3(h) + h)


class MatmulBlock(nn.Module):
    """The same math written with raw parameters: ``relu(x @ W + b)`` twice."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b1 = nn.Parameter(torch.randn(width) * 0.1)
        self.w2 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b2 = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.matmul(x, self.w1) + self.b1)
        return torch.relu(torch.matmul(x, self.w2) + self.b2)


def _kinds_table(gm: fx.GraphModule, title: str) -> Table:
    kinds = Counter(n.op for n in gm.graph.nodes)
    t = Table(title=title)
    t.add_column("node kind")
    t.add_column("count", justify="right")
    t.add_column("what it is")
    what = {
        "placeholder": "a forward() argument",
        "get_attr": "a parameter/buffer read",
        "call_module": "a submodule call (Conv2d, BatchNorm2d, ...)",
        "call_function": "a free function (torch.flatten, operator.add, ...)",
        "call_method": "a Tensor method (x.view, ...)",
        "output": "the return value",
    }
    for k in NODE_KINDS:
        t.add_row(k, str(kinds.get(k, 0)), what[k])
    return t


def _ops_table(gm: fx.GraphModule, title: str, limit: int = 8) -> Table:
    modules = modules_of(gm)
    labels = Counter(node_label(n, modules) for n in gm.graph.nodes if n.op.startswith("call"))
    t = Table(title=title)
    t.add_column("op")
    t.add_column("count", justify="right")
    for label, c in labels.most_common(limit):
        t.add_row(label, str(c))
    return t


def _err(ref: Any, new: Any) -> tuple[float, float]:
    r, n = flat_output(ref), flat_output(new)
    return max_abs_diff(r, n), cosine(r, n)


class _Tour:
    def __init__(self, console: Console, model: nn.Module | None, rounds: int, calib_batches: int) -> None:
        self.c = console
        self.model = model
        self.rounds = rounds
        self.calib_batches = calib_batches
        self.summary: list[tuple[str, str, str]] = []
        self.failed = False
        torch.manual_seed(0)

    def big_model(self) -> nn.Module:
        if self.model is not None:
            return copy.deepcopy(self.model).eval()
        from gml.models import load_model

        return load_model("resnet18")

    def big_input(self, batch: int = 1, generator: torch.Generator | None = None) -> torch.Tensor:
        shape = getattr(self.model, "example_input_shape", (1, 3, 224, 224))
        return torch.randn(batch, *shape[1:], generator=generator)

    def phase(self, number: int, title: str, fn: Callable[[], str]) -> None:
        self.c.print(Rule(f"[bold]Phase {number}: {title}"))
        t0 = time.perf_counter()
        try:
            outcome = fn()
        except _NotAvailable as exc:
            outcome = f"not available yet: {exc}"
            self.c.print(f"[yellow]{outcome}[/]")
        except Exception as exc:  # a broken phase is reported; the tour goes on
            self.failed = True
            outcome = f"failed: {type(exc).__name__}: {exc}"
            self.c.print(f"[red]{outcome}[/]")
        self.summary.append((f"{number}. {title}", outcome, f"{time.perf_counter() - t0:.1f}"))

    # 1 ---------------------------------------------------------------------------------------
    def trace_basics(self) -> str:
        from gml.capture import capture

        model = self.big_model()
        x = self.big_input()
        gm = capture(model, (x,))
        self.c.print(
            "torch.fx runs forward() once with proxy values and records every operation as a node; "
            "each node names its inputs in args, so the list is also the data-flow graph."
        )
        self.c.print(_kinds_table(gm, f"{type(model).__name__}: {len(gm.graph.nodes)} nodes"))
        t = Table(title="The first nodes (shapes from shape propagation)")
        for col in ("op", "name", "target", "args", "shape"):
            t.add_column(col)
        modules = modules_of(gm)
        for node in list(gm.graph.nodes)[:7]:
            meta = node.meta.get("tensor_meta")
            shape = str(tuple(meta.shape)) if hasattr(meta, "shape") else ""
            target = node_label(node, modules) if node.op.startswith("call") else str(node.target)
            t.add_row(node.op, node.name, target, str(tuple(str(a) for a in node.args))[:40], shape)
        self.c.print(t)
        calls = sum(1 for n in gm.graph.nodes if n.op.startswith("call"))
        return f"{len(gm.graph.nodes)} nodes, {calls} ops"

    def _fuse(
        self, model: nn.Module, module: str, cls: str
    ) -> tuple[tuple[nn.Module, fx.GraphModule, torch.Tensor], str]:
        """Steps 2 and 3: run fusion pass ``module.cls`` on ``model`` (eval) for a (32, 512) input;
        ``((model, fused, x), "nodes before → after, max |Δ|")``."""
        model = model.eval()
        x = torch.randn(32, 512)
        before = len(fx.symbolic_trace(model).graph.nodes)
        gm = self._run_pass(module, cls, model, x, f"{module.rsplit('.', 1)[1]} on {type(model).__name__}")
        with torch.no_grad():
            err, _ = _err(model(x), gm(x))
        return (model, gm, x), f"nodes {before} → {len(gm.graph.nodes)}, max |Δ| {err:.1e}"

    def _run_pass(self, module: str, cls: str, model: nn.Module, x: torch.Tensor, title: str) -> fx.GraphModule:
        """Capture ``model``, run the project's pass ``module.cls`` under the PassManager, show the report."""
        try:
            pass_cls = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError) as exc:
            raise _NotAvailable(f"{module}.{cls} ({exc})") from None
        from gml.capture import capture
        from gml.passes.manager import PassManager

        gm = capture(copy.deepcopy(model), (x,))
        res = PassManager([pass_cls()]).run(gm, [(x,)])
        self.c.print(res.report.table(title))
        if res.report.skips or res.report.rolled_back:
            self.c.print(res.report.skip_table())
        out = res.graph_module
        self.c.print("[dim]forward() after the pass:[/]\n" + out.code.strip())
        t = Table(title="What each call_module now runs")
        t.add_column("node")
        t.add_column("module")
        modules = modules_of(out)
        for node in out.graph.nodes:
            if node.op == "call_module":
                mod = modules[node.target]
                extra = mod.extra_repr()
                t.add_row(node.name, f"{type(mod).__name__}({extra[:60]})")
        self.c.print(t)
        return out

    # 2 ---------------------------------------------------------------------------------------
    def manual_fusion(self) -> str:
        self.c.print(
            "FuseLinearActivation walks the nodes in order. A call_module whose module *type* is Linear "
            "and whose only reader is an activation becomes one FusedLinear: oneDNN's inner product with "
            "the activation as a post-op, applied while the output tile is still in registers. Insert "
            "the new node, point the activation's readers at it, erase both, recompile. A Linear whose "
            "output is read twice is declined, with the reason."
        )
        self._mlp, summary = self._fuse(DemoMLP(), "gml.passes.fuse_linear", "FuseLinearActivation")
        return summary

    # 3 ---------------------------------------------------------------------------------------
    def pattern_rewrite(self) -> str:
        try:
            fm = importlib.import_module("gml.passes.fuse_matmul")
            n_patterns = len(fm.patterns())
        except (ImportError, AttributeError) as exc:
            raise _NotAvailable(f"gml.passes.fuse_matmul ({exc})") from None
        self.c.print(
            "FuseMatmulAddRelu is a pattern rule: torch.fx.subgraph_rewriter matches the graph of\n"
            "    def pattern(x, w, b): return relu(matmul(x, w) + b)\n"
            f"({n_patterns} spellings: @ or torch.matmul, + or torch.add, F.relu / torch.relu / .relu()) and\n"
            "    def replacement(x, w, b): return fused_matmul_add_relu(x, w, b)\n"
            "with a filter that declines what the kernel cannot compute. Constant w, b are then lowered to "
            "a FusedLinear holding Wᵀ prepacked, so nothing is transposed per call."
        )
        self._matmul, summary = self._fuse(MatmulBlock(), "gml.passes.fuse_matmul", "FuseMatmulAddRelu")
        return summary

    # 4 ---------------------------------------------------------------------------------------
    def fused_benchmark(self) -> str:
        if not hasattr(self, "_mlp") or not hasattr(self, "_matmul"):
            raise _NotAvailable("phases 2 and 3 did not produce their models")
        mlp, mlp_fused, x = self._mlp
        mm, mm_fused, _ = self._matmul
        calls = {
            "MLP, unfused": lambda: mlp(x),
            "MLP, fused (phase 2)": lambda: mlp_fused(x),
            "matmul block, unfused": lambda: mm(x),
            "matmul block, rewritten (phase 3)": lambda: mm_fused(x),
        }
        with torch.no_grad():
            samples = time_interleaved(calls, rounds=self.rounds, target_sample_ms=10.0)
        stats = {k: summarize(v) for k, v in samples.items()}
        fp_before = activation_footprint(fx.symbolic_trace(mlp), (x,))
        fp_after = activation_footprint(copy.deepcopy(mlp_fused), (x,))
        t = Table(title=f"Latency per call, batch {x.shape[0]} ({self.rounds} interleaved rounds)")
        for col in ("model", "median ms", "p10–p90 ms", "speedup"):
            t.add_column(col, justify="left" if col == "model" else "right")
        pairs = [
            ("MLP, unfused", "MLP, fused (phase 2)"),
            ("matmul block, unfused", "matmul block, rewritten (phase 3)"),
        ]
        for base, fused in pairs:
            for k in (base, fused):
                s = stats[k]
                sp = stats[base].median / s.median
                t.add_row(k, f"{s.median:.3f}", f"{s.p10:.3f}–{s.p90:.3f}", f"{sp:.2f}×")
        self.c.print(t)
        self.c.print(
            f"Activation bytes written per call (MLP, from shape propagation): "
            f"{fp_before.total_bytes / 1024:.0f} KiB unfused → {fp_after.total_bytes / 1024:.0f} KiB fused "
            f"({fp_before.tensors} → {fp_after.tensors} intermediate tensors): the pre-ReLU tensors are gone."
        )
        self.c.print(
            "[dim]Medians of interleaved rounds on a shared machine; `gml bench` measures whole models the same way.[/]"
        )
        s_mlp = stats[pairs[0][0]].median / stats[pairs[0][1]].median
        s_mm = stats[pairs[1][0]].median / stats[pairs[1][1]].median
        return (
            f"MLP {s_mlp:.2f}×, matmul block {s_mm:.2f}×; activations "
            f"{fp_before.total_bytes // 1024} → {fp_after.total_bytes // 1024} KiB"
        )

    # 5 ---------------------------------------------------------------------------------------
    def conv_bn(self) -> str:
        try:
            fold_mod = importlib.import_module("gml.passes.fold_bn")
        except ImportError as exc:
            raise _NotAvailable(f"gml.passes.fold_bn ({exc})") from None
        from gml.capture import capture
        from gml.passes.manager import PassManager

        model = self.big_model()
        x = self.big_input()
        gm = capture(copy.deepcopy(model), (x,))
        bn_before = sum(1 for n in gm.graph.nodes if op_kind(n, modules_of(gm)) == "batchnorm")
        res = PassManager([fold_mod.FoldBatchNorm()]).run(gm, [(x,)])
        out = res.graph_module
        bn_after = sum(1 for n in out.graph.nodes if op_kind(n, modules_of(out)) == "batchnorm")
        with torch.no_grad():
            err, _ = _err(model(x), out(x))
        self.c.print(
            "In eval mode BN is y = s·(z − μ) + β with s = γ/√(σ²+ε), all constants; z = W∗x + b is "
            "linear in W and b, so W' = s·W and b' = s·(b − μ) + β give the same output with one op less."
        )
        self.c.print(res.report.table("FoldBatchNorm under the PassManager (lint + numerics checked)"))
        if res.report.skips:
            self.c.print(res.report.skip_table())
        outcome = f"{bn_before} → {bn_after} BatchNorm nodes, max |Δ| {err:.1e}"
        return outcome + self._fp32_pipeline(model, x)

    def _fp32_pipeline(self, model: nn.Module, x: torch.Tensor) -> str:
        """Folding is one pass of ``gml.optimize``; show the whole fp32 pipeline when it exists."""
        try:
            api = importlib.import_module("gml.api")
            res = api.optimize(copy.deepcopy(model), (x,))
        except (ImportError, AttributeError, NotImplementedError) as exc:
            self.c.print(f"[yellow]the full fp32 pipeline (gml.optimize) is not available yet: {exc}[/]")
            return ""
        self.c.print(res.report.table("The whole fp32 pipeline: gml.optimize"))
        with torch.no_grad():
            err, _ = _err(model(x), res.module(x))
        nodes = len(res.module.graph.nodes) if isinstance(res.module, fx.GraphModule) else "?"
        return f"; gml.optimize: {nodes} nodes, max |Δ| {err:.1e}"

    # 6 ---------------------------------------------------------------------------------------
    def int8(self) -> str:
        try:
            api = importlib.import_module("gml.api")
        except ImportError as exc:
            raise _NotAvailable(f"gml.api ({exc})") from None
        quantize = getattr(api, "quantize", None)
        if quantize is None:
            raise _NotAvailable("gml.quantize is not implemented yet")
        model = self.big_model()
        gen = torch.Generator().manual_seed(1)
        x = self.big_input(1, gen)
        calib = [(self.big_input(1, gen),) for _ in range(self.calib_batches)]
        check = [self.big_input(4, gen)]
        t0 = time.perf_counter()
        try:
            res = quantize(copy.deepcopy(model), calib, example_inputs=(x,))
        except (ImportError, NotImplementedError) as exc:
            raise _NotAvailable(f"gml.quantize: {exc}") from None
        build_s = time.perf_counter() - t0
        q = res.module
        run = getattr(res, "executable", q)  # the native engine where it covers the graph
        self.c.print(
            f"Calibrated on {len(calib)} generated batches, quantized and lowered in {build_s:.1f} s "
            "(observers → per-channel INT8 weights → Q/DQ graph → torch.ops.gml INT8 ops)."
        )
        if getattr(res, "runtime", None) is not None:
            self.c.print(str(res.runtime))
        report = getattr(res, "report", None)
        if report is not None and hasattr(report, "table"):
            self.c.print(report.table("INT8 pipeline"))
        if isinstance(q, fx.GraphModule):
            self.c.print(_ops_table(q, "Ops of the INT8 graph (most common)"))
        with torch.no_grad():
            ref, out = model(check[0]), run(check[0])
            err, cos = _err(ref, out)
            top1 = top1_agreement(ref, out)
            samples = time_interleaved(
                {"fp32 eager": lambda: model(x), "GML INT8": lambda: run(x)}, rounds=max(3, self.rounds // 2)
            )
        fp32_ms, int8_ms = (summarize(samples[k]).median for k in ("fp32 eager", "GML INT8"))
        agree = "" if top1 is None else f", top-1 agreement {100 * top1:.0f}%"
        self.c.print(
            f"vs fp32 on 4 held-out inputs: max |Δ| {err:.3f}, cosine {cos:.5f}{agree}; latency bs1 "
            f"{fp32_ms:.1f} ms → {int8_ms:.1f} ms ({fp32_ms / int8_ms:.2f}×)"
        )
        return f"cosine {cos:.4f}{agree}; {fp32_ms / int8_ms:.2f}× vs fp32 eager at bs1"

    def finish(self) -> None:
        self.c.print(Rule("[bold]Summary"))
        t = Table(title="GML-Lab tour")
        t.add_column("phase")
        t.add_column("result")
        t.add_column("s", justify="right")
        for row in self.summary:
            style = "yellow" if row[1].startswith("not available") else "red" if row[1].startswith("failed") else ""
            t.add_row(*row, style=style)
        self.c.print(t)
        self.c.print(
            "Next: `gml inspect resnet18`, `gml optimize resnet18`, `gml quantize resnet18`, "
            "`gml bench resnet18` (every peer side by side)."
        )


class _NotAvailable(Exception):
    """A stage of the project this phase needs has not landed yet."""


def run_demo(
    console: Console | None = None,
    *,
    model: nn.Module | None = None,
    rounds: int = 15,
    calib_batches: int = 4,
) -> int:
    """Walk every phase; 0 when no phase failed (phases whose stage is missing are only announced).

    ``model`` replaces ResNet18 in phases 1, 5 and 6 (the tests pass a smaller network).
    """
    console = console or Console(highlight=False)
    tour = _Tour(console, model, rounds, calib_batches)
    with torch.no_grad():
        tour.phase(1, "trace basics", tour.trace_basics)
        tour.phase(2, "manual Linear+ReLU fusion", tour.manual_fusion)
        tour.phase(3, "matmul+add+relu pattern rewrite", tour.pattern_rewrite)
        tour.phase(4, "fused vs unfused benchmark", tour.fused_benchmark)
        tour.phase(5, "Conv+BN folding", tour.conv_bn)
        tour.phase(6, "INT8 quantize + lower", tour.int8)
    tour.finish()
    return 1 if tour.failed else 0


def main() -> int:
    return run_demo()


if __name__ == "__main__":
    raise SystemExit(main())
