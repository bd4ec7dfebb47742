"""``gml run`` arguments and command; ``gml.cli`` wires them with one call each."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from gml.argtypes import positive_int
from gml.data.cli import add_preprocess_arguments, data_options
from gml.data.loader import KINDS

DESCRIPTION = (
    "Batch inference: run a model saved by gml (gml quantize / optimize --out FILE.pt2) over every input in "
    f"PATH ({KINDS}) and write the outputs with each input's id to FILE (.parquet: columns id, output; .npy: "
    "FILE = outputs stacked, FILE.ids.npy = ids). Outputs are written in shards (FILE.parts/, each file "
    "atomically): an interrupted run picks up where it stopped when run again with the same arguments, and "
    "writes every input exactly once. Unreadable inputs are skipped and listed in FILE.skipped.json. "
    "--ray runs the same job on Ray Data, one GML model per actor."
)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("saved", metavar="SAVED.pt2", help="a model saved by gml (its engine plan is rebuilt for this CPU)")
    p.add_argument("--input", required=True, metavar="PATH", help=f"the inputs: {KINDS}")
    p.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="FILE.parquet (needs pyarrow; without it FILE.npy is written instead) or FILE.npy",
    )
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="inputs per model call (default 8)")
    p.add_argument(
        "--shard-size",
        type=positive_int,
        default=256,
        metavar="N",
        help="inputs per output shard, the unit of resuming (default 256)",
    )
    p.add_argument(
        "--preprocess",
        metavar="MODEL",
        help="images: take the resize/crop/mean/std of this torchvision name or timm:NAME (a .pt2 does not "
        "record its preprocessing; default: resize to the model's input size, pixels in [0, 1])",
    )
    p.add_argument("--threads", type=positive_int, metavar="N", help="torch threads in process (default: torch's)")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run on Ray Data (pip install 'gml-lab[ray]'): one GML model per actor, one actor per CPU; "
        "no ADDRESS starts a local Ray, 'auto' or host:port joins a cluster",
    )
    p.add_argument(
        "--ray-cpus", type=positive_int, metavar="N", help="CPUs of the local Ray --ray starts (default: all)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_preprocess_arguments(p)


def run_command(args: argparse.Namespace, console: Console) -> int:
    import torch

    from gml.batch.run import run_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    report = run_batch(
        args.saved,
        args.input,
        args.output,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        options=data_options(args),
        preprocess_model=args.preprocess,
        ray_address=args.ray,
        ray_cpus=args.ray_cpus,
        progress=not args.no_progress,
        console=console,
    )
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    console.print(f"inputs: {escape(report.source)}")
    resumed = f", {report.shards_done_before} already written by an earlier run" if report.shards_done_before else ""
    console.print(
        f"wrote {report.written} of {report.items} inputs to {escape(report.output)} ({report.fmt}; "
        f"{report.shards} shard(s){resumed}) in {report.seconds:.1f} s, {report.items_per_s:.1f} inputs/s "
        f"({escape(report.runner)}"
        + (f"; first results after {report.first_result_s:.1f} s" if report.first_result_s is not None else "")
        + ")"
    )
    if report.skipped:
        console.print(
            f"[yellow]skipped {len(report.skipped)} unreadable input(s)[/], listed in "
            f"{escape(report.output)}.skipped.json; first: {escape(report.skipped[0][0])}: "
            f"{escape(report.skipped[0][1])}"
        )
    return 0
