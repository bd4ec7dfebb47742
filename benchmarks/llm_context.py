"""Decode tokens/s as the context grows (issue #26: decode at 2,048 tokens of context >= 85% of decode at
128), and where the extra time per step goes: the attention calls vs the rest of the step.

    python benchmarks/llm_context.py --model int8=/tmp/gemma-int8.gml --model int4=/tmp/gemma-int4.gml \\
        --contexts 128,512,1024,2048 --steps 32 --rounds 3 --threads 2 [--kv-cache fp32,bf16]

Every (model, KV cache type) is one fresh process that loads the saved LLM once with ``max_length`` =
the longest context + steps; per round it runs every context in a seeded random order: a prompt of
that many random token ids (prefill, untimed here), then ``--steps`` greedy decode steps
(``lm.stats.decode_tokens_per_second``). With ``--profile`` each step's native attention calls are
timed too (``time.perf_counter`` around ``decode_attention``: ms per step for all layers), so the
growth of a step splits into attention and the rest. Rows print the best round per context and the
ratio to the shortest context; the load average is printed at the end (the machine may be shared:
compare ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ROW = r"""
import importlib, json, random, sys, time, torch, gml
api = importlib.import_module("gml.llm.api")  # (gml.llm is the function)
path, act, kv, contexts, steps, threads, rounds, vocab, profile = sys.argv[1:10]
contexts = [int(c) for c in contexts.split(",")]
steps, rounds, vocab, profile = int(steps), int(rounds), int(vocab), profile == "1"
kv = None if kv == "None" else kv
torch.set_num_threads(int(threads))
rng = random.Random(0)
seq = [2] + [rng.randrange(vocab) for _ in range(max(contexts) + steps + 8)]
lm = gml.llm(path, activations=act, kv_cache=kv, max_length=max(contexts) + steps + 8)
spent = [0.0]
if profile:  # time the attention calls of every decode step
    real = api.native_glue()
    class Timed:
        def __getattr__(self, name):
            return getattr(real, name)
        def decode_attention(self, *a):
            t = time.perf_counter()
            real.decode_attention(*a)
            spent[0] += time.perf_counter() - t
    timed = Timed()
    api.native_glue = lambda: timed
lm.generate(seq[:8], 4)
out = {c: [] for c in contexts}
att = {c: [] for c in contexts}
for r in range(rounds):
    order = list(contexts)
    rng.shuffle(order)
    for c in order:
        spent[0] = 0.0
        lm.generate(seq[:c], steps + 1)
        out[c].append(lm.stats.decode_tokens_per_second)
        att[c].append(1000 * spent[0] / steps)
print(json.dumps({"tps": out, "attention_ms": att}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the GML checkout's venv python")
    ap.add_argument("--model", action="append", default=[], help="LABEL=FILE written by lm.save")
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--kv-cache", default="", help="comma-separated KV cache types (default: the file's)")
    ap.add_argument("--contexts", default="128,512,1024,2048")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000, help="random prompt ids are drawn below this")
    ap.add_argument("--profile", action="store_true", help="also time the attention calls")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    kvs = args.kv_cache.split(",") if args.kv_cache else ["None"]
    print(f"| model | KV cache | {' | '.join(f'ctx {c} tok/s' for c in contexts)} | "
          f"{' | '.join(f'{c}/{contexts[0]}' for c in contexts[1:])} |"
          + (f" {' | '.join(f'attention ms/step @{c}' for c in contexts)} |" if args.profile else ""))  # fmt: skip
    print("|---" * (2 + 2 * len(contexts) - 1 + (len(contexts) if args.profile else 0)) + "|")
    for m in args.model:
        label, path = m.split("=", 1)
        for kv in kvs:
            cmd = [args.python, "-c", ROW, path, args.activations, kv, args.contexts, str(args.steps),
                   str(args.threads), str(args.rounds), str(args.vocab), "1" if args.profile else "0"]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{label} / {kv} failed:\n{res.stderr[-3000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            best = {int(c): max(v) for c, v in row["tps"].items()}
            ratios = " | ".join(f"{best[c] / best[contexts[0]]:.2f}" for c in contexts[1:])
            line = f"| {label} | {kv if kv != 'None' else 'saved'} | " + " | ".join(f"{best[c]:.1f}" for c in contexts)
            line += f" | {ratios} |"
            if args.profile:
                line += " " + " | ".join(f"{min(row['attention_ms'][str(c)]):.2f}" for c in contexts) + " |"
            print(line, flush=True)
            print(f"  rounds: {json.dumps(row['tps'])}", file=sys.stderr, flush=True)
    with open("/proc/loadavg") as f:
        print(f"\nload average at the end: {' / '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
