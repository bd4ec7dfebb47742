"""Summary statistics and output-agreement metrics for the benchmark.

Latency samples are summarised by the median and the 10th/90th percentiles (linear interpolation
between order statistics, numpy's default), never by the mean: one preempted sample on a shared
machine moves a mean a lot and a median not at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Stats:
    """Order statistics of latency samples, in milliseconds."""

    n: int
    median: float
    p10: float
    p90: float
    min: float
    max: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(samples_ms: Sequence[float]) -> Stats:
    """Median, p10, p90, min and max of ``samples_ms`` (at least one sample)."""
    if not samples_ms:
        raise ValueError("no samples to summarize")
    a = np.asarray(samples_ms, dtype=np.float64)
    p10, median, p90 = np.percentile(a, [10, 50, 90])
    return Stats(len(a), float(median), float(p10), float(p90), float(a.min()), float(a.max()))


def speedup(baseline_ms: float, candidate_ms: float) -> float:
    """How many times faster ``candidate`` is than ``baseline`` (ratio of medians; >1 is faster)."""
    return baseline_ms / candidate_ms if candidate_ms > 0 else math.inf


def flat_output(out: Any) -> torch.Tensor:
    """Every floating/quantized tensor in a (nested) model output, dequantized, as one fp64 vector."""
    leaves, _ = tree_flatten(out)
    parts = []
    for t in leaves:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t)
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_quantized:
            t = t.dequantize()
        if t.is_mkldnn:
            t = t.to_dense()
        parts.append(t.detach().reshape(-1).to(torch.float64))
    if not parts:
        raise ValueError("model output holds no tensor")
    return torch.cat(parts)


def max_abs_diff(ref: torch.Tensor, new: torch.Tensor) -> float:
    """``max |ref - new|`` of two flat outputs (inf if their sizes differ)."""
    if ref.shape != new.shape:
        return math.inf
    return float((ref - new).abs().max()) if ref.numel() else 0.0


def cosine(ref: torch.Tensor, new: torch.Tensor) -> float:
    """Cosine similarity of two flat outputs; 1.0 when both are all zeros, nan if sizes differ."""
    if ref.shape != new.shape:
        return math.nan
    nr, nn_ = float(ref.norm()), float(new.norm())
    if nr == 0.0 and nn_ == 0.0:
        return 1.0
    if nr == 0.0 or nn_ == 0.0:
        return 0.0
    return float(torch.dot(ref, new)) / (nr * nn_)


def top1_agreement(ref: Any, new: Any) -> float | None:
    """Share of rows whose argmax agrees, for a single 2-D (batch, classes) output; else None."""
    r_leaves = [t for t in tree_flatten(ref)[0] if isinstance(t, torch.Tensor | np.ndarray)]
    n_leaves = [t for t in tree_flatten(new)[0] if isinstance(t, torch.Tensor | np.ndarray)]
    if len(r_leaves) != 1 or len(n_leaves) != 1:
        return None
    r, n = (torch.as_tensor(x) for x in (r_leaves[0], n_leaves[0]))
    if r.is_quantized:
        r = r.dequantize()
    if n.is_quantized:
        n = n.dequantize()
    if r.dim() != 2 or r.shape != n.shape or r.shape[1] < 2:
        return None
    return float((r.argmax(1) == n.argmax(1)).float().mean())
