"""Winograd F(2x2, 3x3) in the engine (ADR 010): direct-only vs the measured choice, in one process.

    python benchmarks/winograd.py [--threads 1] [--rounds 15] [--batch 1 8] [--precisions bf16 fp32 int8]
                                  [--skip-convs] [--skip-resnet18]

* Per conv: ResNet18's four stride-1 3x3 shapes (64@56², 128@28², 256@14², 512@7², ReLU fused),
  bf16, fp32 and INT8 (u8 in and out, s8 weights: native/winograd_int8.h), as one-conv engine plans
  built with ``winograd="0"`` (oneDNN's direct conv) and ``winograd="1"`` (Winograd), timed
  alternately; minimum over the rounds. The INT8 rows also say whether both outputs are equal, and
  add ResNet18's 7x7 / 2 RGB stem (3→64 @ 224², GML's patch GEMM with ``winograd="1"``:
  native/im2col_int8.h).
* ResNet18 (random init, 224²) through ``gml.optimize`` for bf16 and fp32 and ``gml.quantize`` for
  INT8, engine built with ``winograd="0"`` and ``auto`` (the default: per conv, Winograd when timed
  >= 10% faster at plan build; INT8 only on targets without VNNI, ``Target.int8_winograd``), timed
  interleaved; medians. Also the build time of each (plan build included) and how many convs took
  Winograd. INT8 Winograd is meant for CPUs without VNNI: run with ``ONEDNN_MAX_CPU_ISA=AVX2`` on a
  bigger one.

Prints the CPU and oneDNN's ISA; other processes share the cores: read ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def winograd(mode: str) -> Any:
    """The engine options with ``winograd=mode`` (the rest from the environment, as gml.optimize's default)."""
    from gml.runtime.options import EngineOptions

    return dataclasses.replace(EngineOptions.from_env(), winograd=mode)


def interleaved(engines: dict[str, Any], x: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each engine on ``x``, the engines called in turn each round (one warm-up
    call each first): ratios between them share the machine's state at each moment."""
    times: dict[str, list[float]] = {m: [] for m in engines}
    with torch.no_grad():
        for e in engines.values():
            e(x)
        for _ in range(rounds):
            for m, e in engines.items():
                t0 = time.perf_counter()
                e(x)
                times[m].append(time.perf_counter() - t0)
    return times


def _winograd_convs(engine) -> int:
    """Convs run by GML's own kernels: Winograd, and the INT8 patch GEMM (an RGB stem)."""
    return sum(impl.startswith(("gml:winograd_f", "gml:im2col")) for _, impl in engine.step_impls())


def _conv_module(precision: str, c: int, stem: bool = False) -> nn.Module:
    from gml.ir.values import PostOp as QPostOp
    from gml.ir.values import QParams
    from gml.kernels import bf16 as kb
    from gml.kernels.fp32 import FusedConv, PostOp
    from runtime.helpers import qconv

    if precision == "int8":
        qp = {"in_qp": QParams(0.05, 0), "out_qp": QParams(0.2, 0), "post_op": QPostOp("relu")}
        if stem:  # ResNet's 7x7 / 2 on RGB (weights in the target's INT8 range: 7 bits on AVX2)
            return qconv(3, 64, 7, stride=(2, 2), padding=(3, 3), **qp)
        return qconv(c, c, 3, padding=(1, 1), **qp)
    mod = FusedConv.from_conv(nn.Conv2d(c, c, 3, padding=1).eval(), PostOp("relu"))
    return kb.Bf16Conv.from_fused(mod) if precision == "bf16" else mod


def _conv_input(precision: str, n: int, c: int, hw: int) -> torch.Tensor:
    if precision == "int8":
        x = torch.randint(0, 256, (n, c, hw, hw), dtype=torch.uint8)
    else:
        x = torch.randn(n, c, hw, hw).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    return x.contiguous(memory_format=torch.channels_last)


def per_conv(batches: list[int], rounds: int, precisions: list[str]) -> None:
    from gml.kernels import bf16 as kb
    from gml.runtime import compile_engine
    from runtime.helpers import graph_of

    print(
        "\n| precision | batch | conv | direct µs | Winograd µs | Winograd / direct | INT8 F(2x2) µs "
        "| F(2x2) / direct | kernel |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for precision in precisions:
        if precision == "bf16" and not kb.bf16_available():
            print(f"| bf16 | - | skipped: {kb.bf16_unavailable_reason()} | | | | |")
            continue
        for n in batches:
            shapes = [(64, 56), (128, 28), (256, 14), (512, 7)] + ([(3, 224)] if precision == "int8" else [])
            for c, hw in shapes:
                torch.manual_seed(0)
                stem = c == 3
                mod = _conv_module(precision, c, stem)
                x = _conv_input(precision, n, c, hw)
                with torch.no_grad():
                    eng = {}
                    # "1" forces the larger eligible tile (INT8: F(4x4, 3x3) where exact); "f2x3" F(2x2, 3x3)
                    for m in ("0", "1") + (("f2x3",) if precision == "int8" and not stem else ()):
                        eng[m] = compile_engine(graph_of(mod), [x], options=winograd(m))
                    times = interleaved(eng, x, rounds)
                    same = ""
                    if precision == "int8":
                        outs = [e(x) for e in eng.values()]
                        same = ", equal outputs" if all(torch.equal(outs[0], o) for o in outs) else ", outputs DIFFER"
                a, b = min(times["0"]) * 1e6, min(times["1"]) * 1e6
                f2 = " | "
                if "f2x3" in times:
                    f2 = f"{min(times['f2x3']) * 1e6:.0f} | {min(times['f2x3']) * 1e6 / a:.2f}"
                kernel = eng["1"].step_impls()[0][1] + same
                conv = "3→64 7×7/2 @ 224² (stem)" if stem else f"{c}→{c} @ {hw}²"
                print(f"| {precision} | {n} | {conv} | {a:.0f} | {b:.0f} | {b / a:.2f} | {f2} | {kernel} |", flush=True)


def resnet18(batches: list[int], rounds: int, precisions: list[str]) -> None:
    import torchvision

    import gml

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    print("\n| precision | batch | direct only ms | auto ms | auto / direct | build s (direct / auto) | GML convs |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for n in batches:
        x = torch.randn(n, 3, 224, 224)
        for precision in precisions:
            engines, build = {}, {}
            for mode in ("0", "auto"):
                t0 = time.perf_counter()
                if precision == "int8":
                    calib = [torch.randn(n, 3, 224, 224) for _ in range(4)]
                    q = gml.quantize(model, calib, example_inputs=(x,), options=winograd(mode))
                    if q.precision != "int8":
                        print(f"| int8 | {n} | gml.quantize returned {q.precision} | | | | |")
                        break
                    engines[mode] = q.engine
                else:
                    engines[mode] = gml.optimize(model, x, precision=precision, options=winograd(mode)).engine
                build[mode] = time.perf_counter() - t0
            if len(engines) < 2:
                continue
            times = interleaved(engines, x, rounds if n == 1 else max(3, rounds // 2))
            a, b = (statistics.median(times[m]) * 1e3 for m in ("0", "auto"))
            print(
                f"| {precision} | {n} | {a:.2f} | {b:.2f} | {b / a:.3f} | {build['0']:.2f} / {build['auto']:.2f} "
                f"| {_winograd_convs(engines['auto'])} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32", "int8"], choices=["bf16", "fp32", "int8"])
    ap.add_argument("--skip-convs", action="store_true")
    ap.add_argument("--skip-resnet18", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from gml.kernels.bf16 import cpu_description
    from gml.runtime.target import detect_target

    target = detect_target()
    print(f"{cpu_description()}; target {target.describe()}; load average {os.getloadavg()[0]:.2f}")
    if not args.skip_convs:
        per_conv(args.batch, args.rounds, args.precisions)
    if not args.skip_resnet18:
        resnet18(args.batch, args.rounds, args.precisions)


if __name__ == "__main__":
    main()
