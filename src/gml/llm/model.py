"""GML's decoder: the captured layers (:mod:`gml.llm.spec`) run over a KV cache that GML owns.

**KV cache.** One preallocated tensor ``[layers, 2, batch, kv_heads, max_length, head_dim]`` (fp32,
bf16 or fp16: :data:`KV_DTYPES`; index 0 = keys after RoPE, 1 = values). A forward step writes the new positions'
keys/values at ``[start, start + L)`` and attends over ``[0, start + L)``; nothing is reallocated
while generating. Sliding-window layers keep every position too and mask the ones out of their
window (simple, and exact; a ring buffer would save memory on long contexts).

**Attention.** ``torch.ops.gml.attention`` (SDPA semantics). Grouped-query attention without copying
K/V: the ``G = heads / kv_heads`` query heads sharing a KV head are laid out as ``G * L`` query rows
of that KV head, with the mask repeated per group. Decode (``L = 1``) of a full-attention layer needs
no mask at all.

**Linears.** Each matrix is a :class:`LinearOp`: fp32 ``F.linear``, bf16 weights (``F.linear`` in
bf16, fp32 out), or ``torch.ops.gml.woq_linear`` (INT8 / INT4 weights, fp32 activations) on the native
kernel ``kernel`` names (native/woq*.h, via :mod:`gml.kernels.woq`) or, with ``kernel=None``, on the
op's reference kernel. ``activations="int8"`` quantizes the activations per block of 32 (``act_bits=8``)
in calls of fewer than ``GEMM_MIN_ROWS`` (2) rows (decode); from that many rows on (prefill) a call
keeps fp32 activations and runs as GEMMs over dequantized weight tiles, as llama.cpp does with a BLAS.
The LM head runs on the last position only when the caller asks for it (decode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from gml.errors import UnsupportedError
from gml.ir.attention import attention_op
from gml.ir.llm_ops import QuantizedWeight, embedding_rows, quantize_weight, woq_linear
from gml.kernels.woq import GEMM_MIN_ROWS, native_supports, woq_linear_bound, woq_linear_native
from gml.llm.spec import CapturedLM, LayerWeights, Linear, ModelSpec, Norm


def default_activations(weights: str) -> str:
    """What decode steps do with the activations when the caller does not say: ``int8`` (per block of
    32, integer dot products) for INT4 weights, ``fp32`` otherwise. Measured on Gemma-3-270M's
    2,048 teacher-forced decode steps (docs/llm.md): int8 activations move INT4's mean KL 0.198 →
    0.199 (its weights' error dominates) for 1.2-1.5x faster decode, but INT8 g32's 0.00044 → 0.00204."""
    return "int8" if weights == "int4" else "fp32"


@dataclass(frozen=True)
class MatrixFormat:
    """How the decoder's matrices are stored and multiplied: one value passed from :func:`gml.llm`
    down to every :class:`LinearOp` (options as values, issue #25).

    ``weights``: ``fp32 | bf16 | int8 | int4``; ``group_size``: INT8 / INT4 scales per that many
    weights along K (``None``: INT8 per output channel); ``symmetric``: INT4 without zero points;
    ``kernel``: the native woq kernel's ISA (``None``: the op's reference kernel); ``activations``:
    ``int8`` quantizes a decode call's activations per block of 32."""

    weights: str
    group_size: int | None = 32
    symmetric: bool = True
    kernel: str | None = None
    activations: str = "fp32"


class LinearOp:
    """One matrix of the model in its run-time storage: fp32 or bf16 ``weight``, or a weight-only
    quantized ``qweight`` (:class:`QuantizedWeight`) run by the native kernel ``kernel`` (an ISA of
    :mod:`gml.kernels.woq`; ``None``: the op's reference kernel)."""

    def __init__(
        self,
        *,
        weight: torch.Tensor | None = None,
        qweight: QuantizedWeight | None = None,
        bias: torch.Tensor | None = None,
        kernel: str | None = None,
        activations: str = "fp32",
    ) -> None:
        if (weight is None) == (qweight is None):
            raise ValueError("a LinearOp holds either a dense weight or a quantized one")
        self.weight = weight
        self.qweight = qweight
        self.bias = bias
        self.out_features, self.in_features = (
            weight.shape if weight is not None else (qweight.out_features, qweight.in_features)
        )
        self.kernel = kernel if qweight is not None and native_supports(qweight) else None
        # woq_linear's act_bits for calls of fewer than GEMM_MIN_ROWS rows (prefill keeps fp32)
        self.act_bits = 8 if activations == "int8" and qweight is not None else 0

    @classmethod
    def build(cls, lin: Linear, fmt: MatrixFormat) -> LinearOp:
        """``lin`` stored and run as ``fmt`` says."""
        weights, group_size = fmt.weights, fmt.group_size
        run = {"bias": lin.bias, "kernel": fmt.kernel, "activations": fmt.activations}
        if weights == "fp32":
            return cls(weight=lin.weight, **run)
        if weights == "bf16":
            return cls(weight=lin.weight.to(torch.bfloat16), **run)
        if weights == "int8":
            return cls(qweight=quantize_weight(lin.weight, 8, group_size), **run)
        if weights == "int4":
            return cls(qweight=quantize_weight(lin.weight, 4, group_size, fmt.symmetric), **run)
        raise ValueError(f"weights={weights!r}")

    def act_bits_for(self, rows: int) -> int:
        """``woq_linear``'s ``act_bits`` for a call on ``rows`` rows: prefill-sized calls keep fp32."""
        return self.act_bits if rows < GEMM_MIN_ROWS else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            act_bits = self.act_bits_for(x.numel() // x.shape[-1])
            if self.kernel is not None:
                return woq_linear_native(x, self.qweight, self.bias, self.kernel, act_bits)
            return woq_linear(x, self.qweight, self.bias, act_bits)
        if self.weight.dtype == torch.bfloat16:
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            return F.linear(x.to(torch.bfloat16), self.weight, bias).float()
        return F.linear(x, self.weight, self.bias)

    def bind(self, x: torch.Tensor, y: torch.Tensor) -> Callable[[], object]:
        """A call writing ``self(x)`` into ``y`` (both preallocated, contiguous fp32 ``[rows, in]`` /
        ``[rows, out]``): decode steps (:mod:`gml.llm.decode`) call it with nothing to allocate or check
        per call — for the native kernel, its arguments are one fixed tuple."""
        if self.qweight is not None and self.kernel is not None:
            return woq_linear_bound(x, self.qweight, self.bias, y, self.kernel, self.act_bits_for(x.shape[0]))
        return lambda: y.copy_(self(x))

    def nbytes(self) -> int:
        if self.qweight is not None:
            return self.qweight.nbytes()
        return self.weight.numel() * self.weight.element_size()


#: The KV cache's entry types by name (``gml.llm(..., kv_cache=...)``, the saved ``kv_cache`` field) and
#: the code native/decode.h's attention reads them by (``KvType``).
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_NATIVE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP16_INF = 65520.0  # the smallest magnitude fp16 rounds to inf (its largest finite value is 65504)


def kv_overflow(layer: int, value: float | None = None) -> UnsupportedError:
    """The error for a key / value an fp16 KV cache cannot hold (it would store inf, then NaN logits)."""
    what = "a key / value" if value is None else f"a key / value of magnitude {value:.4g}"
    return UnsupportedError(
        f"layer {layer} wrote {what} into the fp16 KV cache, beyond fp16's range (65504)",
        "build the LLM with kv_cache='bf16' (fp32's range) or kv_cache='fp32'",
    )


def check_kv_range(cache: KVCache, layer: int, *rows: torch.Tensor) -> None:
    """Refuse keys / values an fp16 cache would turn into inf (bf16 and fp32 have fp32's range)."""
    if cache.data.dtype == torch.float16:
        top = max(float(r.abs().amax()) for r in rows)
        if top >= FP16_INF:
            raise kv_overflow(layer, top)


class KVCache:
    """``data: [layers, 2, batch, kv_heads, max_length, head_dim]``, preallocated."""

    def __init__(self, spec: ModelSpec, batch: int, max_length: int, dtype: torch.dtype) -> None:
        self.data = torch.zeros(spec.num_layers, 2, batch, spec.num_kv_heads, max_length, spec.head_dim, dtype=dtype)
        self.length = 0  # positions [0, length) are filled

    @property
    def max_length(self) -> int:
        return self.data.shape[4]

    @property
    def batch(self) -> int:
        return self.data.shape[2]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _norm(x: torch.Tensor, n: Norm, spec: ModelSpec) -> torch.Tensor:
    if spec.norm == "layer":
        return F.layer_norm(x, (x.shape[-1],), n.weight, n.bias, spec.norm_eps)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
    return y * (1.0 + n.weight) if spec.norm_plus_one else y * n.weight


def _act(x: torch.Tensor, name: str, inplace: bool = False) -> torch.Tensor:
    """The MLP's activation; ``inplace`` overwrites ``x`` where torch has the in-place form (SiLU, ReLU)."""
    if name == "silu":
        return F.silu(x, inplace=inplace)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.relu(x, inplace=inplace)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [B, h, L, D]``, ``cos/sin: [L, R]`` (R <= D: partial rotary rotates the first R dims)."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    rotated = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rotated if xp.shape[-1] == 0 else torch.cat((rotated, xp), dim=-1)


class Layer:
    """One decoder layer: its norms (``w``: a :class:`LayerWeights` whose matrices are ``None``) and
    its four matrices as :class:`LinearOp` s."""

    def __init__(self, w: LayerWeights, qkv: LinearOp, o: LinearOp, up: LinearOp, down: LinearOp) -> None:
        self.w = w
        self.qkv, self.o, self.up, self.down = qkv, o, up, down

    @classmethod
    def build(cls, w: LayerWeights, fmt: MatrixFormat) -> Layer:
        ops = [LinearOp.build(getattr(w, n), fmt) for n in ("qkv", "o", "up", "down")]
        # Keep the norms, drop the fp32 matrices now held by the LinearOps.
        w.qkv = w.o = w.up = w.down = None  # type: ignore[assignment]
        return cls(w, *ops)

    def linears(self) -> list[LinearOp]:
        return [self.qkv, self.o, self.up, self.down]


class Decoder:
    """Runs a decoder LM: ``spec``, the embedding table (and GPT-2's learned ``positions``), the
    layers, the final norm, the LM head and the RoPE tables (layer type -> ``(cos, sin)``)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        embed: torch.Tensor | QuantizedWeight,
        positions: torch.Tensor | None,
        layers: list[Layer],
        final_norm: Norm,
        lm_head: LinearOp,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        weights: str,
        lm_head_weights: str | None = None,
        embed_weights: str | None = None,
    ) -> None:
        self.spec = spec
        self.embed = embed  # fp32 / bf16 [V, H], or a QuantizedWeight (rows dequantized when looked up)
        self.embed_weights = embed_weights or weights
        self.positions = positions
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.rope = rope
        self.weights = weights
        self.lm_head_weights = lm_head_weights or weights
        self.layer_types = [
            "sliding_attention" if win is not None else "full_attention" for win in self.spec.sliding_windows
        ]

    @classmethod
    def build(
        cls, lm: CapturedLM, fmt: MatrixFormat, *, lm_head_weights: str | None = None, embed_weights: str | None = None
    ) -> Decoder:
        """A :class:`CapturedLM` with its matrices stored as ``fmt`` says (``fmt.weights``: ``fp32 |
        bf16 | int8 | int4``), the LM head as ``lm_head_weights`` and the embedding table as ``embed_weights``.

        The table is quantized like a matrix (a row per token). Default ``embed_weights``: the LM
        head's format when the model ties the head to the table — then one tensor serves both (the
        lookup dequantizes the rows it gathers, the head reads it as a ``woq_linear``) — else
        ``weights``."""
        # an INT4 model keeps its LM head INT8 unless told otherwise, as llama.cpp's Q4_0 does: the
        # logits are the most error-sensitive matrix (measured on Gemma-3-270M, docs/llm.md)
        weights = fmt.weights
        head_w = lm_head_weights or ("int8" if weights == "int4" else weights)
        tied = (
            lm.lm_head.bias is None
            and lm.lm_head.weight.shape == lm.embed.shape
            and lm.lm_head.weight.data_ptr() == lm.embed.data_ptr()
        )
        embed_w = embed_weights or (head_w if tied else weights)
        table = LinearOp.build(Linear(lm.embed), replace(fmt, weights=embed_w))
        lm_head = table if tied and embed_w == head_w else LinearOp.build(lm.lm_head, replace(fmt, weights=head_w))
        return cls(
            lm.spec,
            embed=table.weight if table.weight is not None else table.qweight,
            positions=lm.positions,
            layers=[Layer.build(w, fmt) for w in lm.layers],
            final_norm=lm.final_norm,
            lm_head=lm_head,
            rope=lm.rope,
            weights=weights,
            lm_head_weights=head_w,
            embed_weights=embed_w,
        )

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (the matrices and the LM head; not the embedding table)."""
        return sum(op.nbytes() for layer in self.layers for op in layer.linears()) + self.lm_head.nbytes()

    def _rope_table(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.rope) == 1:
            return next(iter(self.rope.values()))
        key = self.layer_types[layer_index]
        return self.rope.get(key) or self.rope["full_attention"]

    @staticmethod
    def _mask(start: int, length: int, total: int, window: int | None, groups: int) -> torch.Tensor | None:
        """Additive fp32 ``[groups * length, total]``: 0 where the query at ``start + i`` sees key ``j``
        (``j <= start + i`` and ``j > start + i - window``), ``-inf`` elsewhere. ``None`` when every key
        is visible (decode, full attention). Built once per forward and window, in SDPA's own float
        form: a bool mask is converted to this by every attention call (two ``[G*L, S]`` temporaries
        per layer, 16 MB each for a 256-row chunk of a TinyLlama-shaped model at 2,048 tokens)."""
        if length == 1 and (window is None or total <= window):
            return None
        q = torch.arange(start, start + length)[:, None]
        k = torch.arange(total)[None, :]
        hidden = k > q
        if window is not None:
            hidden |= k <= q - window
        mask = torch.zeros(groups * length, total)
        return mask.masked_fill_(hidden.repeat(groups, 1), float("-inf"))

    def _embed(self, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """fp32 ``[B, L, H]``: the rows of ``ids: [B, L]`` (positions ``[start, end)``), scaled, plus the
        learned positions (GPT-2)."""
        if isinstance(self.embed, QuantizedWeight):
            h, table_dtype = embedding_rows(self.embed, ids), torch.float32
        else:
            h, table_dtype = F.embedding(ids, self.embed).float(), self.embed.dtype
        if self.spec.embed_scale != 1.0:  # HF rounds the scale to the table's dtype
            h = h * torch.tensor(self.spec.embed_scale, dtype=table_dtype).float()
        if self.positions is not None:
            h = h + self.positions[start:end]
        return h

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool) -> torch.Tensor:
        """Run positions ``[cache.length, cache.length + L)`` of ``ids: [B, L]``; returns fp32 logits
        ``[B, L, V]`` (``[B, 1, V]`` with ``last_only``) and advances the cache."""
        spec = self.spec
        b, n = ids.shape
        start = cache.length
        end = start + n
        h = self._embed(ids, start, end)
        heads, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        groups = heads // kv
        masks: dict[int | None, torch.Tensor | None] = {}
        attend = attention_op()
        for i, layer in enumerate(self.layers):
            w = layer.w
            a = _norm(h, w.attn_in_norm, spec)
            qkv = layer.qkv(a)
            q = qkv[..., : heads * d].reshape(b, n, heads, d).transpose(1, 2)
            k = qkv[..., heads * d : (heads + kv) * d].reshape(b, n, kv, d).transpose(1, 2)
            v = qkv[..., (heads + kv) * d :].reshape(b, n, kv, d).transpose(1, 2)
            if w.q_norm is not None:
                q, k = _norm(q, w.q_norm, spec), _norm(k, w.k_norm, spec)
            if spec.rotary_dim:
                cos, sin = self._rope_table(i)
                q = _rope(q, cos[start:end], sin[start:end])
                k = _rope(k, cos[start:end], sin[start:end])
            check_kv_range(cache, i, k, v)
            cache.data[i, 0, :, :, start:end] = k
            cache.data[i, 1, :, :, start:end] = v
            keys = cache.data[i, 0, :, :, :end]
            values = cache.data[i, 1, :, :, :end]
            if keys.dtype != torch.float32:
                keys, values = keys.float(), values.float()
            window = spec.sliding_windows[i]
            if window not in masks:
                masks[window] = self._mask(start, n, end, window, groups)
            # [B, heads, L, D] -> [B, kv, G*L, D]: the G query heads of a KV head as G*L rows.
            qg = q.reshape(b, kv, groups * n, d)
            o = attend(qg, keys, values, masks[window], spec.attn_scale, False)
            o = o.reshape(b, heads, n, d).transpose(1, 2).reshape(b, n, heads * d)
            o = layer.o(o)
            if w.attn_out_norm is not None:
                o = _norm(o, w.attn_out_norm, spec)
            h = h + o
            m = _norm(h, w.mlp_in_norm, spec)
            if spec.gated_mlp:
                # act(gate) * up written over the gate half of up's output: one [L, I] temporary
                # fewer (of two) per layer during prefill (benchmarks/llm_memory.py: peak RSS).
                gate, up = layer.up(m).chunk(2, dim=-1)
                m = _act(gate, spec.activation, inplace=True).mul_(up)
            else:
                m = _act(layer.up(m), spec.activation)
            m = layer.down(m)
            if w.mlp_out_norm is not None:
                m = _norm(m, w.mlp_out_norm, spec)
            h = h + m
        cache.length = end
        if last_only:
            h = h[:, -1:]
        logits = self.lm_head(_norm(h, self.final_norm, spec))
        if spec.final_logit_softcap is not None:
            cap = spec.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
