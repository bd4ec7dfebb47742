"""``torch.ops.gml.rms_norm``: root-mean-square normalization over the last dim (RMSNorm).

Semantics, for ``x: [..., D]`` and ``weight: [D]`` (or ``None``)::

    rms_norm(x, weight, eps) = x / sqrt(mean(x², dim=-1) + eps) · weight

the statistics in fp32 (``torch.nn.functional.rms_norm``'s math: Llama, Qwen, Mistral, T5, Gemma —
whose ``(1 + w)`` is a constant once folded — and ``torch.nn.RMSNorm``). The Python kernel is
``F.rms_norm``; the engine runs it as ``RmsNormStep`` (native/rms_norm.h, one GML kernel step:
no oneDNN 3.2 primitive normalizes without the mean) through the generic translation rule of an op
that names its engine step (gml.runtime.rules.kernel). ``gml.passes.rms_norm`` writes it.

Part of the op vocabulary: imports no other gml package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gml.ir.library import OpDef, declare, register

SCHEMA = "(Tensor x, Tensor? weight, float eps) -> Tensor"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _fake_rms_norm(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


RMS_NORM = register(OpDef("rms_norm", SCHEMA, _rms_norm, _fake_rms_norm, engine_step="RmsNormStep"))


def rms_norm_op() -> torch._ops.OpOverload:
    """``torch.ops.gml.rms_norm.default``, declaring it on first use."""
    return declare(RMS_NORM)
