"""``torch.ops.gml.group_norm``: group normalization (GroupNorm) of ``[N, C, *spatial]``.

Semantics, for ``x: [N, C, *S]``, ``G = num_groups`` dividing ``C``, ``weight`` / ``bias``: ``[C]``
(or ``None``)::

    group g of sample n: the C/G channels g·C/G .. (g+1)·C/G − 1, all positions
    μ, σ² = mean and biased variance of x over that group
    group_norm(x)[n, c] = (x[n, c] − μ) / sqrt(σ² + eps) · weight[c] + bias[c]

``torch.nn.functional.group_norm``'s math (``nn.GroupNorm``; timm's ``GroupNorm1`` / ``GroupNormAct``
in BiT / PoolFormer / ConvNeXt-style nets; HF Wav2Vec2's first feature conv). The Python kernel is
``F.group_norm``; the engine runs it as ``GroupNormStep`` (native/group_norm.h, one GML kernel step:
oneDNN 3.2 has no group normalization, and its layer normalization cannot give a scale per channel
across the group's positions). The generic translation rule of such an op (gml.runtime.rules.kernel)
could build the step on dense rows; the engine's table has a rule of its own for it first
(gml.runtime.rules.eltwise), which also passes the convs' channels-last layout as it is.
``gml.passes.group_norm`` writes it.

Part of the op vocabulary: imports no other gml package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gml.ir.library import OpDef, declare, register

SCHEMA = "(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps) -> Tensor"


def _group_norm(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return F.group_norm(x, num_groups, weight, bias, eps)


def _fake_group_norm(x, num_groups, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


GROUP_NORM = register(OpDef("group_norm", SCHEMA, _group_norm, _fake_group_norm, engine_step="GroupNormStep"))


def group_norm_op() -> torch._ops.OpOverload:
    """``torch.ops.gml.group_norm.default``, declaring it on first use."""
    return declare(GROUP_NORM)
