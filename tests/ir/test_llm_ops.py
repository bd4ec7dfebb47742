"""torch.ops.gml.woq_linear: the weight format, exact integer arithmetic, the quantizer's error bound."""

from __future__ import annotations

import pytest
import torch

from gml.ir.llm_ops import (
    check_format,
    dequantize_weight,
    integer_weight,
    quantize_weight,
    unpack_int4,
    woq_linear,
    woq_linear_op,
)


def test_int4_packing_low_nibble_first():
    w = torch.tensor([[-8.0, 7.0, 0.0, 1.0] * 8])  # Q4_0 rule: the extreme -8 lands on -8, scale 1
    qw = quantize_weight(w, 4, 32)
    assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (1, 16)
    q = unpack_int4(qw.qweight)
    for i in range(4):  # value k of the row is nibble (k % 2) of byte k // 2
        byte = int(qw.qweight[0, i // 2])
        assert int(q[0, i]) == (byte >> (4 * (i % 2))) & 0xF
    assert integer_weight(qw.qweight, None, 4, 32)[0, :4].tolist() == [-8, 7, 0, 1]
    assert float(qw.scales[0, 0]) == 1.0


def test_int4_symmetric_rounds_ties_up_as_q4_0():
    # ggml's quantize_row_q4_0_ref: q = min(15, (int)(x / s + 8.5)) - 8, a tie goes up. Weights that
    # already lie on a 4-bit grid (a Q4_K GGUF requantized) are full of ties; rounding them to even
    # would merge neighbouring levels: here -1.5, -0.5, 0.5, 1.5, 2.5 must stay five distinct values.
    # The other 25 values are whole steps, so Q4_0's scale (1: the -8 on -8) beats m / 7.
    rest = [float(v) for v in [*range(-7, 8), *range(-7, 3)]]
    w = torch.tensor([[-8.0, -1.5, -0.5, 0.5, 1.5, 2.5, 6.5, *rest]])
    qw = quantize_weight(w, 4, 32)
    assert float(qw.scales[0, 0]) == 1.0
    q = integer_weight(qw.qweight, None, 4, 32)[0, :7].tolist()
    assert q == [-8, -1, 0, 1, 2, 3, 7]  # ties to even would give [-8, -2, 0, 0, 2, 2, 6]


def test_int4_symmetric_takes_the_scale_with_the_smaller_error():
    # A group whose positive side reaches past 7/8 of the extreme -1: Q4_0's s = 1/8 clips 0.99 to
    # 7/8; s = -1/7 puts -1 on +7 and 0.99 near -7, so it is taken, and every group's squared error is
    # at most Q4_0's alone.
    w = torch.tensor([[-1.0, 0.99] + [0.0] * 30, [-1.0, 0.5] + [0.25] * 30])
    qw = quantize_weight(w, 4, 32)
    assert torch.allclose(qw.scales[:, 0], torch.tensor([-1 / 7, 1 / 8]))
    err = (dequantize_weight(*qw) - w).square().sum(-1)
    q4_0 = (torch.floor(w * 8 + 8.5).clamp(0, 15) - 8) / 8  # Q4_0 at s = 1/8 (the -1 on -8)
    assert (err <= (q4_0 - w).square().sum(-1)).all()


@pytest.mark.parametrize(
    ("bits", "group", "symmetric"),
    [(8, None, True), (8, 32, True), (8, 128, True), (4, 32, True), (4, 64, False), (4, 128, True)],
)
def test_woq_linear_is_exact_integer_arithmetic(bits, group, symmetric):
    # Integer activations and power-of-two scales (one of two per group, so a scale applied to the wrong
    # group shows): every product and partial sum is an exact fp32 multiple of 1/4, so the op must equal
    # the int64 dot products of each group, scaled, exactly.
    torch.manual_seed(0)
    n, k = 24, 256
    qw = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    scales = torch.where(torch.rand(qw.scales.shape) < 0.5, 0.25, 0.5)
    x = torch.randint(-20, 21, (3, k)).float()
    g = qw.group_size
    wi = integer_weight(qw.qweight, qw.zeros, bits, g).long().reshape(n, k // g, g)
    exact = (torch.einsum("mgk,ngk->mng", x.long().reshape(3, k // g, g), wi).double() * scales.double()).sum(-1)
    got = woq_linear_op()(x, qw.qweight, scales, qw.zeros, None, bits, qw.group_size)
    exact = exact.float()
    assert torch.equal(got, exact)


@pytest.mark.parametrize(
    ("bits", "group", "symmetric"), [(8, None, True), (8, 32, True), (8, 64, True), (4, 32, True), (4, 32, False)]
)
def test_quantization_error_is_half_a_step(bits, group, symmetric):
    torch.manual_seed(1)
    w = torch.randn(16, 128) * 0.1
    qw = quantize_weight(w, bits, group, symmetric)
    step = qw.scales.abs().repeat_interleave(qw.group_size, dim=1)
    err = (dequantize_weight(*qw) - w).abs()
    if bits == 4 and symmetric:
        # the group's extreme lands exactly on -8 steps (Q4_0's scale) or +7 (m / 7); with Q4_0's a
        # value of the other sign beyond +7 steps clips to +7 (an error under one step), every other
        # value rounds
        signed = w.reshape(16, -1, group) / qw.scales[..., None]
        clipped = (signed > 7.5).reshape(16, -1)
        assert (err[~clipped] <= step[~clipped] / 2 + 1e-7).all()
        assert (err[clipped] <= step[clipped] + 1e-7).all()
        extreme = w.reshape(16, -1, group).abs().argmax(-1, keepdim=True)
        deq = dequantize_weight(*qw).reshape(16, -1, group)
        torch.testing.assert_close(deq.gather(-1, extreme), w.reshape(16, -1, group).gather(-1, extreme))
        return
    assert (err <= step / 2 + 1e-7).all()


def test_woq_linear_matches_dequantized_linear_with_bias():
    torch.manual_seed(2)
    qw = quantize_weight(torch.randn(40, 64), 4, 32, symmetric=False)
    x, b = torch.randn(2, 5, 64), torch.randn(40)
    ref = torch.nn.functional.linear(x, dequantize_weight(*qw), b)
    torch.testing.assert_close(woq_linear(x, qw, b), ref)


def test_format_reasons():
    assert check_format(4, 48, 96) == "4-bit group_size 48 is not one of (32, 64, 128)"
    assert check_format(8, 48, 96) == (
        "8-bit group_size 48 is not one of (32, 64, 128) or in_features = 96 (per output channel)"
    )
    assert check_format(8, 32, 64) is None and check_format(8, 100, 100) is None  # Q8_0's group; per channel
    assert "does not divide" in check_format(8, 64, 96)
    assert "does not divide" in check_format(4, 64, 96)
    assert check_format(3, 32, 64).startswith("bits=3")
    with pytest.raises(ValueError, match="symmetric"):
        quantize_weight(torch.randn(4, 32), 8, symmetric=False)
