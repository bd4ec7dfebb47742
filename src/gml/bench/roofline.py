"""The roofline line of the benchmark: model work and this machine's measured compute peak.

* **Work** is counted by :class:`torch.utils.flop_counter.FlopCounterMode` on the eager model
  (convolutions, linears, matmuls; it counts a multiply-add as 2 FLOPs, so MACs = FLOPs / 2).
  Element-wise ops, pooling and normalisation are not counted: they are cheap in FLOPs and
  bound by memory, which is exactly what fusion removes.
* **Peak** is *measured*, not taken from a datasheet: the best rate of a large fp32 oneDNN
  convolution (FLOP/s) and of ``torch._int_mm`` on int8 matrices (OP/s, the VNNI path), each the
  best of a few repetitions at the benchmark's thread count. The result is cached per CPU model,
  thread count and torch version in ``$XDG_CACHE_HOME/gml/peak.json`` (``~/.cache`` by default).
* **Floor** = work / peak: no implementation can run the model faster than this on this machine
  at this precision. fp32 variants are held to the fp32 peak, INT8 variants to the int8 peak.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class Peak:
    """Measured compute peaks of this machine (FLOP/s or OP/s) at ``threads`` threads."""

    fp32_flops: float
    int8_ops: float | None
    threads: int
    cpu: str
    torch_version: str
    measured_at: str = ""
    source: str = "measured"  # "measured" | "cache" (an earlier, higher measurement was kept)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def floor_ms(self, flops: float, precision: str) -> float | None:
        rate = self.int8_ops if precision == "int8" else self.fp32_flops
        return flops / rate * 1e3 if rate else None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def count_flops(model: nn.Module, example_inputs: Sequence[Any]) -> int:
    """FLOPs of one forward pass (2 per multiply-add), as counted by ``FlopCounterMode``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*example_inputs)
    return int(counter.get_total_flops())


def _best_rate(fn: Callable[[], object], work: float, reps: int) -> float:
    fn()  # first call: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / best


def measure_peak(threads: int, *, reps: int = 10, scale: float = 1.0) -> Peak:
    """Measure fp32 conv and int8 matmul peaks (about a second at full ``scale``)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            n = max(1, round(4 * scale))
            # channels-last lets oneDNN pick its fastest direct-conv kernel (near the FMA limit here)
            x = torch.randn(n, 256, 28, 28).to(memory_format=torch.channels_last)
            w = torch.randn(256, 256, 3, 3).to(memory_format=torch.channels_last)
            conv_flops = 2.0 * n * 256 * 256 * 9 * 28 * 28
            fp32 = _best_rate(lambda: torch.nn.functional.conv2d(x, w, padding=1), conv_flops, reps)
            int8: float | None
            try:
                m = max(256, int(2048 * scale) // 64 * 64)
                a = torch.randint(-128, 127, (m, m), dtype=torch.int8)
                b = torch.randint(-128, 127, (m, m), dtype=torch.int8)
                int8 = _best_rate(lambda: torch._int_mm(a, b), 2.0 * m * m * m, reps)
            except (RuntimeError, AttributeError):  # no int8 GEMM in this build
                int8 = None
    finally:
        torch.set_num_threads(old)
    return Peak(fp32, int8, threads, cpu_name(), torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S"))


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gml" / "peak.json"


def cached_peak(threads: int, *, reset: bool = False, cache: Path | None = None) -> Peak:
    """Measure the peak now and return the best of this and every earlier measurement cached for
    this CPU/threads/torch (``reset`` forgets the earlier ones).

    A peak is a maximum, and a measurement taken while other processes use the cores comes out
    low; re-measuring each run (about a second) and keeping the best makes the cached value
    converge to the machine's real peak instead of freezing a bad first measurement.
    """
    path = cache or _cache_path()
    key = f"{cpu_name()}|{threads}|{torch.__version__}"
    try:
        entries: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    peak = measure_peak(threads)
    old = None if reset else entries.get(key)
    if old is not None:
        if old["fp32_flops"] > peak.fp32_flops:
            peak.fp32_flops, peak.source = old["fp32_flops"], "cache"
        if old.get("int8_ops") and (not peak.int8_ops or old["int8_ops"] > peak.int8_ops):
            peak.int8_ops, peak.source = old["int8_ops"], "cache"
    entries[key] = peak.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entries, indent=1))
    except OSError:
        pass  # a read-only home only loses the history
    return peak
