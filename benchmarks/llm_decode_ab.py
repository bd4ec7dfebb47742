"""Decode tokens/s of saved GML LLMs — under one or more GML checkouts — and of llama.cpp GGUFs, OpenVINO
GenAI IR folders and ONNX Runtime GenAI folders, one interleaved run (every row a fresh process per round,
rows in a seeded random order per round).

    python benchmarks/llm_decode_ab.py --gml new=.venv/bin/python --gml old=../base/.venv/bin/python \\
        --model int8=/tmp/gemma-int8.gml --model int4=/tmp/gemma-int4.gml --activations int8 \\
        --llamacpp Q8_0=/tmp/gemma-3-270m-q8_0.gguf --llamacpp Q4_0=/tmp/gemma-3-270m-q4_0.gguf \\
        --openvino int8=/tmp/gemma-ov-int8 --openvino int4=/tmp/gemma-ov-int4 \\
        --ortgenai int4=/tmp/gemma-ort-int4

Each row: a prompt of ``--prompt`` random token ids (seeded), then ``--steps`` decode steps, batch 1,
``--threads`` threads. GML: ``lm.generate`` (greedy; the LM head runs every step) after one short
untimed generation, ``lm.stats.decode_tokens_per_second``. The peers run through ``gml bench --llm``'s
drivers (``gml.bench.llm_peers``: a worker process in the peer's own venv, ``--llamacpp-python``,
``--openvino-python``, ``--ortgenai-python``; greedy, ``--threads`` threads; one short untimed run, then
the timed one): llama.cpp (llama-cpp-python, its AMX matmul off: see llamacpp_noamx.c), OpenVINO GenAI
(``LLMPipeline`` on token ids, on a folder ``openvino_worker.py export`` wrote), ONNX Runtime GenAI (on
a folder ``ortgenai_export.py`` wrote). Nothing here imports a peer.
A GML checkout is given by its venv's python, so an old commit and a new one run side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # gml.bench.llm_peers: the worker needs no GML install
from gml.bench.llm_peers import PeerWorker  # noqa: E402

GML_ROW = r"""
import json, sys, torch, gml
path, act, prompt, steps, threads, tokens, kv = sys.argv[1:8]
torch.set_num_threads(int(threads))
seq = json.load(open(tokens))[0]
lm = gml.llm(path, activations=act, max_length=int(prompt) + int(steps) + 8, kv_cache=None if kv == "-" else kv)
lm.generate(seq[:8], 4)
lm.generate(seq[: int(prompt)], int(steps) + 1)
print(json.dumps({"decode_tokens_per_second": lm.stats.decode_tokens_per_second,
                  "ttft_ms": 1000 * lm.stats.prefill_seconds}))
