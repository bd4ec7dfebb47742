"""The INT8 cost policy: keep fp32 every INT8 region that is slower than its fp32 counterpart.

INT8 pays where a run of INT8 kernels is long enough to amortise the conversions around it. It
does not pay for an *island* — one conv between two fp32 ops, wrapped in a ``quantize`` and a
``dequantize`` —, for depthwise or tiny convs where those conversions cost more than the conv,
or for ops only the Python executor runs. Which regions lose depends on the CPU, the shapes and
the runtime, so the policy *measures* them, on the example input, with the runtime that will run
the model (:func:`gml.runtime.select.attach_runtime`: the native engine where it covers the graph).

Regions. After lowering, a *region* is a maximal connected set of nodes of the lowered graph whose
values are uint8, plus the ``gml.quantize`` nodes that enter it and the nodes that leave it (a
``gml.dequantize``, a conv/linear writing fp32). Regions are separated by fp32 ops, so each one
can be kept INT8 or fp32 on its own without changing the others.

The rule (per region ``R``, ``t`` = measured median latency at the example input's shapes)::

    t_int8(R) = time of R's lowered nodes, entry quantize and exit dequantize included,
                run the way the executable runs them (engine segments where the engine covers them)
    t_fp32(R) = time of the fp32 ops R replaced (the float twin's nodes), through the same fp32
                fusion passes and on the same runtime as a kept region runs
    keep R in INT8  iff  t_fp32(R) / t_int8(R) >= min_speedup     (default 1.0: never slower)

A region kept fp32 is rewritten in the *reference* graph (:func:`keep_fp32`): its ops take the
float twin's modules (no fake-quantized weights), the quantize → dequantize pairs between them
and their fp32 neighbours vanish, and each op is marked so the lowering leaves it fp32 with the
measured numbers as its reason (``coverage.kept_fp32``). Then the lowering runs again.

A region kept fp32 is then rewritten by the same fusion passes as ``gml.optimize``
(:func:`gml.quant.pipeline.fp32_remainder_passes`): it runs GML's fused fp32 kernels, on the engine
where the engine covers them.

A model with a single INT8 region is not timed region by region: that region is the whole INT8
model, which the last guard times against GML fp32 with a stricter margin.

Last guard (:func:`run_policy`): the whole INT8 executable against ``gml.optimize``'s model (GML
fp32, on the engine where it covers the graph), interleaved rounds (:attr:`CostReport.whole`). When
INT8 is slower than ``whole_margin`` (:data:`WHOLE_MARGIN`, 0.9) times that, INT8 cannot pay on this model:
``gml.quantize`` returns ``gml.optimize``'s model instead (:attr:`CostReport.all_fp32`), with both
numbers as the reason.

The policy takes its costs from a function (``cost(region) -> RegionCost``): :class:`MeasuredCost`
times the regions; tests inject fixed costs, so the decisions are deterministic there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from gml.ir.qdq import is_dequantize, is_quantize_any
from gml.ir.values import cloned
from gml.kernels.packs import drop_packed
from gml.memory import returns_memory, shared_copy, trim_malloc
from gml.passes.utils import remove_unused_nodes
from gml.quant.lower import KEEP_FP32_COST as KEEP_FP32  # node.meta key LowerToGML reads
from gml.runtime.options import COST_POLICIES
from gml.runtime.timing import median_ms_interleaved

#: the policies by name (one definition: gml.runtime.options, whose ``cost_policy`` sets the default)
POLICIES = COST_POLICIES

#: INT8 is returned only when the whole INT8 executable takes at most this fraction of the GML fp32
#: one's time. INT8 costs accuracy, so it has to buy a speed-up that survives noise: a 9-round guard
#: on a 50 ms model measured INT8 faster while an 11-round benchmark found it 1.10x slower
#: (timm pvt_v2_b0, docs/cost-policy.md). Within 10% the fp32 model is returned, with both numbers.
WHOLE_MARGIN = 0.9


@dataclass
class Region:
    """One INT8 region of a lowered graph."""

    index: int
    #: lowered-graph nodes: entry quantizes, INT8 ops, exit nodes (graph order)
    nodes: list[str]
    #: the reference-graph ops the region computes (what stays fp32 if it loses)
    covered: list[str]
    #: the gml op of each INT8 node, for the report
    ops: list[str]

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op] = counts.get(op, 0) + 1
        return ", ".join(f"{n}x {op}" if n > 1 else op for op, n in sorted(counts.items()))


@dataclass
class RegionCost:
    """Milliseconds of a region in INT8 and of its fp32 counterpart (None: not measured, and why)."""

    int8_ms: float | None
    fp32_ms: float | None
    note: str = ""


@dataclass
class RegionDecision:
    region: Region
    cost: RegionCost
    int8: bool
    reason: str


@dataclass
class CostReport:
    """What the cost policy measured and decided, region by region, and the whole-model guard."""

    policy: str
    decisions: list[RegionDecision] = field(default_factory=list)
    #: (INT8 ms, fp32 ms) of the whole INT8 executable vs gml.optimize's model (GML fp32)
    whole: tuple[float, float] | None = None
    shapes: str = ""
    notes: list[str] = field(default_factory=list)
    #: the whole-model guard found INT8 slower than GML fp32: gml.quantize returns gml.optimize's model
    all_fp32: bool = False

    @property
    def kept_fp32(self) -> list[RegionDecision]:
        return [d for d in self.decisions if not d.int8]

    @property
    def slower_than_fp32(self) -> bool:
        return self.whole is not None and self.whole[0] > self.whole[1]

    def __str__(self) -> str:
        if self.policy == "off":
            return "cost policy: off (every op with an INT8 kernel runs INT8)"
        lines = [
            f"cost policy: {len(self.decisions)} INT8 region(s) measured at {self.shapes}; "
            f"{len(self.kept_fp32)} kept fp32 (slower in INT8)"
        ]
        for d in self.kept_fp32:
            lines.append(f"  region {d.region.index} ({d.region.describe()}): {d.reason}")
        if self.whole is not None:
            i8, f32 = self.whole
            verdict = "INT8 is SLOWER than GML fp32" if i8 > f32 else f"{f32 / i8:.2f}x faster than GML fp32"
            lines.append(f"  whole model: INT8 {i8:.2f} ms vs GML fp32 (gml.optimize) {f32:.2f} ms ({verdict})")
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------- regions
def _is_u8(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.uint8
    if isinstance(value, list | tuple):
        return any(_is_u8(v) for v in value)
    return False


def record(gm: fx.GraphModule, inputs: Sequence[Any], keep: Collection[fx.Node] | None = None) -> dict[fx.Node, Any]:
    """Every node's value on ``inputs`` (a run of the Python executor on copies); with ``keep``,
    only those nodes' (the others are freed as the run goes: a whole model's activations at once
    were the build's peak, #28)."""
    from gml.runtime.compile import Recorder

    rec = Recorder(gm, keep)
    with torch.no_grad():
        rec.run(*cloned(inputs))
    return rec.values


