"""The engine's fp32 layout policy, measured: free fp32 values in NHWC vs oneDNN's pick (``any``).

    .venv/bin/python benchmarks/fp32_layouts.py [--model resnet18] [--batch 1] [--rounds 31] [--threads 1]

Compiles one model twice with :func:`gml.optimize` (random init, eval mode), once per value of
:data:`gml.runtime.plan.FP32_FREE_LAYOUT`, prints the oneDNN implementations each plan runs, checks
the two agree, then times both in interleaved rounds (:func:`gml.bench.runner.time_interleaved`) and
prints the ratio. ADR 006 ("CNN kernels and fusions checked for #13") has the Zen 4 figures; run it
on another CPU (an Intel AVX-512 / AMX Xeon) before changing the policy there.
"""

from __future__ import annotations

import argparse
import collections
import platform

import torch
import torchvision

import gml
from gml.bench.runner import time_interleaved
from gml.bench.stats import summarize
from gml.runtime import native
from gml.runtime import plan as plan_mod


def _impls(result: gml.OptimizeResult) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for seg in result.engine.segments():
        for compiled, _ in seg._plans.values():
            if compiled is not None:
                out.update(i.split(":")[0] for i in compiled.step_impls())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", help="a torchvision model name")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().eval()
    x = torch.randn(args.batch, 3, 224, 224)
    saved = plan_mod.FP32_FREE_LAYOUT
    built = {}
    try:
        for layout in ("any", "nhwc"):
            plan_mod.FP32_FREE_LAYOUT = layout
            r = gml.optimize(model, (x,))
            if r.engine is None:
                raise SystemExit(f"{layout}: the model did not run on the engine:\n{r.runtime}")
            built[layout] = r
            print(f"{layout}: {sum(_impls(r).values())} steps {dict(_impls(r))}")
    finally:
        plan_mod.FP32_FREE_LAYOUT = saved
    with torch.no_grad():
        diff = float((built["any"].executable(x) - built["nhwc"].executable(x)).abs().max())
    print(f"max |any - nhwc| = {diff:.3g}")
    calls = {k: (lambda f=r.executable: f(x)) for k, r in built.items()}
    with torch.no_grad():
        samples = time_interleaved(calls, rounds=args.rounds, threads=args.threads)
    stats = {k: summarize(v) for k, v in samples.items()}
    for k, s in stats.items():
        print(f"{k:5s}: median {s.median:.2f} ms  p10 {s.p10:.2f}  min {s.min:.2f}")
    print(
        f"nhwc / any: median {stats['nhwc'].median / stats['any'].median:.3f}, "
        f"min {stats['nhwc'].min / stats['any'].min:.3f}  ({platform.processor() or platform.machine()}, "
        f"oneDNN ISA {native.load().cpu_isa()}, {args.threads} thread(s), batch {args.batch})"
    )


if __name__ == "__main__":
    main()
