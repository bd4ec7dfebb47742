"""``gml::dynamic_linear`` in the native engine against its Python kernel, op by op (ADR 008).

The bound: both quantize every row to the same int8 values and accumulate the same int32 sums (the
row quantization is the same fp32 arithmetic), then apply the same fp32 operations in the same
order, ``((acc * (s_w / 127)) * amax) + bias``; only the post-op differs (oneDNN's GELU vs
``F.gelu``, a few ulps). So without a GELU the outputs are expected bit-identical, and with one
within 1e-6 of the output's magnitude (the test allows 4 fp32 ulps of each output plus that).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.ir.library import op
from gml.ir.target import Target
from gml.kernels import dynamic_int8
from gml.kernels.int8_ops import register
from gml.quant.transformer import DynamicQuantLinear
from gml.runtime import unavailable_reason
from gml.runtime.plan import exact_int8_gemm
from runtime.helpers import run_both

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's s8 x s8 matmul computes exact int32 sums on this CPU: with VNNI / AMX.
    Without (AVX2, AVX-512 without VNNI, or ONEDNN_MAX_CPU_ISA capping either) its ``vpmaddubsw``
    adds product pairs into saturating int16, and the engine uses GML's exact kernel instead."""
    from gml.runtime.target import detect_target

    return not exact_int8_gemm(detect_target())


@pytest.fixture(params=["gml", "onednn"], autouse=True)
def gemm(request, monkeypatch):
    """Every test here runs on both GEMMs of the engine's dynamic_linear: GML's exact AVX2 kernel
    (native/int8_gemm_avx2.h; the plans built for an AVX2 target, which any x86-64 CPU with AVX2 runs)
    and oneDNN's matmul (this CPU's own target, where that is exact: VNNI / AMX)."""
    from gml.runtime import target

    if request.param == "onednn" and not onednn_int8_is_exact():
        pytest.skip("oneDNN's int8 matmul saturates without VNNI; the engine does not use it here")
    if request.param == "gml":
        monkeypatch.setattr(target, "detect_target", lambda threads=None: Target("avx2", threads=threads or 1))
    return request.param


def dyn_graph(
    k: int, n: int, *, bias: bool = True, smooth: bool = False, post_op: str = "none", algorithm: str = "", seed=0
) -> fx.GraphModule:
    """A one-op lowered graph ``x -> gml.dynamic_linear(x, W, ...)`` built as the transformer scheme builds it."""
    register()
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    s = torch.rand(k, generator=gen) * 4 + 0.25 if smooth else None
    q = DynamicQuantLinear(lin, s)  # 8-bit weights: both engine GEMMs and the Python kernel are exact on every tier
    root = nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    consts = []
    for name in ("weight", "weight_scale", "bias", "smooth_inv"):
        t = getattr(q, name)
        if t is None:
            consts.append(None)
        else:
            root.register_buffer(name, t)
            consts.append(g.get_attr(name))
    g.output(g.call_function(op("dynamic_linear"), (x, *consts, post_op, [], algorithm)))
    return fx.GraphModule(root, g)


def step_impls(eng: nn.Module) -> list[str]:
    """The implementation of each step of the engine's (single) plan."""
    from gml.runtime.compile import EngineSegment

    (seg,) = [m for m in eng.modules() if isinstance(m, EngineSegment)]
    (entry,) = seg._plans.values()
    return list(entry[0].step_impls())


