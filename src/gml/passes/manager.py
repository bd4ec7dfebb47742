"""Run an explicit, ordered pass pipeline and check every pass as it goes.

For each pass the manager

1. snapshots the module: a deep copy of its graph and submodules that *shares* every tensor
   (parameters, buffers, tensor attributes) with the module — passes never write a tensor in place
   (``INVARIANTS.md`` 11), so a snapshot costs the graph, not a second copy of the weights; the
   tensors' version counters and data pointers are checked after the pass, and a pass declaring
   ``writes_tensors = True`` gets a full copy,
2. runs the pass and times it,
3. checks ``graph.lint()``, recompiles, and runs the sample inputs,
4. compares the outputs with the outputs *before* the pass, within the pass's
   :class:`~gml.passes.base.Tolerance` (``None``: only shapes and finiteness are checked),
5. on any failure (lint, numerics, an exception inside the pass) restores the snapshot, so no
   half-rewritten module survives, and records why; with ``strict=True`` it raises
   :class:`~gml.errors.PassFailure` instead.

The result carries a :class:`PipelineReport`: per pass, nodes before/after, matches, skipped
candidates with reasons, max abs error and wall time.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._pytree import tree_flatten

from gml.errors import GMLError, PassFailure
from gml.memory import module_tensors, release, returns_memory, shared_copy
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance


@dataclass
class PassRecord:
    """One line of the pipeline report."""

    name: str
    status: str  # "applied" | "unchanged" | "rolled back"
    nodes_before: int
    nodes_after: int
    matches: int = 0
    skips: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_abs_err: float | None = None
    wall_ms: float = 0.0
    error: str | None = None


@dataclass
class PipelineReport:
    records: list[PassRecord] = field(default_factory=list)

    @property
    def rolled_back(self) -> list[PassRecord]:
        return [r for r in self.records if r.status == "rolled back"]

    @property
    def skips(self) -> list[tuple[str, Skip]]:
        """Every declined candidate of every pass: the missed-fusion report."""
        return [(r.name, s) for r in self.records for s in r.skips]

    def record(self, name: str) -> PassRecord:
        for r in self.records:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"passes": [asdict(r) for r in self.records]}

    def table(self, title: str = "Pass pipeline"):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=title)
        for col in ("pass", "status", "nodes", "matches", "skipped", "max |err|", "ms"):
            t.add_column(col, justify="right" if col not in ("pass", "status") else "left")
        for r in self.records:
            err = "-" if r.max_abs_err is None else f"{r.max_abs_err:.2e}"
            style = {"rolled back": "red", "applied": "green"}.get(r.status, "")
            t.add_row(
                r.name,
                f"[{style}]{r.status}[/]" if style else r.status,
                f"{r.nodes_before} → {r.nodes_after}",
                str(r.matches),
                str(len(r.skips)),
                err,
                f"{r.wall_ms:.1f}",
            )
        return t

    def skip_table(self, title: str = "Declined candidates (missed fusions)"):
        from rich.table import Table

        t = Table(title=title)
        for col in ("pass", "pattern", "node", "reason"):
            t.add_column(col)
        for name, s in self.skips:
            t.add_row(name, s.pattern, s.node, s.reason)
        for r in self.rolled_back:
            t.add_row(r.name, "(whole pass)", "-", f"rolled back: {r.error}")
        return t


@dataclass
class PipelineResult:
    graph_module: fx.GraphModule
    report: PipelineReport


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def run_outputs(gm: torch.nn.Module, sample_inputs: Sequence[tuple]) -> list[list[torch.Tensor]]:
    """Outputs of ``gm`` on each sample input tuple, flattened, as dense fp tensors."""
    outs = []
    with torch.no_grad():
        for args in sample_inputs:
            # fresh copies: a model that writes its input in place must not see the last run's write
            flat = _flat_outputs(gm(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
            outs.append([t.dequantize() if t.is_quantized else t.to_dense() if t.is_mkldnn else t for t in flat])
    return outs


def compare_outputs(
    ref: list[list[torch.Tensor]], new: list[list[torch.Tensor]], tol: Tolerance | None
) -> tuple[float, str | None]:
    """Max abs error between two output sets and, if they disagree beyond ``tol``, why."""
    worst = 0.0
    for i, (r_out, n_out) in enumerate(zip(ref, new)):
        if len(r_out) != len(n_out):
            return math.inf, f"sample {i}: {len(n_out)} outputs instead of {len(r_out)}"
        for j, (r, n) in enumerate(zip(r_out, n_out)):
            if r.shape != n.shape:
                return math.inf, f"sample {i} output {j}: shape {tuple(n.shape)} instead of {tuple(r.shape)}"
            if not r.is_floating_point():
                if not torch.equal(r, n):
                    return math.inf, f"sample {i} output {j}: integer output changed"
                continue
            n = n.to(r.dtype)
            fin_r, fin_n = torch.isfinite(r), torch.isfinite(n)
            if not (fin_r.all() and fin_n.all()):
                # NaN/Inf must sit where they sat (an optimizer must neither create nor hide them),
                # and be the same non-finite value; the finite rest is compared as usual
                if not torch.equal(fin_r, fin_n):
                    what = "appeared" if fin_r.sum() > fin_n.sum() else "disappeared"
                    return math.inf, f"sample {i} output {j}: NaN/Inf {what}"
                same = torch.equal(r.isnan(), n.isnan()) and torch.equal(r[r.isinf()], n[n.isinf()])
                if not same:
                    return math.inf, f"sample {i} output {j}: NaN/Inf changed"
                r, n = r[fin_r], n[fin_n]
            diff = (r - n).abs()
            err = float(diff.max()) if diff.numel() else 0.0
            worst = max(worst, err)
            if tol is not None:
                # Scale-aware bound: float reassociation errors scale with the output's magnitude,
                # not with each element's (an element near zero has no smaller error).
                ref_max = float(r.abs().max()) if r.numel() else 0.0
                bound = tol.atol + tol.rtol * ref_max
                if err > bound:
                    return worst, (
                        f"sample {i} output {j}: max abs error {err:.3g} exceeds "
                        f"atol={tol.atol:g} + rtol={tol.rtol:g}*max|ref| = {bound:.3g}"
                    )
    return worst, None


def _refresh_shapes(gm: fx.GraphModule, args: tuple) -> str | None:
    """Refill ``tensor_meta``; on failure, a note (metadata is a convenience, never fatal).

    On copies (a model that writes its input must not change the caller's sample) and without
    autograd (a buffer forward() updates must stay a leaf the next snapshot can copy)."""
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    except Exception as e:
        return f"shape propagation failed: {e}"
    return None


def _node_shapes(gm: fx.GraphModule) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """``name → (op, target, shape)`` of every node with a single-tensor ``tensor_meta``."""
    shapes = {}
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta")
        shape = getattr(meta, "shape", None)
        if shape is not None and n.op != "output":
            shapes[n.name] = (n.op, str(n.target), tuple(shape))
    return shapes


def _shape_change(before: dict[str, tuple], after: dict[str, tuple]) -> str | None:
    """Why a pass changed an intermediate value's shape, or ``None``.

    Comparing outputs alone misses a rewrite that shrinks a feature map in the middle of a network
    whose head pools it back to the same logits shape (a "same"-padded conv lowered without its
    padding: 7x7 became 4x4, the logits kept their shape). A node that survives the pass (same
    name, op and target) must keep its shape.
    """
    for name, (op, target, shape) in before.items():
        new = after.get(name)
        if new is not None and new[:2] == (op, target) and new[2] != shape:
            return (
                f"intermediate value {name} ({op} {target}) changed shape from {list(shape)} to "
                f"{list(new[2])}: the rewrite does not compute what it replaced"
            )
    return None


def _data_ptr(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # an opaque (mkldnn) tensor: its version counter is what is checked
        return 0


class Snapshot:
    """A copy of a module to roll back to, sharing its tensors (copy-on-write per pass).

    ``copy.deepcopy`` with every tensor of the module pre-seeded in the memo: the graph, the nodes
    and the submodules are copied, the weights are not. A pass replaces a tensor it changes (a new
    ``Parameter``, a copied module), which leaves the snapshot's untouched; :meth:`written` lists
    the tensors a pass wrote in place instead, which a rollback could not undo. ``share=False``:
    a full copy (a pass that declares ``writes_tensors``)."""

    def __init__(self, gm: fx.GraphModule, *, share: bool = True) -> None:
        self.module: fx.GraphModule = shared_copy(gm) if share else copy.deepcopy(gm)
        self._stamps = [(t, t._version, _data_ptr(t)) for t in (module_tensors(gm) if share else [])]

    def written(self) -> int:
        """How many shared tensors were written in place (or given new data) since the snapshot."""
        return sum(t._version != v or _data_ptr(t) != p for t, v, p in self._stamps)

    def discard(self, live: fx.GraphModule) -> None:
        """The pass was accepted: empty the snapshot now (:func:`gml.memory.release`). It is a
        reference cycle holding the tensors the pass replaced (a folded BN's conv weight, the fp32
        weight the INT8 lowering quantized), which would otherwise stay resident beside their
        replacements until the next full garbage collection (issue #28)."""
        self._stamps = []
        release(self.module, keep=[live])


class PassManager:
    """Runs passes in the given order with per-pass lint and numeric checks and rollback.

    Args:
        passes: the pipeline, in order. Order is explicit; nothing is discovered or registered.
        strict: raise :class:`PassFailure` on the first broken pass instead of rolling back.
        check_numerics: compare outputs before/after each pass (needs ``sample_inputs`` in :meth:`run`).
        propagate_shapes: refresh ``node.meta['tensor_meta']`` after each applied pass.
    """

    def __init__(
        self,
        passes: Sequence[GraphPass],
        *,
        strict: bool = False,
        check_numerics: bool = True,
        propagate_shapes: bool = True,
    ) -> None:
        self.passes = list(passes)
        self.strict = strict
        self.check_numerics = check_numerics
        self.propagate_shapes = propagate_shapes

    @returns_memory  # a pipeline that grew the process hands its garbage back (replaced weights, #28)
    def run(self, gm: fx.GraphModule, sample_inputs: Sequence[tuple] | None = None) -> PipelineResult:
        """Run the pipeline. ``gm`` may be mutated; use the returned module."""
        report = PipelineReport()
        samples = list(sample_inputs or [])
        if self.check_numerics and not samples:
            raise ValueError("check_numerics=True needs sample_inputs")
        ref = run_outputs(gm, samples) if self.check_numerics else []
        if self.propagate_shapes and samples:
            _refresh_shapes(gm, samples[0])  # the intermediate shapes each pass is checked against
        for p in self.passes:
            gm, ref = self._run_one(p, gm, samples, ref, report)
        return PipelineResult(gm, report)

    def _run_one(
        self,
        p: GraphPass,
        gm: fx.GraphModule,
        samples: list[tuple],
        ref: list[list[torch.Tensor]],
        report: PipelineReport,
    ) -> tuple[fx.GraphModule, list[list[torch.Tensor]]]:
        name = p.pass_name
        snap = Snapshot(gm, share=not getattr(p, "writes_tensors", False))
        snapshot = snap.module
        nodes_before = len(gm.graph.nodes)
        t0 = time.perf_counter()
        result: PassResult | None = None
        error: str | None = None
        max_err: float | None = None
        new_ref = ref
        try:
            result = p(gm)
            gm = result.graph_module
            gm.graph.lint()
            gm.recompile()
        except GMLError as e:
            error = f"{type(e).__name__}: {e.message}"
        except Exception as e:  # a pass that crashes must not take the model down with it
            error = f"pass raised {type(e).__name__}: {e}"
        wall_ms = (time.perf_counter() - t0) * 1e3
        shapes_before = _node_shapes(snapshot)
        if error is None and self.check_numerics and result is not None and result.modified:
            try:
                new_ref = run_outputs(gm, samples)
                max_err, why = compare_outputs(ref, new_ref, p.tolerance)
                if why is not None:
                    error = f"numerics: {why}"
            except Exception as e:
                error = f"rewritten module failed to run: {type(e).__name__}: {e}"
        if error is None and result is not None and result.modified and self.propagate_shapes and samples:
            note = _refresh_shapes(gm, samples[0])
            if note:
                result.notes.append(note)
            else:
                error = _shape_change(shapes_before, _node_shapes(gm))
        if error is not None and snap.written():
            # the snapshot shares the tensors this pass wrote: rolling back would keep the writes
            raise PassFailure(
                f"pass {name!r} failed ({error}) after writing {snap.written()} weight tensor(s) in place, "
                "so it cannot be rolled back",
                hint="a pass replaces the tensors it changes (passes/INVARIANTS.md 11); one that must write "
                "in place sets writes_tensors = True to get a full snapshot",
            )
        if error is not None:
            if self.strict:
                raise PassFailure(
                    f"pass {name!r} broke the model: {error}",
                    hint="run without strict to roll the pass back and continue",
                )
            report.records.append(
                PassRecord(
                    name,
                    "rolled back",
                    nodes_before,
                    nodes_before,
                    matches=result.matches if result else 0,
                    skips=result.skips if result else [],
                    max_abs_err=max_err,
                    wall_ms=wall_ms,
                    error=error,
                )
            )
            return snapshot, ref
        assert result is not None
        report.records.append(
            PassRecord(
                name,
                "applied" if result.modified else "unchanged",
                nodes_before,
                len(gm.graph.nodes),
                matches=result.matches,
                skips=result.skips,
                notes=result.notes,
                max_abs_err=max_err,
                wall_ms=wall_ms,
            )
        )
        snap.discard(gm)
        return gm, new_ref