"""


def run_peer(kind: str, python: str, model: str, env: dict[str, str], ids: list[int], prompt: int, steps: int,
             threads: int) -> tuple[float, float]:  # fmt: skip
    """A fresh worker: load, one short untimed run, then ``steps`` decode steps after ``prompt`` ids."""
    w = PeerWorker(kind, python, env)
    try:
        w.request({"cmd": "load", "model": model, "threads": threads, "max_length": prompt + steps + 8})
        w.request({"cmd": "run", "prompt": ids[:8], "new_tokens": 4})
        r = w.request({"cmd": "run", "prompt": ids[:prompt], "new_tokens": steps + 1})
    finally:
        w.close()
    return steps / r["decode_seconds"], 1000 * r["prefill_seconds"]


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(decode tokens/s, time to first token in ms: the prompt's prefill up to its last logits)."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{cmd[:3]} failed:\n{out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return row["decode_tokens_per_second"], row["ttft_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gml", action="append", default=[], help="LABEL=PYTHON of a GML checkout's venv")
    ap.add_argument("--model", action="append", default=[], help="LABEL=FILE written by lm.save")
    ap.add_argument("--activations", default="int8", help="comma-separated: fp32,int8")
    ap.add_argument("--kv-cache", default="-", help="comma-separated GML KV cache types (default: the file's)")
    ap.add_argument("--llamacpp", action="append", default=[], help="LABEL=FILE.gguf")
    ap.add_argument("--llamacpp-python", default="/work/venvs/llamacpp/bin/python")
    ap.add_argument("--openvino", action="append", default=[], help="LABEL=DIR: an OpenVINO IR folder")
    ap.add_argument("--openvino-python", default="/work/venvs/openvino/bin/python")
    ap.add_argument("--ortgenai", action="append", default=[], help="LABEL=DIR: an ONNX Runtime GenAI folder")
    ap.add_argument("--ortgenai-python", default="/work/venvs/ortgenai/bin/python")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=262144, help="random prompt ids are drawn below this")
    ap.add_argument("--bos", type=int, default=2, help="the first id of the prompt (Gemma's BOS; Llama's is 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gml-decode-ab-"))
    rng = random.Random(args.seed)
    tokens = work / "tokens.json"
    ids = [args.bos] + [rng.randrange(args.vocab) for _ in range(args.prompt + args.steps + 8)]
    tokens.write_text(json.dumps([ids]))
    rows: dict[str, Callable[[], tuple[float, float]]] = {}
    for g in args.gml:
        label, py = g.split("=", 1)
        for m in args.model:
            mlabel, path = m.split("=", 1)
            for act in args.activations.split(","):
                for kv in args.kv_cache.split(","):
                    cmd = [py, "-c", GML_ROW, path, act, str(args.prompt), str(args.steps), str(args.threads),
                           str(tokens), kv]  # fmt: skip
                    name = f"GML {label} {mlabel}" + (", int8 activations" if act == "int8" else "")
                    rows[name + ("" if kv == "-" else f", {kv} KV cache")] = lambda cmd=cmd: run(cmd)
    env: dict[str, str] = {}
    if args.llamacpp:
        lib = work / "libnoamx.so"
        cc = ["gcc", "-O2", "-shared", "-fPIC", str(HERE / "llamacpp_noamx.c"), "-o", str(lib), "-ldl"]
        subprocess.run(cc, check=True)
        env = {"LD_PRELOAD": str(lib)}
    for kind, name, given, python, kind_env in (
        ("llamacpp", "llama.cpp", args.llamacpp, args.llamacpp_python, env),
        ("openvino", "OpenVINO GenAI", args.openvino, args.openvino_python, {}),
        ("ortgenai", "ONNX Runtime GenAI", args.ortgenai, args.ortgenai_python, {}),
    ):
        for q in given:
            label, path = q.split("=", 1)
            rows[f"{name} {label}"] = lambda k=kind, py=python, m=path, e=kind_env: run_peer(
                k, py, m, e, ids, args.prompt, args.steps, args.threads
            )
    got: dict[str, list[float]] = {name: [] for name in rows}
    ttft: dict[str, list[float]] = {name: [] for name in rows}
    order = list(rows)
    for r in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            tps, first = rows[name]()
            got[name].append(tps)
            ttft[name].append(first)
            print(f"round {r + 1}: {name}: {tps:.1f} tok/s, first token {first:.1f} ms", file=sys.stderr, flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"\nbatch 1, prompt {args.prompt}, {args.steps} decode steps, {args.threads} threads, best of "
          f"{args.rounds} interleaved rounds; load average at the end {' / '.join(load)}")  # fmt: skip
    first = f"time to first token, {args.prompt}-token prompt (ms, best / median)"
    print(f"| runtime | decode tok/s (best) | median | all rounds | {first} |")
    print("|---|---|---|---|---|")
    for name, v in got.items():
        med, t = sorted(v)[len(v) // 2], sorted(ttft[name])
        rounds = ", ".join(f"{x:.1f}" for x in v)
        print(f"| {name} | {max(v):.1f} | {med:.1f} | {rounds} | {t[0]:.0f} / {t[len(t) // 2]:.0f} |")


if __name__ == "__main__":
    main()
