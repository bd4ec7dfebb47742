"""What the ``torch.ops.gml`` IR costs the Python executor: an INT8 model through the dispatcher vs
the same graph calling each op's Python implementation directly, and (``--old PATH``) vs the
pre-IR tree's INT8 modules.

    .venv/bin/python benchmarks/ir_executor.py [--model resnet18] [--batch 1] [--threads 1] [--rounds 60]
    .venv/bin/python benchmarks/ir_executor.py --old /tmp/oldpkg   # a pre-#12 tree importable as gml_old

For ``--old``: ``git archive e44df65 | tar -x -C /tmp/ir-old``, copy ``/tmp/ir-old/src/gml`` to
``/tmp/oldpkg/gml_old`` and rewrite its ``gml.`` imports to ``gml_old.``; both packages then run in
one process, so one interleaved run compares them (docs/benchmarks.md, "The lowered IR").
Every round runs each variant once, in rotating order; the table is the median per variant.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torchvision

import gml
from gml.ir import library
from gml.kernels.int8_ops import IMPLEMENTATIONS


def direct_python(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same graph, each ``torch.ops.gml`` call replaced by its Python implementation."""
    out = copy.deepcopy(gm)
    for n in out.graph.nodes:
        name = library.gml_op_name(n)
        if name:
            n.target = IMPLEMENTATIONS[name]
    out.recompile()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--old", metavar="PATH", help="directory holding a pre-IR tree as package gml_old")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = getattr(torchvision.models, args.model)().eval()
    x = torch.randn(args.batch, 3, 224, 224)
    calib = [torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    new = gml.quantize(model, calib, example_inputs=(x,), per_layer=False).module
    variants = {"gml ops (dispatcher)": new, "gml ops (direct Python)": direct_python(new)}
    if args.old:
        sys.path.insert(0, args.old)
        import gml_old  # type: ignore[import-not-found]

        variants["pre-IR INT8 modules"] = gml_old.quantize(model, calib, example_inputs=(x,), per_layer=False).module
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        ref = new(x)
        for k, f in variants.items():
            assert torch.equal(f(x), ref), f"{k} computes something else"
            for _ in range(3):
                f(x)
        for r in range(args.rounds):
            keys = list(variants)
            for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
                t = time.perf_counter()
                variants[k](x)
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times["gml ops (dispatcher)"])
    print(f"{args.model} INT8, batch {args.batch}, {args.threads} thread(s), {args.rounds} interleaved rounds")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"  {k:26s} median {med * 1e3:8.2f} ms   min {min(v) * 1e3:8.2f} ms   vs dispatcher {med / base:.3f}")


if __name__ == "__main__":
    main()
