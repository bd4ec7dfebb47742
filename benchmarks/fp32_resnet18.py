"""GML fp32 ResNet18 vs eager and ``torch.compile`` (Inductor, freezing): latency and error.

    .venv/bin/python benchmarks/fp32_resnet18.py [--batch 1 8] [--rounds 21] [--threads 2] [--openvino]

Variants (one random-init torchvision ResNet18 in eval mode, built separately per batch size, since
every contender specializes on the static input shape):

* ``eager``: the model as is (NCHW, BatchNorm unfolded);
* ``gml``: :func:`gml.capture` → Normalize → UntieSharedModules → FoldBatchNorm → the fusion passes
  of :func:`gml.passes.fuse_all.fusion_passes` under the PassManager (every pass checked);
* ``inductor``: ``torch.compile(backend="inductor")`` with ``torch._inductor.config.freezing = True``;
* ``openvino`` (``--openvino``, if installed): ``openvino.convert_model``, CPU, f32 inference
  precision, latency hint, one stream, the same thread count.

Latency: interleaved rounds (each variant once per round, order shuffled per round), each sample
the mean of a ~20 ms block of calls; the table reports medians and the ratio to eager and to
Inductor. Other processes share the cores, so read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from rich.console import Console
from rich.table import Table

from gml.bench.runner import time_interleaved
from gml.bench.stats import summarize
from gml.capture import capture
from gml.passes.fuse_all import fusion_passes
from gml.passes.manager import PassManager
from gml.passes.pipeline import canonical_passes

warnings.filterwarnings("ignore", category=FutureWarning)


def build_gml(model: torch.nn.Module, x: torch.Tensor) -> tuple[Any, float, Any]:
    t0 = time.perf_counter()
    gm = capture(copy.deepcopy(model), (x,))
    passes = [*canonical_passes(), *fusion_passes()]
    result = PassManager(passes).run(gm, [(x,)])
    return result.graph_module, time.perf_counter() - t0, result.report


def build_inductor(model: torch.nn.Module, x: torch.Tensor) -> tuple[Any, float]:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    t0 = time.perf_counter()
    compiled = torch.compile(copy.deepcopy(model), backend="inductor", dynamic=False)
    with torch.no_grad():
        compiled(x)
    return compiled, time.perf_counter() - t0


def build_openvino(model: torch.nn.Module, x: torch.Tensor, threads: int) -> tuple[Callable, float]:
    import openvino as ov

    t0 = time.perf_counter()
    ov_model = ov.convert_model(copy.deepcopy(model), example_input=(x,))
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "INFERENCE_PRECISION_HINT": "f32",
    }
    compiled = ov.Core().compile_model(ov_model, "CPU", config)
    request = compiled.create_infer_request()

    def run(t: torch.Tensor) -> torch.Tensor:
        out = request.infer([t.numpy()])
        return torch.from_numpy(next(iter(out.values())).copy())

    run.keepalive = compiled  # type: ignore[attr-defined]
    return run, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--openvino", action="store_true", help="also time OpenVINO fp32 (if installed)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--report", action="store_true", help="print the GML pass report")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    console = Console()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()

    for batch in args.batch:
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
        variants: dict[str, Callable[[torch.Tensor], Any]] = {"eager": model}
        build_s: dict[str, float] = {}
        variants["gml"], build_s["gml"], report = build_gml(model, x)
        if args.report:
            console.print(report.table())
            console.print(report.skip_table())
        if not args.no_inductor:
            variants["inductor"], build_s["inductor"] = build_inductor(model, x)
        if args.openvino:
            try:
                variants["openvino"], build_s["openvino"] = build_openvino(model, x, threads)
            except ImportError:
                console.print("[yellow]openvino is not installed; skipped[/]")
        with torch.no_grad():
            ref = model(x)
            err = {n: (f(x) - ref).abs().max().item() for n, f in variants.items()}
            calls = {n: (lambda f=f, x=x: f(x)) for n, f in variants.items()}
            for fn in calls.values():
                fn()
            samples = time_interleaved(calls, rounds=args.rounds, seed=batch)
        table = Table(title=f"ResNet18 fp32, batch {batch}, {threads} threads, {args.rounds} interleaved rounds")
        for col in ("variant", "median ms", "p10", "p90", "vs eager", "vs inductor", "max |err|", "build s"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        med = {n: summarize(s).median for n, s in samples.items()}
        for n, s in samples.items():
            st = summarize(s)
            vs_ind = f"{med['inductor'] / st.median:.2f}x" if "inductor" in med else "-"
            table.add_row(
                n,
                f"{st.median:.2f}",
                f"{st.p10:.2f}",
                f"{st.p90:.2f}",
                f"{med['eager'] / st.median:.2f}x",
                vs_ind,
                f"{err[n]:.1e}",
                f"{build_s[n]:.1f}" if n in build_s else "-",
            )
        console.print(table)


if __name__ == "__main__":
    main()
