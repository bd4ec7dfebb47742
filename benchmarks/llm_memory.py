"""Peak RSS of a saved decoder LLM while it loads and generates, against its weight + KV-cache bytes, and
decode tokens/s at a short and a long context (#26: peak RSS <= 1.3x (weights + KV cache); decode at
2,048 tokens of context >= 85% of decode at 128).

    python benchmarks/llm_memory.py [--model tinyllama] [--weights int8,int4] [--contexts 128,2048] [--new 16]

The model (``gml.bench.llm.RANDOM_LLMS``: random weights, nothing downloaded) is built once per weight
format and saved with ``lm.save`` into ``--dir``; then every (format, context) runs in a fresh
subprocess (``--child``): imports, the native engine mapped and GML's load path imported, so the
baseline holds the runtime itself (torch alone maps ~500 MB here); the high-water mark is read after
``gml.load`` and after ``generate`` (prompt of ``context`` tokens, ``--new`` new tokens). "peak above
baseline" is what the model costs; the ratio divides it by the weights a decode step reads plus the KV
cache (``Decoder.weight_bytes`` + ``KVCache.nbytes``; the quantized embedding table is listed apart).
The CPU is printed with the table; the machine may be shared: decode tokens/s are from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def _mib_peak() -> float:
    """This process's RSS high-water mark. ``VmHWM`` (of this address space, fresh after exec) rather
    than ``ru_maxrss``, which Linux keeps across fork + exec: a child of a parent that had just built
    the 1.1B-parameter model reported the parent's 8 GB as its own baseline."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(path: str, context: int, new: int) -> None:
    import torch

    import gml
    import gml.io  # the load path's imports belong to the baseline
    from gml.kernels.woq import detect_kernel
    from gml.llm import store  # noqa: F401

    detect_kernel()  # maps the native engine (oneDNN)
    base = _mib_peak()
    lm = gml.llm(path, max_length=context + new)
    after_load = _mib_peak()
    ids = torch.randint(0, lm.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    lm.generate(ids, new)
    peak = _mib_peak()
    emb = lm.decoder.embed
    embed_bytes = emb.nbytes() if hasattr(emb, "bits") else emb.numel() * emb.element_size()
    print(json.dumps({
        "base": base, "after_load": after_load, "peak": peak, "weights": lm.weight_bytes() / 2**20,
        "embed": embed_bytes / 2**20, "kv": lm._cache.nbytes() / 2**20,
        "decode": lm.stats.decode_tokens_per_second, "prefill": lm.stats.prefill_tokens_per_second,
    }))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinyllama")
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "gml-llm-memory"))
    ap.add_argument("--child", nargs=3, metavar=("PATH", "CONTEXT", "NEW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    import gml
    from gml.bench.llm import _hf_module
    from gml.bench.roofline import cpu_name

    contexts = [int(c) for c in args.contexts.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    files = {}
    model = None
    for w in args.weights.split(","):
        path = os.path.join(args.dir, f"{args.model}-{w}.gml")
        if not os.path.exists(path):
            model = model or _hf_module(args.model)
            print(f"building {path}", flush=True)
            gml.llm(model, weights=w, max_length=max(contexts) + args.new).save(path)
        files[w] = path
    del model
    print(f"CPU: {cpu_name()}; {args.model} (random weights); {args.new} new tokens; one run, machine may be shared\n")
    print("| weights | context | baseline MiB | peak above it after load / generate (MiB) | weights + KV MiB "
          "(embedding apart) | peak / (weights + KV) | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    decode = {}
    for w, path in files.items():
        for ctx in contexts:
            out = subprocess.run(
                [sys.executable, __file__, "--child", path, str(ctx), str(args.new)], capture_output=True, text=True
            )
            if out.returncode:
                print(f"| {w} | {ctx} | failed: {out.stderr.strip().splitlines()[-1]} |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            need = r["weights"] + r["kv"]
            decode[w, ctx] = r["decode"]
            print(
                f"| {w} | {ctx} | {r['base']:.0f} | {r['after_load'] - r['base']:.0f} / {r['peak'] - r['base']:.0f} | "
                f"{r['weights']:.0f} + {r['kv']:.0f} ({r['embed']:.0f}) | {(r['peak'] - r['base']) / need:.2f} | "
                f"{r['decode']:.2f} |",
                flush=True,
            )
    lo, hi = min(contexts), max(contexts)
    for w in files:
        if (w, lo) in decode and (w, hi) in decode and decode[w, lo]:
            print(f"\n{w}: decode at {hi} tokens of context = {100 * decode[w, hi] / decode[w, lo]:.0f}% of at {lo}")


if __name__ == "__main__":
    main()
