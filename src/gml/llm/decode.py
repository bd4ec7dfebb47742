"""A batch-1 decode step of a :class:`~gml.llm.model.Decoder` with every buffer preallocated.

:meth:`Decoder.forward` is general (any batch, any number of positions) and pays for it in a decode
step: each layer runs ~60 torch ops on rows of a few hundred floats (norms, slicing, RoPE, reshapes),
and every matrix call reshapes, allocates and passes its arguments again — on Gemma-3-270M that was
about as long as the 18 layers' matrix kernels themselves (docs/llm.md, "Where a decode step goes").
:class:`DecodeStep` runs the same math for one token of one sequence:

* one row buffer per intermediate (``h``, the normed row, the fused QKV row, the attention output, the
  MLP rows, the logits), allocated once; each matrix is a call bound once to its input and output
  buffers (:meth:`LinearOp.bind`: the native kernel's arguments are a fixed tuple);
* the glue between the matrices in native calls (native/decode_attention.h): a norm; the residual add fused with
  the next norm (the sandwich norm of Gemma 3 first); the q/k norm + RoPE of the fused QKV row in place;
* attention as one native call per layer that also writes the new k / v rows (native/decode.h: an
  fp32, bf16 or fp16 cache read in place, each K / V row once for all the query heads of its KV head;
  on long contexts the positions split over the decode pool's threads, flash-decoding). A sliding
  window is a narrower range of positions instead of a mask: for the newest position the two are the
  same;
* the argmax of greedy decoding (:func:`gml.llm.sampling.next_token`) through numpy, 7x faster than
  ``torch.argmax`` over a 262k vocabulary.

What stays as torch ops: the embedding lookup, the activation (``act(gate) * up``). Equal to
``forward`` on the same token up to fp32 rounding (tests/llm/test_llm_decode.py). The logits it
returns are a buffer the next step overwrites.
"""

from __future__ import annotations

import torch

from gml.ir.attention import attention_op
from gml.kernels.woq import ATTENTION_TIERS, detect_kernel
from gml.llm.model import KV_NATIVE_TYPES, Decoder, KVCache, _act, check_kv_range, kv_overflow
from gml.llm.spec import Norm

_KINDS = {"rms": 0, "layer": 1}


def native_glue():
    """The engine module when it has the decode glue (native/decode_attention.h), else ``None``."""
    from gml.runtime.native import _load

    engine, _ = _load()
    return engine if engine is not None and hasattr(engine, "decode_residual_norm") else None


