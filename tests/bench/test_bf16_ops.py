"""benchmarks/bf16_ops.py: the per-op profiler reads oneDNN's verbose lines right (both formats),
counts multiply-adds per problem, and captures the engine's primitives, only the engine's, per call
(no timing assertions: the machine is shared)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from gml.runtime import native
from gml.runtime.plan_steps import describe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bf16_ops

V32 = (
    "onednn_verbose,exec,cpu,convolution,brgconv:avx512_core_bf16,forward_inference,src_bf16::blocked:acdb::f0 "
    "dst_bf16::blocked:acdb::f0,attr-scratchpad:user ,alg:convolution_direct,"
    "mb1_ic64oc64_ih56oh56kh3sh1dh0ph1_iw56ow56kw3sw1dw0pw1,0.998047"
)
V1 = (
    "onednn_verbose,v1,primitive,exec,cpu,matmul,brg:avx512_core_bf16,undef,src:bf16::blocked:ab::f0,"
    "attr-scratchpad:user,,128x384:384x1152,0.5"
)


def test_parse_reads_both_verbose_formats_per_call():
    text = "\n".join(["onednn_verbose,info,oneDNN v3.2.0", "@@call 0", V32, "noise", "@@call 1", V1, V32])
    calls = bf16_ops._parse_verbose(text)
    assert len(calls) == 2
    kind, impl, problem, us = calls[0][0]
    assert (kind, impl) == ("convolution", "brgconv:avx512_core_bf16")
    assert problem.startswith("mb1_ic64oc64") and us == pytest.approx(998.047)
    assert [c[0] for c in calls[1]] == ["matmul", "convolution"] and calls[1][0][3] == pytest.approx(500.0)


def test_macs_per_problem():
    assert (
        bf16_ops.macs("convolution", "mb1_ic64oc64_ih56oh56kh3sh1dh0ph1_iw56ow56kw3sw1dw0pw1") == 56 * 56 * 64 * 64 * 9
    )
    assert bf16_ops.macs("convolution", "mb2_g32ic32oc32_ih8oh8kh3sh1dh0ph1_iw8ow8kw3sw1dw0pw1") == 2 * 64 * 32 * 9
    assert bf16_ops.macs("inner_product", "mb128ic384oc1536") == 128 * 384 * 1536
    assert bf16_ops.macs("matmul", "1x12x128x32:1x12x32x128") == 12 * 128 * 32 * 128
    assert bf16_ops.macs("matmul", "128x1536:1536x384") == 128 * 1536 * 384
    assert bf16_ops.macs("softmax", "1x12x128x128") == 0
    assert bf16_ops.gml_category("matmul", "1x12x128x32:1x12x32x128").startswith("attention")
    assert bf16_ops.gml_category("matmul", "128x1536:1536x384") == "conv / GEMM"


@pytest.mark.skipif(native.unavailable_reason() is not None, reason=str(native.unavailable_reason()))
def test_engine_verbose_captures_each_calls_primitives_and_restores_stdout(capfd):
    eng = native.load()
    plan = eng.Plan()
    w, x, y = torch.randn(16, 8), torch.randn(4, 8), torch.empty(4, 16)
    src = plan.add_value([4, 8], [8, 1], "f32", 1, 0, 0)
    dst = plan.add_value([4, 16], [16, 1], "f32", 2, 0, 0)
    plan.add(describe(eng.InnerProductStep, src=src, dst=dst, weight=w.data_ptr(), wdims=[16, 8], w_scales=[1.0],
                      name="ip"))  # fmt: skip
    plan.finalize(0)
    calls = bf16_ops.EngineVerbose().calls(lambda: plan.run([x.data_ptr()], [y.data_ptr()], 1), 2)
    assert len(calls) == 2
    for call in calls:
        assert len(call) == 1
        kind, impl, problem, us = call[0]
        assert kind == "inner_product" and impl == plan.step_impls()[0] and problem == "mb4ic8oc16" and us >= 0
    torch.testing.assert_close(y, x @ w.T)
    print("after")  # stdout is the test's again, and verbose is off
    plan.run([x.data_ptr()], [y.data_ptr()], 1)
    out = capfd.readouterr().out
    assert "after" in out and "onednn_verbose" not in out
