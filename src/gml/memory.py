"""What an optimized model keeps in memory, and handing the rest back (issue #28, docs/memory.md).

* :func:`module_tensors`: every tensor a module's submodules hold, each once (what a rollback
  snapshot shares, what :func:`gml.kernels.packs.drop_packed` looks up).
* :func:`shared_copy`: a deep copy of a module's graph and submodules that shares its tensors, for
  a copy whose rewrites replace tensors and never write them (``passes/INVARIANTS.md`` 11): rollback
  snapshots, torch.ao's float twin, the graph the INT8 lowering rewrites.
* :func:`release`: empty a discarded module copy (a pass snapshot, a timing graph) now instead of at
  the next full garbage collection (fx graphs are reference cycles).
* :func:`trim_malloc`: collect garbage and ask glibc to return freed heap pages to the system
  (``malloc_trim(0)``). A build frees several times what it keeps (snapshots, reference graphs,
  calibration, the Python executor's packed weights while the engine is checked); glibc keeps most
  of it resident, because its mmap threshold rises as large blocks are freed and later large
  blocks then come from the heap, whose free pages it does not return on its own. Measured on
  ResNet18 ``gml.optimize``: 500 MB kept without it, 185 MB with it. No-op on other C libraries.
* :func:`returns_memory`: the decorator ``gml.optimize`` / ``gml.quantize`` / ``gml.load`` (and the
  INT8 accuracy report) wear: they trim when they return (or raise), and on entry when called from
  inside another of them. Trimming on entry matters for the peak: ``gml.quantize``'s whole-model guard
  calls ``gml.optimize`` while the pages the INT8 lowering freed are still resident. Either trim
  happens only when the process grew by :data:`TRIM_MIN_GROWTH` or more since the (outermost) call
  began: a full collection costs 0.2 s in a small process and seconds in a large one, more than a
  small model's whole load — a loop of small loads (or a test suite) must not pay it per call.
"""

from __future__ import annotations

import contextvars
import copy
import ctypes
import functools
import gc
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=nn.Module)


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``module``'s submodules hold: parameters, buffers and plain tensor attributes
    (a lowered graph's ``get_attr`` constants), each object once."""
    seen: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for t in (*mod._parameters.values(), *mod._buffers.values(), *vars(mod).values()):
            if isinstance(t, torch.Tensor):
                seen.setdefault(id(t), t)
    return list(seen.values())


def shared_copy(module: M) -> M:
    """``copy.deepcopy(module)`` except its tensors (parameters, buffers, tensor attributes), which
    the copy shares: a new graph and new submodules over the same weights. Neither side may then
    write a tensor in place; replacing one (a new ``Parameter``) is what rewrites do."""
    memo: dict[int, Any] = {id(t): t for t in module_tensors(module)}
    return copy.deepcopy(module, memo)


def release(module: nn.Module, *, keep: Sequence[nn.Module] = ()) -> None:
    """Empty a module copy nobody will use again: every submodule's parameters, buffers, tensor
    attributes and children, and its graphs' node metadata, dropped now.

    An fx ``GraphModule`` is a reference cycle (graph ↔ owning module, nodes ↔ graph), so a dropped
    copy — a pass snapshot once the pass is accepted, a region's timing graph — keeps every tensor
    it reaches until the next *full* garbage collection, which a large process rarely runs; the
    weights a pass replaced (folded BN, the fp32 weights the INT8 lowering quantized) then stayed
    resident beside their replacements for the rest of the build. Emptied, the copy's skeleton still
    waits for the collector but holds nothing heavy. Submodules of the modules in ``keep`` (the live
    ones the copy may share submodules with) are left alone; tensors are only dereferenced, never written, so a tensor
    the copy shares with a live module lives on there."""
    kept = {id(m) for live in keep for m in live.modules()}
    for mod in list(module.modules()):
        if id(mod) in kept:
            continue
        mod._parameters.clear()
        mod._buffers.clear()
        for name in [k for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]:
            del mod.__dict__[name]
        graph = mod.__dict__.get("_graph")
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                node.meta = {}
        mod._modules.clear()


#: the resident size when the outermost returns_memory call in this context began (None: none runs)
_OUTER_START: contextvars.ContextVar[int | None] = contextvars.ContextVar("gml_memory_outer_start", default=None)

#: growth of the resident size (bytes) since a call began below which it does not trim: what a call
#: that grew the process less than this could hand back is not worth a full garbage collection
TRIM_MIN_GROWTH = 32 << 20


def resident_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``), or -1 where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