def rows(*shape: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x[..., 0] *= 30.0  # an outlier channel, as a transformer's residual stream has
    return x


def check(gm: fx.GraphModule, x: torch.Tensor, *, exact: bool = True):
    ref, eng, got = run_both(gm, x)
    assert eng.report.path == "engine", str(eng.report)
    assert got.shape == ref.shape and got.dtype == torch.float32
    if exact:
        assert torch.equal(got, ref), f"max |diff| {float((got - ref).abs().max())}"
    else:
        tol = 4 * torch.finfo(torch.float32).eps * ref.abs() + 1e-6 * float(ref.abs().max())
        assert bool(((got - ref).abs() <= tol).all()), f"max |diff| {float((got - ref).abs().max())}"
    return eng


@pytest.mark.parametrize(
    "shape,n",
    [((1, 384), 384), ((11, 384), 1536), ((128, 384), 384), ((7, 33), 17), ((1, 1), 3), ((2, 5, 19), 13), ((3, 64), 1)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_shapes(shape, n, gemm):
    eng = check(dyn_graph(shape[-1], n), rows(*shape))
    impls = step_impls(eng)
    assert impls[0] == "gml:row_quantize_s8" and len(impls) == 2, impls
    assert not impls[1].startswith("ref"), f"oneDNN's reference matmul, not a jitted one: {impls}"
    assert impls[1].startswith("gml:int8_gemm_avx2") == (gemm == "gml"), impls


def hostile_graph(k: int, n: int, post_op: str = "none", qmax: int = 127) -> tuple[fx.GraphModule, torch.Tensor]:
    """Operands that saturate ``vpmaddubsw``'s int16 pair sums under oneDNN's u8 shift
    ((127 + 128) * 127 * 2 > 32767): weights quantized to +-``qmax`` (one value per row), and rows of
    +-1 (quantized to +-127) with signs that make adjacent products add up. ``qmax=64``: the largest
    7-bit weights, the edge of the AVX2 kernel's u8 path ((127 + 128) * 64 * 2 = 32,640)."""
    gm = dyn_graph(k, n, post_op=post_op)
    gen = torch.Generator().manual_seed(5)
    sign = torch.where(torch.rand(n, k, generator=gen) < 0.5, -1, 1).to(torch.int8)
    gm.weight.copy_(sign * qmax)
    x = torch.where(torch.rand(9, k, generator=gen) < 0.5, -1.0, 1.0)
    r = min(4, n)
    x[:r] = sign[:r].float()  # rows equal to a weight row: every product +127^2, the largest sum
    return gm, x


def exact_reference(gm: fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    """ADR 008's math with the int32 sums computed exactly in int64 (no GEMM kernel involved)."""
    q_x, amax = dynamic_int8.quantize_rows(x)
    acc = q_x.long() @ gm.weight.long().t()
    assert int(acc.abs().max()) < 2**31
    return (acc.int() * (gm.weight_scale / 127)) * amax + gm.bias


@pytest.mark.parametrize("k,n", [(384, 40), (1, 3), (5, 17), (1031, 33)])
def test_saturating_operands_are_exact(k, n):
    """Both executors equal exact integer arithmetic where a saturating int8 dot product would not
    (issue #23: oneDNN's AVX2 matmul and torch._int_mm were 0.4 off on such a layer)."""
    gm, x = hostile_graph(k, n)
    want = exact_reference(gm, x)
    assert torch.equal(gm(x), want)  # the Python kernel
    check(gm, x)  # the engine, bit-identical to it


@pytest.mark.parametrize("k,n", [(384, 40), (1, 3), (5, 17), (1031, 33), (133_143, 1)])
def test_seven_bit_weights_are_exact(k, n, gemm):
    """Weights in [-64, 64] (``Target.dynamic_weight_qmax`` without VNNI) take the AVX2 kernel's u8
    path (x + 128 into ``vpmaddubsw``, 128 * colsum(w) subtracted): exact at its edge (+127 rows
    against +64 weights, pair sums 32,640), and at K = 133,143 where its int32 accumulator wraps
    (255 * 64 * K > 2^31) but the result does not."""
    gm, x = hostile_graph(k, n, qmax=64)
    x[0] = 1.0  # one row of +127 everywhere: x + 128 = 255 in every byte
    if k == 133_143:
        gm.weight.fill_(64)
    want = exact_reference(gm, x)
    assert torch.equal(gm(x), want)
    eng = check(gm, x)
    assert step_impls(eng)[1].startswith("gml:int8_gemm_avx2_u8s7") == (gemm == "gml"), step_impls(eng)


def test_python_int8_matmul_is_exact_beyond_fp32_integers():
    """``int8_matmul``'s fp32 chunks: sums up to 2100 * 127^2 (> 2^24, where one fp32 matmul over
    all of K would round) and K = 1 (where torch._int_mm was wrong) are the exact integers."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((3, 2100, 5), (4, 1, 6), (1, 1024, 1), (2, 1025, 3)):
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        a[0], b[0] = 127, 127  # one sum of K * 127^2
        got = dynamic_int8.int8_matmul(a, b)
        assert got.dtype == torch.int32 and torch.equal(got.long(), a.long() @ b.long().t()), (m, k, n)


@pytest.mark.parametrize("post_op", ["relu", "gelu"])
def test_engine_gemm_tiles_and_tails(post_op, gemm):
    """Row counts around the kernel's 4-row tile and column counts around its 16-column block, K not a
    multiple of 4, with the fused activation (ReLU in the kernel's epilogue, GELU a oneDNN eltwise)."""
    for m, k, n in ((1, 7, 16), (3, 13, 15), (4, 64, 17), (5, 33, 31), (9, 130, 48)):
        check(dyn_graph(k, n, post_op=post_op), rows(m, k), exact=post_op == "relu")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("smooth", [True, False])
def test_bias_and_smooth(bias, smooth):
    check(dyn_graph(48, 40, bias=bias, smooth=smooth), rows(2, 9, 48))


def test_relu_post_op_is_exact():
    check(dyn_graph(32, 24, post_op="relu"), rows(5, 32))


@pytest.mark.parametrize("algorithm", ["none", "tanh"])
def test_gelu_post_op(algorithm):
    check(dyn_graph(32, 24, post_op="gelu", algorithm=algorithm), rows(5, 32), exact=False)


def test_zero_row_and_non_contiguous_input():
    x = rows(6, 40)
    x[2] = 0.0  # an all-zero row: q = 0, output = bias (AMAX_FLOOR keeps 127 / amax finite)
    check(dyn_graph(40, 8), x)
    xt = rows(40, 6).t()  # rows with a column stride: the engine copies them dense first
    check(dyn_graph(40, 8), xt)


def test_inputs_with_gaps_or_overlaps():
    """A row view with gaps (BERT's pooler reads ``hidden[:, 0]``) is planned with its own strides,
    not a contiguous copy's (the engine once read it as contiguous: 0.23 off on a 0.22 output);
    an expanded input (overlapping rows, stride 0) is planned with its own strides too and runs in
    the engine (``same_layout_copy`` reproduces any strides)."""
    x3 = rows(2, 12, 32)
    check(dyn_graph(32, 16), x3[:, 0])
    gm = dyn_graph(32, 16)
    x = rows(1, 32).expand(4, 32)
    ref, eng, got = run_both(gm, x)
    assert torch.equal(got, ref)
    assert eng.report.path == "engine" and not eng.report.shape_fallbacks, eng.report


def test_python_kernel_matches_the_exact_integer_math():
    """The Python kernel's integers are the definition's: int8 rows, exact int32 sums."""
    x = rows(4, 50)
    gm = dyn_graph(50, 7)
    q_x, _ = dynamic_int8.quantize_rows(x)
    assert int(q_x.abs().max()) == 127 and q_x.dtype == torch.int8
    torch.testing.assert_close(gm(x), exact_reference(gm, x), rtol=0, atol=0)
