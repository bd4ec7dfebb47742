"""``gml bench FILE``: a model saved by ``gml.io.save``, on the native engine vs its Python executor.

A saved file holds the optimized graph, not the eager model it came from, so the peers of
``gml bench MODEL`` (eager, torch.compile, ONNX Runtime, ...) cannot be built from it. What can be
measured is what loading gives: the engine's plan rebuilt on this machine (:func:`gml.io.load`),
timed in interleaved rounds against the same graph on the Python executor (``runtime="torch"``),
with their outputs compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gml.bench.roofline import cpu_name
from gml.bench.runner import time_interleaved
from gml.bench.stats import flat_output, max_abs_diff, summarize


def _inputs(
    templates: Sequence[torch.Tensor], batch: int, shapes: Sequence[Sequence[int]] | None, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, t in enumerate(templates):
        shape = list(shapes[i]) if shapes and i < len(shapes) else list(t.shape)
        shape[0] = batch
        if t.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(t.dtype))
        else:
            out.append(torch.zeros(shape, dtype=t.dtype))
    return tuple(out)


def bench_saved(
    path: str | Path,
    *,
    batch_sizes: Sequence[int] = (1,),
    rounds: int = 20,
    threads: int | None = None,
    seed: int = 0,
    input_shape: Sequence[Sequence[int]] | None = None,
    settle_ms: float = 100.0,
    console: Console | None = None,
) -> int:
    """Time ``path`` on the engine and on the Python executor; returns the exit code (0)."""
    from gml.io import attach_loaded_runtime, load, placeholder_inputs
    from gml.runtime.target import detect_target

    console = console or Console(highlight=False)
    target = detect_target(threads or None)
    gm = load(path, runtime="torch", target=target, graph=True)
    engine = attach_loaded_runtime(gm, "engine", target)
    report = engine.runtime
    isa = target.isa
    console.print(f"[bold]{path}[/]: a model saved by gml; {str(report).splitlines()[0]}")
    for line in str(report).splitlines()[1:]:
        console.print(f"[dim]{line}[/]")
    console.print(
        f"[dim]CPU: {cpu_name()}, oneDNN ISA {isa}; no eager model in a saved file: the engine is timed "
        "against the same graph on the Python executor[/]"
    )
    templates = placeholder_inputs(gm)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    table = Table(title=f"{Path(path).name}: latency (median of {rounds} interleaved rounds)")
    for col in ("batch", "runtime", "median ms", "p10–p90 ms", "speedup", "max |diff| vs executor"):
        table.add_column(col, justify="right" if col != "runtime" else "left")
    try:
        with torch.no_grad():
            for bs in batch_sizes:
                x = _inputs(templates, bs, input_shape, seed)
                calls = {"python executor": lambda x=x: gm(*x)}
                if engine is not gm:
                    label = "engine" if report.path == "engine" else f"engine ({report.path})"
                    calls[label] = lambda x=x: engine(*x)
                ref = flat_output(gm(*x))
                diffs = {name: max_abs_diff(ref, flat_output(fn())) for name, fn in calls.items()}
                samples = time_interleaved(calls, rounds=rounds, seed=seed, threads=threads, settle_ms=settle_ms)
                base = summarize(samples["python executor"]).median
                for name, ms in samples.items():
                    st = summarize(ms)
                    table.add_row(
                        str(bs),
                        name,
                        f"{st.median:.3f}",
                        f"{st.p10:.3f}–{st.p90:.3f}",
                        f"{base / st.median:.2f}x",
                        f"{diffs[name]:.3g}",
                    )
    finally:
        torch.set_num_threads(old)
    console.print(table)
    return 0


__all__ = ["bench_saved"]
