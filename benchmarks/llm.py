"""Decoder LLM tokens/s (#26) on a TinyLlama-1.1B-shaped random Llama: ``gml bench tinyllama --llm``.

    python benchmarks/llm.py [--weights fp32,bf16,int8,int4] [--prompt 128] [--new 16] [--rounds 2]

The same run as the CLI (:mod:`gml.bench.llm`): GML's weight formats against HF eager fp32 (its own KV
cache), interleaved rounds, best round per row, next to the measured read-bandwidth ceiling
``bandwidth / (weight bytes + KV-cache bytes per token)``; the CPU is printed with the table.
"""

from __future__ import annotations

import argparse

from gml.bench.llm import bench_llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--weights", default="fp32,bf16,int8,int4")
    args = ap.parse_args()
    result = bench_llm(
        "tinyllama", weights=args.weights.split(","), prompt_tokens=args.prompt, new_tokens=args.new,
        rounds=args.rounds, progress=print,
    )  # fmt: skip
    print(result.markdown())


if __name__ == "__main__":
    main()