def _grew(since: int) -> bool:
    now = resident_bytes()
    return since >= 0 and now >= 0 and now - since >= TRIM_MIN_GROWTH


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on: its own symbols (``dlopen(NULL)``), where CPython's libc
    is. Not ``ctypes.util.find_library("c")``, which runs ``/sbin/ldconfig -p`` in a subprocess —
    inside every first ``gml.load`` of a process, under the hostile-file test's audit hook."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another C library, or no libc found)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_malloc() -> bool:
    """Collect garbage (fx graphs are reference cycles) and hand freed heap pages back to the
    system; False where the C library has no ``malloc_trim``."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


#: ``madvise`` advice that reclaims a range's pages (Linux >= 5.4): clean file-backed pages are dropped
#: and read from the file again when touched; a page written since (copy-on-write) is never lost
_MADV_PAGEOUT = 21


class MappedFile:
    """A file mapped read-copy-on-write into this process, whose bytes back tensors (a loaded model's
    weights: :func:`gml.archive.read_export_program`), as ``torch.load(mmap=True)`` and llama.cpp map
    theirs. A page costs resident memory only once touched; :meth:`page_out` hands the touched ones
    back (the engine holds its own reordered copy of the weights: the graph's copy is read again, from
    the page cache or the disk, only when the Python executor runs).

    The mapping lives as long as a tensor over it. Replacing the file (``gml.io.save`` writes a new
    file and renames it) does not reach the mapping; writing into the file in place would, as with
    any mapped file. A copy (``copy.deepcopy`` of a model) shares the mapping: its tensors copy what
    they need."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.nbytes = os.path.getsize(self.path)
        self.storage = torch.UntypedStorage.from_file(self.path, False, self.nbytes)

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` (a multiple of the element size)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset % itemsize or offset < 0 or offset + numel * itemsize > self.nbytes:
            raise ValueError(f"{numel} x {dtype} at byte {offset} is not an aligned range of {self.path}")
        return torch.empty(0, dtype=dtype).set_(self.storage, offset // itemsize, (numel,), (1,))

    def page_out(self) -> bool:
        """Hand the mapping's resident pages back to the system; False where the kernel cannot."""
        madvise = _madvise()
        if madvise is None or self.nbytes == 0:
            return False
        ptr = self.storage.data_ptr()
        start = ptr - ptr % os.sysconf("SC_PAGE_SIZE")
        return madvise(start, self.nbytes + (ptr - start), _MADV_PAGEOUT) == 0

    def __deepcopy__(self, memo: dict[int, Any]) -> MappedFile:
        return self


@functools.cache
def _madvise() -> Any:
    fn = getattr(_libc(), "madvise", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def returns_memory(fn: F) -> F:
    """``fn``, trimming the heap (:func:`trim_malloc`) when it returns or raises, and when it is called
    from inside another such call (``gml.quantize``'s whole-model guard calls ``gml.optimize``: the
    pages the INT8 lowering freed are GML's own garbage, and trimming them lowers the peak) — each only
    when the process grew by :data:`TRIM_MIN_GROWTH` since the call (on entry: the outermost call)
    began. A call from user code does not trim on entry: the caller's garbage is the caller's."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = _OUTER_START.get()
        if outer is not None and _grew(outer):
            trim_malloc()
        start = resident_bytes()
        token = _OUTER_START.set(start if outer is None else outer)
        try:
            return fn(*args, **kwargs)
        finally:
            _OUTER_START.reset(token)
            if _grew(start):
                trim_malloc()

    return wrapper  # type: ignore[return-value]
