"""``gml::qlinear(..., backend="gml")``: 8-bit weights on GML's exact AVX2 GEMM (ADR 011, 2026-11-29).

Three claims, each against something independent of the kernel under test:

* the Python kernel (gml.kernels.exact_int8) is exact integer arithmetic followed by its documented
  fp32 epilogue (checked against int64 sums computed here);
* the engine step (native/qlinear_exact.h) is bit-identical to the Python kernel, uint8 and fp32
  outputs, ReLU, tails of K and N, hostile operands that saturate ``vpmaddubsw`` under oneDNN's u8
  shift, 7-bit weights (the GEMM's u8 path) and 8-bit ones (its sign path);
* the step runs on any CPU with AVX2, whatever its ISA tier (the plan is built for an AVX2 target).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.ir.checks import check_call
from gml.ir.library import op
from gml.ir.target import Target
from gml.kernels import exact_int8
from gml.kernels.int8_ops import register
from gml.runtime import unavailable_reason
from runtime.helpers import run_both

AVX2 = Target("avx2")


def qlinear_graph(
    w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None, *, x_qp=(0.02, 3), out_qp=(0.5, 7),
    out_dtype=torch.uint8, post_op="none",
) -> fx.GraphModule:  # fmt: skip
    register()
    root = nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    consts = []
    for name, t in (("weight", w), ("weight_scale", ws), ("bias", bias)):
        if t is None:
            consts.append(None)
        else:
            root.register_buffer(name, t)
            consts.append(g.get_attr(name))
    out = out_qp if out_dtype == torch.uint8 else (1.0, 0)
    g.output(g.call_function(op("qlinear"), (x, *x_qp, *consts, *out, out_dtype, post_op, [], "", "gml")))
    return fx.GraphModule(root, g)


def operands(m: int, k: int, n: int, seed: int = 0, qmax: int = 127):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    w = torch.randint(-qmax, qmax + 1, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    ws = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(n, generator=gen)
    return x, w, ws, bias


def int64_reference(x, x_qp, w, ws, bias, relu: bool) -> torch.Tensor:
    """The layer in exact integer sums (int64) and float64 scaling: what the kernel approximates
    only by its fp32 epilogue roundings."""
    acc = (x.to(torch.int64) - x_qp[1]) @ w.to(torch.int64).t()
    y = acc.double() * (x_qp[0] * ws.double()) + bias.double()
    return y.clamp_min(0) if relu else y


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_python_kernel_is_exact_integer_arithmetic(post_op, native):
    """Both formulations of the Python kernel: exact fp32 chunks (torch), and the engine's layer code
    (native, where the engine is built and the CPU has AVX2; else it falls back to the torch one)."""
    x, w, ws, bias = operands(37, 515, 19)
    got = exact_int8.qlinear(x, 0.02, 3, w, ws, bias, 1.0, 0, torch.float32, post_op, native=native)
    ref = int64_reference(x, (0.02, 3), w, ws, bias, post_op == "relu")
    # only the epilogue's fp32 roundings: float(acc), the scale product and the bias add
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_python_kernel_quantizes_its_output_as_documented(native):
    x, w, ws, bias = operands(8, 64, 40, seed=3)
    y = exact_int8.qlinear(x, 0.02, 3, w, ws, bias, 1.0, 0, torch.float32, "none", native=native)
    q = exact_int8.qlinear(x, 0.02, 3, w, ws, bias, 0.05, 9, torch.uint8, "none", native=native)
    inv = exact_int8.out_inverse(0.05)
    assert torch.equal(q, torch.round(y * inv).add(9).clamp(0, 255).to(torch.uint8))


def test_python_kernel_refuses_minus_128_and_other_post_ops():
    x, w, ws, bias = operands(2, 8, 4)
    w[0, 0] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        exact_int8.qlinear(x, 0.02, 3, w, ws, bias, 1.0, 0, torch.float32, "none")
    w[0, 0] = 0
    with pytest.raises(ValueError, match="post_op 'gelu'"):
        exact_int8.qlinear(x, 0.02, 3, w, ws, bias, 1.0, 0, torch.float32, "gelu")


def test_saved_calls_with_backend_gml_are_checked():
    assert check_call("qlinear", {"backend": "gml", "post_op": "relu"}) is None
    assert "none or relu only" in check_call("qlinear", {"backend": "gml", "post_op": "gelu"})
    assert "none or relu only" in check_call("qconv", {"backend": "gml", "post_op": "none"})


needs_engine = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def step_impls(eng: nn.Module) -> list[str]:
    from gml.runtime.compile import EngineSegment

    (seg,) = [m for m in eng.modules() if isinstance(m, EngineSegment)]
    (entry,) = seg._plans.values()
    return list(entry[0].step_impls())


def torch_formulation(gm: fx.GraphModule, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The graph on the Python kernel's torch formulation (exact fp32 chunks, no native code)."""
    from gml.kernels import int8_ops

    with monkeypatch.context() as mp:
        mp.setattr(exact_int8, "_native_layer", lambda *a: None)
        int8_ops.clear_packs()
        try:
            with torch.no_grad():
                return gm(x.clone())
        finally:
            int8_ops.clear_packs()


