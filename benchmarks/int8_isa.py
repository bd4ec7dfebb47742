"""INT8 on every ISA (#23, docs/adr/011-int8-on-every-isa.md): accuracy and speed of each arithmetic.

    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/int8_isa.py [--threads N] [--rounds R]

The issue's hostile layers, weights and inputs U(-1, 1) (the whole 8-bit range is used, so u8×s8
pairs reach 255·127·2 > 32,767 where the CPU has no VNNI):

* ``conv``: 3×3 conv 64→64 on [1, 64, 32, 32];
* ``linear``: a Linear 512→256 head on 2048 rows (top-1 agreement with fp32 per row), also with
  the target's linear arithmetic (8-bit weights in [-127, 127] on GML's exact AVX2 GEMM);
* ``conv_relu_conv``: 3×3 conv 64→64 → ReLU → 3×3 conv 64→64.

Each is quantized (GML's frontend + lowering) with each arithmetic — ``8-bit`` (VNNI's: weights
[-128, 127], u8 activations 0..255), ``7-bit weights`` ([-64, 64] at twice the scale), ``7-bit
activations`` (torch.ao's x86 ``reduce_range``: 0..127) — and run by the Python executor (torch's
oneDNN kernels) and by the native engine. Columns: cosine vs fp32, cosine vs *exact* integer
arithmetic with the same qparams (the reference Q/DQ graph, which dequantizes and multiplies in
fp32: exact products, fp32 sums), the error ratio ``(1 - cos_fp32) / (1 - cos_fp32 of exact)`` and
top-1 agreement; then the engine's median latency of each arithmetic (same kernels: 7 bits cost no
time). Prints the CPU, oneDNN's dispatched ISA and the cap.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
from torch import nn

from gml.ir.target import Int8Arithmetic, Target
from gml.passes.manager import PassManager
from gml.quant.frontend import prepare_reference
from gml.quant.pipeline import lowering_passes
from gml.runtime.compile import compile_engine
from gml.runtime.target import detect_target

#: name -> (the arithmetic's qparams, the target its graph is lowered for: the 8-bit row is lowered as
#: for a VNNI CPU, so on a CPU without VNNI it shows what saturating kernels compute)
ARITHMETICS = {
    "8-bit": (Target("avx512_core_vnni").int8, Target("avx512_core_vnni")),
    "7-bit weights": (dataclasses.replace(Target("avx2").int8, exact_linear=False), Target("avx")),
    "7-bit weights, exact 8-bit linear": (Target("avx2").int8, Target("avx2")),
    "7-bit activations": (
        Int8Arithmetic("7-bit activations", -128, 127, 0, 127, "torch.ao x86 reduce_range"),
        Target("avx512_core_vnni"),
    ),
}


def uniform_(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
    return m.eval()


def layers() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)

    def u(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g) * 2 - 1

    conv = uniform_(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1)))
    linear = uniform_(nn.Sequential(nn.Linear(512, 256)))
    crc = uniform_(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)))
    return {
        "conv": (conv, u(1, 64, 32, 32)),
        "linear": (linear, u(2048, 512)),
        "conv_relu_conv": (crc, u(1, 64, 32, 32)),
    }


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def top1(a: torch.Tensor, b: torch.Tensor) -> float | None:
    return float((a.argmax(1) == b.argmax(1)).double().mean()) if a.dim() == 2 else None


def quantize(model: nn.Module, x: torch.Tensor, arithmetic: Int8Arithmetic, target: Target):
    """Reference and lowered graphs and the engine, for ``arithmetic``'s qparams lowered for ``target``
    (the engine's plan is built for this CPU's own ISA, with ``target``'s weight ranges)."""
    calib = [(x,)] + [(torch.rand_like(x) * 2 - 1,) for _ in range(3)]
    ref = prepare_reference(model, (x,), calib, arithmetic=arithmetic, progress=False)
    import copy

    passes = lowering_passes("onednn", target=target)
    lowered = PassManager(passes).run(copy.deepcopy(ref.graph_module), [(x,)]).graph_module
    return ref.graph_module, lowered, compile_engine(lowered, (x,))


def median_ms(fn, x: torch.Tensor, rounds: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from gml.bench.roofline import cpu_name

    target = detect_target(args.threads)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "none")
    print(f"{cpu_name()}; ONEDNN_MAX_CPU_ISA={cap}; target {target.describe()}; load {os.getloadavg()[0]:.1f}")
    print("| layer | arithmetic | executor | cos vs fp32 | cos vs exact | error / exact's | top-1 vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    timings: dict[str, dict[str, object]] = {}
    for name, (model, x) in layers().items():
        with torch.no_grad():
            y = model(x)
        timings[name] = {}
        for aname, (arith, lowered_for) in ARITHMETICS.items():
            if name != "linear" and aname == "7-bit weights, exact 8-bit linear":
                continue  # a conv's arithmetic is the 7-bit row's
            ref, lowered, engine = quantize(model, x, arith, lowered_for)
            with torch.no_grad():
                exact = ref(x)
                runs = {"exact (Q/DQ)": exact, "python": lowered(x), "engine": engine(x)}
            e_exact = 1 - cosine(exact, y)
            for ex, out in runs.items():
                e = 1 - cosine(out, y)
                t1 = top1(out, y)
                print(
                    f"| {name} | {aname} | {ex} | {1 - e:.6f} | {cosine(out, exact):.6f} | "
                    f"{e / e_exact if e_exact > 0 else float('nan'):.2f} | {'' if t1 is None else f'{100 * t1:.1f}%'} |"
                )
            timings[name][aname] = engine
    print()
    print(f"engine latency, median of {args.rounds} (ms), {args.threads} thread(s), interleaved per round:")
    for name, (_, x) in layers().items():
        fns = timings[name]
        samples: dict[str, list[float]] = {a: [] for a in fns}
        with torch.no_grad():
            for _ in range(args.rounds):
                for a, eng in fns.items():
                    samples[a].append(median_ms(eng, x, 5))
        print(f"  {name}: " + ", ".join(f"{a} {statistics.median(v):.3f}" for a, v in samples.items()))


if __name__ == "__main__":
    main()
