"""``gml.ir``: the contract every other gml package imports, and that imports none of them.

* :mod:`gml.ir.ops` — the op vocabulary (kinds, spellings, tags: view / activation / int8);
* :mod:`gml.ir.values` — value types: :class:`QParams`, :class:`ChannelQParams`, :class:`ConvSpec`,
  :class:`PostOp`;
* :mod:`gml.ir.alias` — the one alias / mutation analysis;
* :mod:`gml.ir.qdq` — quantize / dequantize recognition and their parameters;
* :mod:`gml.ir.library` — the lowered ops ``torch.ops.gml.*`` (schemas + fake kernels);
* :mod:`gml.ir.attention` — ``torch.ops.gml.attention`` (SDPA semantics, one op for attention);
* :mod:`gml.ir.llm_ops` — ``torch.ops.gml.woq_linear`` (INT8 / INT4 weight-only linear: the format, its quantizer);
* :mod:`gml.ir.match` — the pattern matcher rules are written with.
"""

from __future__ import annotations

from gml.ir.values import NO_POST_OP, ChannelQParams, ConvSpec, PostOp, QParams

__all__ = ["NO_POST_OP", "ChannelQParams", "ConvSpec", "PostOp", "QParams"]
