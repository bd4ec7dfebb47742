"""Choosing the next token from fp32 logits: greedy, or temperature / top-k / top-p sampling with a seed.

``temperature == 0`` is greedy (``argmax``; ties go to the lowest id, as ``torch.argmax``). Otherwise
the logits are divided by ``temperature``, everything outside the ``top_k`` largest is dropped, then
everything outside the smallest set of most likely tokens whose probability reaches ``top_p`` (the most
likely token always stays), and one token is drawn from the softmax of what is left with a
``torch.Generator`` seeded once per generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def check(self) -> str | None:
        """Why these settings are invalid, or ``None``."""
        if self.temperature < 0:
            return f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
        if self.top_k is not None and self.top_k < 1:
            return f"top_k must be >= 1, got {self.top_k}"
        if self.top_p is not None and not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        return None

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def next_token(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """``logits: [B, V]`` -> ``[B]`` token ids."""
    if s.temperature == 0:
        # numpy's argmax: the same index (the first maximum; a NaN counts as the maximum), 7x faster
        # than torch.argmax over a 262k vocabulary (measured, docs/llm.md)
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    logits = logits / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= s.top_p
        drop[..., 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)[..., 0]
