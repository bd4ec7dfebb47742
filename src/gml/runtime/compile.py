"""Compile a lowered GraphModule for the native engine: partition, segments, shape-keyed plans.

Partition: every node the translation table (:mod:`gml.runtime.rules`) accepts is an engine
node; each maximal run of engine nodes (in graph order) becomes one :class:`EngineSegment` module,
and everything else stays a torch node between segments. The result is an ordinary GraphModule
(``EngineModule.graph_module``), so mixed graphs run as they did, with the segments as single calls.

A segment compiles a plan per input layout (shape, strides, dtype): it runs its own Python executor
(the original nodes, kept as ``segment.reference``) once on copies of the inputs to learn every
value's layout, translates the nodes, plans the arena and creates the oneDNN primitives
(:mod:`gml.runtime.plan`). A shape the engine cannot plan runs the reference for that shape, and the
report says why.
"""

from __future__ import annotations

import operator
import statistics
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Collection, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from gml.errors import InputError, UnsupportedError
from gml.inference import inputs_by_name, refuse_grad_inputs, refuse_nonfinite_inputs
from gml.ir.target import Target
from gml.ir.values import INPUT_NAME
from gml.kernels.fp32 import all_finite, no_nan
from gml.runtime import native, timing
from gml.runtime.direct_call import DirectCall, any_global_hooks, specialise
from gml.runtime.options import EngineOptions, resolve_options
from gml.runtime.plan import Builder
from gml.runtime.rules import Unsupported, read_call, rule_for
from gml.runtime.rules.attention import mask_only_inputs
from gml.runtime.rules.shape import SIZE_INPUT, is_size, read_size
from gml.runtime.shape_values import cache_guards, cache_shape_values, schedule_for_engine

#: Plans a segment keeps (one per input layout seen; the oldest goes first beyond this).
MAX_PLANS = 8

#: set by EngineModule.profile(): segments then run their plans with per-step timing and append
#: ``(segment, plan, [µs per step])`` here
_PROFILE: ContextVar[list | None] = ContextVar("gml_engine_profile", default=None)


@dataclass
class StepTime:
    """One native step of a profile (:meth:`EngineModule.profile`): which segment, the node it came
    from, the implementation that ran (oneDNN's, e.g. ``brg:avx512_core_bf16``, or GML's own, e.g.
    ``gml:attention_avx512_bf16``) and its median wall time."""

    segment: int
    step: str
    impl: str
    us: float


@dataclass
class NodeReport:
    name: str
    op: str
    runs_in: str  # "engine" | "torch"
    reason: str = ""


@dataclass
class RuntimeReport:
    """Which path ran: per node, engine or torch and why; per segment, its shape fallbacks."""

    runtime: str  # "engine" | "torch"
    nodes: list[NodeReport] = field(default_factory=list)
    segments: int = 0
    note: str = ""
    shape_fallbacks: dict[str, str] = field(default_factory=dict)
    #: convs the example input's plans run as Winograd (docs/adr/010-winograd-conv.md) ...
    winograd_convs: int = 0
    #: ... of which INT8 ones with 4x4 output tiles, F(4x4, 3x3) (the rest F(2x2, 3x3))
    winograd_4x4_convs: int = 0
    #: INT8 convs with few input channels the plans run as GML's patch GEMM (native/im2col_int8.h)
    im2col_convs: int = 0
    #: depthwise INT8 convs the plans run as GML's tap-pair kernel (native/dw_int8.h)
    dw_convs: int = 0
    #: the CPU the plans are built for (gml.ir.target; detected once at the API boundary)
    target: Target | None = None
    #: the engine's switches the plans are built with (gml.runtime.options; set at the API boundary)
    options: EngineOptions = field(default_factory=EngineOptions)
    #: what the plan changed for this target (e.g. a saved model's 8-bit weights requantized to 7 bits)
    changes: list[str] = field(default_factory=list)
    #: plans built without GML's own convs because the whole plan timed faster without them
    #: (EngineSegment._whole_plan_check), by plan key: the measurement
    own_convs_dropped: dict[str, str] = field(default_factory=dict)
    #: steps of the built plans that run a oneDNN reference kernel (:func:`is_reference_impl`), by
    #: step name: a bug (a layout or formulation oneDNN has no jitted kernel for), never expected
    reference_steps: dict[str, str] = field(default_factory=dict)

    @property
    def engine_nodes(self) -> int:
        return sum(n.runs_in == "engine" for n in self.nodes)

    @property
    def torch_nodes(self) -> list[NodeReport]:
        return [n for n in self.nodes if n.runs_in == "torch"]

    @property
    def path(self) -> str:
        """``engine`` (every compute node), ``mixed``, or ``torch``."""
        if self.runtime == "torch" or self.engine_nodes == 0:
            return "torch"
        return "engine" if not self.torch_nodes and not self.shape_fallbacks else "mixed"

    def __str__(self) -> str:
        lines = [
            f"runtime: {self.path} ({self.engine_nodes} nodes in {self.segments} engine segment(s), "
            f"{len(self.torch_nodes)} in torch)"
        ]
        if self.target is not None:
            lines.append(f"  target: {self.target.describe()}")
        lines += [f"  changed for this CPU: {c}" for c in self.changes]
        if self.note:
            lines.append(f"  {self.note}")
        if self.winograd_convs:
            n, n4 = self.winograd_convs, self.winograd_4x4_convs
            tiles = f"{n - n4} F(2x2, 3x3), {n4} INT8 F(4x4, 3x3)" if n4 else "F(2x2, 3x3)"
            lines.append(
                f"  {n} 3x3 conv(s) run as Winograd, {tiles} (winograd='0', GML_WINOGRAD=0: direct convs only)"
            )
        if self.im2col_convs:
            lines.append(
                f"  {self.im2col_convs} INT8 conv(s) with few input channels run as GML's exact patch GEMM "
                "(winograd='0', GML_WINOGRAD=0: oneDNN's direct convs only)"
            )
        if self.dw_convs:
            lines.append(
                f"  {self.dw_convs} depthwise INT8 conv(s) run as GML's exact tap-pair kernel "
                "(winograd='0', GML_WINOGRAD=0: oneDNN's direct convs only)"
            )
        for why in self.own_convs_dropped.values():
            lines.append(f"  GML's own convs left out of a plan: {why} (winograd='1' forces them)")
        if self.reference_steps:
            steps = ", ".join(f"{name} ({impl})" for name, impl in self.reference_steps.items())
            lines.append(
                f"  BUG: {len(self.reference_steps)} engine step(s) run oneDNN's reference kernel, 10-1000x slower "
                f"than a jitted one (please report it with the model and the CPU): {steps}"
            )
        lines += [f"  torch: {n.name} ({n.op}): {n.reason}" for n in self.torch_nodes]
        lines += [f"  torch for shape {k}: {v}" for k, v in self.shape_fallbacks.items()]
        return "\n".join(lines)


