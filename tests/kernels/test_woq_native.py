"""native/woq.h (gml._engine.woq_linear) against the op's Python reference and exact integer arithmetic,
on every kernel this CPU runs; the kernel choice follows the CPU description (ONEDNN_MAX_CPU_ISA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gml.ir.llm_ops import integer_weight, quantize_weight, woq_linear
from gml.ir.target import Target
from gml.kernels.woq import GEMM_MIN_ROWS, KERNEL_ISAS, detect_kernel, kernel_isa, native_kernel_runs, woq_linear_native

pytestmark = pytest.mark.skipif(detect_kernel() is None, reason="native engine without woq_linear")
ISAS = [isa for isa in KERNEL_ISAS if native_kernel_runs(isa)]
FORMATS = [(8, None, True), (4, 32, True), (4, 64, False), (4, 128, True)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_matches_reference(isa, bits, group, symmetric):
    torch.manual_seed(0)
    # N = 4k + 3 rows: the 4-row blocks and the row tail; K = 256 + 16 (int8): the 16-lane tail
    n, k = 39, 272 if bits == 8 else 256
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    x, b = torch.randn(5, k), torch.randn(n)
    torch.testing.assert_close(woq_linear_native(x, w, b, isa), woq_linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_prefill_gemm_matches_reference(isa, bits, group, symmetric):
    """Rows >= GEMM_MIN_ROWS: dequantized tiles (two whole 64-row tiles and a tail) into oneDNN's GEMM."""
    torch.manual_seed(2)
    n, k = 135, 264 if bits == 8 else 256
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    b = torch.randn(n)
    for m in (1, 3, 17, 130):
        x = torch.randn(m, k)
        ref = woq_linear(x, w, b)
        for min_rows in (1, GEMM_MIN_ROWS):  # forced GEMM, and the default switch
            got = woq_linear_native(x, w, b, isa, gemm_min_rows=min_rows)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "symmetric"), FORMATS)
def test_exact_integer_arithmetic(isa, bits, group, symmetric):
    torch.manual_seed(1)
    n, k = 13, 264 if bits == 8 else 384
    w = quantize_weight(torch.randn(n, k), bits, group, symmetric)
    w = w._replace(scales=torch.full_like(w.scales, 0.5))
    x = torch.randint(-30, 31, (2, k)).float()
    exact = (x.long() @ integer_weight(w.qweight, w.zeros, bits, w.group_size).long().t()).float() * 0.5
    assert torch.equal(woq_linear_native(x, w, None, isa), exact)
    assert torch.equal(woq_linear_native(x, w, None, isa, gemm_min_rows=1), exact)


def test_kernel_follows_the_cpu_description():
    assert kernel_isa(Target("avx512_core_amx")) == "avx512"
    assert kernel_isa(Target("avx512_core")) == "avx512"
    assert kernel_isa(Target("avx2_vnni")) == "avx2"
    assert kernel_isa(Target("sse41")) == "scalar"
    if "avx2" not in ISAS:
        pytest.skip("CPU without AVX2")
    code = "from gml.kernels.woq import detect_kernel; print(detect_kernel())"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"


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
