"""The quick interleaved timer behind GML's run-time decisions: the cost policy's regions and
whole-model guard (gml.quant.cost_policy), the engine-vs-executor check (gml.runtime.select) and the
latency line of ``gml optimize`` / ``gml quantize``. Benchmarks use
:func:`gml.bench.runner.time_interleaved` (torch Timer blocks, shuffled order, settle pauses)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def median_ms_interleaved(
    fns: Sequence[Callable[[], Any]], rounds: int = 5, min_ms: float = 2.0, decisive: float = 10.0
) -> list[float]:
    """Median ms per call of each function, in interleaved rounds (machine noise hits all alike);
    each sample repeats a call until it takes ``min_ms`` so that short regions are not timer noise.
    When one call is ``decisive`` times slower than another already (a kernel gone wrong), the
    first timed calls are the answer: more rounds would not change the ranking, only cost time."""
    with torch.no_grad():
        inner, first = [], []
        for f in fns:  # warm up (oneDNN primitives, allocator) and size the inner loop
            f()
            t0 = time.perf_counter()
            f()
            once = max(time.perf_counter() - t0, 1e-6) * 1e3
            first.append(once)
            inner.append(max(1, min(200, int(min_ms / once) + 1)))
        if len(first) > 1 and max(first) > decisive * min(first) and max(first) > 10 * min_ms:
            return first
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(rounds):
            for i, f in enumerate(fns):
                t0 = time.perf_counter()
                for _ in range(inner[i]):
                    f()
                samples[i].append((time.perf_counter() - t0) * 1e3 / inner[i])
    return [statistics.median(s) for s in samples]