#: implementations of GML's own conv kernels (native/conv.h), each taken per conv when it timed
#: faster than oneDNN's direct conv at plan build (``winograd="auto"``): Winograd (fp32 / bf16 /
#: INT8), the INT8 patch GEMM and the INT8 depthwise tap-pair kernel
OWN_CONV_IMPLS = ("gml:winograd_f", "gml:im2col", "gml:dw")


def is_own_conv_impl(impl: str) -> bool:
    """Whether a step's implementation is one of GML's own conv kernels (:data:`OWN_CONV_IMPLS`)."""
    return impl.startswith(OWN_CONV_IMPLS)


def is_reference_impl(impl: str) -> bool:
    """Whether a step's implementation (``Plan.step_impls``) is oneDNN's reference kernel
    (``ref:any``, ``ref:...``): alone, or as a part of a GML kernel's (``gml:int8_gemm_avx2+ref:any``)."""
    return any(part.startswith("ref") for part in impl.split("+"))


def free_values(gm: fx.GraphModule, env: dict[fx.Node, Any]) -> set[fx.Node]:
    """Nodes whose value may take the layout its primitive picks (see gml.runtime.plan, "Free
    layouts"): fp32 4-D, written by a rule with ``writes_free``, read only by rules with
    ``reads_free`` inside the segment (never returned, never a view's base)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        t = env.get(node)
        if node.op not in ("call_module", "call_function") or not isinstance(t, torch.Tensor):
            continue
        if t.dtype != torch.float32 or t.dim() != 4 or not node.users:
            continue
        rule, _ = rule_for(read_call(gm, node))
        if rule is None or not rule.writes_free:
            continue
        readers = [rule_for(read_call(gm, u))[0] if u.op != "output" else None for u in node.users]
        if all(r is not None and r.reads_free for r in readers):
            out.add(node)
    return out


def same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its exact shape and strides (``clone()`` makes a non-dense view dense: a
    channel slice of an NHWC tensor, e.g. a ``split`` output, would then be planned with strides
    other than those the engine is called with; timm's mixnet_s). The bytes ``t`` spans are copied,
    so any strides, overlapping ones included, are reproduced."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    span = sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1
    flat = t.as_strided((span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride(), 0)


def _last_use(graph: fx.Graph) -> dict[fx.Node, float]:
    """Position of each node's last reader (``inf`` when the graph returns it)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    out: dict[fx.Node, float] = {}
    for n in graph.nodes:
        out[n] = max((float("inf") if u.op == "output" else pos[u] for u in n.users), default=pos[n])
    return out


