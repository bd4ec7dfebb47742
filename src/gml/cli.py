"""The ``gml`` command line: inspect, optimize, quantize, bench, run, generate, demo.

Every command takes a MODEL: a torchvision name (``resnet18``; random weights, nothing is
downloaded) or ``path/to/file.py:ClassName``. Errors a user can cause print one paragraph that says
what went wrong and what to do, and exit non-zero; ``--debug`` shows the Python traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from gml.argtypes import add_model_arguments
from gml.errors import GMLError, InputError

console = Console(highlight=False)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_model_arguments(
        p,
        saved_models="; `inspect` also takes a model saved by gml (file.pt2: its graph and the runtime it loads onto)",
    )


def _command(
    sub: argparse._SubParsersAction,
    name: str,
    func: Callable[[argparse.Namespace], int | None],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """The subcommand ``name`` running ``func``, with the arguments ``add_arguments`` declares (the
    commands that take a model: :func:`_add_model_args`); the caller adds the command's own."""
    p = sub.add_parser(name, help=help, description=description)
    if add_arguments is not None:
        add_arguments(p)
    p.set_defaults(func=func)
    return p


def load_from_args(args: argparse.Namespace, batch: int | None = None):
    """(model, example_inputs) from the common model arguments."""
    from gml.capture import check_leaf_names
    from gml.errors import ModelLoadError
    from gml.io import is_saved_model
    from gml.models import example_inputs, load_with_defaults, parse_shapes

    if is_saved_model(args.model):
        raise ModelLoadError(
            f"{args.model} is a model saved by gml: it is already optimized, and this command starts from "
            "the original model",
            hint=f"`gml inspect {args.model}` shows its graph and the runtime it loads onto, `gml bench "
            f"{args.model}` times it on the native engine; in Python, gml.load(path) runs it",
        )
    model, shapes, like = load_with_defaults(
        args.model,
        weights=args.weights,
        unsafe_load=args.unsafe_load,
        submodule=args.submodule,
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    if args.input_shape:
        shapes = parse_shapes(args.input_shape)
    check_leaf_names(model, getattr(args, "leaf", ()), option="--leaf")
    return model, example_inputs(shapes, batch=batch, like=like)


def _model_label(args: argparse.Namespace) -> str:
    return f"{args.model}.{args.submodule}" if getattr(args, "submodule", None) else args.model


def _fmt_meta(node) -> str:
    meta = node.meta.get("tensor_meta")
    if meta is None:
        return ""
    if hasattr(meta, "shape"):
        return f"{tuple(meta.shape)} {str(meta.dtype).removeprefix('torch.')}"
    if isinstance(meta, list | tuple):
        return ", ".join(str(tuple(m.shape)) for m in meta if hasattr(m, "shape"))
    return ""


def _short(value: object, limit: int = 48) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _load_saved(spec: str):
    """``(graph module, example inputs)`` of a file written by ``gml.io.save`` (the graph on the
    Python executor, shapes propagated), or ``None`` when ``spec`` names no such file (a model name
    or ``file.py:Class``)."""
    from torch.fx.passes.shape_prop import ShapeProp

    from gml.io import is_saved_model, load, placeholder_inputs

    if not is_saved_model(spec):
        return None
    gm = load(spec, runtime="torch", graph=True)
    inputs = placeholder_inputs(gm)  # a symbolic (dynamic) batch is shown at size 1
    ShapeProp(gm).propagate(*inputs)
    return gm, inputs


def _print_saved_runtime(gm) -> None:
    """Which runtime a saved model loads onto here: the engine's plan, compiled now, or torch and why."""
    from rich.markup import escape

    from gml.io import attach_loaded_runtime

    report = attach_loaded_runtime(gm, "engine").runtime
    console.print(f"[bold]loads onto[/] {escape(str(report))}")


def _print_capture(gm, model, inputs) -> None:
    """#15: which capture path made the graph and why; what the generated inputs are."""
    import torch
    from rich.markup import escape

    from gml.capture_export import capture_info
    from gml.models_hf import describe_inputs

    info = capture_info(gm)
    if info is not None and (info.path != "torch.fx" or info.reason != "symbolic_trace"):
        console.print(f"[dim]{escape(info.summary())}[/]")
        for note in info.notes:
            console.print(f"[dim]capture: {escape(note)}[/]")
    if any(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in inputs):
        console.print(f"[dim]inputs: {escape(describe_inputs(model, tuple(inputs)))}[/]")


def cmd_inspect(args: argparse.Namespace) -> int:
    from gml.capture import capture
    from gml.passes.catalog import find_patterns, sibling_groups
    from gml.passes.oplib import node_label
    from gml.passes.utils import modules_of

    check_out_path(args.svg, "--svg")
    saved = _load_saved(args.model)
    if saved is not None:  # a model written by gml.io.save: show the graph it holds (gml ops for INT8)
        gm, inputs = saved
        _print_saved_runtime(gm)
    else:
        model, inputs = load_from_args(args)
        gm = capture(model, inputs, leaf_modules=args.leaf)
        _print_capture(gm, model, inputs)
    modules = modules_of(gm)
    n_params = sum(p.numel() for p in gm.parameters())
    console.print(
        f"[bold]{_model_label(args)}[/]: {len(gm.graph.nodes)} nodes, {n_params:,} parameters, inputs "
        + ", ".join(str(tuple(t.shape)) for t in inputs)
    )
    if not args.no_nodes:
        t = Table(title="Nodes")
        for col in ("#", "op", "name", "target", "args", "shape / dtype"):
            t.add_column(col)
        for i, node in enumerate(gm.graph.nodes):
            target = node_label(node, modules) if node.op.startswith("call") else str(node.target)
            if node.op == "call_module":
                target = f"{node.target}: {target}"
            t.add_row(str(i), node.op, node.name, _short(target), _short(node.args), _fmt_meta(node))
        console.print(t)

    kinds = Counter(n.op for n in gm.graph.nodes)
    labels = Counter(node_label(n, modules) for n in gm.graph.nodes if n.op.startswith("call"))
    h = Table(title="Op histogram")
    h.add_column("node kind")
    h.add_column("count", justify="right")
    for k in ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output"):
        h.add_row(k, str(kinds.get(k, 0)))
    o = Table(title="Ops")
    o.add_column("op")
    o.add_column("count", justify="right")
    for label, c in labels.most_common():
        o.add_row(label, str(c))
    console.print(h)
    console.print(o)

    found, blocked = find_patterns(gm)
    p = Table(title="Fusible patterns")
    for col in ("pattern", "count", "rewrite", "e.g."):
        p.add_column(col)
    by_pattern: dict[str, list] = {}
    for occ in found:
        by_pattern.setdefault(occ.pattern.name, []).append(occ)
    for name, occs in by_pattern.items():
        p.add_row(name, str(len(occs)), occs[0].pattern.rewrite, " → ".join(occs[0].nodes))
    for group in sibling_groups(gm):
        p.add_row("sibling linears", "1", "horizontal merge into one wider linear", ", ".join(group))
    console.print(p if p.row_count else "[dim]No known fusible patterns.[/]")
    for pat, skip in blocked:
        console.print(f"[yellow]blocked[/] {pat.name} at {skip.node}: {skip.reason}")

    if args.svg:
        _write_graph_drawing(gm, args.svg)
    return 0


def _write_graph_drawing(gm, path: str) -> None:
    import shutil

    from torch.fx.passes.graph_drawer import FxGraphDrawer

    from gml.files import write_atomically

    dot = FxGraphDrawer(gm, type(gm).__name__).get_dot_graph()
    if path.endswith(".dot"):
        write_atomically(path, lambda tmp: tmp.write_text(dot.to_string()), what="graph drawing")
    elif shutil.which("dot") is None:
        raise GMLError(
            "Drawing an SVG needs Graphviz's `dot` program, which is not installed.",
            hint="install it (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz), "
            "or write the graph source with --svg FILE.dot and render it elsewhere.",
        )
    else:
        svg = dot.create_svg()
        write_atomically(path, lambda tmp: tmp.write_bytes(svg), what="graph drawing")
    console.print(f"graph drawn to {path}")


def _time_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 15) -> dict[str, float]:
    """Median ms per call of each function in ``rounds`` interleaved rounds (the timer of GML's
    run-time decisions, :func:`gml.runtime.timing.median_ms_interleaved`)."""
    from gml.runtime.timing import median_ms_interleaved

    return dict(zip(fns, median_ms_interleaved(list(fns.values()), rounds=rounds), strict=True))


