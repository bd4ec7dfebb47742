"""GML INT8 ResNet18 vs torch.ao's own INT8 (``convert_fx``, x86 engine): latency, build time, accuracy.

    .venv/bin/python benchmarks/int8_resnet18.py [--batch 1 8] [--rounds 15] [--jit] [--fbgemm]

Variants (all from the same random-init torchvision ResNet18, same calibration batches):

* ``fp32``: eager fp32 (context only);
* ``ao-x86``: torch.ao ``prepare_fx`` / ``convert_fx`` with the x86 qconfig and BackendConfig, run
  on the ``x86`` quantized engine: the baseline to beat;
* ``ao-x86-jit`` (``--jit``): the same, ``torch.jit.trace`` + ``freeze``d;
* ``gml-onednn`` / ``gml-fbgemm`` (``--fbgemm``): the GML frontend's reference graph lowered by
  :func:`~gml.quant.pipeline.lowering_passes` onto torch.ops.gml (oneDNN or FBGEMM kernels).

Latency: interleaved rounds (every variant once per round, order shuffled per round), each sample
the mean of a block of calls lasting ~20 ms; the table reports the median over rounds. Build
time of the GML path is split into calibration (not counted in the < 5 s target) and
"convert + lower" (the reference conversion, the lowering pass and weight prepacking).
Accuracy: output cosine vs fp32 on fixed-seed held-out inputs.
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
from gml.bench.stats import cosine, flat_output, summarize
from gml.quant.lower import coverage_of
from gml.quant.pipeline import lowering_passes

warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated.*")
warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
warnings.filterwarnings("ignore", message=r".*reduce_range will be deprecated.*")


def calibration_batches(n: int, batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 224, 224, generator=g) for _ in range(n)]


def build_ao_x86(model: torch.nn.Module, calib: list[torch.Tensor], jit: bool) -> tuple[Any, float]:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = "x86"
    t0 = time.perf_counter()
    bc = get_x86_backend_config()
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (calib[0],), backend_config=bc)
    with torch.no_grad():
        for x in calib:
            prepared(x)
    q = convert_fx(prepared, backend_config=bc)
    if jit:
        with torch.no_grad():
            q = torch.jit.freeze(torch.jit.trace(q, (calib[0],)).eval())
    return q, time.perf_counter() - t0


def build_gml(model: torch.nn.Module, calib: list[torch.Tensor], backend: str) -> tuple[Any, dict[str, float], Any]:
    from gml.quant.frontend import calibrate, convert_reference, keep_outputs_fp32, prepare, run_fp32_passes

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    gm, _ = run_fp32_passes(model, (calib[0],))
    fe_backend = "fbgemm" if backend == "fbgemm" else "onednn"
    prepared = prepare(gm, (calib[0],), backend=fe_backend)
    calibrate(prepared, calib, progress=False)
    times["capture + prepare + calibrate"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    ref = convert_reference(prepared, backend=fe_backend)
    keep_outputs_fp32(ref)
    times["convert"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    gm = ref
    for step in lowering_passes(backend):  # the INT8 pipeline's post-convert steps, in order
        gm = step(gm).graph_module
    times["lower + fuse"] = time.perf_counter() - t2
    return gm, times, coverage_of(gm)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calib", type=int, default=8, help="calibration batches")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--jit", action="store_true", help="also time torch.ao x86 after jit trace+freeze")
    ap.add_argument("--fbgemm", action="store_true", help="also time GML on the FBGEMM fallback backend")
    ap.add_argument("--no-fp32", action="store_true", help="skip the eager fp32 variant")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    calib = calibration_batches(args.calib, 1, seed=1)
    held_out = calibration_batches(4, 4, seed=2)

    variants: dict[str, Callable[[torch.Tensor], Any]] = {}
    if not args.no_fp32:
        variants["fp32"] = model
    ao, ao_s = build_ao_x86(model, calib, jit=False)
    variants["ao-x86"] = ao
    if args.jit:
        variants["ao-x86-jit"], _ = build_ao_x86(model, calib, jit=True)
    gml, times, coverage = build_gml(model, calib, "onednn")
    variants["gml-onednn"] = gml
    if args.fbgemm:
        variants["gml-fbgemm"], _, _ = build_gml(model, calib, "fbgemm")

    console.print(f"[bold]GML lowering[/]: {coverage.summary()}")
    console.print(
        "GML build: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
        + f"  (torch.ao x86 prepare+calibrate+convert: {ao_s:.2f} s)"
    )
    with torch.no_grad():
        ref = [model(x) for x in held_out]
        acc = {
            n: min(cosine(flat_output(r), flat_output(f(x))) for r, x in zip(ref, held_out))
            for n, f in variants.items()
        }

    for batch in args.batch:
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(3))
        calls = {n: (lambda f=f, x=x: f(x)) for n, f in variants.items()}
        with torch.no_grad():
            for fn in calls.values():  # first call packs weights for this batch size
                fn()
            samples = time_interleaved(calls, rounds=args.rounds, seed=batch)
        table = Table(title=f"ResNet18 INT8, batch {batch}, {torch.get_num_threads()} threads, {args.rounds} rounds")
        for col in ("variant", "median ms", "p10", "p90", "vs ao-x86", "cos vs fp32"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        base = summarize(samples["ao-x86"]).median
        for n, s in samples.items():
            st = summarize(s)
            table.add_row(
                n, f"{st.median:.3f}", f"{st.p10:.3f}", f"{st.p90:.3f}", f"{base / st.median:.2f}x", f"{acc[n]:.6f}"
            )
        console.print(table)


if __name__ == "__main__":
    main()
