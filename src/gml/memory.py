"""What an optimized model keeps in memory, and handing the rest back (issue #28, docs/memory.md).

* :func:`module_tensors`: every tensor a module's submodules hold, each once (what a rollback
  snapshot shares, what :func:`gml.kernels.packs.drop_packed` looks up).
* :func:`shared_copy`: a deep copy of a module's graph and submodules that shares its tensors, for
  a copy whose rewrites replace tensors and never write them (``passes/INVARIANTS.md`` 11): rollback
  snapshots, torch.ao's float twin, the graph the INT8 lowering rewrites.
* :func:`trim_malloc`: collect garbage and ask glibc to return freed heap pages to the system
  (``malloc_trim(0)``). A build frees several times what it keeps (snapshots, reference graphs,
  calibration, the Python executor's packed weights while the engine is checked); glibc keeps most
  of it resident, because its mmap threshold rises as large blocks are freed and later large
  blocks then come from the heap, whose free pages it does not return on its own. Measured on
  ResNet18 ``gml.optimize``: 500 MB kept without it, 185 MB with it. No-op on other C libraries.
* :func:`returns_memory`: the decorator ``gml.optimize`` / ``gml.quantize`` / ``gml.load`` (and the
  INT8 accuracy report) wear: they trim when they return (or raise), and on entry when called from
  inside another of them. Trimming on entry matters for the peak: ``gml.quantize``'s whole-model guard
  calls ``gml.optimize`` while the pages the INT8 lowering freed are still resident.
"""

from __future__ import annotations

import contextvars
import copy
import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
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


#: how many returns_memory calls are running in this context (0: a call from user code)
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("gml_memory_depth", default=0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another C library, or no libc found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
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


def returns_memory(fn: F) -> F:
    """``fn``, trimming the heap (:func:`trim_malloc`) when it returns or raises, and when it is called
    from inside another such call (``gml.quantize``'s whole-model guard calls ``gml.optimize``: the
    pages the INT8 lowering freed are GML's own garbage, and trimming them lowers the peak). A call from
    user code does not trim on entry: the caller's garbage is the caller's, and a full collection costs
    up to a second in a large process — per call, in a loop of loads."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = _DEPTH.get()
        if outer:
            trim_malloc()
        token = _DEPTH.set(outer + 1)
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.reset(token)
            trim_malloc()

    return wrapper  # type: ignore[return-value]
