"""Random small transformer blocks for the fuzzer (#15): encoder blocks, ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer`` and hand-written attention in its common spellings.

A block is described by a :class:`BlockSpec` (its ``repr`` is paste-able Python); :func:`build_block`
makes the ``nn.Module`` (eval mode, weights from ``spec.seed``), :meth:`BlockSpec.example_inputs`
its inputs. Kinds:

* ``block`` — a pre- or post-norm encoder block written by hand: ``x + proj(attn(ln(x)))`` then
  ``x + mlp(ln(x))``; attention spelled as ``attn`` says: ``sdpa`` (``F.scaled_dot_product_attention``),
  ``div`` (``softmax(q @ kᵀ / c) @ v``), ``mul`` (``* c``), ``bmm`` (``torch.matmul``/``torch.bmm``
  on merged batch·heads), with Q/K/V as one ``Linear`` or three (``fused_qkv``); ``mask``: an additive
  padding mask ``[B, 1, 1, S]`` as a second input; ``causal``: an upper-triangle mask.
* ``nn_layer`` — ``nn.TransformerEncoderLayer`` (``norm_first``, ``act``).
* ``mha`` — ``nn.MultiheadAttention(need_weights=False)`` with a residual; ``mask``: a bool
  ``key_padding_mask`` input.

Every padded row keeps at least one key, so no softmax row is all ``-inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("block", "nn_layer", "mha")
ATTN_FORMS = ("sdpa", "div", "mul", "bmm")


@dataclass(frozen=True)
class BlockSpec:
    """One random transformer block (module docstring); ``repr`` is valid Python."""

    kind: str = "block"
    d_model: int = 16
    heads: int = 2
    ffn: int = 32
    layers: int = 1
    attn: str = "sdpa"
    fused_qkv: bool = True
    norm_first: bool = True
    act: str = "gelu"
    mask: bool = False
    causal: bool = False
    batch: int = 2
    seq: int = 7
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.attn not in ATTN_FORMS or self.d_model % self.heads:
            raise ValueError(f"invalid block spec {self!r}")

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """``x`` ``[B, S, D]`` N(0, 1), and the padding mask when ``spec.mask`` (row ``b`` keeps
        ``S - b`` keys, at least one)."""
        gen = torch.Generator().manual_seed(1000 * self.seed + seed)
        x = torch.randn(self.batch, self.seq, self.d_model, generator=gen)
        if not self.mask:
            return (x,)
        keep = torch.arange(self.seq)[None, :] < (self.seq - torch.arange(self.batch)).clamp_min(1)[:, None]
        if self.kind == "mha":
            return x, ~keep  # key_padding_mask: True = padding
        additive = torch.zeros(self.batch, 1, 1, self.seq).masked_fill(~keep[:, None, None, :], -1e4)
        return x, additive


class _Attention(nn.Module):
    def __init__(self, spec: BlockSpec) -> None:
        super().__init__()
        d = spec.d_model
        self.spec = spec
        self.dh = d // spec.heads
        if spec.fused_qkv:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.c = math.sqrt(self.dh)  # a constant: FuseAttention reads it as the scale
        if spec.causal:
            self.register_buffer("causal_mask", torch.full((spec.seq, spec.seq), -1e4).triu(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        h, dh = self.spec.heads, self.dh
        if self.spec.fused_qkv:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.view(b, s, h, dh).transpose(1, 2) for t in (q, k, v))
        bias = mask
        if self.spec.causal:
            bias = self.causal_mask if bias is None else bias + self.causal_mask
        form = self.spec.attn
        if form == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        elif form == "bmm":
            qf, kf, vf = (t.reshape(b * h, s, dh) for t in (q, k, v))
            scores = torch.bmm(qf, kf.transpose(1, 2)) * (1.0 / self.c)
            if bias is not None:
                scores = (scores.view(b, h, s, s) + bias).view(b * h, s, s)
            out = torch.matmul(scores.softmax(dim=-1), vf).view(b, h, s, dh)
        else:
            scores = q @ k.transpose(-2, -1)
            scores = scores / self.c if form == "div" else scores * (1.0 / self.c)
            if bias is not None:
                scores = scores + bias
            out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class _Block(nn.Module):
    def __init__(self, spec: BlockSpec) -> None:
        super().__init__()
        d = spec.d_model
        self.norm_first = spec.norm_first
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(spec)
        self.mlp = nn.Sequential(nn.Linear(d, spec.ffn), nn.GELU() if spec.act == "gelu" else nn.ReLU(),
                                 nn.Linear(spec.ffn, d))  # fmt: skip

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_first:
            x = x + self.attn(self.ln1(x), mask)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x, mask))
        return self.ln2(x + self.mlp(x))


class _Stack(nn.Module):
    """``spec.layers`` blocks (or torch.nn layers) in sequence; the mask, if any, is the second input."""

    def __init__(self, spec: BlockSpec) -> None:
        super().__init__()
        self.kind = spec.kind
        if spec.kind == "block":
            self.layers = nn.ModuleList(_Block(spec) for _ in range(spec.layers))
        elif spec.kind == "nn_layer":
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    spec.d_model,
                    spec.heads,
                    spec.ffn,
                    dropout=0.0,
                    activation=spec.act,
                    batch_first=True,
                    norm_first=spec.norm_first,
                )
                for _ in range(spec.layers)
            )
        else:
            self.layers = nn.ModuleList(
                nn.MultiheadAttention(spec.d_model, spec.heads, batch_first=True) for _ in range(spec.layers)
            )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            if self.kind == "block":
                x = layer(x, mask)
            elif self.kind == "nn_layer":
                x = layer(x)
            else:
                x = x + layer(x, x, x, key_padding_mask=mask, need_weights=False)[0]
        return x


def build_block(spec: BlockSpec) -> nn.Module:
    """The eval-mode module of ``spec``, weights drawn from ``spec.seed`` (N(0, 0.2²), LayerNorm
    affine near 1/0 so every path carries signal)."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = _Stack(spec)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.split(".")[-2].startswith("ln"):
                    p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.2)
    return model.eval()