def check_out_path(path: str | None, option: str = "--out") -> None:
    """Fail before the run, not after it, when an output path option cannot be written
    (:func:`gml.files.check_writable`, the one check every output option goes through)."""
    from gml.files import check_writable

    check_writable(path, option)


def cmd_optimize(args: argparse.Namespace) -> int:
    from gml.api import optimize
    from gml.passes.pipeline import passes_by_name

    check_out_path(args.out)
    model, inputs = load_from_args(args)
    passes = passes_by_name([p.strip() for p in args.passes.split(",") if p.strip()]) if args.passes else None
    res = optimize(model, inputs, passes=passes, strict=args.strict, leaf_modules=args.leaf, precision=args.precision)
    _print_capture(res.module, model, inputs)
    console.print(res.report.table(title=f"gml optimize {_model_label(args)}"))
    if res.report.skips or res.report.rolled_back:
        console.print(res.report.skip_table())
    for rec in res.report.records:
        for note in rec.notes:
            console.print(f"[dim]{rec.name}: {note}[/]")
    if res.precision is not None:  # --precision bf16: every op's precision and why, or why not bf16
        from rich.markup import escape

        if res.precision.effective == "bf16":
            console.print(res.precision.table())
        for w in res.precision.warnings:
            console.print(f"[yellow]warning: {escape(w)}[/]")
        console.print(escape(res.precision.summary()))
    scale = f"{res.rel_err:.1e} of the largest output, {res.max_abs_ref:.3g}"
    console.print(f"max abs error vs eager: {res.max_abs_err:.2e} ({scale})")
    if getattr(res, "runtime", None) is not None:  # which executor runs the fp32 graph (the native engine by default)
        console.print(str(res.runtime))
    if not args.no_time:
        t = _time_interleaved({"eager": lambda: model(*inputs), "optimized": lambda: res.executable(*inputs)})
        console.print(
            f"latency (median of 15 interleaved rounds): eager {t['eager']:.2f} ms, "
            f"optimized {t['optimized']:.2f} ms ({t['eager'] / t['optimized']:.2f}x); "
            "use `gml bench` for a full measurement"
        )
    if args.out:
        res.save(args.out)
        console.print(f"saved to {args.out}")
    return 0


