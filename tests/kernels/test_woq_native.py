"""native/woq*.h (gml._engine.woq_linear / woq_gemm) against the op's Python reference and exact integer
arithmetic, on every kernel this CPU runs, with fp32 and int8 activations; the kernel choice follows the
CPU description (ONEDNN_MAX_CPU_ISA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gml.ir.llm_ops import ACT_BLOCK, integer_weight, quantize_activations, quantize_weight, woq_linear
from gml.ir.target import Target
from gml.kernels.woq import GEMM_MIN_ROWS, KERNEL_ISAS, detect_kernel, kernel_isa, native_kernel_runs, woq_linear_native

pytestmark = pytest.mark.skipif(detect_kernel() is None, reason="native engine without woq_linear")
ISAS = [isa for isa in KERNEL_ISAS if native_kernel_runs(isa)]
# INT8 per output channel (group None: K, any K) and in groups of 32 (llama.cpp's Q8_0) / 64 / 128
FORMATS = [(8, None, True), (8, 32, True), (8, 64, True), (8, 128, True), (4, 32, True), (4, 64, False), (4, 128, True)]


def pow2_scales(w, choices=(0.25, 0.5, 1.0), seed=0):
    """``w`` with a power-of-two scale per group, drawn from ``choices`` (a different one per group, so a
    kernel that applied another group's scale would be caught), keeping every partial sum exact."""
    pick = torch.randint(0, len(choices), w.scales.shape, generator=torch.Generator().manual_seed(seed))
    return w._replace(scales=torch.tensor(choices)[pick])


def exact_grouped(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ W^T`` in int64 per group, scaled per group in float64 (exact for the tests' ranges)."""
    wi = integer_weight(w.qweight, w.zeros, w.bits, w.group_size).long()
    n, k = wi.shape
    g = w.group_size
    per_group = torch.einsum("mgk,ngk->mng", x.long().reshape(-1, k // g, g), wi.reshape(n, k // g, g))
    return (per_group.double() * w.scales.double()[None]).sum(-1).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_matches_reference(isa, bits, group, symmetric):
    torch.manual_seed(0)
    # N = 4k + 3 rows: the 4-row blocks and the row tail; K = 256 + 16 (int8 per channel): the 16-lane tail
    n, k = 39, 272 if group is None else 256
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    x, b = torch.randn(5, k), torch.randn(n)
    got = woq_linear_native(x, w, b, isa, gemm_min_rows=sys.maxsize)  # the GEMV kernel on 5 rows
    torch.testing.assert_close(got, woq_linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_prefill_gemm_matches_reference(isa, bits, group, symmetric):
    """Rows >= GEMM_MIN_ROWS: dequantized tiles (two whole 128-row tiles and a tail) into oneDNN's GEMM."""
    torch.manual_seed(2)
    n, k = 263, 264 if group is None else 256
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    b = torch.randn(n)
    for m in (1, 3, 17, 130):
        x = torch.randn(m, k)
        ref = woq_linear(x, w, b)
        for min_rows in (1, GEMM_MIN_ROWS, 4):  # forced GEMM, the default switch, GEMV up to 3 rows
            got = woq_linear_native(x, w, b, isa, gemm_min_rows=min_rows)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_exact_integer_arithmetic(isa, bits, group, symmetric):
    torch.manual_seed(1)
    n, k = 13, 264 if group is None else 384
    w = pow2_scales(quantize_weight(torch.randn(n, k), bits, group, symmetric))
    x = torch.randint(-30, 31, (2, k)).float()
    exact = exact_grouped(x, w)  # |partial sums| <= 384 * 30 * 128 in steps of 1/4: < 2^24 steps, exact
    assert torch.equal(woq_linear_native(x, w, None, isa, gemm_min_rows=sys.maxsize), exact)
    assert torch.equal(woq_linear_native(x, w, None, isa, gemm_min_rows=1), exact)


# ---------------------------------------------------------------- int8 activations (act_bits=8)
def exact_act8(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    """The act_bits=8 math in int64 / float64 (independent of the op's reference kernel)."""
    m, k = x.shape
    qx, sx = quantize_activations(x)
    nb = sx.shape[1]
    wi = torch.nn.functional.pad(integer_weight(w.qweight, w.zeros, w.bits, w.group_size), (0, nb * ACT_BLOCK - k))
    isum = torch.einsum("mbk,nbk->mnb", qx.long().reshape(m, nb, ACT_BLOCK), wi.long().reshape(-1, nb, ACT_BLOCK))
    sw = w.scales[:, torch.arange(nb) * ACT_BLOCK // w.group_size].double()
    y = (isum.double() * sx.double()[:, None, :] * sw[None]).sum(-1)
    return y if bias is None else y + bias.double()


def test_quantize_activations_is_q8_0():
    x = torch.tensor([[0.0] * 31 + [0.0] + [1.0, -2.0, 0.5, 127.0 / 254] + [0.0] * 30])  # K = 66: 3 blocks
    qx, sx = quantize_activations(x)
    assert qx.shape == (1, 96) and sx.tolist()[0][0] == 0.0 and sx[0, 1] == 2.0 / 127
    assert qx[0, 32:36].tolist() == [64, -127, 32, 32]  # 63.5 and 31.75 -> ties / nearest
    assert not qx[0, :32].any() and not qx[0, 66:].any()


@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_act8_reference_is_the_exact_math(bits, group, symmetric):
    torch.manual_seed(3)
    n, k = 7, 272 if group is None else 256
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    x, b = torch.randn(3, k), torch.randn(n)
    torch.testing.assert_close(woq_linear(x, w, b, act_bits=8).double(), exact_act8(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_act8_matches_reference(isa, bits, group, symmetric):
    torch.manual_seed(4)
    # N = 4k + 3 (row blocks + tail); K: int8 per channel 1056 + 16 (a partial block past the 64-wide
    # VNNI steps), groups of 32: 32 * 33 (a block past the 64-wide steps)
    n, k = 39, 1072 if group is None else 1056 if group == 32 else 1024
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    b = torch.randn(n)
    for m in (1, 3):
        x = torch.randn(m, k)
        ref = woq_linear(x, w, b, act_bits=8)
        got = woq_linear_native(x, w, b, isa, act_bits=8)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # int8 activations change the result (the test would pass vacuously otherwise)
    assert not torch.allclose(ref, woq_linear(x, w, b), rtol=1e-4, atol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_act8_exact_integer_arithmetic_at_the_extremes(isa, bits, group, symmetric):
    """Every block of x holds a +-127 (s_x = 1, qx = x), weights at their extremes (INT8 includes -128,
    which the quantizer never makes: the sign trick must not wrap it) and the worst u8 x s8 pairs for
    an int16 step: equal to the int64 dot product times the power-of-two scale, bit for bit."""
    torch.manual_seed(5)
    n, k = 13, 264 if group is None else 384
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    if bits == 8:
        extremes = torch.tensor([-128, 127, -127], dtype=torch.int8)
        w = w._replace(qweight=extremes[torch.randint(0, 3, (n, k))])
    else:
        nibbles = torch.tensor([0x00, 0xFF, 0x0F, 0xF0], dtype=torch.uint8)  # 0 and 15 on both halves
        w = w._replace(qweight=nibbles[torch.randint(0, 4, (n, k // 2))])
    # a power-of-two scale per group out of two: |partial sums| <= 384 * 127 * 128 * 0.5 in steps of
    # 1/4, fewer than 2^24 steps: every fp32 sum exact
    w = pow2_scales(w, (0.25, 0.5), seed=5)
    x = torch.randint(-127, 128, (3, k)).float()
    x[:, ::ACT_BLOCK] = 127.0  # amax 127 in every block: s_x = 1
    x[1] = torch.where(torch.rand(k) < 0.5, 127.0, -127.0)  # every pair at the int16 bound
    exact = exact_grouped(x, w)
    assert torch.equal(woq_linear_native(x, w, None, isa, act_bits=8), exact)
    assert torch.equal(woq_linear(x, w, None, act_bits=8), exact)


def test_kernel_follows_the_cpu_description():
    assert kernel_isa(Target("avx512_core_amx")) == "vnni"
    assert kernel_isa(Target("avx512_core_vnni")) == "vnni"
    assert kernel_isa(Target("avx512_core")) == "avx512"
    assert kernel_isa(Target("avx2_vnni")) == "avxvnni"
    assert kernel_isa(Target("avx2")) == "avx2"
    assert kernel_isa(Target("sse41")) == "scalar"
    if "avx2" not in ISAS:
        pytest.skip("CPU without AVX2")
    code = "from gml.kernels.woq import detect_kernel; print(detect_kernel())"
    caps = {"AVX2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "vnni"}
    for cap, kernel in caps.items():
        if kernel not in ISAS:
            continue
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA=cap)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == kernel, cap


def test_llm_native_equals_reference():
    import gml
    from assets.llm_models import tiny

    model = tiny("llama")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = gml.llm(model, weights="int4", max_length=16, kernel="reference").logits(ids)
    for isa in ISAS:
        got = gml.llm(model, weights="int4", max_length=16, kernel=isa).logits(ids)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
        assert all(
            op.kernel == isa
            for layer in gml.llm(model, weights="int8", kernel=isa).decoder.layers
            for op in layer.linears()
        )


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_llm_int8_activations(monkeypatch, weights):
    """activations="int8": in a generation on every native kernel, each matrix call equals the op's
    reference on the same input — act_bits=8 for decode steps (one row), 0 for the prefill (GEMM).
    (Logits of whole runs are not compared: rounding x to int8 is discontinuous, so an fp32-rounding
    difference upstream may flip one qx and move later logits by ~1e-3.)"""
    import gml
    from assets.llm_models import tiny
    from gml.llm.model import LinearOp

    seen = set()
    call = LinearOp.__call__

    def checked(op, x):
        y = call(op, x)
        act_bits = op.act_bits_for(x.numel() // x.shape[-1])
        ref = woq_linear(x, op.qweight, op.bias, act_bits)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        seen.add(act_bits)
        return y

    monkeypatch.setattr(LinearOp, "__call__", checked)
    model = tiny("llama")
    for isa in ISAS:
        gml.llm(model, weights=weights, activations="int8", max_length=16, kernel=isa).generate([3, 1, 4, 1, 5, 9], 4)
    assert seen == {0, 8}
    with pytest.raises(gml.GMLError, match="activations='int4' is not one of"):
        gml.llm(model, weights=weights, activations="int4")


def test_saved_llm_takes_int8_activations_at_load(tmp_path):
    """``activations`` is a run-time choice, not stored: a saved INT4 model loaded with
    activations="int8" generates what the in-memory one with the same option does; loaded with
    "fp32" it has fp32 activations (without the option: INT4's default, int8)."""
    import gml
    from assets.llm_models import tiny

    lm = gml.llm(tiny("qwen2"), weights="int4", activations="int8", max_length=24)
    path = lm.save(tmp_path / "m.gml")
    back = gml.llm(path, activations="int8")
    assert all(op.act_bits == 8 for layer in back.decoder.layers for op in layer.linears())
    assert back.generate([5, 17, 3, 99], 8) == lm.generate([5, 17, 3, 99], 8)
    assert all(op.act_bits == 0 for layer in gml.llm(path, activations="fp32").decoder.layers for op in layer.linears())
    assert all(op.act_bits == 8 for layer in gml.llm(path).decoder.layers for op in layer.linears())


_CAPPED = """
import sys, torch
from gml.ir.llm_ops import quantize_weight, woq_linear
from gml.kernels.woq import detect_kernel, woq_linear_native
isa = detect_kernel()
torch.manual_seed(0)
worst = 0.0
for group in (32, 128, None):  # INT8 in groups (the LLM default) and per output channel
    w = quantize_weight(torch.randn(39, 1024), 8, group)
    b = torch.randn(39)
    for m, act_bits, min_rows in ((1, 0, 2), (3, 0, sys.maxsize), (5, 0, 2), (1, 8, 2), (3, 8, 2)):
        x = torch.randn(m, 1024)
        ref = woq_linear(x, w, b, act_bits=act_bits)
        got = woq_linear_native(x, w, b, isa, act_bits=act_bits, gemm_min_rows=min_rows)
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
print(isa, worst)
"""


@pytest.mark.parametrize(("cap", "kernel"), [("AVX2", "avx2"), ("AVX512_CORE", "avx512")])
def test_grouped_int8_under_an_isa_cap(cap, kernel):
    """Under ONEDNN_MAX_CPU_ISA (a fresh process: oneDNN reads it once) the kernel GML picks runs INT8 in
    groups and per channel — GEMV, GEMM, int8 activations — equal to the reference."""
    if kernel not in ISAS:
        pytest.skip(f"CPU without the {kernel} kernel")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=cap)
    out = subprocess.run([sys.executable, "-c", _CAPPED], env=env, capture_output=True, text=True, check=True)
    isa, worst = out.stdout.split()
    assert isa == kernel and float(worst) <= 1e-5, out.stdout


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("bits", "group", "symmetric"),
    [(8, None, True), (8, 32, True), (8, 64, True), (4, 32, True), (4, 32, False), (4, 64, False)],
)
def test_act8_short_rows_exact(isa, bits, group, symmetric):
    """The LM head's shape class (K = 640: 10 steps of 64, groups of 32 in a window of 16 blocks and a
    partial one of 4) over several 8-row blocks and a row tail, weights at their extremes: bit-exact."""
    torch.manual_seed(6)
    n, k = 8 * 5 + 3, 640
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    if bits == 8:
        w = w._replace(qweight=torch.tensor([-128, 127, -127, 0, 1], dtype=torch.int8)[torch.randint(0, 5, (n, k))])
    else:
        w = w._replace(
            qweight=torch.tensor([0x00, 0xFF, 0x0F, 0xF0, 0x87], dtype=torch.uint8)[torch.randint(0, 5, (n, k // 2))]
        )
    w = pow2_scales(w, (0.25, 0.5), seed=6)
    x = torch.randint(-127, 128, (1, k)).float()
    x[:, ::ACT_BLOCK] = -127.0  # s_x = 1 in every block
    assert torch.equal(woq_linear_native(x, w, None, isa, act_bits=8), exact_grouped(x, w))
