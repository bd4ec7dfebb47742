"""Token-id batches for transformer tests: varied ids, an attention mask, an optionally padded row."""

from __future__ import annotations

import torch


def padded_tokens(
    batch: int, seq: int, pad_from: int | None = None, vocab: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: ids in ``[1, vocab)`` seeded by the shape; with ``pad_from``
    the last row is padding (id 0, mask 0) from that position on."""
    gen = torch.Generator().manual_seed(batch * 100 + seq)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_from is not None:
        mask[-1, pad_from:] = 0
        ids[-1, pad_from:] = 0
    return ids, mask
