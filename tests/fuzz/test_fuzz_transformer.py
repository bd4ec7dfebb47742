"""Fuzz transformer blocks (#15): random small encoder blocks, nn.MultiheadAttention,
nn.TransformerEncoderLayer and hand-written attention in its spellings (gml.testing.blockgen).

fp32 property (check_block_fp32): no pass rolled back, within 1e-4 of eager on unseen inputs,
attention fused into one gml.attention op per layer (or declined with a reason), model untouched.
INT8 property (check_block_int8): the transformer scheme keeps cosine >= 0.995 vs fp32 on unseen
inputs, every GEMM INT8 or kept fp32 by the accuracy fallback, torch.nn blocks get the scheme by
default. CI: 12 + 8 blocks (~30 s on 2 busy cores); `make fuzz` (GML_FUZZ_EXAMPLES) runs more.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, target

from gml.testing.blockgen import BlockSpec, block_specs, check_block_fp32, check_block_int8
from gml.testing.fuzz import FuzzFailure
from gml.testing.strategies import fuzz_seed, fuzz_settings


@fuzz_seed
@fuzz_settings(12, share=0.1)
@given(spec=block_specs())
def test_fp32_transformer_blocks_match_eager(spec: BlockSpec) -> None:
    out = check_block_fp32(spec)
    event(f"{spec.kind}/{spec.attn}: {out['attention']} attention op(s)")
    target(out["rel_err"], label="fp32 error vs eager")


@fuzz_seed
@fuzz_settings(8, share=0.05)
@given(spec=block_specs())
def test_int8_transformer_blocks_keep_accuracy(spec: BlockSpec) -> None:
    out = check_block_int8(spec)
    event(f"{out['int8']}/{out['gemms']} GEMMs INT8")
    target(-out["cosine"], label="1 - INT8 cosine")


def test_the_block_property_catches_a_wrong_attention_scale(monkeypatch) -> None:
    """A FuseAttention that drops the scale (softmax(q·kᵀ)·v) must fail the fp32 property."""
    import gml.passes.attention as attention

    real = attention.attention_op()

    def unscaled(q, k, v, attn_mask=None, scale=None, is_causal=False):
        return real(q, k, v, attn_mask, 1.0, is_causal)

    monkeypatch.setattr(attention, "attention_op", lambda: unscaled)
    with pytest.raises(FuzzFailure, match=r"differs from eager|rolled back"):
        check_block_fp32(BlockSpec(kind="block", attn="div", d_model=16, heads=2, seq=6))
