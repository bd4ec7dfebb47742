"""The roofline line of the benchmark: model work and this machine's measured compute peak.

* **Work** is counted by :class:`torch.utils.flop_counter.FlopCounterMode` on the eager model
  (convolutions, linears, matmuls; it counts a multiply-add as 2 FLOPs, so MACs = FLOPs / 2).
  Element-wise ops, pooling and normalisation are not counted: they are cheap in FLOPs and
  bound by memory, which is exactly what fusion removes.
* **Peak** is *measured*, not taken from a datasheet, the way GML's kernels reach it: a large inner
  product (``M = N = K = 1024`` at full scale) run as a oneDNN primitive by the native engine
  (:mod:`gml.runtime`) in each precision — INT8 (u8 x s8, OP/s), fp32 and, where the CPU has
  native bf16 (AVX512-BF16, AMX), bf16 (FLOP/s) — so on an AMX machine the INT8 / bf16 peaks are
  AMX's, not VNNI's; oneDNN's dispatched ISA (``_engine.cpu_isa()``) and the implementation it
  picked per precision are recorded. The earlier torch probes (a large fp32 oneDNN convolution,
  ``torch._int_mm``) run too, and each precision keeps the higher rate (without the engine they
  are the peak). Every rate is the best of a few repetitions at the benchmark's thread count. The
  result is cached per CPU model, thread count and torch version in
  ``$XDG_CACHE_HOME/gml/peak.json`` (``~/.cache`` by default).
* **Floor** = work / peak: no implementation can run the model faster than this on this machine
  at this precision. fp32 variants are held to the fp32 peak, INT8 variants to the int8 peak.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gml.errors import GMLError
from gml.ir.target import Target


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
    bf16_flops: float | None = None
    #: the instruction set oneDNN dispatches to (``gml._engine.cpu_isa()``), "" without the engine
    isa: str = ""
    #: per precision, what reached the peak: ``engine <oneDNN implementation>`` or ``torch ...``
    kernels: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def floor_ms(self, flops: float, precision: str) -> float | None:
        rate = {"int8": self.int8_ops, "bf16": self.bf16_flops}.get(precision, self.fp32_flops)
        return flops / rate * 1e3 if rate else None


@dataclass
class EnginePeak:
    """Peaks of one large inner product per precision through the native engine (ops or FLOP/s)."""

    isa: str
    rates: dict[str, float]  # "int8" | "fp32" | "bf16" -> rate
    impls: dict[str, str]  # precision -> oneDNN implementation (e.g. "brg:avx512_core_amx")


def measure_engine_peak(threads: int, *, reps: int = 10, scale: float = 1.0) -> EnginePeak:
    """INT8, fp32 and (native only) bf16 peaks of a ``[M, K] x [K, N]`` inner product planned and
    run by the native engine, as GML's INT8 / fp32 graphs run. Raises :class:`~gml.errors.
    UnsupportedError` when the engine is not built."""
    from gml.runtime import native
    from gml.runtime.plan_steps import describe

    eng = native.load()
    isa = eng.cpu_isa()
    n = max(64, int(1024 * scale) // 64 * 64)
    gen = torch.Generator().manual_seed(0)
    cases = {
        # precision: (src dtype, weight dtype, (engine src dtype, engine weight dtype))
        "int8": (torch.uint8, torch.int8, ("u8", "s8")),
        "fp32": (torch.float32, torch.float32, ("f32", "f32")),
    }
    if Target(isa).native_bf16:  # elsewhere oneDNN emulates bf16: no peak to measure
        cases["bf16"] = (torch.bfloat16, torch.bfloat16, ("bf16", "bf16"))
    rates: dict[str, float] = {}
    impls: dict[str, str] = {}
    for precision, (sdt, wdt, (sname, wname)) in cases.items():
        if sdt == torch.uint8:
            x = torch.randint(0, 256, (n, n), dtype=sdt, generator=gen)
            w = torch.randint(-128, 128, (n, n), dtype=wdt, generator=gen)
        else:
            x, w = torch.randn(n, n, generator=gen).to(sdt), torch.randn(n, n, generator=gen).to(wdt)
        y = torch.empty(n, n)
        plan = eng.Plan()
        src = plan.add_value([n, n], [n, 1], sname, 1, 0, 0)
        dst = plan.add_value([n, n], [n, 1], "f32", 2, 0, 0)
        try:
            plan.add(describe(
                eng.InnerProductStep, src=src, dst=dst, weight=w.data_ptr(), wdims=[n, n], wdtype=wname,
                w_scales=[1.0], src_q=(1.0, 0) if precision == "int8" else None, name=precision,
            ))  # fmt: skip
        except (RuntimeError, ValueError):  # this oneDNN has no such primitive here
            continue
        plan.finalize(0)
        args = ([x.data_ptr()], [y.data_ptr()], threads)
        rates[precision] = _best_rate(lambda plan=plan, args=args: plan.run(*args), 2.0 * n * n * n, reps)
        impls[precision] = plan.step_impls()[0]
    return EnginePeak(isa, rates, impls)


def cpu_name() -> str:
    """The CPU's model name, and the CPUID mask it runs under if any (``benchmarks/cpu_mask``)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mask = os.environ.get("GML_CPU_MASK")
    if mask and "cpu_mask" in os.environ.get("LD_PRELOAD", ""):
        name += f" [CPUID masked to {mask}]"
    return name


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
        kernels = {"fp32": "torch conv2d", **({"int8": "torch _int_mm"} if int8 else {})}
        bf16: float | None = None
        isa = ""
        try:
            ep = measure_engine_peak(threads, reps=reps, scale=scale)
        except GMLError:  # no native engine: the torch probes are the peak
            ep = None
        if ep is not None:
            isa = ep.isa
            for precision, rate in ep.rates.items():
                kernel = f"engine {ep.impls[precision]}"
                if precision == "bf16":
                    bf16 = rate
                    kernels[precision] = kernel
                elif precision == "int8" and (int8 is None or rate > int8):
                    int8 = rate
                    kernels[precision] = kernel
                elif precision == "fp32" and rate > fp32:
                    fp32 = rate
                    kernels[precision] = kernel
    finally:
        torch.set_num_threads(old)
    return Peak(
        fp32,
        int8,
        threads,
        cpu_name(),
        torch.__version__,
        time.strftime("%Y-%m-%d %H:%M:%S"),
        bf16_flops=bf16,
        isa=isa,
        kernels=kernels,
    )


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
    try:
        entries: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    peak = measure_peak(threads)
    # the ISA oneDNN dispatched to is part of the key: a run capped to AVX2 (ONEDNN_MAX_CPU_ISA,
    # or a CPUID mask) on this CPU must not inherit the VNNI peak of an uncapped run
    key = f"{cpu_name()}|{peak.isa}|{threads}|{torch.__version__}"
    old = None if reset else entries.get(key)
    if old is not None:
        if old["fp32_flops"] > peak.fp32_flops:
            peak.fp32_flops, peak.source = old["fp32_flops"], "cache"
        if old.get("int8_ops") and (not peak.int8_ops or old["int8_ops"] > peak.int8_ops):
            peak.int8_ops, peak.source = old["int8_ops"], "cache"
        if old.get("bf16_flops") and (not peak.bf16_flops or old["bf16_flops"] > peak.bf16_flops):
            peak.bf16_flops, peak.source = old["bf16_flops"], "cache"
    entries[key] = peak.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entries, indent=1))
    except OSError:
        pass  # a read-only home only loses the history
    return peak
