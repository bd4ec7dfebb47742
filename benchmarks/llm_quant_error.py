"""How far gml.llm's quantized weights and int8 activations move the logits (#26), on the tiny random
configs of the tests (no download).

    python benchmarks/llm_quant_error.py [--families llama,gemma3,gpt2] [--positions 64]

For each family: ``--positions`` random token ids, teacher-forced through *decode steps* (one token per
forward, so every matrix call is a one-row GEMV: where ``activations="int8"`` applies; prefill keeps
fp32), logits compared with GML fp32 on the same path. Columns: relative L2 error of the logits
(``||q - ref|| / ||ref||`` over all positions) and the mean KL divergence ``KL(softmax(ref) ||
softmax(q))`` per position. Random Gaussian weights are harsh on INT4, and top-1 agreement is near
meaningless on random configs (near-tied logits).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

CONFIGS = {  # name: gml.llm keyword arguments
    "bf16": {"weights": "bf16"},
    "int8": {"weights": "int8"},
    "int8, int8 act.": {"weights": "int8", "activations": "int8"},
    "int4 g32 sym": {"weights": "int4"},
    "int4 g32 sym, int8 act.": {"weights": "int4", "activations": "int8"},
    "int4 g32 asym": {"weights": "int4", "symmetric": False},
    "int4 g32 asym, int8 act.": {"weights": "int4", "symmetric": False, "activations": "int8"},
}


def stepwise_logits(lm, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits ``[L, V]``, one decode step per position."""
    cache = lm._fresh_cache(1)
    return torch.cat([lm.decoder.forward(torch.tensor([[t]]), cache, last_only=False)[0] for t in ids])


def errors(q: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    rel = float((q - ref).norm() / ref.norm())
    kl = torch.nn.functional.kl_div(q.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    return rel, float(kl.sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llama,gemma3,gpt2")
    ap.add_argument("--positions", type=int, default=64)
    args = ap.parse_args()

    import gml
    from assets.llm_models import VOCAB, tiny

    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (args.positions,)).tolist()
    extra = [c for c in CONFIGS if c.endswith(", int8 act.")]
    vs_fp32, vs_weight_only = [], []
    for family in args.families.split(","):
        model = tiny(family)
        ref = stepwise_logits(gml.llm(model, max_length=args.positions), ids)
        logits = {c: stepwise_logits(gml.llm(model, max_length=args.positions, **kw), ids) for c, kw in CONFIGS.items()}
        vs_fp32.append([family, *("{:.3f} / {:.1e}".format(*errors(q, ref)) for q in logits.values())])
        weight_only = [logits[c.removesuffix(", int8 act.")] for c in extra]
        vs_weight_only.append(
            [family, *("{:.3f} / {:.1e}".format(*errors(logits[c], w)) for c, w in zip(extra, weight_only))]
        )
    print("Against GML fp32 (rel. L2 / mean KL):")
    print("| family | " + " | ".join(CONFIGS) + " |\n|---|" + "---|" * len(CONFIGS))
    for row in vs_fp32:
        print("| " + " | ".join(row) + " |")
    print("\nInt8 activations against the same weights with fp32 activations (rel. L2 / mean KL):")
    print("| family | " + " | ".join(c.removesuffix(", int8 act.") for c in extra) + " |\n|---|" + "---|" * len(extra))
    for row in vs_weight_only:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
