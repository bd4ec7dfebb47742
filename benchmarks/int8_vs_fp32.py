"""GML INT8 (``gml.quantize``'s default, cost policy on) against GML fp32 (``gml.optimize``), per model.

Each model runs in a child process that builds both, then times eager, ``optimize(...).executable``
and ``quantize(...).executable`` in interleaved rounds (machine noise hits all three alike); the
number to read is the INT8/fp32 ratio of one process. ``--python`` runs the same child under several
interpreters, alternating model by model (e.g. a checkout before a change and after it), so that
"before" and "after" see the same machine state:

    python benchmarks/int8_vs_fp32.py --models shufflenet_v2_x1_0 timm:levit_128s \\
        --python before=/path/to/old/.venv/bin/python after=.venv/bin/python

Rows are printed as JSON lines (``--results`` appends them to a file) and as a Markdown table.
The child uses only the public API (``gml.optimize``, ``gml.quantize``, ``gml.models``), so it runs
against older checkouts too; fields a version lacks are reported as ``-``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from zoo_sweep import latency_ms  # the same interleaved timer as the sweep (this directory)

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ["shufflenet_v2_x1_0", "timm:levit_128s", "timm:mixnet_s", "timm:tf_mixnet_s"]


def run_one(spec: str, rounds: int, inner: int, calib: int, bf16: bool = False) -> dict[str, Any]:
    import warnings

    import torch
    import torch.nn.functional as F

    import gml
    from gml.models import default_input_shapes, load_model

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = load_model(spec)
    (shape,) = default_input_shapes(model, spec)[:1]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    row: dict[str, Any] = {"model": spec, "input": "x".join(map(str, shape)), "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    opt = gml.optimize(model, (x,))
    row["s_optimize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    q = gml.quantize(model, calib, example_inputs=(x,), per_layer=False)
    row["s_quantize"] = time.perf_counter() - t0
    row["int8_precision"] = getattr(q, "precision", "-")
    row["runtime"] = q.runtime.path if q.runtime is not None else "torch"
    row["coverage"] = q.coverage.summary()
    row["cost"] = str(q.cost) if q.cost is not None else ""
    precisions = getattr(q, "precisions", None)
    if hasattr(precisions, "summary"):
        row["precisions"] = precisions.summary()
    fns = {"eager": model, "gml_fp32": opt.executable, "gml_int8": q.executable}
    if bf16:  # the same INT8 model with what INT8 leaves out on bf16 kernels (#14 mixed mode)
        t0 = time.perf_counter()
        q16 = gml.quantize(model, calib, example_inputs=(x,), per_layer=False, fallback_precision="bf16")
        row["s_quantize_bf16"] = time.perf_counter() - t0
        row["int8_bf16_precision"] = q16.precision
        row["precisions_bf16"] = q16.precisions.summary()
        fns["gml_int8_bf16"] = q16.executable
    with torch.no_grad():
        y = model(x)
        for k in [k for k in fns if k.startswith("gml_int8")]:
            got = fns[k](x).flatten().double()
            row[f"cos_{k.removeprefix('gml_')}_fp32"] = float(F.cosine_similarity(got, y.flatten().double(), 0))
    row.update({f"ms_{k}": v for k, v in latency_ms(fns, x, rounds, inner).items()})
    row["int8_over_fp32"] = row["ms_gml_int8"] / row["ms_gml_fp32"]
    if bf16:
        row["int8_bf16_over_int8"] = row["ms_gml_int8_bf16"] / row["ms_gml_int8"]
    return row


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    row = run_one(args.child, args.rounds, args.inner, args.calib, args.bf16_fallback)
    print("ROW " + json.dumps(row), flush=True)


def _run(label: str, python: str, spec: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [python, os.path.abspath(__file__), "--child", spec, "--threads", str(args.threads)]
    cmd += ["--rounds", str(args.rounds), "--inner", str(args.inner), "--calib", str(args.calib)]
    cmd += ["--bf16-fallback"] if args.bf16_fallback else []
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("GML_COST_POLICY", None)  # the default policy (measure), what a user gets
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model": spec, "version": label, "error": f"timed out after {args.timeout} s"}
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            return {**json.loads(line[4:]), "version": label}
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"model": spec, "version": label, "error": tail[:300]}


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | version | eager ms | GML fp32 ms | GML INT8 ms | INT8/fp32 | returned | runtime | cos vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['version']} | error: {r['error']} ||||||| ")
            continue
        lines.append(
            f"| {r['model']} | {r['version']} | {_fmt(r['ms_eager'])} | {_fmt(r['ms_gml_fp32'])} | "
            f"{_fmt(r['ms_gml_int8'])} | {_fmt(r['int8_over_fp32'])} | {r['int8_precision']} | {r['runtime']} | "
            f"{_fmt(r['cos_int8_fp32'], '.5f')} |"
        )
    bf = [r for r in rows if "ms_gml_int8_bf16" in r]
    if bf:
        lines += ["", "| model | INT8 (fp32 fallback) ms | INT8 (bf16 fallback) ms | ratio | returned | cos vs fp32 |"]
        lines.append("|---|---|---|---|---|---|")
        for r in bf:
            lines.append(
                f"| {r['model']} | {_fmt(r['ms_gml_int8'])} | {_fmt(r['ms_gml_int8_bf16'])} | "
                f"{_fmt(r['int8_bf16_over_int8'])} | {r['int8_bf16_precision']} | "
                f"{_fmt(r['cos_int8_bf16_fp32'], '.5f')} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--python", nargs="+", default=[f"this={sys.executable}"], metavar="LABEL=PYTHON")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--results", help="append each row (JSON) to this file")
    ap.add_argument(
        "--bf16-fallback",
        action="store_true",
        help="also time gml.quantize(..., fallback_precision='bf16') (checkouts that have it)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    pythons = [p.split("=", 1) for p in args.python]
    print(f"load average: {os.getloadavg()}", flush=True)
    rows = []
    for spec in args.models:
        for label, python in pythons:
            row = _run(label, python, spec, args)
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