class EngineSegment(nn.Module):
    """A run of engine nodes: ``forward(*tensors) -> tuple`` through a plan for the inputs' layout."""

    def __init__(
        self,
        reference: fx.GraphModule,
        report: RuntimeReport,
        per_shape: Sequence[int] = (),
        mask_only: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.reference = reference
        self._report = report
        #: positions of inputs computed once per input shape (ShapeValues items: HF's position and
        #: token-type embeddings, masks): their NaN / Inf check runs once per plan, not per call
        self.per_shape = tuple(per_shape)
        #: positions of inputs read only as attention masks (:func:`mask_only_inputs`): ``-inf`` is a
        #: mask's value there, so they are checked for NaN only
        self.mask_only = tuple(mask_only)
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        #: per plan key: (the per-shape inputs are finite, the positions of the other float inputs)
        self._finite_per_shape: dict[tuple, tuple[bool, tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_plans"], state["_lock"] = OrderedDict(), None  # native plans are rebuilt, never saved
        state["_finite_per_shape"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("mask_only", ())
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> EngineSegment:
        import copy

        return EngineSegment(copy.deepcopy(self.reference, memo), self._report, self.per_shape, self.mask_only)

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def plan_for(self, inputs: Sequence[torch.Tensor], key: tuple | None = None) -> tuple[Any, list[tuple]]:
        key = tuple(_input_key(t) for t in inputs) if key is None else key
        entry = self._plans.get(key)
        if entry is None:
            with self._lock:
                entry = self._plans.get(key)
                if entry is None:
                    entry = self._compile(inputs, key)
                    while len(self._plans) >= MAX_PLANS:
                        self._plans.popitem(last=False)
                    self._plans[key] = entry
        return entry

    def _compile(self, inputs: Sequence[torch.Tensor], key: tuple) -> tuple[Any, list[tuple]]:
        # 1. the executor's own tensors, on copies (a residual add may write an input in place) in
        # the inputs' exact layout: the plan reads each input with the strides the executor saw
        copies = [same_layout_copy(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        recorder = Recorder(self.reference)
        try:
            with torch.no_grad():
                recorder.run(*copies)
        except RUN_ERRORS as e:  # (AssertionError: the model's own shape check, ``torch._assert``)
            raise cannot_run(inputs, e) from e
        # 2. translate
        try:
            plan, outs = self._translate(recorder.values)
        except (Unsupported, RuntimeError, ValueError) as e:
            self._report.shape_fallbacks[_key_str(key)] = str(e)
            return None, []
        # 3. GML's own convs, each chosen alone, against the plan without any
        plan = self._whole_plan_check(plan, outs, recorder.values, copies, key)
        for name, impl in zip(plan.step_names(), plan.step_impls()):
            if is_reference_impl(impl):
                self._report.reference_steps[name] = impl
        return plan, outs

    def _whole_plan_check(
        self, plan: Any, outs: list[tuple], env: dict[fx.Node, Any], inputs: Sequence[Any], key: tuple
    ) -> Any:
        """``plan``, or the same plan with oneDNN's direct convs only where that one runs faster.

        The plan build takes each of GML's own convs (:data:`OWN_CONV_IMPLS`) when it timed faster
        than oneDNN's direct conv alone, on cold weights. Alone is not in the model: measured on an
        Intel Xeon under the AVX2 mask (docs/benchmarks.md, session 26), a plan holding GML's
        depthwise INT8 kernel runs every *other* step 5-13% slower — a scalar loop timed between
        the steps slows down as much, one thread or two: the core's clock, not the kernels — so
        MobileNetV2's depthwise convs that each broke even cost the whole call 3-6%. Only the
        whole plan, timed on this CPU, says whether the convs pay; this times both (interleaved,
        on the recorded inputs) and keeps the faster. Only where the plan build timed its choices
        (``winograd="auto"``) and timing is allowed (``cost_policy="measure"``)."""
        opts = self._report.options
        own = sum(is_own_conv_impl(impl) for impl in plan.step_impls())
        if not own or opts.winograd != "auto" or opts.cost_policy != "measure":
            return plan
        try:
            direct, _ = self._translate(env, replace(opts, winograd="0"))
        except (Unsupported, RuntimeError, ValueError):
            return plan
        tensors = [t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)]
        results = [torch.empty_strided(*o[:2], dtype=o[2]) for o in outs if not isinstance(o, _Size)]
        written = [r.data_ptr() for r in results]

        def run(p: Any) -> Any:
            return lambda: p.run(tensors, written, torch.get_num_threads())

        # ~1 s of timed calls at most past the warm-up (a large batch's first call must not take
        # minutes): 9 rounds for calls up to ~50 ms, down to 3 for long ones
        t0 = time.perf_counter()
        run(plan)()
        once_ms = (time.perf_counter() - t0) * 1e3
        rounds = max(3, min(9, int(500 / max(once_ms, 1e-3))))
        own_ms, direct_ms = timing.median_ms_interleaved([run(plan), run(direct)], rounds=rounds)
        if direct_ms < own_ms:
            self._report.own_convs_dropped[_key_str(key)] = (
                f"{own} conv(s) as GML's kernels made the whole plan {own_ms / direct_ms:.2f}x as slow "
                f"as oneDNN's direct convs ({own_ms:.2f} vs {direct_ms:.2f} ms)"
            )
            return direct
        return plan

    def _translate(self, env: dict[fx.Node, Any], options: EngineOptions | None = None) -> tuple[Any, list[tuple]]:
        graph = self.reference.graph
        b = Builder(_last_use(graph), self._report.target, options or self._report.options)
        free = free_values(self.reference, env)
        vals: dict[fx.Node, Any] = {}
        sizes: set[fx.Node] = set()
        inputs, outputs, metas = [], [], []
        for pos, node in enumerate(graph.nodes):
            b.pos, b.node_name = pos, node.name
            if node.op == "placeholder":
                if not isinstance(env[node], torch.Tensor):  # a size computed outside (sym_size)
                    if _is_size_value(env[node]):  # in the plan's key: the plan is for this value
                        vals[node] = env[node]  # a rule reading it gets the number (a pad's width)
                        continue
                    raise Unsupported(f"segment input {node.name} is a {type(env[node]).__name__}")
                vals[node] = b.value_for(node, env[node])
                inputs.append(vals[node])
                b.place_inputs(inputs)  # now: a later in-place step must see it is the caller's
            elif node.op == "output":
                for a in node.args[0]:
                    if a in sizes:  # fixed for this plan's inputs: returned as it is
                        metas.append(_Size(env[a]))
                        continue
                    if not isinstance(env[a], torch.Tensor):
                        raise Unsupported(f"segment output {a.name} is a {type(env[a]).__name__}")
                    outputs.append(vals[a])
                    metas.append(env[a])
            elif node.op != "get_attr":  # constants are read by the rules through the Call
                call = read_call(self.reference, node)
                rule, reason = rule_for(call)
                if rule is None:
                    raise Unsupported(reason)
                t = env[node]
                if rule.size_out:  # x.shape, n // 2: no step (the plan is for these sizes)
                    if t is None and node.target is torch._assert:  # a shape check: held when recorded
                        continue
                    if not _is_size_value(t):
                        raise Unsupported(f"{node.name} returns {type(t).__name__}")
                    sizes.add(node)
                    vals[node] = t
                    continue
                if rule.tuple_out:  # split: its getitem readers alias pieces of its input
                    vals[node] = vals[call.inputs[0]]
                    continue
                if not isinstance(t, torch.Tensor):
                    raise Unsupported(f"{node.name} returns {type(t).__name__}")
                if t.dim() == 0:  # a oneDNN memory descriptor has at least one dim
                    raise Unsupported(f"{node.name} returns a 0-d tensor")
                vals[node] = b.value_for(node, t, free=node in free)
                rule.emit(b, call, [_input_val(b, vals, env, a) for a in call.inputs], vals[node])
        b.place_outputs(outputs, [t for t in metas if isinstance(t, torch.Tensor)])
        plan = b.build(native.load())
        return plan, [t if isinstance(t, _Size) else (tuple(t.shape), tuple(t.stride()), t.dtype) for t in metas]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.run(inputs, self.plan_key(inputs))

    @staticmethod
    def plan_key(inputs: Sequence[Any]) -> tuple:
        """The key of the plan for ``inputs``: each one's layout, or value for a size."""
        return tuple(_input_key(t) for t in inputs)

    def run(self, inputs: Sequence[Any], key: tuple) -> tuple[torch.Tensor, ...]:
        """``forward(*inputs)`` with its plan key given (the model's direct call computes the key
        once per input layout where the segment's inputs are the model's or fixed by its layout)."""
        if not self._finite(inputs, key):
            # oneDNN's ReLU / clip post-ops and max pooling take a max that drops NaN (vmaxps), so
            # a NaN or Inf input would come out as finite numbers (issue #24): the segment's Python
            # executor propagates them as eager does (its fused kernels check the same way)
            return tuple(self.reference(*inputs))
        plan, outs = self.plan_for(inputs, key)
        if plan is None:
            return tuple(self.reference(*inputs))
        results = [o.value if isinstance(o, _Size) else torch.empty_strided(*o[:2], dtype=o[2]) for o in outs]
        tensors = [t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)]  # sizes are in the plan's key
        written = [r.data_ptr() for r in results if isinstance(r, torch.Tensor)]
        record = _PROFILE.get()
        try:
            if record is None:
                plan.run(tensors, written, torch.get_num_threads())
            else:
                times = plan.run_timed(tensors, written, torch.get_num_threads())
                record.append((self, plan, times))
        except RuntimeError as e:
            # oneDNN created the primitives but one will not execute (fuzz seed 20261127: "could not
            # execute a primitive" on a Conv3d graph): this shape falls back to the Python executor
            # for good, with the reason in the report, instead of an internal error (issue #24)
            # (an out-of-range token id is an IndexError: the user's input, raised as it is)
            with self._lock:
                self._plans[key] = (None, [])
            self._report.shape_fallbacks[_key_str(key)] = f"the engine failed to run it: {e}"
            return tuple(self.reference(*inputs))
        return tuple(results)

    def _finite(self, inputs: Sequence[Any], key: tuple) -> bool:
        """No NaN / Inf in ``inputs``. The per-shape ones (:attr:`per_shape`) are the same values
        for every call with these shapes, so they are checked once per ``key``, and which of the
        others are floating point follows from ``key`` (their dtypes): a call whose other inputs are
        integers (token ids, masks) checks nothing. A torch reduction per call costs little when
        warm, but 1–3 ms on a call after 100 ms idle (a cold CPU), more than the engine's own share
        of an 11-token MiniLM sentence."""
        memo = self._finite_per_shape.get(key)
        if memo is None:
            floats = tuple(i for i, k in enumerate(key) if isinstance(k[2], torch.dtype) and k[2].is_floating_point)
            # (the per-shape inputs' answer holds for every call with this key)
            ok = self._inputs_ok(inputs, [i for i in floats if i in self.per_shape])
            memo = (ok, tuple(i for i in floats if i not in self.per_shape))
            if len(self._finite_per_shape) >= MAX_PLANS:
                self._finite_per_shape.clear()
            self._finite_per_shape[key] = memo
        ok, others = memo
        return ok and (not others or self._inputs_ok(inputs, others))

    def _inputs_ok(self, inputs: Sequence[Any], positions: Sequence[int]) -> bool:
        """No NaN / Inf in the inputs at ``positions``; no NaN in an attention mask (:attr:`mask_only`)."""
        masks = [inputs[i] for i in positions if i in self.mask_only]
        others = [inputs[i] for i in positions if i not in self.mask_only]
        return _finite_inputs(others) and (not masks or no_nan(*masks))


def _finite_inputs(inputs: Sequence[Any]) -> bool:
    """Whether no floating-point tensor in ``inputs`` holds a NaN or an Inf (one sum each:
    :func:`gml.kernels.fp32.all_finite`, cheap next to the segment it guards)."""
    floats = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return not floats or all_finite(*floats)


def _input_val(b: Builder, vals: dict[fx.Node, Any], env: dict[fx.Node, Any], a: fx.Node) -> Any:
    """The plan value a rule reads for ``a``: a value of the segment, or, for a module's tensor
    argument read straight from the model (``gml.nn.Add(x, self.pos_embed)``: a ``get_attr`` node),
    a constant the plan owns."""
    if a in vals:
        return vals[a]
    if a.op == "get_attr" and isinstance(env.get(a), torch.Tensor):
        vals[a] = b.constant(env[a])
        return vals[a]
    raise Unsupported(f"input {a.name} of the segment is neither a segment value nor a model constant")


class Recorder(fx.Interpreter):
    """A Python executor keeping every node's result (a segment's layouts for its plan; the INT8
    cost policy's region values)."""

    def __init__(self, gm: fx.GraphModule, keep: Collection[fx.Node] | None = None) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}
        #: the nodes whose results are kept (``None``: every node's); the others are freed once read
        self.keep = keep

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if self.keep is None or n in self.keep:
            self.values[n] = out
        return out


def _input_names(gm: fx.GraphModule) -> list[str]:
    """The graph's inputs by name: the captured ``forward``'s parameter names (gml.capture tags its
    placeholders; a loaded or exported graph's placeholders carry the names themselves)."""
    return [n.meta.get(INPUT_NAME, n.name) for n in gm.graph.nodes if n.op == "placeholder"]


@dataclass(frozen=True)
class _Size:
    """A segment output that is a size (``x.shape`` read by torch after the segment): fixed for the
    plan's input shapes, returned as the plan was made with it."""

    value: Any


def _is_size_value(v: Any) -> bool:
    """A number or a shape (``x.shape`` read by ``reshape(x.shape)``: timm's RoPE) a segment takes."""
    if isinstance(v, list | tuple):
        return all(isinstance(i, int) and not isinstance(i, bool) for i in v)
    return isinstance(v, int | float | bool)


#: ``nn.Module.__call__`` as torch defines it (:meth:`EngineModule.__call__`)
_MODULE_CALL = nn.Module.__call__


class _Layout(NamedTuple):
    """What :class:`EngineModule` keeps per input layout: the graph's code it was made for, its
    direct call (None where :func:`specialise` declined) and whether a float tensor is among the
    inputs (an INT8 model's NaN / Inf check has nothing to read otherwise)."""

    code: str
    direct: DirectCall | None
    floats: bool


def _inputs_key(inputs: Sequence[Any]) -> tuple:
    """The layout key of a call's inputs: :func:`_input_key` of each, a tensor's written inline (a
    loop rather than a generator: fewer frames on every call)."""
    key = []
    for t in inputs:
        key.append((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else _input_key(t))
    return tuple(key)


def _input_key(t: Any) -> tuple:
    """A segment input's part of a plan's key: a tensor's layout, or a size's value (``sym_size``).
    A sequence is keyed by its items' keys, never by the tensors themselves: a key holding this
    call's tensors would miss on every call and compile (and fall back) again each time."""
    if isinstance(t, torch.Tensor):
        return (tuple(t.shape), tuple(t.stride()), t.dtype)
    if isinstance(t, list | tuple):  # a split's pieces; a run-time shape list (GPT-2's view(*shape, -1))
        return ((), (), tuple(_input_key(x) for x in t))
    return ((), (), t)


def _key_str(key: tuple) -> str:
    def one(shape: tuple, what: Any) -> str:
        if isinstance(what, tuple):  # a sequence input: its items
            return "(" + ", ".join(one(s, d) for s, _, d in what) + ")"
        return f"{tuple(shape)} {str(what).replace('torch.', '')}"

    return ", ".join(one(s, d) for s, _, d in key)


def partition(
    gm: fx.GraphModule, target: Target | None = None, options: EngineOptions | None = None
) -> tuple[fx.GraphModule, RuntimeReport]:
    """A copy of ``gm`` with each maximal run of engine nodes replaced by one EngineSegment call;
    the segments plan for ``target`` (default: this process's, :func:`gml.runtime.target.detect_target`)
    with ``options`` (default: the shipped :class:`~gml.runtime.options.EngineOptions`)."""
    from gml.runtime.target import resolve

    report = RuntimeReport("engine", target=resolve(target), options=options or EngineOptions())
    # torch glue first (gml.runtime.shape_values): values of the input sizes alone are computed once
    # per shape, and torch nodes independent of an engine run move before it (fewer segments)
    gm = fx.GraphModule(gm, copy_graph(gm.graph))  # a copy to reorder; the caller's graph is untouched
    shape_values = cache_shape_values(gm, on_output=_keep_size)
    cache_guards(gm)
    if schedule_for_engine(gm.graph, lambda n: _engine_node(gm, n)[0]):
        gm.recompile()
    _gather_split_pieces(gm.graph)  # last: the order the segments are cut from
    graph = gm.graph
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "get_attr":  # a weight read by the next op: it goes where its readers go
            continue
        ok, reason = _engine_node(gm, node)
        if node.op == "call_module" and shape_values is not None and node.target == "shape_values":
            ops = ", ".join(sorted(set(shape_values.ops)))
            why = f"{len(shape_values.ops)} ops of the input sizes only ({ops}), computed once per input shape"
            report.nodes.append(NodeReport(node.name, "ShapeValues", "torch", why))
        elif node.op in ("call_module", "call_function", "call_method"):
            call = read_call(gm, node)
            op = call.name if call is not None else str(getattr(node.target, "__name__", node.target))
            if _is_shape_value(node) and shape_values is not None:  # a plan reads it as a number: nothing runs per call
                reason = "an item of the ShapeValues results (computed once per input shape)"
            report.nodes.append(NodeReport(node.name, op, "engine" if ok else "torch", reason or ""))
        if ok:
            current.append(node)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    # a run of sizes alone (``x.shape`` between two torch ops) has no step to join: torch reads them
    sizes_only = [r for r in runs if all(read_size(n) is not None for n in r)]
    runs = [r for r in runs if r not in sizes_only]
    alone = {n.name for r in sizes_only for n in r}
    for i, rep in enumerate(report.nodes):
        if rep.name in alone:
            report.nodes[i] = NodeReport(rep.name, rep.op, "torch", "a size read between torch ops (no engine step)")

    new = fx.GraphModule(gm, copy_graph(graph))
    name_map = {n.name: n for n in new.graph.nodes}
    for i, run in enumerate(runs):
        nodes = [name_map[n.name] for n in run]
        _replace_run(new, nodes, f"engine_segment_{i}", report)
    for node in list(new.graph.nodes):  # weights now read inside a segment
        if node.op == "get_attr" and not node.users:
            new.graph.erase_node(node)
    new.graph.lint()
    new.delete_all_unused_submodules()
    new.recompile()
    report.segments = len(runs)
    return new, report


def _gather_split_pieces(graph: fx.Graph) -> None:
    """Move every ``getitem`` of a ``split`` right after the split (in index order). A piece is a
    view that depends on nothing else, so the graph computes the same; but a torch node traced
    between two pieces (timm tf_mixnet_s: the "same" padding ``F.pad`` of one mixed-kernel conv)
    ended the split's engine run before its other pieces, the next segment then took the split's
    tuple as its input, and both segments fell back to their Python executor."""
    from gml.runtime.rules.shape import is_split

    for node in list(graph.nodes):
        if not is_split(node):
            continue
        pieces = [
            u
            for u in node.users
            if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
        ]
        for piece in sorted(pieces, key=lambda u: u.args[1], reverse=True):
            node.append(piece)


#: gml.optimize / gml.quantize results' Python executors (python_executor), per graph module
_EXECUTORS: weakref.WeakKeyDictionary[fx.GraphModule, tuple[str, PythonExecutor]] = weakref.WeakKeyDictionary()


#: A module's forward-hook state: the hooks and which of them take kwargs / always run.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def python_executor(gm: fx.GraphModule) -> PythonExecutor:
    """What runs ``gm`` where no engine does: ``gm`` itself, or a copy whose torch glue runs once
    per input shape, as it does around the engine's segments (:func:`partition`): the values of the
    input sizes alone (:func:`~gml.runtime.shape_values.cache_shape_values`) and an exported
    program's input guards (:class:`~gml.runtime.shape_values.ShapeGuards`).

    Measured (HF Swin, a shrunk config, 1 thread, Zen 4 under the AVX2 cap): torch.export's guard
    function read 5,700 sizes per call; the graph as it was ran 9.30 ms against eager's 7.33, the
    copy 6.85. The copy shares ``gm``'s weights and its forward hooks (the INT8 model's
    NaN / Inf and autograd refusals); ``gm`` stays the graph that is inspected and saved. Either
    runs inside a :class:`PythonExecutor`: wrong inputs are an :class:`InputError`, as on the engine."""
    hit = _EXECUTORS.get(gm)
    if hit is not None and hit[0] is gm.code:
        return hit[1]
    copy = fx.GraphModule(gm, copy_graph(gm.graph))
    changed = cache_shape_values(copy) is not None
    changed = cache_guards(copy) or changed
    runner = gm
    if changed:
        copy.recompile()
        copy.train(gm.training)
        # the same dicts: hooks added later apply too, and a hook registered ``with_kwargs`` (an
        # exported program's input-constraint check, gml.io.load) is still called with them
        for hooks in _HOOK_DICTS:
            setattr(copy, hooks, getattr(gm, hooks))
        # ... and finds the plain attributes it reads (``validate_inputs``, ``range_constraints``, the
        # flags of gml.inference); methods bound to ``gm`` (an export's ``train`` refusal) are not taken
        for name, value in vars(gm).items():
            if name not in vars(copy) and not callable(value):
                setattr(copy, name, value)
        runner = copy
    executor = PythonExecutor(runner, placeholder_expectations(gm))
    _EXECUTORS[gm] = (gm.code, executor)
    return executor


def copy_graph(graph: fx.Graph) -> fx.Graph:
    import copy

    g = fx.Graph()
    # keep the graph's codegen: an exported program's module (gml.io.load) flattens its inputs and
    # unflattens its outputs with a pytree spec, so a single output comes back as a tensor, not (y,)
    g._codegen = copy.deepcopy(graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(graph, env)
    g.output(out)
    return g


def _engine_node(gm: fx.GraphModule, node: fx.Node) -> tuple[bool, str | None]:
    if node.op in ("placeholder", "output", "get_attr"):
        return False, None
    call = read_call(gm, node)
    rule, reason = rule_for(call)
    if rule is None:
        return False, reason
    meta = node.meta.get("val", node.meta.get("tensor_meta"))
    if getattr(meta, "shape", None) == ():  # DeBERTa's attention scale, sqrt(size * factor)
        return False, "a 0-d tensor (a scalar: torch computes it)"
    if node.op == "call_module" and (node.kwargs or not all(isinstance(a, fx.Node) for a in node.args)):
        return False, "non-tensor arguments"
    if rule.arity is not None and len(call.inputs) != rule.arity:
        return False, f"{len(call.inputs)} inputs (expects {rule.arity})"
    return True, None


def _keep_size(node: fx.Node, item: fx.Node) -> None:
    """A size computed once per input shape (timm's "same" padding of a stride-2 conv: ``(k - 1) *
    d``) stays a size when a ShapeValues item replaces it: a segment's size nodes may read it."""
    if read_size(node) is not None:
        item.meta[SIZE_INPUT] = True


def _is_shape_value(node: fx.Node) -> bool:
    """An item of the ShapeValues call (computed once per input shape and cached)."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and getattr(node.args[0], "op", None) == "call_module"
        and node.args[0].target == "shape_values"
    )


def _replace_run(gm: fx.GraphModule, run: list[fx.Node], name: str, report: RuntimeReport) -> None:
    inside = set(run)
    inputs: list[fx.Node] = []
    weights: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            group = weights if a.op == "get_attr" else inputs
            if a not in inside and a not in group:
                group.append(a)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for a in inputs:  # a size made outside: the segment's size nodes may read it
        if is_size(a):
            env[a].meta[SIZE_INPUT] = True
    for w in weights:  # constants stay constants of the segment (its reference module holds them)
        env[w] = sub.get_attr(str(w.target))
    for n in run:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    reference = fx.GraphModule(gm, sub)
    per_shape = [i for i, a in enumerate(inputs) if _is_shape_value(a)]
    gm.add_submodule(name, EngineSegment(reference, report, per_shape, mask_only_inputs(reference)))
    with gm.graph.inserting_before(run[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        for i, o in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            if is_size(o):  # the next segment's size nodes may read it
                item.meta[SIZE_INPUT] = True
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(run):
        gm.graph.erase_node(n)


#: ``(dtype, rank, channels or None)`` per input: what a model compiled for an example takes; an
#: input the example gave as ``None`` (a skipped positional parameter) is ``None``: it must stay None.
Expected = list[tuple[torch.dtype, int, int | None] | None]


def expected_inputs(example: Sequence[Any]) -> Expected:
    """What a model compiled for ``example`` takes: each input's dtype and rank, and its channels
    (dim 1) for image / video inputs; other dims may change (a new plan), and for other ranks dim 1
    may be a sequence length: the first call with a shape checks those (:func:`run_first_call`).
    ``None`` in the example (``(ids, None, mask)``: an HF decoder's cache skipped) stays ``None``."""
    return [None if t is None else (t.dtype, t.dim(), t.shape[1] if t.dim() >= 4 else None) for t in example]


def check_inputs(expect: Expected, inputs: Sequence[Any]) -> None:
    """:class:`InputError` unless ``inputs`` are what ``expect`` says (count, device, dtype, rank, channels)."""
    if len(inputs) != len(expect):
        raise InputError(f"the model takes {len(expect)} input(s), got {len(inputs)}.")
    for i, (t, spec) in enumerate(zip(inputs, expect)):
        if spec is None:
            if t is not None:
                raise InputError(f"input {i} was None in the example the model was built for; got {type(t).__name__}.")
            continue
        dtype, rank, channels = spec
        want = f"a {dtype} tensor of rank {rank}" + (f" with {channels} channels (dim 1)" if channels else "")
        if not isinstance(t, torch.Tensor):
            raise InputError(f"input {i} is a {type(t).__name__}; the model expects {want}.")
        if t.device.type != "cpu":
            raise InputError(f"input {i} is on {t.device}; the engine runs on the CPU.", hint="pass x.cpu().")
        if t.dtype != dtype or t.dim() != rank or (channels is not None and t.shape[1] != channels):
            raise InputError(f"input {i} is a {t.dtype} tensor of shape {tuple(t.shape)}; the model expects {want}.")


def cannot_run(inputs: Sequence[Any], e: BaseException) -> InputError:
    """The error for inputs the graph fails on (a height a linear cannot take, a guard of the model's)."""
    shapes = ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = first.split(" If you meant for this dimension to be dynamic")[0]  # torch.export's advice, not ours
    return InputError(
        f"the model cannot run on inputs of shape {shapes}: {first}",
        hint="give inputs of the shape and dtype the model was compiled with.",
    )


#: What torch raises for inputs a graph cannot take (AssertionError: the model's own shape checks,
#: ``torch._assert``, and an exported program's guards; ValueError: a pytree of other structure).
RUN_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, AssertionError)


def run_first_call(fn: Any, inputs: Sequence[Any]) -> Any:
    """``fn(*inputs)`` for a layout of the inputs not run before: what torch raises there is an
    :class:`InputError` naming the shapes (a layout that ran once is the model's own; later calls
    run without this frame)."""
    try:
        return fn(*inputs)
    except (InputError, UnsupportedError):
        raise
    except RUN_ERRORS as e:
        raise cannot_run(inputs, e) from e


class PythonExecutor(nn.Module):
    """``graph_module`` run by torch, with the engine's input checks: the inputs against the graph's
    placeholders (:func:`check_inputs`) and the first call of each layout (:func:`run_first_call`),
    so a wrong input is an :class:`InputError` on either runtime, never torch's raw error."""

    def __init__(self, graph_module: fx.GraphModule, expect: Expected | None) -> None:
        super().__init__()
        self.graph_module = graph_module
        self._expect = expect
        self._seen: set[tuple] = set()

    def forward(self, *inputs: Any, **named: Any) -> Any:
        if named:
            inputs = inputs_by_name(_input_names(self.graph_module), inputs, named)
        try:
            key: tuple | None = tuple(_input_key(t) for t in inputs)
            seen = key in self._seen
        except TypeError:  # an unhashable input: the checks say what the model takes
            key, seen = None, False
        if seen:
            return self.graph_module(*inputs)
        if getattr(self.graph_module, "_gml_refuses_autograd", False):  # its pre-hook's words first, as on the engine
            refuse_grad_inputs(inputs)
        if self._expect is not None:
            check_inputs(self._expect, inputs)
        out = run_first_call(self.graph_module, inputs)
        if key is not None:
            if len(self._seen) >= MAX_PLANS:
                self._seen.clear()
            self._seen.add(key)
        return out


def placeholder_expectations(gm: fx.GraphModule) -> Expected | None:
    """:func:`expected_inputs` of ``gm``'s placeholders' shape metadata, or None where one has none."""
    metas = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if "val" in node.meta and node.meta["val"] is None:  # an input the example gave as None
            metas.append(None)
            continue
        meta = node.meta.get("val", node.meta.get("tensor_meta"))
        if meta is None or not hasattr(meta, "dtype") or not hasattr(meta, "shape"):
            return None
        channels = meta.shape[1] if len(meta.shape) >= 4 and isinstance(meta.shape[1], int) else None
        metas.append((meta.dtype, len(meta.shape), channels))
    return metas


class EngineModule(nn.Module):
    """A lowered model executed by the native engine where it covers the graph.

    ``graph_module`` is the partitioned graph (EngineSegment calls between torch nodes);
    ``report`` says which nodes run where and why. Inputs are checked against the example the model
    was compiled with (device, dtype, rank, channels): a mismatch is an :class:`InputError`.
    """

    def __init__(self, graph_module: fx.GraphModule, report: RuntimeReport, example: Sequence[torch.Tensor]):
        super().__init__()
        self.graph_module = graph_module
        self.report = report
        # channels (dim 1) are fixed for image / video inputs; other dims may change (a new plan),
        # and for other ranks dim 1 may be a sequence length: the plan's compile run checks those
        self._expect = expected_inputs(example)
        #: an INT8 model refuses NaN / Inf inputs (:func:`gml.inference.refuse_nonfinite` sets it:
        #: checked here rather than by a forward pre-hook, which would slow every ``__call__``)
        self.refuses_nonfinite = False
        #: positions of inputs read only as attention masks: ``-inf`` allowed, NaN refused
        self.nonfinite_masks: tuple[int, ...] = ()
        #: per input layout, the graph's call with its glue evaluated (:mod:`gml.runtime.direct_call`)
        self._direct: dict[tuple, _Layout] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_direct"] = {}  # generated code: rebuilt on the first call of each layout
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_direct", {})
        self.__dict__.setdefault("refuses_nonfinite", False)
        self.__dict__.setdefault("nonfinite_masks", ())

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """:meth:`forward`, without ``nn.Module.__call__``'s dispatch where nothing needs it: no hook
        on this module or for every module, no fx or TorchScript trace, no ``module.compile()``. Its
        answer is the same; a call after 100 ms idle skips code the CPU would read again from memory
        (0.6–2 ms of a cold 11-token MiniLM call on the VM of docs/benchmarks.md, session 27)."""
        if (
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or self._compiled_call_impl is not None
            or any_global_hooks()
            or nn.Module.__call__ is not _MODULE_CALL  # torch.fx's tracer patches it while it traces
            or torch._C._get_tracing_state()
        ):
            return super().__call__(*inputs, **named)
        return self.forward(*inputs, **named)

    def forward(self, *inputs: Any, **named: Any) -> Any:
        """The model's outputs. The first call with a layout of the inputs checks them against the
        example (:meth:`_check`), runs the partitioned graph and keeps its direct call
        (:func:`~gml.runtime.direct_call.specialise`); later calls with that layout run it. Inputs
        may be given by name too, as the model's ``forward`` names them (:func:`inputs_by_name`).
        Per call, only what the layout does not settle is checked: inputs that require grad (when
        autograd is on) and NaN / Inf in float inputs of an INT8 model."""
        if named:
            inputs = inputs_by_name(_input_names(self.graph_module), inputs, named)
        if torch.is_grad_enabled():
            refuse_grad_inputs(inputs)  # the engine's outputs carry no autograd graph (gml.inference)
        key = _inputs_key(inputs)
        try:
            hit = self._direct.get(key)
        except TypeError:  # an unhashable input (a dict): _check says what the model takes
            hit = None
        gm = self.graph_module
        if hit is None or hit.code is not gm.code:  # a new layout (or a graph changed since)
            self._check(inputs)
            if self.refuses_nonfinite:
                refuse_nonfinite_inputs(inputs, self.nonfinite_masks)
            out = run_first_call(gm, inputs)
            if len(self._direct) >= MAX_PLANS:
                self._direct.clear()
            floats = any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs)
            self._direct[key] = _Layout(gm.code, specialise(gm, inputs, out), floats)
            return out
        if self.refuses_nonfinite and hit.floats:
            refuse_nonfinite_inputs(inputs, self.nonfinite_masks)
        return gm(*inputs) if hit.direct is None else hit.direct(*inputs)

    def _check(self, inputs: Sequence[Any]) -> None:
        check_inputs(self._expect, inputs)

    def segments(self) -> list[EngineSegment]:
        return [m for m in self.graph_module.modules() if isinstance(m, EngineSegment)]

    def profile(self, *inputs: Any, rounds: int = 5) -> list[StepTime]:
        """Every native step these inputs run, with its implementation and median wall time over
        ``rounds`` calls (after one warm-up call), in execution order. Steps are timed one by one
        (the stream is waited on after each), so the sum is a little above a plain call's time."""
        if rounds < 1:
            raise InputError(f"rounds={rounds}: profile at least one call.")
        with torch.no_grad():
            self(*inputs)  # plans compiled, caches warm
            runs: list[list] = []
            for _ in range(rounds):
                record: list = []
                token = _PROFILE.set(record)
                try:
                    self(*inputs)
                finally:
                    _PROFILE.reset(token)
                runs.append(record)
        index = {id(seg): i for i, seg in enumerate(self.segments())}
        rows: list[StepTime] = []
        for k, (seg, plan, _) in enumerate(runs[0]):
            names, impls = plan.step_names(), plan.step_impls()
            for j, (name, impl) in enumerate(zip(names, impls)):
                us = statistics.median(run[k][2][j] for run in runs)
                rows.append(StepTime(index.get(id(seg), -1), name, impl, us))
        return rows

    def step_impls(self) -> list[tuple[str, str]]:
        """``(node name, implementation)`` of every step of the compiled plans (each segment's plans
        in the order they were built): oneDNN's implementation name (``brg:avx512_core_bf16``) or the
        engine's own kernel (``gml:winograd_f2x3+brg:avx512_core_bf16`` for a Winograd conv: its
        batched matmul's implementation after the ``+``)."""
        return [
            (name, impl)
            for seg in self.segments()
            for plan, _ in seg._plans.values()
            if plan is not None
            for name, impl in zip(plan.step_names(), plan.step_impls())
        ]


def compile_engine(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    target: Target | None = None,
    options: EngineOptions | None = None,
) -> EngineModule:
    """Partition ``gm`` for the engine and compile the plan for ``example_inputs``' shapes, for
    ``target`` (the API boundary's :class:`~gml.ir.target.Target`; default: this process's), with
    ``options`` (:class:`~gml.runtime.options.EngineOptions`; default: the ``GML_*`` variables').

    Raises :class:`UnsupportedError` if the native engine is not built (see :func:`native.load`).
    """
    native.load()
    part, report = partition(gm, target, resolve_options(options))
    module = EngineModule(part, report, list(example_inputs))
    with torch.no_grad():
        module(*example_inputs)  # compiles the plans for these shapes
    impls = [impl for _, impl in module.step_impls()]
    report.winograd_convs = sum(impl.startswith("gml:winograd_f") for impl in impls)
    report.winograd_4x4_convs = sum(impl.startswith("gml:winograd_f4x3") for impl in impls)
    report.im2col_convs = sum(impl.startswith("gml:im2col") for impl in impls)
    report.dw_convs = sum(impl.startswith("gml:dw") for impl in impls)
    if report.engine_nodes == 0:
        report.note = "no node of this graph has an engine kernel"
    return module


__all__ = [
    "EngineModule",
    "EngineSegment",
    "RuntimeReport",
    "StepTime",
    "UnsupportedError",
    "compile_engine",
    "is_reference_impl",
    "partition",
]
