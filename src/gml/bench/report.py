"""Render a :class:`~gml.bench.runner.BenchResult`: rich tables, JSON, Markdown and a PNG chart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gml.bench.runner import BatchResult, BenchResult, VariantResult
from gml.bench.variants import BENCH_EXTRA_HINT as BENCH_HINT

COLUMNS = (
    "variant",
    "median ms",
    "p10–p90 ms",
    "speedup",
    "max |Δ|",
    "cosine",
    "top-1",
    "build s",
    "peak RSS MB (+build)",
    "act. MB total / peak",
)


def _f(x: float | None, fmt: str, dash: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return dash
    return format(x, fmt)


def _ms(x: float | None) -> str:
    """Milliseconds with 3 decimals, or 2 significant digits below 0.01 ms (tiny-model floors)."""
    if x is None:
        return "–"
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2g}"


def _row(v: VariantResult) -> list[str]:
    if not v.ok or v.stats is None:
        return [v.label, f"{v.status}: {v.message}" if v.message else v.status] + [""] * (len(COLUMNS) - 2)
    s = v.stats
    rss = "–"
    if v.rss is not None and v.rss.peak_rss_mb is not None:
        rss = f"{v.rss.peak_rss_mb:.0f} (+{v.rss.build_peak_delta_mb:.0f})"
    elif v.rss is not None and v.rss.retained_mb is not None:
        rss = f"retained {v.rss.retained_mb:+.0f}"
    act = "–"
    if v.footprint is not None:
        act = f"{v.footprint.total_mb:.1f} / {v.footprint.peak_live_mb:.1f}"
    diff = "0" if v.max_abs_diff == 0 else _f(v.max_abs_diff, ".2e")
    return [
        v.label,
        f"{s.median:.3f}",
        f"{s.p10:.3f}–{s.p90:.3f}",
        _f(v.speedup, ".2f") + "×" if v.speedup is not None else "–",
        diff,
        _f(v.cosine, ".6f"),
        _f(None if v.top1_agreement is None else 100 * v.top1_agreement, ".0f")
        + ("%" if v.top1_agreement is not None else ""),
        _f(v.build_s, ".1f"),
        rss,
        act,
    ]


def _floor_line(result: BenchResult, b: BatchResult) -> str:
    parts = []
    if b.macs is not None:
        parts.append(f"{b.macs / 1e9:.3f} GMAC per call")
    if result.peak is not None and b.flops is not None:
        p = result.peak
        parts.append(
            f"measured peak fp32 {p.fp32_flops / 1e9:.0f} GFLOP/s → floor {_ms(p.floor_ms(b.flops, 'fp32'))} ms"
        )
        if p.int8_ops:
            parts.append(f"int8 {p.int8_ops / 1e9:.0f} GOP/s → floor {_ms(p.floor_ms(b.flops, 'int8'))} ms")
        if p.bf16_flops:
            parts.append(f"bf16 {p.bf16_flops / 1e9:.0f} GFLOP/s → floor {_ms(p.floor_ms(b.flops, 'bf16'))} ms")
        if p.kernels:  # what reached each peak, and the ISA oneDNN dispatched (roofline.measure_peak)
            via = ", ".join(f"{k}: {v}" for k, v in p.kernels.items())
            parts.append(f"peaks via {via}" + (f" (oneDNN ISA {p.isa})" if p.isa else ""))
    return "; ".join(parts)


def _header(result: BenchResult) -> str:
    m, s = result.machine, result.settings
    return (
        f"{result.model} on {m['cpu']}"
        + (f" ({m['target']})" if m.get("target") else "")
        + f", {s['threads']} threads, torch {m['versions'].get('torch')}; "
        f"{s['rounds']} interleaved rounds after {s['warmup']} warm-up calls; {result.created}"
    )


def _mem_cells(v: VariantResult) -> list[str]:
    r, fp = v.rss, v.footprint
    peak = delta = kept = "–"
    if r is not None:
        peak = _f(r.peak_rss_mb, ".0f")
        delta = _f(r.build_peak_delta_mb, "+.0f")
        kept = _f(r.retained_mb, "+.0f")
    total = live = "–"
    if fp is not None:
        total, live = f"{fp.total_mb:.2f}", f"{fp.peak_live_mb:.2f}"
    return [peak, delta, kept, total, live]


def _table(title: str, columns: tuple[str, ...]) -> Table:
    t = Table(title=title)
    t.add_column(columns[0], no_wrap=True)
    for col in columns[1:]:
        t.add_column(col, justify="right")
    return t


def render_table(result: BenchResult) -> Group:
    """Rich renderable: per batch size three narrow tables (latency; outputs vs eager; build and
    memory) that fit an 80-column terminal, then the roofline line and skipped/failed variants."""
    parts: list[Any] = [Text(_header(result), style="dim")]
    for b in result.batches:
        head = f"{result.model}, batch {b.batch_size}"
        lat = _table(f"{head}: latency per call", ("variant", "median ms", "p10–p90 ms", "× eager", "floor ms"))
        acc = _table(f"{head}: outputs vs eager fp32", ("variant", "max |Δ|", "cosine", "top-1"))
        mem = _table(
            f"{head}: build and memory (MB)",
            ("variant", "build s", "peak RSS", "build +", "kept +", "act.", "live act."),
        )
        for v in b.variants:
            if not v.ok or v.stats is None:
                continue
            s = v.stats
            style = "bold" if v.name.startswith("gml") else ""
            speed = "–" if v.speedup is None else f"{v.speedup:.2f}×"
            lat.add_row(v.name, f"{s.median:.3f}", f"{s.p10:.3f}–{s.p90:.3f}", speed, _ms(v.floor_ms), style=style)
            row = _row(v)
            acc.add_row(v.name, row[4], row[5], row[6], style=style)
            mem.add_row(v.name, _f(v.build_s, ".1f"), *_mem_cells(v), style=style)
        parts += [lat, acc, mem]
        line = _floor_line(result, b)
        if line:
            parts.append(Text(f"roofline: {line}"))
        for v in b.variants:
            if not v.ok:
                style = "yellow" if v.status == "skipped" else "red"
                parts.append(Text(f"{v.status}: {v.name}: {v.message}", style=style))
    return Group(*parts)


def to_json(result: BenchResult) -> str:
    return json.dumps(result.to_dict(), indent=1)


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(to_json(result) + "\n")


def render_markdown(result: BenchResult) -> str:
    """Markdown: a header line, then per batch size a table, the roofline line and skipped variants."""
    m = result.machine
    out = [
        f"Model **{result.model}**; {m['cpu']} ({m['logical_cpus']} logical CPUs), "
        f"{result.settings['threads']} threads; {result.created}.",
        *(["", f"Target: {m['target']}."] if m.get("target") else []),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
    ]
    for b in result.batches:
        out += [f"#### batch size {b.batch_size}", ""]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |")
        out.append("|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|")
        for v in b.variants:
            if v.ok and v.stats is not None:
                cells = _row(v)
                if v.name.startswith("gml"):
                    cells[0] = f"**{cells[0]}**"
                out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
        line = _floor_line(result, b)
        if line:
            out += [f"Roofline: {line}.", ""]
        missing = [v for v in b.variants if not v.ok]
        for v in missing:
            out.append(f"- {v.label} ({v.name}): {v.status}: {v.message}")
        if missing:
            out.append("")
    return "\n".join(out)


def write_markdown(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(render_markdown(result) + "\n")


_COLORS = {"fp32": "#4c72b0", "int8": "#dd8452", "bf16": "#55a868"}


def render_png(result: BenchResult, path: str | Path) -> None:
    """Bar chart per batch size: median latency per variant, p10–p90 error bars, roofline floors."""
    try:
        import matplotlib
    except ImportError:
        from gml.errors import GMLError

        raise GMLError("Drawing the chart needs matplotlib, which is not installed.", hint=BENCH_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [b for b in result.batches if any(v.ok and v.stats for v in b.variants)]
    if not batches:
        batches = result.batches
    width = max(6.0, 1.5 + 0.8 * _max_bars(batches))
    fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(width * max(1, len(batches)), 5.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        vs = [v for v in b.variants if v.ok and v.stats is not None]
        xs = range(len(vs))
        med = [v.stats.median for v in vs]  # type: ignore[union-attr]
        lo = [v.stats.median - v.stats.p10 for v in vs]  # type: ignore[union-attr]
        hi = [v.stats.p90 - v.stats.median for v in vs]  # type: ignore[union-attr]
        colors = [_COLORS.get(v.precision, "#8172b2") for v in vs]
        bars = ax.bar(xs, med, yerr=[lo, hi], capsize=3, color=colors, edgecolor="black", linewidth=0.5)
        for bar, v in zip(bars, vs):
            if v.name.startswith("gml"):
                bar.set_hatch("//")
            if v.speedup is not None:
                ax.annotate(
                    f"{v.speedup:.2f}×",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([v.name for v in vs], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("latency per call, ms (median, p10–p90)")
        ax.set_title(f"{result.model}, batch {b.batch_size}")
        if result.peak is not None and b.flops is not None:
            floors = [("fp32", "--", 1.0)] + ([("int8", ":", 1.2)] if result.peak.int8_ops else [])
            for precision, style, width in floors:
                ax.axhline(
                    result.peak.floor_ms(b.flops, precision),
                    color=_COLORS[precision],
                    linestyle=style,
                    linewidth=width,
                    label=f"{precision} floor (measured peak)",
                )
            ax.legend(fontsize=7, loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(_header(result), fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)


def _max_bars(batches: list[BatchResult]) -> int:
    return max((sum(1 for v in b.variants if v.ok) for b in batches), default=1)