def _print_transformer_result(args: argparse.Namespace, res, model, inputs, eval_desc: str | None = None) -> None:
    """#15: what the transformer INT8 scheme did: passes, every GEMM/attention/LayerNorm/softmax with
    its precision and why."""
    _print_capture(res.module, model, inputs)
    if res.precision != "int8":  # the whole-model guard returned gml.optimize's model: describe that one
        _print_returned_fp32(args, res)
    else:
        console.print(res.report.table(title=f"gml quantize {_model_label(args)} (transformer scheme)"))
        if res.report.skips or res.report.rolled_back:
            console.print(res.report.skip_table(title="Declined candidates"))
        console.print(res.frontend.table())
        console.print(res.frontend.summary())
    from rich.markup import escape

    if eval_desc is not None:  # --eval-data
        console.print(f"[dim]accuracy below: on {escape(eval_desc)}[/]")


def _print_returned_fp32(args: argparse.Namespace, res) -> None:
    """The report of the model the whole-model guard returned (gml.optimize's): its passes and the
    precision of every op, never the INT8 candidate's (issue #24: "48/48 GEMMs INT8" was printed for
    an fp32 model)."""
    console.print(res.report.table(title=f"gml optimize passes of the returned {res.precision} model"))
    if res.report.skips or res.report.rolled_back:
        console.print(res.report.skip_table(title="Declined candidates"))
    _print_precisions(res)


def _print_precisions(res) -> None:
    """The static scheme's precision of every op (int8 / bf16 / fp32, why, where it runs), and a
    clear line when the whole-model guard returned gml optimize's model instead of INT8."""
    from rich.markup import escape

    table = res.precisions
    if hasattr(table, "table") and (res.precision != "int8" or any(r.precision != "int8" for r in table)):
        console.print(table.table())
    if hasattr(table, "summary"):
        console.print(escape(table.summary()))
    if res.precision != "int8":
        console.print(f"[yellow]not INT8:[/] {escape(res.precision_reason)}")