def expected_attention(spec: BlockSpec) -> int:
    """How many ``gml.attention`` ops FuseAttention must make of the block: one per layer, except for
    the ``bmm`` spelling with a mask, which adds it on a ``view`` of the scores (declined, with the reason)."""
    return 0 if spec.attn == "bmm" and (spec.mask or spec.causal) and spec.kind == "block" else spec.layers


def block_specs() -> Any:
    """Hypothesis strategy drawing :class:`BlockSpec` s (small: d_model ≤ 32, seq ≤ 9, ≤ 2 layers);
    shrinks towards the first option of each field."""
    from hypothesis import strategies as st

    @st.composite
    def draw(data: Any) -> BlockSpec:
        kind = data(st.sampled_from(KINDS))
        heads = data(st.sampled_from((1, 2, 4)))
        return BlockSpec(
            kind=kind,
            d_model=heads * data(st.sampled_from((4, 8))),
            heads=heads,
            ffn=data(st.sampled_from((8, 16, 32))),
            layers=data(st.integers(1, 2)),
            attn=data(st.sampled_from(ATTN_FORMS)) if kind == "block" else "sdpa",
            fused_qkv=data(st.booleans()),
            norm_first=data(st.booleans()),
            act=data(st.sampled_from(("gelu", "relu"))),
            mask=data(st.booleans()) if kind != "nn_layer" else False,
            causal=data(st.booleans()) if kind == "block" else False,
            batch=data(st.integers(1, 3)),
            seq=data(st.integers(1, 9)),
            seed=data(st.integers(0, 2**16)),
        )

    return draw()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else (1.0 if float((a - b).abs().max()) == 0 else 0.0)