def check_bit_identical(gm: fx.GraphModule, x: torch.Tensor, monkeypatch=None) -> None:
    """The engine against the Python executor (which runs the engine's layer code where it can) and,
    given ``monkeypatch``, against the torch formulation too: the same bits all three."""
    ref, eng, got = run_both(gm, x, target=AVX2)
    if monkeypatch is not None:
        alt = torch_formulation(gm, x, monkeypatch)
        assert alt.dtype == got.dtype and torch.equal(alt, got), float((alt.float() - got.float()).abs().max())
    assert eng.report.path == "engine", str(eng.report)
    impls = step_impls(eng)
    seven_bit = int(gm.weight.abs().max()) <= 64  # the GEMM's u8 path, else its sign path
    want = "gml:int8_gemm_avx2_u8s7" if seven_bit else "gml:int8_gemm_avx2"
    assert want in impls, impls
    assert got.dtype == ref.dtype and torch.equal(got, ref), (
        f"max |diff| {float((got.float() - ref.float()).abs().max())}"
    )


@needs_engine
@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.float32], ids=["u8", "f32"])
@pytest.mark.parametrize("post_op", ["none", "relu"])
@pytest.mark.parametrize("m,k,n", [(1, 512, 256), (5, 33, 17), (64, 515, 19), (3, 1, 1), (130, 128, 1000)])
def test_engine_is_bit_identical_to_the_python_kernel(m, k, n, post_op, out_dtype, monkeypatch):
    x, w, ws, bias = operands(m, k, n, seed=m + k + n)
    gm = qlinear_graph(w, ws, bias, out_dtype=out_dtype, post_op=post_op, out_qp=(0.05, 128))
    check_bit_identical(gm, x, monkeypatch)


@needs_engine
def test_hostile_operands_are_exact(monkeypatch):
    """Every pair ``x_i w_i + x_j w_j`` at the largest magnitude: x in {0, 255} (so x − 128 is −128 or
    127) against w = ±127 with matching signs. Under oneDNN's u8 shift these saturate int16; here each
    pair is at most 2·128·127 = 32,512."""
    k, n = 256, 16
    gen = torch.Generator().manual_seed(7)
    sign = torch.where(torch.rand(n, k, generator=gen) < 0.5, -1, 1)
    w = (sign * 127).to(torch.int8)
    x = torch.where(sign[:4] > 0, 255, 0).to(torch.uint8)  # x − 128 has w's sign: every product positive
    ws, bias = torch.full((n,), 1e-3), torch.zeros(n)
    gm = qlinear_graph(w, ws, bias, x_qp=(1.0, 128), out_dtype=torch.float32)
    ref, _, got = run_both(gm, x, target=AVX2)
    exact = int64_reference(x, (1.0, 128), w, ws, bias, False)
    assert torch.equal(got, ref) and torch.equal(got, torch_formulation(gm, x, monkeypatch))
    assert torch.allclose(got.double(), exact, rtol=1e-6), float((got.double() - exact).abs().max())


@needs_engine
def test_seven_bit_weights_take_the_u8_path_and_agree(monkeypatch):
    x, w, ws, bias = operands(9, 200, 40, qmax=64)
    check_bit_identical(qlinear_graph(w, ws, bias), x, monkeypatch)


@needs_engine
def test_rank3_input_and_no_bias(monkeypatch):
    x, w, ws, _ = operands(12, 48, 24, seed=11)
    gm = qlinear_graph(w, ws, None)
    check_bit_identical(gm, x.reshape(3, 4, 48), monkeypatch)


def test_the_op_kernel_prepares_a_weight_once():
    """The registered kernel caches the packed layer per weight and input qparams (int8_ops._packed):
    a second call does not pack again, a written weight does."""
    from gml.kernels import int8_ops

    x, w, ws, bias = operands(2, 64, 16)
    calls = []
    real = exact_int8.prepare

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    register()
    int8_ops.clear_packs()
    try:
        exact_int8.prepare = counting  # the kernel looks it up at call time
        args = (x, 0.02, 3, w, ws, bias, 0.5, 7, torch.uint8, "none", [], "", "gml")
        first = op("qlinear")(*args)
        assert torch.equal(op("qlinear")(*args), first) and len(calls) == 1
        w.add_(0)  # a write bumps the version: prepared again
        op("qlinear")(*args)
        assert len(calls) == 2
    finally:
        exact_int8.prepare = real
        int8_ops.clear_packs()


@needs_engine
@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.float32], ids=["u8", "f32"])
def test_an_empty_batch_gives_an_empty_result(out_dtype):
    """0 rows: the step asks for 0 scratch bytes and still runs (it used to look up an unbound
    scratchpad: ``unordered_map::at``, found with the whole suite under a CPUID mask to AVX2)."""
    x, w, ws, bias = operands(0, 64, 8)
    ref, eng, got = run_both(qlinear_graph(w, ws, bias, out_dtype=out_dtype), x, target=AVX2)
    assert eng.report.path == "engine", str(eng.report)
    assert got.shape == ref.shape == (0, 8) and got.dtype == out_dtype
