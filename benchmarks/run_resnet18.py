"""Produce the ResNet18 tables of docs/benchmarks.md (batch sizes 1 and 8, every variant).

    .venv/bin/python benchmarks/run_resnet18.py             # full run, rewrites the results section
    .venv/bin/python benchmarks/run_resnet18.py --rounds 3 --doc /tmp/b.md   # quick trial elsewhere

Run it on a quiet machine (nothing else using the cores): the harness interleaves variants so
drift hits all of them alike, but it cannot give back cores another process is using. It writes

* the section between the ``<!-- results:begin -->`` / ``<!-- results:end -->`` markers of
  ``--doc`` (date, machine, versions and the tables),
* every sample as JSON (``--json``) and the bar chart (``--png``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from rich.console import Console

from gml.bench import render_markdown, render_png, render_table, run_bench, write_json

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def fill_section(doc: Path, body: str) -> None:
    """Replace what is between the result markers of ``doc`` with ``body``."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} markers")
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{body.strip()}\n{END}", text, count=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--variants", default=None, help="default: every variant of `gml bench`")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "resnet18.json")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "benchmarks-resnet18.png")
    args = p.parse_args(argv)

    console = Console(stderr=True, highlight=False)
    result = run_bench(
        "resnet18",
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        variants=args.variants,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        console=console,
    )
    console.print(render_table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(result, args.json)
    render_png(result, args.png)
    rel = lambda path: path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path  # noqa: E731
    body = (
        render_markdown(result)
        + f"\nCommand: `python benchmarks/run_resnet18.py --rounds {args.rounds} --warmup {args.warmup}"
        + f" --batch-sizes {args.batch_sizes}`. Every sample: `{rel(args.json)}`.\n\n"
        + f"![ResNet18 latency per variant]({os.path.relpath(args.png, args.doc.parent)})\n"
    )
    fill_section(args.doc, body)
    console.print(f"wrote {args.doc}, {args.json}, {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