def escape_markup(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def cmd_quantize(args: argparse.Namespace) -> int:
    from gml.api import quantize

    if args.calib < 1:
        raise GMLError("--calib must be at least 1.", hint="e.g. --calib 8")
    if args.min_cosine is not None and not -1.0 <= args.min_cosine <= 1.0:
        raise GMLError(f"--min-cosine {args.min_cosine:g} is not a cosine.", hint="give a value in [-1, 1], e.g. 0.99.")
    check_out_path(args.out)
    model, inputs = load_from_args(args)
    from gml.data.cli import open_calib_eval

    calib_src, eval_src = open_calib_eval(args, model, inputs)
    calib: object = args.calib
    eval_data = eval_labels = None
    if calib_src is not None:
        calib = calib_src.calibration(args.calib_samples)
        console.print(f"calibration data: {escape_markup(calib_src.describe())}; {sum(len(b[0]) for b in calib)} used")
    if eval_src is not None:
        eval_data, eval_labels = eval_src.evaluation()
        console.print(f"evaluation data: {escape_markup(eval_src.describe())}")
    import warnings

    from gml.quant.calibrate import CalibrationWarning

    with warnings.catch_warnings():  # printed below, in the frontend summary
        warnings.simplefilter("ignore", CalibrationWarning)
        res = quantize(
            model,
            calib,
            example_inputs=inputs,
            eval_data=eval_data,
            eval_labels=eval_labels,
            backend=args.backend,
            observer=args.observer,
            per_channel=not args.per_tensor,
            per_layer=not args.no_per_layer,
            progress=True,
            leaf_modules=args.leaf,
            scheme=args.scheme,
            min_sqnr_db=None if args.min_sqnr < 0 else args.min_sqnr,
            smooth_alpha=args.smooth_alpha,
            cost_policy=args.cost_policy,
            fallback_precision=args.fallback_precision,
            keep_broken=args.keep_broken,
        )
    console.print(f"[dim]{res.scheme_reason}[/]")
    fe = res.frontend
    if res.scheme == "transformer":
        _print_transformer_result(args, res, model, inputs, eval_src.describe() if eval_src is not None else None)
    elif res.precision != "int8":
        _print_returned_fp32(args, res)
    else:
        if fe.fp32_passes is not None:
            console.print(fe.fp32_passes.table(title="fp32 passes before quantization"))
        console.print(res.report.table(title="INT8 passes after convert"))
        if res.report.skips or res.report.rolled_back:
            console.print(res.report.skip_table(title="Declined candidates"))
        console.print(res.coverage.table())
        console.print(res.coverage.summary())
        console.print(f"frontend: {fe.summary()}")
        _print_precisions(res)
    acc = res.accuracy
    if acc.layers:
        worst = type(acc)(acc.samples, acc.cosine, acc.max_abs_diff, acc.top1_agreement, layers=acc.worst(10))
        console.print(worst.table(title="INT8 accuracy: the 10 layers with the lowest SQNR"))
    if res.target is not None:  # the CPU planned for and which INT8 arithmetic, and why
        console.print(f"target: {res.target.describe()}")
    rejected = res.rejected_int8_accuracy
    if rejected is not None:
        console.print(f"[bold red]INT8 BROKEN, not returned:[/] {rejected.summary()}")
    returned = "" if res.precision == "int8" else f" (of the {res.precision} model returned)"
    console.print(f"accuracy: {acc.summary()}{returned}")
    if acc.broken:
        console.print(f"[bold red]BROKEN:[/] {acc.broken}; do not deploy this INT8 model.")
    console.print("stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in res.seconds.items()))
    if res.runtime is not None:  # which executor runs the INT8 graph (the native engine by default)
        console.print(str(res.runtime))
    if res.cost is not None and res.cost.policy != "off":  # regions kept fp32, with the measured numbers
        console.print(str(res.cost), markup=False)
    if not args.no_time:
        t = _time_interleaved({"fp32": lambda: model(*inputs), "int8": lambda: res.executable(*inputs)})
        returned = "INT8" if res.precision == "int8" else f"GML {res.precision} (the returned model)"
        console.print(
            f"latency (median of 15 interleaved rounds): fp32 eager {t['fp32']:.2f} ms, "
            f"{returned} {t['int8']:.2f} ms ({t['fp32'] / t['int8']:.2f}x); use `gml bench` for a full measurement"
        )
        if res.precision == "int8" and t["int8"] >= t["fp32"]:
            kept = sorted({e.op for e in res.coverage.kept_fp32})
            why = (
                f"{len(res.coverage.kept_fp32)} op(s) stay fp32 ({', '.join(kept[:4])}) behind quantize/dequantize "
                "pairs; "
                if kept
                else ""
            )
            console.print(
                f"[yellow]warning:[/] the INT8 model is not faster than fp32 here: {why}"
                "`gml optimize` (fp32 fusion) may serve this model better."
            )
    if args.min_cosine is not None:
        from gml.api import check_min_cosine

        check_min_cosine(acc, args.min_cosine)  # before saving: a result below the bar is not written
    if args.max_accuracy_drop is not None:
        from gml.api import check_accuracy_drop

        check_accuracy_drop(acc, args.max_accuracy_drop)  # before saving, as --min-cosine
    if args.out:
        res.save(args.out)
        console.print(
            f"saved to {args.out} (a torch.export program of gml ops, no pickle: gml.load(path) rebuilds the engine)"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gml",
        description="GML-Lab: make PyTorch models faster for CPU inference by rewriting their torch.fx "
        "graphs (fold, fuse, INT8), with every rewrite verified and explained.",
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(
        sub,
        "inspect",
        cmd_inspect,
        _add_model_args,
        help="print the captured graph: node table, op histogram, fusible patterns",
        description="Trace MODEL with torch.fx, propagate shapes and print every node (kind, target, "
        "args, shape), a histogram of node kinds and ops, and the known fusible patterns it contains.",
    )
    p.add_argument("--no-nodes", action="store_true", help="skip the per-node table")
    p.add_argument("--svg", metavar="FILE", help="draw the graph to FILE (.svg needs Graphviz; .dot does not)")

    p = _command(
        sub,
        "optimize",
        cmd_optimize,
        _add_model_args,
        help="run the fp32 pipeline (normalize, untie, fold BN, fuse) and report every pass",
        description="Capture MODEL, run the fp32 pass pipeline with per-pass verification (a pass that "
        "breaks lint or numerics is rolled back), print the per-pass report and every declined candidate "
        "with its reason, and optionally save the optimized module.",
    )
    p.add_argument(
        "--passes",
        metavar="LIST",
        help="comma-separated pass names to run instead of the default pipeline, in that order "
        "(e.g. normalize,untie,fold_bn)",
    )
    p.add_argument("--strict", action="store_true", help="fail on the first broken pass instead of rolling it back")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32 (default) or bf16: bf16 weights/activations on oneDNN's bf16 kernels, fp32 accumulation, "
        "LayerNorm/softmax/reductions/outputs in fp32; a CPU without native bf16 gets a warning and fp32",
    )
    p.add_argument("--no-time", action="store_true", help="skip the quick eager-vs-optimized latency check")
    p.add_argument("--out", metavar="FILE", help="save the optimized module (see docs/adr/004)")

    from gml.quant.transformer import DEFAULT_MIN_SQNR_DB

    p = _command(
        sub,
        "quantize",
        cmd_quantize,
        _add_model_args,
        help="quantize to INT8 and lower onto fused INT8 kernels; report coverage and accuracy",
        description="Capture MODEL, run the fp32 passes, quantize with GML's BackendConfig (per-channel "
        "symmetric weights, per-tensor activations), calibrate, lower to GML INT8 kernel modules, and print "
        "the pass report, the lowering coverage (which nodes became which INT8 module, which stayed fp32 and "
        "why), the accuracy report (per-layer SQNR, output cosine, top-1 agreement) and fp32-vs-INT8 latency.",
    )
    p.add_argument(
        "--calib", type=int, default=8, metavar="N", help="generated calibration batches (default 8; see --calib-data)"
    )
    p.add_argument("--backend", choices=("onednn", "fbgemm"), default="onednn", help="INT8 kernels (default onednn)")
    p.add_argument(
        "--observer",
        choices=("minmax", "moving_average", "histogram", "percentile"),
        default="minmax",
        help="activation range observer (default minmax)",
    )
    p.add_argument("--per-tensor", action="store_true", help="per-tensor instead of per-channel weight scales")
    p.add_argument("--no-per-layer", action="store_true", help="skip the per-layer SQNR table (faster)")
    p.add_argument("--no-time", action="store_true", help="skip the quick fp32-vs-INT8 latency check")
    p.add_argument(
        "--cost-policy",
        choices=("measure", "off"),
        default=None,
        help="measure (default, or $GML_COST_POLICY): keep fp32 the INT8 regions timed slower than their fp32 "
        "ops on this machine, and return gml optimize's fp32 model when the whole INT8 model is slower than it; "
        "off: every op with an INT8 kernel runs INT8 (docs/cost-policy.md)",
    )
    p.add_argument(
        "--fallback-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="what the ops INT8 leaves out run in: fp32 (default: GML's fused fp32 kernels) or bf16 (oneDNN "
        "bf16 kernels, fp32 accumulation; transformer scheme: attention on bf16 q/k/v; a CPU without native "
        "bf16 gets a warning and fp32); the precision of every op is printed with the reason",
    )
    p.add_argument(
        "--min-cosine",
        type=float,
        metavar="X",
        help="fail (exit 8, nothing saved) when the INT8 outputs' cosine with fp32 is below X (e.g. 0.99); "
        "a cosine below 0.9, or far from exact integer arithmetic with the same qparams, is BROKEN either way "
        "(and gml optimize's fp32 model is returned instead, unless --keep-broken)",
    )
    p.add_argument(
        "--keep-broken",
        action="store_true",
        help="return (and save) the INT8 model even when its accuracy report says BROKEN, to inspect it",
    )
    p.add_argument(
        "--scheme",
        choices=("auto", "static", "transformer"),
        default="auto",
        help="INT8 scheme (default auto: 'transformer' — per-token dynamic INT8 GEMMs, LayerNorm/softmax/"
        "attention fp32 — for transformers models and models holding torch.nn attention layers, else 'static')",
    )
    p.add_argument(
        "--min-sqnr",
        type=float,
        default=DEFAULT_MIN_SQNR_DB,
        metavar="DB",
        help=f"transformer scheme: keep a GEMM fp32 when its INT8 SQNR on the calibration batches is below DB "
        f"(default {DEFAULT_MIN_SQNR_DB:g}; a negative value keeps every GEMM INT8)",
    )
    p.add_argument(
        "--smooth-alpha",
        type=float,
        metavar="A",
        help="transformer scheme: SmoothQuant outlier migration with strength A in (0, 1) (e.g. 0.5), used for "
        "each GEMM where it raises the measured SQNR",
    )
    p.add_argument(
        "--out", metavar="FILE", help="save the INT8 module as a torch.export program of gml ops (see docs/adr/005)"
    )
    from gml.data.cli import add_data_arguments

    add_data_arguments(p)

    from gml.bench.cli import add_bench_arguments, bench_command

    _command(
        sub,
        "bench",
        lambda a: bench_command(a, console),
        add_bench_arguments,
        help="measure every variant (eager, GML fp32/INT8, torch.compile, torch.ao, ONNX Runtime, OpenVINO)",
        description="Benchmark MODEL's variants side by side in one interleaved run: median/p10/p90 latency, "
        "speedup vs eager, output error vs eager, build time, memory, and the roofline floor. Peer runtimes "
        "come from the optional [bench] extra (pip install 'gml-lab[bench]'); a missing one is skipped.",
    )

    from gml.batch.cli import DESCRIPTION, add_run_arguments, run_command

    _command(
        sub,
        "run",
        lambda a: run_command(a, console),
        add_run_arguments,
        help="batch inference of a saved model over a folder / file of inputs (resumable; --ray: on Ray Data)",
        description=DESCRIPTION,
    )

    from gml.llm.cli import DESCRIPTION as GENERATE_DESCRIPTION
    from gml.llm.cli import add_generate_arguments, generate_command

    _command(
        sub,
        "generate",
        lambda a: generate_command(a, console),
        add_generate_arguments,
        help="generate tokens with a decoder LLM from a local HF folder or a .gguf file "
        "(KV cache; fp32/bf16/int8/int4 weights)",
        description=GENERATE_DESCRIPTION,
    )

    _command(
        sub,
        "demo",
        cmd_demo,
        None,
        help="guided tour of the lab on the embedded default (ResNet18), offline",
        description="Walk the fusion practice's phases in order: trace basics, manual Linear+ReLU fusion, "
        "matmul+add+relu pattern rewrite, fused vs unfused benchmark, Conv+BN folding, INT8 quantize + "
        "lower of ResNet18, summary table.",
    )
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from gml.demo import run_demo

    return run_demo(console)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GMLError as exc:
        if args.debug:
            raise
        console.print(f"[bold red]error:[/] {exc.message}")
        if exc.hint:
            console.print(f"[bold]what you can do:[/] {exc.hint}")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except Exception as exc:
        if args.debug:
            raise
        from gml.models import is_out_of_memory

        if is_out_of_memory(exc):  # the model's activations for this input do not fit: the user's choice
            console.print(f"[bold red]error:[/] Out of memory: {str(exc).strip().splitlines()[0][:300]}")
            console.print(
                "[bold]what you can do:[/] use a smaller --input-shape (batch, resolution) or a smaller model."
            )
            return InputError.exit_code
        console.print(
            f"[bold red]internal error:[/] {type(exc).__name__}: {exc}\n"
            "This is a bug in gml, not in your model. Re-run with --debug for the traceback and report it."
        )
        return 70


if __name__ == "__main__":
    sys.exit(main())
