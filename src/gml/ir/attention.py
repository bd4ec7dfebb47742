"""``torch.ops.gml.attention``: attention as one GML op, declared with ``torch.library``.

Semantics are those of ``torch.nn.functional.scaled_dot_product_attention`` at ``dropout_p=0``::

    attention(q, k, v, attn_mask, scale, is_causal) = softmax(q @ k^T * scale + M) @ v

with ``q: [..., L, E]``, ``k: [..., S, E]``, ``v: [..., S, Ev]``; ``scale`` ``None`` means
``1/sqrt(E)``; ``M`` is ``attn_mask`` when it is a float tensor (added), ``-inf`` where a bool mask is
``False``, and the upper triangle ``-inf`` when ``is_causal``; the mask broadcasts to ``[..., L, S]``.

The Python executor runs it with torch's fused CPU SDPA (flash attention on CPU: one pass over
K/V blocks, no ``[L, S]`` score matrix in memory); the native engine runs it as three oneDNN
primitives, matmul (scale and mask as post-ops) → softmax → matmul (gml.runtime.rules.attention). It has a
fake kernel, so graphs holding it export.

Declared in its own ``torch.library`` fragment of the ``gml`` namespace, in the same style as the
lowered INT8 ops (:mod:`gml.ir.library`: a schema table and fake kernels). Part of the op vocabulary,
so it lives in ``gml.ir`` and imports no other gml package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gml.ir.library import OpDef, declare, register

SCHEMAS: dict[str, str] = {
    "attention": "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float? scale=None, "
    "bool is_causal=False) -> Tensor",
}


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale)


def _fake_attention(query, key, value, attn_mask=None, scale=None, is_causal=False):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


ATTENTION = register(OpDef("attention", SCHEMAS["attention"], _attention, _fake_attention))


def attention_op() -> torch._ops.OpOverload:
    """``torch.ops.gml.attention.default``, declaring it on first use."""
    return declare(ATTENTION)


def is_attention(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls ``torch.ops.gml.attention``."""
    return node.op == "call_function" and node.target is attention_op()