class DecodeStep:
    """``step(token_id)`` → logits ``[1, 1, V]`` of position ``cache.length``, advancing the cache. Built
    for one decoder, one batch-1 cache and the current torch thread count (:meth:`fits`)."""

    def __init__(self, decoder: Decoder, cache: KVCache, engine) -> None:
        spec = decoder.spec
        if cache.batch != 1:
            raise ValueError("DecodeStep runs batch 1")
        self.decoder, self.cache, self.data, self.engine = decoder, cache, cache.data, engine
        self.threads = torch.get_num_threads()
        self.kind = _KINDS[spec.norm]
        self.eps = float(spec.norm_eps)
        heads, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        hidden = spec.hidden_size
        self._keep: list[torch.Tensor] = []  # every tensor whose address a native call holds
        f32 = dict(dtype=torch.float32)
        self.h = torch.zeros(1, hidden, **f32)
        self.a = torch.zeros(1, hidden, **f32)  # the normed row every matrix after a norm reads
        self.qkv = torch.zeros(1, (heads + 2 * kv) * d, **f32)
        self.attn = torch.zeros(1, heads * d, **f32)
        self.out = torch.zeros(1, hidden, **f32)  # o and down write here (the residual's delta)
        up_out = decoder.layers[0].up.out_features
        self.mlp = torch.zeros(1, up_out, **f32)
        self.act = torch.zeros(1, up_out // 2 if spec.gated_mlp else up_out, **f32)
        self.logits = torch.zeros(1, spec.vocab_size, **f32)
        # views of the buffers the torch ops read
        self.q = self.qkv[:, : heads * d].view(1, kv, heads // kv, d)  # GQA: a KV head's G query heads as rows
        self.k = self.qkv[0, heads * d : (heads + kv) * d].view(kv, d)
        self.v = self.qkv[0, (heads + kv) * d :].view(kv, d)
        inter = self.act.shape[1]
        self.gate_up = (self.mlp[:, :inter], self.mlp[:, inter:]) if spec.gated_mlp else None
        self.layers = []
        for i, layer in enumerate(decoder.layers):
            w = layer.w
            cos, sin = decoder._rope_table(i) if spec.rotary_dim else (None, None)
            self.layers.append(
                dict(
                    qkv=layer.qkv.bind(self.a, self.qkv),
                    o=layer.o.bind(self.attn, self.out),
                    up=layer.up.bind(self.a, self.mlp),
                    down=layer.down.bind(self.act, self.out),
                    qk=(self._ptr(self._weight(w.q_norm)), self._ptr(self._weight(w.k_norm))),
                    rope=None if cos is None else (self._hold(cos), self._hold(sin)),
                    attn_out=self._norm_args(w.attn_out_norm),
                    mlp_in=self._norm_args(w.mlp_in_norm),
                    mlp_out=self._norm_args(w.mlp_out_norm),
                    attn_in=self._norm_args(w.attn_in_norm),
                    keys=cache.data[i, 0],  # [1, kv, max_length, d]
                    values=cache.data[i, 1],
                    kp=cache.data[i, 0].data_ptr(),
                    vp=cache.data[i, 1].data_ptr(),
                    window=spec.sliding_windows[i],
                )
            )
        self.final = self._norm_args(decoder.final_norm)
        self.lm_head = decoder.lm_head.bind(self.a, self.logits)
        self.attend = attention_op()
        # the native attention (any cache type of KV_NATIVE_TYPES) and its tier from GML's CPU description
        # (AVX-512, AVX2 or scalar); long contexts split their positions over the torch thread count
        self.kv_type = KV_NATIVE_TYPES.get(cache.data.dtype)
        self.native_attention = self.kv_type is not None and hasattr(engine, "decode_attention")
        self.attention_tier = ATTENTION_TIERS[detect_kernel()]

    # ------------------------------------------------------------------ build helpers
    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        t = t.float().contiguous()
        self._keep.append(t)
        return t

    def _ptr(self, t: torch.Tensor | None) -> int:
        return 0 if t is None else self._hold(t).data_ptr()

    def _weight(self, n: Norm | None) -> torch.Tensor | None:
        """The norm's weight as the native norm multiplies by it (Gemma: ``1 + w``)."""
        if n is None:
            return None
        return 1.0 + n.weight if self.decoder.spec.norm_plus_one and self.kind == 0 else n.weight

    def _norm_args(self, n: Norm | None) -> tuple[bool, int, int]:
        """``(present, weight address, bias address)``."""
        if n is None:
            return (False, 0, 0)
        return (True, self._ptr(self._weight(n)), self._ptr(n.bias))

    def fits(self, cache: KVCache) -> bool:
        """Whether this step still serves ``cache`` (the same buffer, the same torch thread count)."""
        return cache is self.cache and cache.data is self.data and torch.get_num_threads() == self.threads

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """``token: [1, 1]`` ids → logits ``[1, 1, V]`` (this object's buffer, overwritten next call)."""
        dec, spec, eng, cache = self.decoder, self.decoder.spec, self.engine, self.cache
        pos = cache.length
        end = pos + 1
        n, kind, eps = spec.hidden_size, self.kind, self.eps
        h, a, out = self.h, self.a, self.out
        hp, ap, outp = h.data_ptr(), a.data_ptr(), out.data_ptr()
        h.copy_(dec._embed(token, pos, end).view(1, n))
        heads, kv, d, r = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rotary_dim
        first = self.layers[0]["attn_in"]
        eng.decode_norm(hp, n, first[1], first[2], kind, eps, ap)
        qkvp = self.qkv.data_ptr()
        for i, lay in enumerate(self.layers):
            lay["qkv"]()
            qw, kw = lay["qk"]
            if lay["rope"] is not None or qw:
                cos, sin = lay["rope"] if lay["rope"] is not None else (None, None)
                cp = 0 if cos is None else cos.data_ptr() + pos * cos.stride(0) * 4
                sp = 0 if sin is None else sin.data_ptr() + pos * sin.stride(0) * 4
                eng.decode_qk_norm_rope(qkvp, heads, kv, d, qw, kw, kind, eps, r if cos is not None else 0, cp, sp)
            keys, values = lay["keys"], lay["values"]
            window = lay["window"]
            lo = end - window if window is not None and end > window else 0
            if self.native_attention:
                try:
                    eng.decode_attention(
                        qkvp, heads, kv, d, lay["kp"], lay["vp"], cache.max_length, lo, pos, spec.attn_scale,
                        self.kv_type, self.attention_tier, self.threads, self.attn.data_ptr(),
                    )  # fmt: skip
                except OverflowError:  # an fp16 cache and a k / v beyond 65504 (native/decode_attention.h)
                    raise kv_overflow(i) from None
            else:
                check_kv_range(cache, i, self.k, self.v)
                keys[0, :, pos].copy_(self.k)
                values[0, :, pos].copy_(self.v)
                k, v = keys[:, :, lo:end].float(), values[:, :, lo:end].float()
                o = self.attend(self.q, k, v, None, spec.attn_scale, False)
                self.attn.view_as(o).copy_(o)
            lay["o"]()
            has, dw, db = lay["attn_out"]
            _, w, b = lay["mlp_in"]
            eng.decode_residual_norm(hp, outp, n, has, dw, db, w, b, kind, eps, ap)
            lay["up"]()
            if self.gate_up is not None:
                gate, up = self.gate_up
                torch.mul(_act(gate, spec.activation), up, out=self.act)
            else:
                self.act.copy_(_act(self.mlp, spec.activation))
            lay["down"]()
            has, dw, db = lay["mlp_out"]
            _, w, b = self.layers[i + 1]["attn_in"] if i + 1 < len(self.layers) else self.final
            eng.decode_residual_norm(hp, outp, n, has, dw, db, w, b, kind, eps, ap)
        cache.length = end
        self.lm_head()
        logits = self.logits
        if spec.final_logit_softcap is not None:
            cap = spec.final_logit_softcap
            torch.mul(torch.tanh(logits / cap), cap, out=logits)
        return logits.view(1, 1, -1)