def find_regions(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> list[Region]:
    """The INT8 regions of a lowered graph, given every node's value (see the module docstring)."""
    from gml.ir.library import gml_op_name
    from gml.quant.lower import LOWERED

    compute = ("call_function", "call_method", "call_module")
    member: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op not in compute:
            continue
        v = values.get(n)
        reads_u8 = any(_is_u8(values.get(a)) for a in n.all_input_nodes)
        if _is_u8(v) or (reads_u8 and isinstance(v, torch.Tensor)):
            member.add(n)
    parent: dict[fx.Node, fx.Node] = {n: n for n in member}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in member:
        for a in n.all_input_nodes:
            if a in member and _is_u8(values.get(a)):
                parent[find(a)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:  # graph order
        if n in member:
            groups.setdefault(find(n), []).append(n)
    regions = []
    for nodes in groups.values():
        covered: list[str] = []
        ops: list[str] = []
        for n in nodes:
            entry = n.meta.get(LOWERED)
            if entry is not None:
                covered += [c for c in entry.nodes if c not in covered]
            name = gml_op_name(n)
            if name not in (None, "quantize", "dequantize", "requantize"):
                ops.append(name)
        if not ops:  # a quantize read only by a dequantize, or by shape queries: nothing to decide
            continue
        regions.append(Region(len(regions), [n.name for n in nodes], covered, ops))
    return regions


# ---------------------------------------------------------------- measuring
def _read_by(gm: fx.GraphModule, groups: Sequence[Sequence[str]]) -> set[fx.Node]:
    """The nodes of ``gm`` that the node groups (names) read from outside themselves: what timing
    each group as a :func:`subgraph` needs as inputs."""
    out: set[fx.Node] = set()
    nodes = {n.name: n for n in gm.graph.nodes}
    for names in groups:
        inside = set(names)
        for name in names:
            n = nodes.get(name)
            if n is not None:
                out.update(a for a in n.all_input_nodes if a.name not in inside)
    return out


def subgraph(gm: fx.GraphModule, names: Sequence[str]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``gm``'s nodes ``names`` as a GraphModule of their own: ``(module, the outside nodes it
    reads, in placeholder order)``; it returns, as a tuple, every member read outside it."""
    wanted = set(names)
    nodes = [n for n in gm.graph.nodes if n.name in wanted]
    inside = set(nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    outside: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a in env:
                continue
            if a.op == "get_attr":
                env[a] = g.get_attr(str(a.target))
            else:
                env[a] = g.placeholder(f"in_{len(outside)}")
                outside.append(a)
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    g.output(tuple(env[n] for n in outs))
    return fx.GraphModule(gm, g), outside


class MeasuredCost:
    """``cost(region)`` by timing, on the example input's values, the region as the runtime runs it
    (engine segments where the engine covers its nodes, torch otherwise) and the float twin's ops it
    replaced as they run when the region stays fp32 (GML's fused fp32 kernels, same runtime)."""

    def __init__(
        self,
        lowered: fx.GraphModule,
        twin: fx.GraphModule,
        inputs: Sequence[Any],
        *,
        runtime: str = "engine",
        rounds: int = 5,
        lowered_values: dict[fx.Node, Any] | None = None,
        regions: Sequence[Region] | None = None,
    ) -> None:
        self.lowered, self.twin, self.runtime, self.rounds = lowered, twin, runtime, rounds
        self.values = lowered_values if lowered_values is not None else record(lowered, inputs)
        # given the regions to time, only the values they read are kept (of both graphs)
        twin_keep = None
        if regions is not None:
            self.values = {n: v for n, v in self.values.items() if n in _read_by(lowered, [r.nodes for r in regions])}
            twin_keep = _read_by(twin, [r.covered for r in regions])
        self.twin_values = record(twin, inputs, twin_keep)
        #: the graphs built to time the current region, emptied once it is timed (see __call__)
        self._scratch: list[fx.GraphModule] = []

    def _on_runtime(self, sub: fx.GraphModule) -> Callable[..., Any]:
        """``sub`` as the runtime runs it: engine segments where the engine covers its nodes."""
        if self.runtime != "engine":
            return sub
        from gml.runtime import native
        from gml.runtime.compile import partition

        try:
            native.load()
            run, _ = partition(sub)
        except Exception:  # no engine build: the Python executor runs the model too
            return sub
        self._scratch.append(run)
        return run

    def _int8_fn(self, region: Region) -> Callable[[], Any]:
        sub, outside = subgraph(self.lowered, region.nodes)
        self._scratch.append(sub)
        args = [self.values[a] for a in outside]
        run = self._on_runtime(sub)
        return lambda: run(*args)

    def _fp32_fn(self, region: Region) -> Callable[[], Any]:
        """The float twin's ops of ``region`` as they run when the region stays fp32: through the
        fp32 remainder passes (GML's fused fp32 kernels), on the runtime."""
        from gml.passes.manager import PassManager
        from gml.quant.pipeline import fp32_remainder_passes

        names = {n.name for n in self.twin.graph.nodes}
        missing = [c for c in region.covered if c not in names]
        if missing:
            raise LookupError(f"no fp32 counterpart for {', '.join(missing[:3])}")
        sub, outside = subgraph(self.twin, region.covered)
        args = [self.twin_values[a] for a in outside]
        # a copy sharing the twin's weights: the remainder passes replace tensors, never write them
        # (passes/INVARIANTS.md 11; the pass manager checks), so a deep copy would only duplicate
        # the region's fp32 weights for as long as it is timed (#28)
        fused = PassManager(fp32_remainder_passes(), check_numerics=False).run(shared_copy(sub), [tuple(args)])
        self._scratch += [sub, fused.graph_module]
        run = self._on_runtime(fused.graph_module)
        return lambda: run(*args)

    def __call__(self, region: Region) -> RegionCost:
        try:
            f8, f32 = self._int8_fn(region), self._fp32_fn(region)
            t8, t32 = median_ms_interleaved([f8, f32], rounds=self.rounds)
        except Exception as e:  # a region we cannot time stays as the lowering made it
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return RegionCost(None, None, f"not measured ({first[:160]})")
        finally:
            self._release_scratch()
        return RegionCost(t8, t32)

    def _release_scratch(self) -> None:
        """Empty the graphs one region was timed with (:func:`gml.memory.release`): fx graphs are
        reference cycles, so without it every region's fp32 weights folded for timing and both
        engine plans (reordered weights) stayed resident until the next full garbage collection —
        on a model of many regions, every region's at once. Modules shared with the lowered graph
        or the float twin (a subgraph holds theirs) are left alone."""
        from gml.memory import release

        scratch, self._scratch = self._scratch, []
        for gm in reversed(scratch):
            release(gm, keep=[self.lowered, self.twin])


# ---------------------------------------------------------------- deciding
def decide(
    regions: Sequence[Region], cost: Callable[[Region], RegionCost], *, min_speedup: float = 1.0
) -> list[RegionDecision]:
    """The rule of the module docstring, region by region (``cost`` may be measured or injected)."""
    out = []
    for r in regions:
        c = cost(r)
        if c.int8_ms is None or c.fp32_ms is None:
            out.append(RegionDecision(r, c, True, c.note or "not measured; kept as lowered"))
            continue
        speedup = c.fp32_ms / c.int8_ms if c.int8_ms > 0 else float("inf")
        int8 = speedup >= min_speedup
        why = f"INT8 {c.int8_ms:.3f} ms (with its quantize/dequantize) vs fp32 {c.fp32_ms:.3f} ms measured" + (
            "" if int8 else "; kept fp32 (cost policy)"
        )
        out.append(RegionDecision(r, c, int8, why))
    return out


# ---------------------------------------------------------------- applying
def keep_fp32(
    reference: fx.GraphModule, twin: fx.GraphModule, keep: dict[str, str], int8_ops: set[str] | None = None
) -> fx.GraphModule:
    """A copy of the reference Q/DQ graph where the ops named in ``keep`` (name → reason) run fp32.

    Before: ``… DQ → conv_ref → Q → DQ → relu → Q → DQ …`` (all of it INT8 after lowering).
    After, for ``keep = {conv, relu}`` between INT8 neighbours: ``… DQ → conv → relu → Q …``:
    each kept op takes the float twin's module (fp32 weights: no fake-quantized copy per call);
    a kept op reads the fp32 value directly (no ``Q → DQ`` rounding) unless an INT8 op that stays
    INT8 produced it (then the ``DQ`` stays: a ``gml.dequantize`` after lowering); an INT8 reader
    of a kept op keeps its ``Q → DQ`` (a ``gml.quantize``). Each kept op is marked
    (``node.meta[KEEP_FP32]``): :class:`~gml.quant.lower.LowerToGML` leaves it fp32 and reports
    the reason. Exact where it removes a pair (fp32 is what the reference approximates).
    ``int8_ops``: the reference ops the lowering made INT8 (default: every op next to a Q/DQ pair).
    """
    from gml.quant.lower import KEPT_FP32, CoverageEntry

    # copies sharing the reference's and the twin's tensors: the lowering that runs on this graph
    # replaces tensors, never writes them (passes/INVARIANTS.md 11), so deep copies would only
    # duplicate the fp32 weights while it runs (#28)
    gm = shared_copy(reference)
    nodes = {n.name: n for n in gm.graph.nodes}
    twin_modules = dict(twin.named_modules())
    modules = dict(gm.named_modules())
    quantized = int8_ops if int8_ops is not None else _int8_ops(gm)
    remaining = quantized - set(keep)
    for name, reason in keep.items():
        node = nodes.get(name)
        if node is None:
            continue
        node.meta[KEEP_FP32] = reason
        node.meta[KEPT_FP32] = CoverageEntry([name], _label(node, modules), "fp32", reason)
        if node.op == "call_module":
            target = str(node.target)
            mod = twin_modules.get(target)
            if mod is not None and type(mod) is not type(modules.get(target)):
                _set_submodule(gm, target, shared_copy(mod))
    dead: list[fx.Node] = []
    for dq in [n for n in gm.graph.nodes if is_dequantize(n)]:
        q = dq.args[0]
        if not (isinstance(q, fx.Node) and is_quantize_any(q)) or not isinstance(q.args[0], fx.Node):
            continue
        v = q.args[0]
        if v.name in remaining:
            continue  # an INT8 value read in fp32: a gml.dequantize after lowering
        for u in list(dq.users):
            if u.name not in remaining and (u.name in keep or v.name in keep):
                u.replace_input_with(dq, v)
        dead.append(dq)
    remove_unused_nodes(gm.graph, dead)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def _int8_ops(gm: fx.GraphModule) -> set[str]:
    """Names of ops that read a dequantize or whose result is quantized."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if is_quantize_any(n) and isinstance(n.args[0], fx.Node):
            out.add(n.args[0].name)
        elif not is_dequantize(n) and any(is_dequantize(a) for a in n.all_input_nodes):
            out.add(n.name)
    return out


def _label(node: fx.Node, modules: dict[str, Any]) -> str:
    from gml.passes.oplib import node_label

    return node_label(node, modules)


def _set_submodule(gm: fx.GraphModule, target: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = target.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    setattr(parent, attr, module)


@returns_memory  # its garbage (replaced weights, timing graphs) handed back before the next stage (#28)
def plan_regions(
    lowered: fx.GraphModule,
    reference: fx.GraphModule,
    twin: fx.GraphModule,
    inputs: Sequence[Any],
    *,
    runtime: str = "engine",
    cost: Callable[[Region], RegionCost] | None = None,
    min_speedup: float = 1.0,
    rounds: int = 5,
) -> tuple[fx.GraphModule | None, CostReport]:
    """Decide every INT8 region of ``lowered``; ``(reference graph to lower again, or None when
    every region stays INT8, the report)``. ``cost`` defaults to :class:`MeasuredCost`."""
    from gml.quant.lower import LOWERED

    values = record(lowered, inputs)
    regions = find_regions(lowered, values)
    shapes = ", ".join("x".join(map(str, t.shape)) for t in inputs if isinstance(t, torch.Tensor))
    report = CostReport("measure", shapes=shapes)
    if not regions:
        return None, report
    if cost is None and len(regions) == 1:
        # The only region is all of the model's INT8: timing it against its fp32 ops built a second
        # fp32 model (and engine) for what the whole-model guard measures next anyway, whole INT8
        # executable vs GML fp32 with the stricter WHOLE_MARGIN; that build was the peak of
        # gml.quantize on ResNet18 (#28). The guard decides it.
        only = "the model's only INT8 region: the whole-model guard decides it"
        report.decisions = [RegionDecision(regions[0], RegionCost(None, None, only), True, only)]
        return None, report
    if cost is None:
        cost = MeasuredCost(
            lowered, twin, inputs, runtime=runtime, rounds=rounds, lowered_values=values, regions=regions
        )
    del values  # what the regions read is in the MeasuredCost
    report.decisions = decide(regions, cost, min_speedup=min_speedup)
    keep: dict[str, str] = {}
    for d in report.kept_fp32:
        why = f"cost policy: region {d.region.index} ({d.region.describe()}) {d.reason}"
        keep.update({name: why for name in d.region.covered})
    if not keep:
        return None, report
    int8 = {c for n in lowered.graph.nodes if LOWERED in n.meta for c in n.meta[LOWERED].nodes}
    return keep_fp32(reference, twin, keep, int8), report


def guard_whole_model(
    executable: Any, fp32: Callable[[], Any], inputs: Sequence[Any], *, rounds: int = 9
) -> tuple[float, float]:
    """(INT8 ms, fp32 ms): the INT8 executable against the fp32 one (``fp32()`` builds it:
    gml.optimize's), interleaved."""
    args = cloned(inputs)
    reference = fp32()
    t8, t32 = median_ms_interleaved([lambda: executable(*args), lambda: reference(*args)], rounds=rounds, min_ms=0.0)
    return t8, t32


def run_policy(
    lowered: Any,
    reference: fx.GraphModule,
    twin: fx.GraphModule,
    inputs: Sequence[Any],
    *,
    policy: str | Callable[[Region], RegionCost],
    runtime: str,
    relower: Callable[[fx.GraphModule], Any],
    attach: Callable[[fx.GraphModule], tuple[Any, Any]],
    fp32: Callable[[], Any],
    strict: bool = False,
    whole_margin: float = WHOLE_MARGIN,
) -> tuple[Any, Any, Any, CostReport]:
    """The policy inside ``gml.quantize``: ``(pass result, engine, runtime report, CostReport)``.

    ``lowered`` is the lowering's PassManager result, ``relower(reference) -> result`` runs the
    lowering again, ``attach(gm) -> (engine or None, report)`` picks the runtime and ``fp32()``
    returns the executable of ``gml.optimize``'s model. Regions are measured with the runtime that
    will run them (the engine unless it declines this graph). Last guard: when the whole INT8
    executable is slower than ``whole_margin`` times the fp32 one, the report says so
    (``all_fp32``, both numbers in ``whole``) and the caller returns the fp32 model instead.
    """
    if policy == "off":
        engine, runtime_report = attach(lowered.graph_module)
        return lowered, engine, runtime_report, CostReport("off")
    given = policy if callable(policy) else None
    result = lowered
    try:
        measure_on = runtime
        if runtime == "engine" and attach(lowered.graph_module)[0] is None:
            measure_on = "torch"  # the engine declines this graph: the Python executor will run it
        trim_malloc()  # that trial engine's plan and reordered weights are garbage now (#28)
        kept_ref, cost = plan_regions(lowered.graph_module, reference, twin, inputs, runtime=measure_on, cost=given)
        if kept_ref is not None:
            result = relower(kept_ref)
    except Exception as e:  # the lowering's result stands; the report says the policy did not run
        if strict:
            raise
        return (lowered, *attach(lowered.graph_module), CostReport("measure", notes=[_failed(e)]))
    # the fp32 model first: the transient copies its build makes (the Python executor's packed
    # weights while its engine is checked) then never sit beside the INT8 engine (#28); and the
    # INT8 graph's packed weights (made by the trial engine's check and the region timing) dropped
    # before it: the INT8 engine built next packs what it needs itself
    drop_packed(result.graph_module)
    trim_malloc()
    try:
        reference = fp32()
    except Exception as e:
        if strict:
            raise
        cost.notes.append(f"whole-model guard not measured ({type(e).__name__}: {e})")
        return (result, *attach(result.graph_module), cost)
    engine, runtime_report = attach(result.graph_module)
    try:
        from gml.runtime.compile import python_executor

        # what the result's executable will be: the engine, or the executor with its glue cached
        runner = engine if engine is not None else python_executor(result.graph_module)
        cost.whole = guard_whole_model(runner, lambda: reference, inputs)
    except Exception as e:
        if strict:
            raise
        cost.notes.append(f"whole-model guard not measured ({type(e).__name__}: {e})")
        return result, engine, runtime_report, cost
    i8, f32 = cost.whole
    if i8 <= whole_margin * f32 or not cost.decisions:
        return result, engine, runtime_report, cost
    cost.all_fp32 = True
    cost.notes.append(
        f"whole model INT8 {i8:.2f} ms vs GML fp32 {f32:.2f} ms (more than {whole_margin:.0%}): INT8 cannot pay here; "
        "gml.optimize's model is returned"
    )
    return result, engine, runtime_report, cost


def _failed(e: Exception) -> str:
    return f"cost policy failed ({type(e).__name__}: {e}); every region kept INT8"


def check_policy(policy: str | Callable[[Region], RegionCost]) -> None:
    """An :class:`~gml.errors.InputError` unless ``policy`` is one of :data:`POLICIES` or a cost function."""
    from gml.errors import InputError

    if not callable(policy) and policy not in POLICIES:
        raise InputError(f"unknown cost_policy {policy!r}.", hint=f"use one of: {', '.join(POLICIES)}.")


__all__ = [
    "KEEP_FP32",
    "POLICIES",
    "CostReport",
    "MeasuredCost",
    "Region",
    "RegionCost",
    "RegionDecision",
    "check_policy",
    "decide",
    "find_regions",
    "guard_whole_model",
    "keep_fp32",
    "plan_regions",
    "run_policy",
    "subgraph",
]
