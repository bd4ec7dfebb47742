"""``gml bench`` arguments and command; ``gml.cli`` wires them with one call each."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from gml.argtypes import add_model_arguments, positive_int
from gml.bench.variants import DEFAULT_VARIANTS, VARIANTS


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``gml bench``'s arguments (including the positional MODEL) to ``p``."""
    add_model_arguments(
        p,
        saved_models=", or a model saved by gml (file.pt2: timed on the native engine against its Python executor)",
        input_shape="input shape(s) like 1x3x224x224 (dim 0 is replaced by each batch size; several inputs: "
        "1x3x32x32,1x10). Default: what the model declares, else 1x3x224x224",
    )
    p.add_argument("--batch-sizes", type=_int_list, default=[1], metavar="N[,N...]", help="batch sizes (default: 1)")
    p.add_argument(
        "--variants",
        default=None,
        metavar="NAMES",
        help=f"comma-separated variants, 'all' or 'default' (default: {','.join(DEFAULT_VARIANTS)}). "
        f"Known: {', '.join(VARIANTS)}",
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="which default variants run: fp32 (above) or bf16 (eager, gml-fp32, gml-bf16, ov-fp32, ov-bf16: "
        "GML bf16 against OpenVINO bf16); --variants still picks any list, gml-bf16 included",
    )
    p.add_argument(
        "--rounds", type=positive_int, default=None, help="interleaved timing rounds (default: 20; with --llm: 3)"
    )
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per variant (default: 3)")
    p.add_argument("--threads", type=positive_int, default=None, help="threads for every runtime (default: all cores)")
    p.add_argument(
        "--calib-batches",
        type=positive_int,
        default=8,
        help="generated calibration batches for INT8 (default: 8; --calib-data calibrates on real data)",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=100.0,
        help="pause before each sample so the previous runtime's spinning threads go idle (default: 100)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of inputs and round order (default: 0)")
    p.add_argument("--json", metavar="FILE", help="write every sample and statistic as JSON")
    p.add_argument("--md", metavar="FILE", help="write the tables as Markdown")
    p.add_argument("--png", metavar="FILE", help="draw a latency bar chart with the roofline floor")
    p.add_argument("--no-floor", action="store_true", help="do not measure the machine's peak (no roofline)")
    p.add_argument("--reset-peak", action="store_true", help="forget the best compute peak measured in earlier runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("decoder LLMs (--llm)")
    g.add_argument(
        "--llm",
        action="store_true",
        help="MODEL is a decoder LLM (a local HF folder, a .gguf file, a file lm.save wrote, or tinyllama: random "
        "weights): prefill / decode tokens/s of GML against HF eager and the peer models given below (each peer in "
        "its own worker process), next to the measured bandwidth ceiling",
    )
    g.add_argument(
        "--llm-weights",
        default="fp32,int8,int4",
        metavar="W[,W...]",
        help="GML weight formats to time: fp32, bf16, int8, int4 (default: fp32,int8,int4)",
    )
    g.add_argument(
        "--llm-activations",
        default="default",
        metavar="A[,A...]",
        help="activations of the int8 / int4 rows: fp32, int8 (decode steps on integer dot products), default "
        "(gml.llm's: int8 for int4 weights, fp32 for int8), or several (default: default)",
    )
    g.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt length (default: 128)")
    g.add_argument("--new-tokens", type=positive_int, default=32, help="tokens generated (default: 32)")
    from gml.bench.llm_peers import PEERS

    for kind in PEERS:
        g.add_argument(
            f"--{kind.key}-model",
            action="append",
            default=[],
            metavar="PATH[,PATH...]",
            help=f"{kind.name}: {kind.model} to time (repeatable; a row each, named by its precision)",
        )
        g.add_argument(
            f"--{kind.key}-python",
            default=None,
            metavar="PYTHON",
            help=f"the python that has {kind.name} (its own venv; default: this one)",
        )
    g.add_argument(
        "--llamacpp-preload",
        default=None,
        metavar="LIB",
        help="a library LD_PRELOADed into the llama.cpp worker only (e.g. benchmarks/llamacpp_noamx.c built, where "
        "ggml's AMX matmul dies with SIGILL)",
    )
    from gml.data.cli import add_data_arguments

    add_data_arguments(p, accuracy_gate=False)


def bench_command(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run ``gml bench`` from parsed arguments; returns the exit code."""
    from gml.bench.report import render_png, render_table, write_json, write_markdown
    from gml.bench.roofline import cached_peak
    from gml.bench.runner import _default_threads, run_bench
    from gml.data.cli import data_options
    from gml.files import check_writable, write_atomically

    console = console or Console(highlight=False)
    for option, path in (("--json", args.json), ("--md", args.md), ("--png", args.png)):
        check_writable(path, option)  # before the run, not after it
    if args.llm:
        return _bench_llm(args, console)
    args.rounds = args.rounds or 20
    shapes = None
    if args.input_shape:
        from gml.models import parse_shapes

        shapes = parse_shapes(args.input_shape)
    from gml.io import is_saved_model

    if is_saved_model(args.model):  # a file gml.io.save wrote: its engine vs its Python executor
        if args.calib_data or args.eval_data:
            from gml.errors import GMLError

            raise GMLError(
                "--calib-data / --eval-data apply to a model to quantize, not to a saved .pt2.",
                hint=f"gml run {args.model} --input PATH --output FILE runs a saved model over data.",
            )
        from gml.bench.saved import bench_saved

        return bench_saved(
            args.model,
            batch_sizes=args.batch_sizes,
            rounds=args.rounds,
            threads=args.threads,
            seed=args.seed,
            input_shape=shapes,
            settle_ms=args.settle_ms,
            console=console,
        )
    peak: object = None
    if not args.no_floor:
        threads = args.threads or _default_threads()
        peak = cached_peak(threads, reset=args.reset_peak)
    result = run_bench(
        args.model,
        input_shape=shapes,
        batch_sizes=args.batch_sizes,
        variants=args.variants,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        calib_batches=args.calib_batches,
        seed=args.seed,
        settle_ms=args.settle_ms,
        weights=args.weights,
        unsafe_load=args.unsafe_load,
        trust_remote_code=args.trust_remote_code,
        submodule=args.submodule,
        leaf_modules=args.leaf,
        precision=args.precision,
        calib_data=args.calib_data,
        calib_samples=args.calib_samples,
        eval_data=args.eval_data,
        data_options=data_options(args),
        peak=peak,  # type: ignore[arg-type]
        console=console,
        progress=not args.no_progress,
    )
    console.print(render_table(result))
    _print_data(result, console)
    for path, write, what in (
        (args.json, write_json, "JSON"),
        (args.md, write_markdown, "Markdown"),
        (args.png, render_png, "chart"),
    ):
        if path:
            write_atomically(path, lambda tmp, write=write: write(result, tmp), what=what)
            console.print(f"{what} written to {path}")
    ok = sum(1 for b in result.batches for v in b.variants if v.ok)
    return 0 if ok else 1


def _bench_llm(args: argparse.Namespace, console: Console) -> int:
    from gml.bench.llm import bench_llm
    from gml.errors import InputError
    from gml.files import write_atomically
    from gml.llm.api import WEIGHTS

    if args.json or args.png or args.batch_sizes != [1]:
        raise InputError(
            "--llm times batch 1 and writes a Markdown table only", "drop --json / --png / --batch-sizes; use --md FILE"
        )
    weights = [w.strip() for w in args.llm_weights.split(",") if w.strip()]
    bad = [w for w in weights if w not in WEIGHTS]
    if bad or not weights:
        raise InputError(f"--llm-weights {args.llm_weights!r}: {bad or 'empty'}", f"pick from {', '.join(WEIGHTS)}")
    acts = tuple(a.strip() for a in args.llm_activations.split(",") if a.strip())
    if not acts or any(a not in ("fp32", "int8", "default") for a in acts):
        raise InputError(
            f"--llm-activations {args.llm_activations!r}", "pick from fp32, int8, default (e.g. fp32,int8)"
        )
    result = bench_llm(
        args.model,
        weights=weights,
        activations=acts,
        peers=_peer_requests(args),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        rounds=args.rounds or 3,
        seed=args.seed,
        threads=args.threads,
        progress=None if args.no_progress else (lambda msg: console.print(f"[dim]{msg}[/]")),
    )
    table = result.markdown()
    console.print(table, markup=False, soft_wrap=True)
    if args.md:
        write_atomically(args.md, lambda tmp: Path(tmp).write_text(table + "\n"), what="Markdown")
        console.print(f"Markdown written to {args.md}")
    return 0


def _peer_requests(args: argparse.Namespace) -> list:
    """One request per peer runtime from ``--KEY-model`` / ``--KEY-python`` / ``--llamacpp-preload``."""
    import sys

    from gml.bench.llm_peers import PEERS, PeerRequest
    from gml.errors import InputError

    requests = []
    for kind in PEERS:
        models = [m.strip() for arg in getattr(args, f"{kind.key}_model") for m in arg.split(",") if m.strip()]
        env = {}
        if kind.key == "llamacpp" and args.llamacpp_preload:
            lib = Path(args.llamacpp_preload)
            if not lib.is_file():
                raise InputError(
                    f"--llamacpp-preload {args.llamacpp_preload!r} does not exist",
                    "build it: gcc -O2 -shared -fPIC benchmarks/llamacpp_noamx.c -o libnoamx.so -ldl",
                )
            env["LD_PRELOAD"] = str(lib.resolve())
        python = getattr(args, f"{kind.key}_python") or sys.executable
        requests.append(PeerRequest(kind, python, models, env))
    return requests


def _print_data(result, console: Console) -> None:
    """What real data the INT8 variants calibrated on and the errors were measured on, and each
    variant's top-1 accuracy against its labels."""
    from rich.markup import escape

    s = result.settings
    if s.get("calib_data", "generated") != "generated":
        console.print(f"INT8 variants calibrated on {escape(s['calib_data'])}")
    if s.get("eval_data", "generated") != "generated":
        console.print(f"output errors measured on {escape(s['eval_data'])}")
    for b in result.batches:
        rows = [f"{v.name} {100 * v.top1_accuracy:.2f}%" for v in b.variants if v.top1_accuracy is not None]
        if rows:
            console.print(f"top-1 accuracy against the labels (batch size {b.batch_size}): {', '.join(rows)}")


def main(argv: list[str] | None = None) -> int:
    """``python -m gml.bench.cli MODEL ...`` until ``gml bench`` is wired into ``gml.cli``."""
    parser = argparse.ArgumentParser(prog="gml bench", description="Benchmark a model against every peer.")
    add_bench_arguments(parser)
    return bench_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
