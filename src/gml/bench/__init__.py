"""``gml bench``: every way of running a model, measured side by side in interleaved rounds.

>>> from gml.bench import run_bench, render_table
>>> result = run_bench("resnet18", batch_sizes=[1, 8], variants="eager,gml-int8,compile")  # doctest: +SKIP
"""

from __future__ import annotations

from gml.bench.report import render_markdown, render_png, render_table, to_json, write_json, write_markdown
from gml.bench.runner import BatchResult, BenchResult, VariantResult, interleaved_schedule, run_bench
from gml.bench.variants import DEFAULT_VARIANTS, VARIANTS, VariantSkipped

__all__ = [
    "DEFAULT_VARIANTS",
    "VARIANTS",
    "BatchResult",
    "BenchResult",
    "VariantResult",
    "VariantSkipped",
    "interleaved_schedule",
    "render_markdown",
    "render_png",
    "render_table",
    "run_bench",
    "to_json",
    "write_json",
    "write_markdown",
]
