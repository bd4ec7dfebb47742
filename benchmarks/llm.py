"""Decoder LLM tokens/s (#26): gml.llm (fp32 / bf16 / int8 / int4 weights) vs HF eager, and the
machine's bandwidth ceiling, on a TinyLlama-1.1B-shaped random Llama.

    python benchmarks/llm.py [--layers 22] [--prompt 128] [--new 16] [--rounds 2] [--weights fp32,bf16,int8,int4]

``--weights`` entries ``int8+a8`` / ``int4+a8`` add ``activations="int8"`` (int8 activations in decode).

* Model: LlamaConfig(hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000, ``--layers``
  layers; 22 is TinyLlama-1.1B), random init (no download).
* Prefill tokens/s over a ``--prompt``-token prompt, decode tokens/s over ``--new`` greedy tokens.
  HF eager uses its own KV cache (``generate``, greedy). Runs are interleaved round by round; the
  best round is kept (the machine is shared: compare ratios from one run).
* Bandwidth ceiling: the best of a 1 GiB read (``sum``) and copy (``copy_``) loop, and the decode
  tokens/s it allows for each weight format: ``bandwidth / (weight bytes + KV-cache bytes)``.

Prints the CPU next to every number.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    return f"{name} ({isa}), {torch.get_num_threads()} thread(s), machine shared"


def bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> tuple[float, float]:
    """Best read (sum) and copy (read + write) GB/s over a buffer of ``gib`` GiB."""
    n = int(gib * (1 << 30)) // 4
    a = torch.ones(n)
    b = torch.empty(n)
    read = copy = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        read = max(read, 4 * n / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        b.copy_(a)
        copy = max(copy, 8 * n / (time.perf_counter() - t) / 1e9)
    return read, copy


def tinyllama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def time_hf(model, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    with torch.no_grad():
        t = time.perf_counter()
        model(prompt, use_cache=True)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    # generate = one prefill + (new - 1) decode steps
    return prompt.shape[1] / prefill, (new - 1) / max(total - prefill, 1e-9)


def time_gml(lm, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    lm.generate(prompt, new)
    s = lm.stats
    return s.prefill_tokens_per_second, s.decode_tokens_per_second


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--weights", default="fp32,bf16,int8,int4")
    args = ap.parse_args()

    import gml

    print(cpu_line())
    read, copy = bandwidth_gbs()
    print(f"bandwidth: read {read:.1f} GB/s, copy {copy:.1f} GB/s (read + write bytes)")
    model = tinyllama(args.layers)
    max_length = args.prompt + args.new
    lms = {}
    for w in args.weights.split(","):
        weights, _, act = w.partition("+")
        lms[w] = gml.llm(model, weights=weights, activations="int8" if act == "a8" else "fp32", max_length=max_length)
    prompt = torch.randint(0, 32000, (1, args.prompt))
    runs = {"HF eager fp32": lambda: time_hf(model, prompt, args.new)}
    runs.update({f"GML {w}": (lambda lm=lm: time_gml(lm, prompt, args.new)) for w, lm in lms.items()})
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            p, d = fn()
            old = best.get(name, (0.0, 0.0))
            best[name] = (max(old[0], p), max(old[1], d))
    kv_bytes = {w: lm._cache.nbytes() for w, lm in lms.items()}  # the cache as allocated (max_length)
    print(f"\nTinyLlama-1.1B-shaped random Llama, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens")
    print("| runtime | weight MB read per token | prefill tok/s | decode tok/s | ceiling tok/s (read BW) |")
    print("|---|---|---|---|---|")
    fp32_bytes = lms["fp32"].weight_bytes() if "fp32" in lms else None
    for name, (p, d) in best.items():
        w = name.split()[-1]
        wb = lms[w].weight_bytes() if w in lms else fp32_bytes
        kvb = kv_bytes.get(w, 0)
        ceiling = f"{read * 1e9 / (wb + kvb):.2f}" if wb else "-"
        mb = f"{wb / 1e6:.0f}" if wb else "-"
        print(f"| {name} | {mb} | {p:.1f} | {d:.2f} | {ceiling} |")


if __name__ == "__main__":
    main()
