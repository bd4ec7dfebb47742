"""``torch.ops.gml.woq_linear``: a linear layer with weight-only quantized (INT8 / INT4) weights.

The weight format (one definition, used by quantization, the reference kernel and every executor)::

    W[n, k] = (q[n, k] - z[n, g]) * s[n, g],   g = k // group_size

* ``bits=8``: ``qweight`` is ``int8 [N, K]``, ``q`` its value; ``zeros`` ``None`` means ``z = 0``
  (symmetric), in groups of 32 / 64 / 128 along ``K`` (:data:`INT8_GROUP_SIZES`; 32 is llama.cpp's
  Q8_0 block) or per output channel (``group_size = K``, any ``K``).
* ``bits=4``: ``qweight`` is ``uint8 [N, K/2]``, two values per byte: ``q[n, 2i]`` is the low nibble of
  ``qweight[n, i]`` and ``q[n, 2i+1]`` the high nibble, both in ``0..15``; ``zeros`` ``None`` means
  ``z = 8`` (symmetric, values ``-8..7``), else ``zeros`` is ``uint8 [N, K/group_size]`` in ``0..15``
  (asymmetric).
* ``scales`` is ``float32 [N, K/group_size]``; ``group_size`` divides ``K`` (``K``: per output channel).

The op computes ``y = x @ W^T + bias`` with ``x: [..., K]`` fp32 and ``y: [..., N]`` fp32. ``act_bits``
says what happens to the activations:

* ``0``: they stay fp32. The reference kernel dequantizes ``W`` and calls ``F.linear``.
* ``8``: they are quantized per row in blocks of :data:`ACT_BLOCK` = 32 along ``K`` (the last block may
  be shorter) to int8, symmetric — llama.cpp's Q8_0 (:func:`quantize_activations`)::

      s_x[m, b] = amax_b |x[m]| / 127,   qx[m, k] = round(x[m, k] / s_x[m, b]) in [-127, 127]  (0 if s_x = 0)

  and every block's dot product is exact integer arithmetic, scaled once::

      y[m, n] = sum_b (s_x[m, b] * s_w[n, g(b)]) * sum_{k in b} qx[m, k] * (q[n, k] - z[n, g(k)]) + bias[n]

  (``g(b)``: the weight group holding block ``b``; a block never straddles two groups, since every
  group size but ``K`` is a multiple of 32, so with INT8 groups of 32 each block has its own
  ``s_x * s_w``, as llama.cpp's Q8_0 x Q8_0 dot product.) A block's integer sum is at most
  ``32 * 128 * 127 < 2^24``: exact in int32 and in fp32.

Faster executors must match the reference to fp32 rounding (summation order only); with integer
operands and power-of-two scales every partial sum is exact and they agree bit for bit.

:func:`quantize_weight` is the one quantizer of this format (round to nearest, ties to even as
``torch.round``, except symmetric 4-bit, which rounds as Q4_0 does, ties up): symmetric
8-bit ``s = amax / 127`` per group (Q8_0's rule); symmetric 4-bit, per group, the better of llama.cpp's
Q4_0 rule ``s = m / -8`` (``m`` the group's value of largest magnitude, which lands exactly on -8; the
scale may be negative) and ``s = m / 7`` (:func:`_int4_symmetric`); asymmetric (4-bit)
``s = (max - min) / 15``, ``z = round(-min / s)``.

Declared in its own ``torch.library`` fragment of the ``gml`` namespace (as
:mod:`gml.ir.attention`), with a fake kernel so graphs holding it export. Imports no other gml package.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from gml.ir.library import OpDef, declare, register

SCHEMAS: dict[str, str] = {
    "woq_linear": (
        "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int bits, int group_size, "
        "int act_bits=0) -> Tensor"
    ),
}

#: The group sizes INT4 weights may use.
INT4_GROUP_SIZES = (32, 64, 128)
#: The group sizes INT8 weights may use besides ``K`` (per output channel). Multiples of ACT_BLOCK, so
#: that a block of int8 activations meets one weight scale.
INT8_GROUP_SIZES = (32, 64, 128)

#: ``act_bits`` values: 0 keeps fp32 activations, 8 quantizes them per block of ``ACT_BLOCK``.
ACT_BITS = (0, 8)
ACT_BLOCK = 32


class QuantizedWeight(NamedTuple):
    """A weight in the ``woq_linear`` format (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else self.zeros.numel() * self.zeros.element_size()
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4 + zeros


def check_format(bits: int, group_size: int, in_features: int) -> str | None:
    """Why ``(bits, group_size)`` cannot quantize a weight with ``in_features`` columns, or ``None``."""
    if bits not in (4, 8):
        return f"bits={bits}: woq_linear reads 8-bit or 4-bit weights"
    if bits == 8 and group_size != in_features and group_size not in INT8_GROUP_SIZES:
        return (
            f"8-bit group_size {group_size} is not one of {INT8_GROUP_SIZES} "
            f"or in_features = {in_features} (per output channel)"
        )
    if bits == 4 and group_size not in INT4_GROUP_SIZES:
        return f"4-bit group_size {group_size} is not one of {INT4_GROUP_SIZES}"
    if in_features % group_size:
        return f"group_size {group_size} does not divide in_features {in_features}"
    return None


def _q4_levels(g: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ggml's Q4_0 rounding of groups ``g [..., G]`` at ``scales [...]``, bit for bit: ``floor(x * (1/s)
    + 8.5) - 8`` clamped to -8..7 — a tie goes *up*, and adding 8.5 (not 0.5) rounds a near-tie's fp32
    sum as ggml's ``(int8_t)(x * id + 8.5f)`` does."""
    inverse = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    return torch.floor(g * inverse[..., None] + 8.5).clamp(0, 15) - 8


def _int4_symmetric(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 levels ``-8..7`` and a signed scale per group of ``g [N, G, size]``.

    Two candidate scales, each putting the group's value of largest magnitude ``m`` (signed) exactly on
    a level: llama.cpp's Q4_0 ``s = m / -8`` (``m`` on -8; values of the other sign clip at +7 steps,
    7/8 of ``|m|``) and ``s = m / 7`` (``m`` on +7; the other sign reaches -8 steps, 8/7 of ``|m|``, at a
    step 8/7 coarser). Each group takes the one with the smaller squared error, Q4_0's on a tie, so no
    group is worse than Q4_0's and a Q4_0 file's groups come back unchanged (error 0). Both keep the
    extreme exact; a finer scale search (ggml's ``make_qx_quants``) was measured worse on a GGUF's
    grid-aligned weights (docs/llm.md). Rounding is Q4_0's (:func:`_q4_levels`): on weights that already
    lie on a 4-bit grid (a Q4_K / Q5_0 GGUF requantized) a quarter are exact ties, and ties to even
    would merge neighbouring grid points on one level."""
    signed_max = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    s8, s7 = signed_max / -8.0, signed_max / 7.0
    q8, q7 = _q4_levels(g, s8), _q4_levels(g, s7)
    err8 = (q8 * s8[..., None] - g).square().sum(-1)
    err7 = (q7 * s7[..., None] - g).square().sum(-1)
    seven = err7 < err8
    q = torch.where(seven[..., None], q7, q8)
    scales = torch.where(seven, s7, s8)
    return q, torch.where(scales != 0, scales, torch.ones_like(scales))


def quantize_weight(
    w: torch.Tensor, bits: int, group_size: int | None = None, symmetric: bool = True
) -> QuantizedWeight:
    """Quantize an fp32 ``[N, K]`` weight to the ``woq_linear`` format (``group_size`` ``None``: ``K``,
    per output channel)."""
    n, k = w.shape
    group_size = k if group_size is None else group_size
    reason = check_format(bits, group_size, k)
    if reason is not None:
        raise ValueError(reason)
    if bits == 8 and not symmetric:
        raise ValueError("8-bit weights are symmetric (zeros=None)")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    qmax = 2 ** (bits - 1) - 1
    if symmetric and bits == 4:
        q, scales = _int4_symmetric(g)
        zeros = None
        offset = 8
    elif symmetric:
        scales = g.abs().amax(-1) / qmax
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(g / scales[..., None]).clamp(-qmax - 1, qmax)
        zeros = None
        offset = 0 if bits == 8 else 8
    else:
        lo = g.amin(-1).clamp(max=0.0)
        hi = g.amax(-1).clamp(min=0.0)
        scales = (hi - lo) / 15
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zp = torch.round(-lo / scales).clamp(0, 15)
        q = (torch.round(g / scales[..., None]) + zp[..., None]).clamp(0, 15)
        zeros = zp.to(torch.uint8)
        offset = 0
    q = q.reshape(n, k)
    if bits == 8:
        qweight = q.to(torch.int8)
    else:
        nib = (q + offset).to(torch.uint8)
        qweight = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return QuantizedWeight(qweight.contiguous(), scales.contiguous(), zeros, bits, group_size)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``uint8 [N, K/2]`` packed nibbles → ``uint8 [N, K]`` values ``0..15`` (low nibble first)."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


def integer_weight(qweight: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The exact integers ``q - z`` as ``int32 [N, K]``."""
    q = qweight.to(torch.int32) if bits == 8 else unpack_int4(qweight).to(torch.int32)
    if zeros is None:
        return q if bits == 8 else q - 8
    return q - zeros.to(torch.int32).repeat_interleave(group_size, dim=1)


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int
) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight the format stands for."""
    wi = integer_weight(qweight, zeros, bits, group_size).to(torch.float32)
    n, k = wi.shape
    return (wi.reshape(n, k // group_size, group_size) * scales[..., None]).reshape(n, k)


def embedding_rows(w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding table stored in the ``woq_linear`` format (``[V, H]``: a row per
    token, quantized like a weight's output channel), dequantized: fp32 ``[*ids.shape, H]``. Only the
    rows looked up are expanded, so the table stays INT8 / INT4 in memory (and a tied LM head reads the
    same bytes)."""
    flat = ids.reshape(-1)
    zeros = None if w.zeros is None else w.zeros[flat]
    rows = dequantize_weight(w.qweight[flat], w.scales[flat], zeros, w.bits, w.group_size)
    return rows.reshape(*ids.shape, rows.shape[-1])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [M, K]`` fp32 → ``(qx int8 [M, nb * 32], s_x fp32 [M, nb])`` per block of 32 along ``K``
    (``qx`` zero-padded past ``K``); the act_bits=8 format of the module docstring."""
    m, k = x.shape
    nb = -(-k // ACT_BLOCK)
    blocks = F.pad(x.float(), (0, nb * ACT_BLOCK - k)).reshape(m, nb, ACT_BLOCK)
    sx = blocks.abs().amax(-1) / 127
    q = torch.round(blocks / torch.where(sx > 0, sx, 1.0)[..., None]).clamp(-127, 127)
    q = torch.where(sx[..., None] > 0, q, 0.0)
    return q.to(torch.int8).reshape(m, nb * ACT_BLOCK), sx


def _woq_linear_act8(x, qweight, scales, zeros, bias, bits, group_size):
    """Reference kernel of act_bits=8: quantize x per block, exact integer dots per block, scale."""
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    x2 = x.reshape(-1, k).float()
    qx, sx = quantize_activations(x2)
    nb = sx.shape[1]
    wi = F.pad(integer_weight(qweight, zeros, bits, group_size), (0, nb * ACT_BLOCK - k))
    wi = wi.reshape(-1, nb, ACT_BLOCK).float()
    # the group of each block (blocks never straddle a group: 32 divides every group size but K)
    sw = scales[:, torch.arange(nb) * ACT_BLOCK // group_size]  # [N, nb]
    qb = qx.reshape(-1, nb, ACT_BLOCK).float()
    y = x2.new_empty(qb.shape[0], qweight.shape[0])
    for i in range(0, qb.shape[0], 16):  # 16 rows at a time bound the [rows, N, nb] block sums
        isum = torch.einsum("mbk,nbk->mnb", qb[i : i + 16], wi)  # |block sum| < 2^24: exact in fp32
        y[i : i + 16] = (isum * (sx[i : i + 16, None, :] * sw[None])).sum(-1)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], qweight.shape[0])


def _woq_linear(x, qweight, scales, zeros, bias, bits, group_size, act_bits=0):
    """Reference kernel: ``act_bits=0``: dequantize, then ``F.linear`` in fp32; ``8``: see above."""
    if act_bits == 8:
        return _woq_linear_act8(x, qweight, scales, zeros, bias, bits, group_size)
    if act_bits != 0:
        raise ValueError(f"act_bits={act_bits}: woq_linear keeps fp32 activations (0) or quantizes them to 8 bits")
    return F.linear(x.float(), dequantize_weight(qweight, scales, zeros, bits, group_size), bias)


def _fake_woq_linear(x, qweight, scales, zeros, bias, bits, group_size, act_bits=0):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]), dtype=torch.float32)


#: not in saved graphs: LLM files are their own format (gml.llm.store), read without torch.export
WOQ_LINEAR = register(OpDef("woq_linear", SCHEMAS["woq_linear"], _woq_linear, _fake_woq_linear, saved=False))


def woq_linear_op() -> torch._ops.OpOverload:
    """``torch.ops.gml.woq_linear.default``, declaring it on first use."""
    return declare(WOQ_LINEAR)


def woq_linear(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, act_bits: int = 0
) -> torch.Tensor:
    """Call ``torch.ops.gml.woq_linear`` on a :class:`QuantizedWeight`."""
    return woq_linear_op()(x, w.qweight, w.scales, w.zeros, bias, w.bits, w.group_size, act_bits)
