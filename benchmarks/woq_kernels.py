"""woq_linear's native kernels (#26): one GEMV (decode) and one GEMM over a prompt (prefill), against fp32
``F.linear`` (torch's oneDNN / MKL), on TinyLlama's matrix shapes.

    python benchmarks/woq_kernels.py [--threads 1] [--rounds 7] [--prefill-rows 128] [--isas vnni,avx2]
        [--formats "int8 g32,int8 per channel"]

* GEMV (one row of x): every kernel tier this CPU runs, fp32 activations (native/woq.h) and int8
  activations (native/woq_int8act.h), INT8 in groups of 32 (gml.llm's default) and per channel and INT4
  group 32 symmetric weights (``--formats``; ``--isas`` limits the tiers), on
  5632 x 2048 (the MLP's up / gate rows) and 2048 x 2048 (attention's output projection).
* Prefill (``--prefill-rows`` rows of x, fp32 activations): the GEMV kernel run per row against the
  dequantized-tile GEMM (native/woq_gemm.h), 5632 x 2048.

Timing: the calls are interleaved round by round and the best round is kept. With one thread the
clock is the calling thread's CPU time (``time.thread_time``: what the machine's other jobs steal is not
counted); with more threads it is wall time (the OpenMP workers' CPU time is not the caller's). Prints
the CPU; on a shared machine compare ratios within one run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gml.ir.llm_ops import quantize_weight
from gml.kernels.woq import KERNEL_ISAS, native_kernel_runs, woq_linear_native

#: weight formats: name -> quantize_weight's (bits, group_size)
FORMATS = {"int8 g32": (8, 32), "int8 per channel": (8, None), "int4 g32": (4, 32)}


def cpu_line() -> str:
    import subprocess

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    return f"{name}, {torch.get_num_threads()} thread(s), machine possibly shared"


def best_us(runs: dict, rounds: int, reps: int) -> dict[str, float]:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            n = max(1, reps // 20) if "scalar" in name else reps
            t = clock()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (clock() - t) / n * 1e6)
    return best


def table(title: str, best: dict[str, float], base: str) -> None:
    print(f"\n{title}\n| kernel | µs | vs {base} |\n|---|---|---|")
    for name, us in best.items():
        print(f"| {name} | {us:.0f} | {best[base] / us:.2f}× |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefill-rows", type=int, default=128)
    ap.add_argument("--isas", default=",".join(KERNEL_ISAS), help="kernel tiers to time (those this CPU runs)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"weight formats out of {', '.join(FORMATS)}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    isas = [isa for isa in args.isas.split(",") if isa in KERNEL_ISAS and native_kernel_runs(isa)]
    formats = {name: FORMATS[name] for name in args.formats.split(",")}
    torch.manual_seed(0)
    for n, k in ((5632, 2048), (2048, 2048)):
        w = torch.randn(n, k)
        x = torch.randn(1, k)
        weights = {name: quantize_weight(w, *fmt) for name, fmt in formats.items()}
        runs = {"fp32 F.linear": lambda x=x, w=w: F.linear(x, w)}
        for wname, qw in weights.items():
            for isa in isas:
                if isa in ("vnni", "avxvnni"):  # fp32 activations: the same code as avx512 / avx2
                    continue
                runs[f"{wname} {isa}, fp32 act."] = lambda x=x, qw=qw, isa=isa: woq_linear_native(x, qw, None, isa)
            for isa in isas:
                runs[f"{wname} {isa}, int8 act."] = lambda x=x, qw=qw, isa=isa: woq_linear_native(x, qw, None, isa, 8)
        table(f"GEMV {n} x {k}, batch 1", best_us(runs, args.rounds, 20), "fp32 F.linear")

    n, k, m = 5632, 2048, args.prefill_rows
    w = torch.randn(n, k)
    x = torch.randn(m, k)
    isa = next(i for i in ("avx512", "avx2", "scalar") if i in [*isas, "scalar"])
    runs = {"fp32 F.linear": lambda: F.linear(x, w)}
    for wname, fmt in formats.items():
        qw = quantize_weight(w, *fmt)
        runs[f"{wname} {isa}, GEMV per row"] = lambda qw=qw: woq_linear_native(x, qw, None, isa, gemm_min_rows=m + 1)
        runs[f"{wname} {isa}, dequantized tiles + GEMM"] = lambda qw=qw: woq_linear_native(x, qw, None, isa)
    table(f"Prefill {m} rows, {n} x {k}", best_us(runs, max(2, args.rounds // 2), 2), "fp32 F.linear")


if __name__ == "__main__":
    main()
