"""Running a model over some items of a source: the work one process (``gml run`` in process) or one
Ray actor (:mod:`gml.batch.on_ray`) does. Below both: :mod:`gml.batch.run` dispatches to Ray, and
the Ray actor runs this, so it lives in neither (no import circle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from gml.errors import InputError


@dataclass
class ItemsResult:
    """Outputs of some items (by index), and the items that could not be read (index, why)."""

    indices: list[int] = field(default_factory=list)
    outputs: list[list[np.ndarray]] = field(default_factory=list)  # per item: one array per output
    skipped: list[tuple[int, str]] = field(default_factory=list)


Samples = tuple[list[tuple[int, tuple[torch.Tensor, ...]]], list[tuple[int, str]]]


def read_items(source: Any, indices: Sequence[int]) -> Samples:
    """``(readable (index, inputs), unreadable (index, why))``: an :class:`InputError` skips the item."""
    good, bad = [], []
    for i in indices:
        try:
            good.append((i, source.read(i)[0]))
        except InputError as exc:
            bad.append((i, exc.message))
    return good, bad


def infer_samples(model: Callable[..., Any], samples: Samples, batch_size: int) -> ItemsResult:
    """Run ``model`` on the readable samples in batches of ``batch_size``. A short last batch is
    padded with copies of its last sample (outputs dropped): every call has one shape, so the
    engine builds one plan, not one more per tail size."""
    from torch.utils.data import default_collate

    good, bad = samples
    out = ItemsResult(skipped=list(bad))
    with torch.inference_mode():
        for start in range(0, len(good), batch_size):
            chunk = good[start : start + batch_size]
            rows = [s for _, s in chunk]
            inputs = default_collate(rows + [rows[-1]] * (batch_size - len(rows)))
            leaves, _ = tree_flatten(model(*inputs))
            arrays = [t.detach().float().numpy() if t.is_floating_point() else t.numpy() for t in leaves]
            for row, (i, _) in enumerate(chunk):
                out.indices.append(i)
                out.outputs.append([a[row].copy() for a in arrays])
    return out


def infer_items(model: Callable[..., Any], source: Any, indices: Sequence[int], batch_size: int) -> ItemsResult:
    """Read ``indices`` from ``source`` (skipping unreadable ones) and run ``model`` on them."""
    return infer_samples(model, read_items(source, indices), batch_size)