def check_block_fp32(spec: BlockSpec) -> dict[str, Any]:
    """``gml.optimize`` of the block: no pass rolled back; within ``FP32_RTOL`` of eager on inputs it
    never saw; FuseAttention makes :func:`expected_attention` ops (and says why where it declines);
    the caller's model untouched. Raises :class:`~gml.testing.fuzz.FuzzFailure`; returns numbers for
    hypothesis' ``target``."""
    from gml.api import optimize
    from gml.testing.fuzz import FP32_RTOL, FuzzFailure, rel_err

    model = build_block(spec)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    res = optimize(model, spec.example_inputs(0), n_check_inputs=1)
    rolled = [f"{r.name}: {r.error}" for r in res.report.rolled_back]
    if rolled:
        raise FuzzFailure(f"pass rolled back: {rolled}\n{spec!r}")
    worst = 0.0
    for seed in (1, 2):
        x = spec.example_inputs(seed)
        with torch.no_grad():
            err = rel_err([model(*x)], [res.module(*x)])
            # the native engine (LayerNorm, attention, GEMMs as oneDNN primitives), where attached
            err_engine = rel_err([model(*x)], [res.executable(*x)])
        worst = max(worst, err, err_engine)
        if err > FP32_RTOL:
            raise FuzzFailure(f"fp32 block differs from eager: {err:.3g} of the output magnitude\n{spec!r}")
        if err_engine > FP32_RTOL:
            raise FuzzFailure(f"the engine's fp32 block differs from eager: {err_engine:.3g}\n{res.runtime}\n{spec!r}")
    if res.engine is None:
        raise FuzzFailure(f"the engine did not take the fp32 block: {res.runtime}\n{spec!r}")
    in_torch = [n for n in res.runtime.torch_nodes if n.op in ("attention", "LayerNorm", "FusedLinear")]
    if in_torch:
        raise FuzzFailure(f"transformer ops left in torch: {[(n.name, n.reason) for n in in_torch]}\n{spec!r}")
    fused = res.report.record("fuse_attention")
    if fused.matches != expected_attention(spec):
        raise FuzzFailure(f"FuseAttention made {fused.matches} attention op(s), expected {expected_attention(spec)}: "
                          f"{[s.reason for s in fused.skips]}\n{spec!r}")  # fmt: skip
    if fused.matches < spec.layers and not fused.skips:
        raise FuzzFailure(f"FuseAttention declined without a reason\n{spec!r}")
    if any(not torch.equal(v, model.state_dict()[k]) for k, v in state.items()):
        raise FuzzFailure(f"the caller's model was modified\n{spec!r}")
    return {"rel_err": worst, "attention": fused.matches}


#: The transformer INT8 scheme's bar on a fuzzed block: output cosine vs fp32 on unseen inputs.
INT8_MIN_COSINE = 0.995


def check_block_int8(spec: BlockSpec) -> dict[str, Any]:
    """``gml.quantize(scheme="transformer")`` of the block: outputs keep shape and finiteness, cosine
    with fp32 ≥ :data:`INT8_MIN_COSINE` on unseen inputs; every GEMM is listed as INT8, or fp32 with
    the accuracy-fallback reason; one attention row per fused attention. Every block (torch.nn layers,
    SDPA and the hand-written spellings) must get the transformer scheme from ``scheme="auto"``."""
    from gml.api import choose_scheme, quantize
    from gml.testing.fuzz import FuzzFailure

    model = build_block(spec)
    if choose_scheme(model, inputs=spec.example_inputs(0))[0] != "transformer":
        raise FuzzFailure(f"scheme='auto' did not pick the transformer scheme\n{spec!r}")
    calib = [spec.example_inputs(s) for s in (3, 4, 5)]
    held = [spec.example_inputs(s) for s in (1, 2)]
    res = quantize(model, calib, example_inputs=spec.example_inputs(0), eval_data=held, per_layer=False,
                   scheme="transformer")  # fmt: skip
    worst = 1.0
    for x in held:
        with torch.no_grad():
            ref, got = model(*x), res.module(*x)
        if got.shape != ref.shape or not torch.isfinite(got).all():
            raise FuzzFailure(f"INT8 output {tuple(got.shape)} (finite: {bool(torch.isfinite(got).all())}) vs "
                              f"{tuple(ref.shape)}\n{spec!r}")  # fmt: skip
        worst = min(worst, _cosine(ref, got))
    if worst < INT8_MIN_COSINE:
        raise FuzzFailure(f"INT8 block cosine {worst:.5f} < {INT8_MIN_COSINE}\n{spec!r}\n{res.frontend.summary()}")
    gemms = [p for p in res.precisions if p.op.startswith("linear")]
    odd = [p for p in gemms if p.precision != "int8" and "accuracy fallback" not in p.why]
    if not gemms or odd:
        raise FuzzFailure(f"GEMMs neither INT8 nor kept by the fallback: {odd or 'none listed'}\n{spec!r}")
    attention_rows = sum(p.op.startswith("attention") for p in res.precisions)
    if attention_rows != expected_attention(spec):
        raise FuzzFailure(f"{attention_rows} attention rows in the precision table\n{spec!r}")
    return {"cosine": worst, "int8": sum(p.precision == "int8" for p in gemms), "gemms": len(gemms)}


__all__ = [
    "ATTN_FORMS",
    "INT8_MIN_COSINE",
    "KINDS",
    "BlockSpec",
    "block_specs",
    "build_block",
    "check_block_fp32",
    "check_block_int8",
    "expected_attention",
]
