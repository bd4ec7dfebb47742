"""Comparing two model outputs exactly: the check shared by capture's determinism test and the
torch.export capture path (which must reproduce the eager outputs bit for bit)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def same_outputs(a: Any, b: Any) -> tuple[bool, float]:
    """Whether two output structures are equal (NaN equals NaN), and the max abs difference."""
    xs, ys = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(xs) != len(ys):
        return False, math.inf
    worst = 0.0
    for x, y in zip(xs, ys):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                return False, math.inf
            continue
        if x.shape != y.shape:
            return False, math.inf
        if x.is_floating_point():
            differ = (x != y) & ~(torch.isnan(x) & torch.isnan(y))
            if differ.any():
                worst = max(worst, float((x - y)[differ].abs().max()))
        elif not torch.equal(x, y):
            worst = math.inf
    return worst == 0.0, worst


__all__ = ["same_outputs"]
