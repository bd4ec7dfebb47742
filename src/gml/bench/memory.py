"""Memory measurements: process RSS per variant and the activation footprint of an FX graph.

**RSS.** All variants live in one process (they must, to be timed in interleaved rounds), so the
numbers are deltas inside that process. Before a variant is built the harness collects garbage,
records the current RSS and resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``,
Linux only). After the build, the first call, the warm-up and the accuracy check it reads

* ``peak_rss_mb``: the process high-water mark reached while this variant was being built and run
  (``VmHWM``: everything already resident, plus this variant's transient peak);
* ``build_peak_delta_mb``: that peak minus the RSS before the build: the extra memory the build
  needed at its worst (an export, a calibration pass, a compiler's working set);
* ``retained_mb``: RSS after minus RSS before: what the built variant keeps (its weights in the
  runtime's layout, compiled code, caches, and shared libraries the first user of a runtime loads).

Allocators keep freed pages, so a later variant can reuse memory an earlier one released and
look cheaper; the numbers rank variants roughly, they are not exact per-variant allocations.
Without ``clear_refs`` (not Linux) only the retained delta is reported.

**Stages.** :class:`StageTrace` records the same figures for nested stages of one call (capture,
passes, calibration, engine compile, ...): entering or leaving a stage folds the high-water mark
into every open stage before resetting it, so an outer stage's peak includes its inner ones'.
``benchmarks/memory.py`` wraps gml's stage functions with it (docs/memory.md).

**Tensor bytes.** :func:`reachable_storages` walks the Python objects reachable from a value (a
result, a module) and sums the *unique* tensor storages it finds: two tensors sharing a storage
count once, a second copy of a weight counts twice. Opaque tensors (oneDNN-blocked ``mkldnn``
tensors, packed-weight script objects) are counted apart; the native engine's plan-owned memory is
invisible here (RSS sees it).

**Returning memory.** :func:`gml.memory.trim_malloc` (re-exported here) hands freed heap pages
back to the system; ``benchmarks/memory.py`` calls it before reading a baseline.

**Activation footprint.** From ``node.meta['tensor_meta']`` (filled by
:class:`torch.fx.passes.shape_prop.ShapeProp`): the bytes of every intermediate tensor the graph
produces (the traffic a fusion removes) and the peak of the bytes alive at once when each
tensor is freed after its last use. Graph inputs, weights (``get_attr``) and pure view/alias
nodes (reshape, flatten, identity) are not counted.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from gml.memory import trim_malloc  # noqa: F401  (re-exported for the benchmarks)
from gml.passes.oplib import op_kind
from gml.passes.utils import modules_of

_MB = 1024 * 1024
# Ops whose output aliases their input's storage: they allocate nothing.
_ALIAS_KINDS = frozenset({"view", "flatten", "identity", "dropout"})


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def current_rss_mb() -> float:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb / 1024
    import psutil  # non-Linux fallback

    return psutil.Process(os.getpid()).memory_info().rss / _MB


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    kb = _status_kb("VmHWM")
    return None if kb is None else kb / 1024


@dataclass
class RssProbe:
    """RSS figures of one variant (MB); see the module docstring for what each means."""

    rss_before_mb: float
    peak_rss_mb: float | None = None
    build_peak_delta_mb: float | None = None
    retained_mb: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RssMeter:
    """``with RssMeter() as m: build(); ...`` then read ``m.probe``."""

    def __enter__(self) -> RssMeter:
        gc.collect()
        self._can_peak = reset_peak_rss()
        self.probe = RssProbe(rss_before_mb=current_rss_mb())
        return self

    def __exit__(self, *exc: object) -> None:
        after = current_rss_mb()
        self.probe.retained_mb = after - self.probe.rss_before_mb
        if self._can_peak:
            peak = peak_rss_mb()
            if peak is not None:
                self.probe.peak_rss_mb = peak
                self.probe.build_peak_delta_mb = peak - self.probe.rss_before_mb


@dataclass
class StageRecord:
    """One stage of a :class:`StageTrace` (MB; ``peak_delta_mb`` is above the RSS at its start)."""

    name: str
    depth: int
    rss_before_mb: float
    rss_after_mb: float = 0.0
    peak_mb: float = 0.0
    seconds: float = 0.0

    @property
    def retained_mb(self) -> float:
        return self.rss_after_mb - self.rss_before_mb

    @property
    def peak_delta_mb(self) -> float:
        return self.peak_mb - self.rss_before_mb


@dataclass
class StageTrace:
    """RSS per nested stage: ``with trace.stage("calibrate"): ...`` (see the module docstring)."""

    records: list[StageRecord] = field(default_factory=list)
    _open: list[StageRecord] = field(default_factory=list)

    def _fold_peak(self) -> None:
        peak = peak_rss_mb()
        if peak is None:
            peak = current_rss_mb()
        for r in self._open:
            r.peak_mb = max(r.peak_mb, peak)
        reset_peak_rss()

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        import time

        self._fold_peak()
        rec = StageRecord(name, len(self._open), current_rss_mb())
        rec.peak_mb = rec.rss_before_mb
        self.records.append(rec)
        self._open.append(rec)
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            rec.seconds = time.perf_counter() - t0
            self._fold_peak()
            self._open.remove(rec)
            rec.rss_after_mb = current_rss_mb()

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "stage": "  " * r.depth + r.name,
                "retained_mb": round(r.retained_mb, 1),
                "peak_delta_mb": round(r.peak_delta_mb, 1),
                "rss_after_mb": round(r.rss_after_mb, 1),
                "seconds": round(r.seconds, 2),
            }
            for r in self.records
        ]


@dataclass
class StorageCount:
    """Unique tensor storages reachable from some roots (see :func:`reachable_storages`)."""

    #: storage data pointer -> bytes
    storages: dict[int, int] = field(default_factory=dict)
    #: id -> bytes of opaque tensors (mkldnn-blocked) whose storage cannot be read
    opaque: dict[int, int] = field(default_factory=dict)
    #: packed-weight script objects (torch.ao / oneDNN prepacked params), counted but not sized
    packed_objects: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.storages.values()) + sum(self.opaque.values())

    @property
    def mb(self) -> float:
        return self.bytes / _MB


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return s.data_ptr(), s.nbytes()


def reachable_storages(*roots: Any, stop: Sequence[Any] = ()) -> StorageCount:
    """Every unique tensor storage reachable from ``roots`` through Python references
    (``gc.get_referents``), not entering ``stop`` objects, classes, Python modules or their globals."""
    skip = {id(m.__dict__) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    skip |= {id(o) for o in stop}
    seen: set[int] = set()
    out = StorageCount()
    stack = list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in skip:
            continue
        seen.add(id(o))
        if isinstance(o, type | types.ModuleType | str | bytes | int | float | bool | types.CodeType):
            continue
        if isinstance(o, torch.Tensor):
            if o.is_meta or isinstance(o, FakeTensor):  # shapes in node.meta, no bytes
                continue
            key = _storage_key(o)
            if key is None:
                out.opaque[id(o)] = o.numel() * o.element_size()
            elif key[0]:
                out.storages[key[0]] = max(out.storages.get(key[0], 0), key[1])
            # a Parameter's or tensor's Python attributes (its grad, a subclass's fields)
            stack.extend(r for r in gc.get_referents(o) if not isinstance(r, torch.Tensor) or r is not o)
            continue
        if isinstance(o, torch.ScriptObject):
            out.packed_objects += 1
            continue
        stack.extend(gc.get_referents(o))
    return out


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each storage counted once."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        key = _storage_key(t)
        if key is not None:
            seen[key[0]] = key[1]
    return sum(seen.values())


def _meta_bytes(meta: Any) -> int:
    if isinstance(meta, TensorMetadata):
        numel = 1
        for d in meta.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=meta.dtype).element_size()
    if isinstance(meta, list | tuple):
        return sum(_meta_bytes(m) for m in meta)
    if isinstance(meta, dict):
        return sum(_meta_bytes(m) for m in meta.values())
    return 0


@dataclass
class Footprint:
    """Activation bytes of a graph (see module docstring)."""

    total_bytes: int
    peak_live_bytes: int
    tensors: int

    @property
    def total_mb(self) -> float:
        return self.total_bytes / _MB

    @property
    def peak_live_mb(self) -> float:
        return self.peak_live_bytes / _MB

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_mb": self.total_mb, "peak_live_mb": self.peak_live_mb}


def activation_footprint(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> Footprint:
    """Intermediate-tensor bytes of ``gm``; runs ShapeProp first if ``example_inputs`` are given.

    Nodes without ``tensor_meta`` (ShapeProp not run, or a non-tensor value) count as zero bytes.
    """
    if example_inputs is not None:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
    modules = modules_of(gm)
    nodes = list(gm.graph.nodes)
    size: dict[fx.Node, int] = {}
    owner: dict[fx.Node, fx.Node] = {}  # the node whose storage a (view) node's output uses
    for n in nodes:
        owner[n] = n
        if not n.op.startswith("call"):
            continue
        if op_kind(n, modules) in _ALIAS_KINDS:
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            owner[n] = owner.get(src, n) if src is not None else n
            continue
        b = _meta_bytes(n.meta.get("tensor_meta"))
        if b:
            size[n] = b
    # Liveness: storage dies after the last reader of it or of any view of it; the output node
    # reads the results, so they stay alive to the end. A tensor nobody reads dies at once.
    last_use: dict[fx.Node, int] = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for inp in n.all_input_nodes:
            last_use[owner[inp]] = i
    freed_at: dict[int, list[fx.Node]] = {}
    for n, i in last_use.items():
        freed_at.setdefault(i, []).append(n)
    live = peak = 0
    for i, n in enumerate(nodes):
        live += size.get(n, 0)
        peak = max(peak, live)
        for dead in freed_at.get(i, []):
            live -= size.get(dead, 0)
    return Footprint(sum(size.values()), peak, len(size))
