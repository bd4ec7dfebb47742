"""Transformer ops on the engine (gml.runtime.rules) vs the Python executor, op by op.

fp32: the same math in another summation order, within 1e-5 of the output's magnitude. bf16:
both sides round operands and outputs to bf16 (8 significant bits) but may differ in where (the
engine keeps the scores and the fused residual sum in fp32): within ``2^-6`` of the magnitude, a
few bf16 roundings (``u = 2^-8``) of the largest output.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml import nn as gnn
from gml.ir.attention import attention_op
from gml.ir.target import Target
from gml.kernels import bf16 as kb
from gml.kernels.fp32 import AddReLU, FusedLinear, PostOp
from gml.runtime import compile_engine, unavailable_reason
from gml.runtime.options import ATTENTION_ENV
from gml.runtime.rules.attention import fused_attention_kernels
from gml.runtime.target import detect_target
from runtime.helpers import attention_graph, graph_of, run_both, strided_heads_graph

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
needs_bf16 = pytest.mark.skipif(not kb.bf16_available(), reason=f"no native bf16: {kb.bf16_unavailable_reason()}")

FP32_RTOL = 1e-5
BF16_RTOL = 2.0**-6


def check(gm: fx.GraphModule, *inputs: torch.Tensor, rtol: float = FP32_RTOL, expect: str = "engine", target=None):
    ref, eng, got = run_both(gm, *inputs, target=target)
    assert eng.report.path == expect, str(eng.report)
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.dtype, ref.shape)
    assert torch.isfinite(got).all()
    err = float((got.float() - ref.float()).abs().max())
    assert err <= rtol * max(1.0, float(ref.float().abs().max())), err
    return eng


def _qkv(b, h, lq, s, e, ev, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen).to(dtype) for n, d in ((lq, e), (s, e), (s, ev))]


# ---------------------------------------------------------------- LayerNorm
@pytest.mark.parametrize("shape", [(3, 20), (2, 5, 20), (1, 1, 7), (2, 3, 4, 9)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_fp32(shape, affine):
    torch.manual_seed(0)
    ln = nn.LayerNorm(shape[-1], eps=1e-6, elementwise_affine=affine).eval()
    if affine:
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
    eng = check(graph_of(ln), torch.randn(*shape) * 3 + 1)
    assert _names(eng) == ["m0"]  # one layer_normalization primitive


def test_layer_norm_of_a_transposed_input_copies_it_dense_first():
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.call_method("transpose", (x, 1, 2))
    root = nn.Module()
    root.ln = nn.LayerNorm(6)
    g.output(g.call_module("ln", (t,)))
    check(fx.GraphModule(root, g), torch.randn(2, 6, 5))


@needs_bf16
def test_layer_norm_bf16_in_and_out():
    torch.manual_seed(0)
    ln = nn.LayerNorm(24).eval().to(torch.bfloat16)
    check(graph_of(ln), torch.randn(2, 7, 24).to(torch.bfloat16), rtol=BF16_RTOL)


# ---------------------------------------------------------------- adds
@pytest.mark.parametrize(
    "shapes", [((2, 5, 8), (2, 5, 8)), ((2, 5, 8), (8,)), ((1, 8), (3, 8)), ((4, 1, 8), (4, 3, 8)), ((4, 1, 8), (3, 8))]
)
def test_float_add_same_shape_and_broadcast(shapes):
    gm = graph_of(gnn.Add(), n_inputs=2, wiring=[(0, 1)])
    # both operands broadcasting ((4, 1, 8) + (3, 8)): the first is spread over the output first
    check(gm, torch.randn(*shapes[0]), torch.randn(*shapes[1]))


@needs_bf16
def test_float_add_of_bf16_and_fp32_promotes_like_torch():
    gm = graph_of(gnn.Add(), n_inputs=2, wiring=[(0, 1)])
    check(gm, torch.randn(3, 8).to(torch.bfloat16), torch.randn(3, 8))


def test_an_int_add_stays_in_torch_with_its_reason():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    root = nn.Module()
    root.add = gnn.Add()
    g.output(g.call_module("add", (a, b)))
    gm = fx.GraphModule(root, g)
    x = torch.arange(6).view(2, 3)
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(x, x)
    eng = compile_engine(gm, (x, x))
    assert [n.reason for n in eng.report.torch_nodes] == [
        "add of torch.int64, torch.int64 tensors (the engine adds fp32 / bf16)"
    ]


#: a target whose f32 matmul has brgemm kernels (AVX-512) and one where it has not (AVX2): the
#: plans differ (Target.f32_matmul_brgemm) and both run, and agree, on any CPU
MATMUL_TARGETS = [Target("avx512_core"), Target("avx2")]


@pytest.mark.parametrize("target", MATMUL_TARGETS, ids=lambda t: t.isa)
@pytest.mark.parametrize("post_op", [PostOp(), PostOp("gelu", (), "none"), PostOp("gelu", (), "tanh")], ids=str)
def test_linear_then_residual_add_is_one_matmul(post_op, target):
    """``linear(x) + r``: the add is a binary post-op of the linear's matmul (one step) where that
    matmul has a brgemm kernel; on AVX2 the linear stays an inner product and the add is a step."""
    torch.manual_seed(0)
    lin = FusedLinear.from_linear(nn.Linear(16, 12), post_op)
    gm = graph_of(lin, gnn.Add(), n_inputs=2, wiring=[(0,), (2, 1)])
    eng = check(gm, torch.randn(2, 5, 16), torch.randn(2, 5, 12), target=target)
    assert _names(eng) == (["m0+m1"] if target.f32_matmul_brgemm else ["m0", "m1"])


def test_a_linear_read_again_after_the_add_is_not_fused():
    torch.manual_seed(0)
    lin = FusedLinear.from_linear(nn.Linear(8, 8), PostOp())
    # y = lin(x); z = y + r; out = z + y
    gm = graph_of(lin, gnn.Add(), gnn.Add(), n_inputs=2, wiring=[(0,), (2, 1), (3, 2)])
    eng = check(gm, torch.randn(3, 8), torch.randn(3, 8))
    assert _names(eng) == ["m0", "m1", "m2"]


def test_a_linear_added_to_itself_is_not_fused():
    """``y = linear(x); y + y``: the add reads the linear's own output, which a fused matmul would no longer
    write (the binary post-op read uninitialized memory: a fuzzed graph was off by 0.77 on some runs)."""
    torch.manual_seed(0)
    lin = FusedLinear.from_linear(nn.Linear(6, 9, bias=False), PostOp())
    eng = check(graph_of(lin, gnn.Add(), n_inputs=1, wiring=[(0,), (1, 1)]), torch.randn(2, 28, 1, 6))
    assert _names(eng) == ["m0", "m1"]


def test_a_residual_add_of_a_transposed_linear_output_is_not_fused():
    """nn.TransformerEncoderLayer's ``x + out_proj(...).view(...).transpose(0, 1)``: the add reads the
    linear's bytes in another order, so it cannot be the linear's post-op (a fuzzed-block bug)."""
    torch.manual_seed(0)
    root = nn.Module()
    root.lin = FusedLinear.from_linear(nn.Linear(4, 4), PostOp())
    root.add = gnn.Add()
    g = fx.Graph()
    x, r = g.placeholder("x"), g.placeholder("r")
    t = g.call_method("transpose", (g.call_module("lin", (x,)), 0, 1))
    g.output(g.call_module("add", (r, t)))
    eng = check(fx.GraphModule(root, g), torch.randn(3, 2, 4), torch.randn(2, 3, 4))
    assert "lin+add" not in _names(eng)


ACTIVATIONS = [nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.Tanh(), nn.SiLU(), nn.Sigmoid()]
# standalone after a conv that could not take them (rexnet's ReLU6, mobilenet_v3's classifier Hardswish)
ACTIVATIONS += [nn.ReLU6(), nn.Hardtanh(-2.0, 3.0), nn.Hardswish(), nn.Hardsigmoid(), nn.LeakyReLU(0.2)]


@pytest.mark.parametrize("target", MATMUL_TARGETS, ids=lambda t: t.isa)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=str)
def test_activation_module_on_its_own_and_after_a_linear(act, target):
    check(graph_of(act), torch.randn(2, 3, 10) * 3, target=target)
    torch.manual_seed(0)
    lin = FusedLinear.from_linear(nn.Linear(10, 10), PostOp())
    # linear -> activation -> + residual: one matmul with two post-ops (AVX-512), else the inner
    # product with the activation as its post-op, then the add
    gm = graph_of(lin, act, gnn.Add(), n_inputs=1, wiring=[(0,), (1,), (2, 0)])
    eng = check(gm, torch.randn(2, 3, 10), target=target)
    assert _names(eng) == (["m0+m1+m2"] if target.f32_matmul_brgemm else ["m0+m1", "m2"])


@pytest.mark.parametrize("act", [nn.ELU(), nn.Mish(), nn.GELU(approximate="none")], ids=str)
def test_an_activation_without_a_onednn_form_stays_in_torch_with_its_reason(act):
    if isinstance(act, nn.GELU):  # the control: it runs
        check(graph_of(act), torch.randn(2, 3, 10))
        return
    eng = check(graph_of(act), torch.randn(2, 3, 10), expect="torch")
    (reason,) = [n.reason for n in eng.report.torch_nodes]
    assert reason.startswith(f"{type(act).__name__} has no oneDNN post-op"), reason


@needs_bf16
def test_bf16_linear_gelu_residual_chain():
    torch.manual_seed(0)
    lin = kb.Bf16Linear.from_fused(FusedLinear.from_linear(nn.Linear(16, 16), PostOp()))
    gm = graph_of(lin, nn.GELU(), gnn.Add(), n_inputs=1, wiring=[(0,), (1,), (2, 0)])
    eng = check(gm, torch.randn(3, 16).to(torch.bfloat16), rtol=BF16_RTOL)
    assert _names(eng)[-1] == "m0+m1+m2"


# ---------------------------------------------------------------- attention
def _padding_mask(b: int, s: int, keep: list[int]) -> torch.Tensor:
    return torch.arange(s)[None, None, None, :] < torch.tensor(keep)[:, None, None, None]


@pytest.mark.parametrize(
    "b,h,lq,s,e,ev",
    [(1, 2, 5, 5, 8, 8), (2, 3, 7, 7, 4, 4), (1, 1, 1, 1, 3, 3), (2, 2, 1, 6, 5, 7), (1, 4, 9, 3, 16, 16)],
)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_attention_fp32_without_mask(b, h, lq, s, e, ev, scale, monkeypatch):
    """Both paths: the primitives (Q.K^T scaled, softmax, P.V) and, by default, GML's fused step
    wherever the target has a kernel (ADR 009: fp32 on AVX-512 and AVX2)."""
    monkeypatch.setenv(ATTENTION_ENV, "primitives")
    eng = check(attention_graph(3, scale), *_qkv(b, h, lq, s, e, ev))
    assert _names(eng) == ["attention_default"] * 3
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    eng = check(attention_graph(3, scale), *_qkv(b, h, lq, s, e, ev))
    target = detect_target()
    kernel = fused_attention_kernels(target).get("f32")
    fused = kernel == "avx512" or (kernel == "avx2" and not target.avx512)  # ADR 009's auto rule
    assert _names(eng) == ["attention_default"] * (1 if fused else 3)


@pytest.mark.parametrize("b,lq,s", [(2, 6, 6), (3, 1, 5), (1, 4, 4)])
def test_attention_with_a_padding_bool_mask(b, lq, s):
    q, k, v = _qkv(b, 2, lq, s, 6, 6)
    keep = [max(1, s - i) for i in range(b)]  # row i: the last i keys are padding
    check(attention_graph(4), q, k, v, _padding_mask(b, s, keep))


def test_attention_with_an_expanded_bool_mask_and_a_float_mask():
    q, k, v = _qkv(2, 3, 5, 5, 4, 4)
    mask = _padding_mask(2, 5, [5, 3]).expand(2, 3, 5, 5)  # stride 0 dims: read as size 1
    check(attention_graph(4), q, k, v, mask)
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~_padding_mask(2, 5, [5, 2]), -1e4) + torch.randn(2, 1, 5, 5)
    check(attention_graph(4, 0.25), q, k, v, additive)


def test_attention_of_strided_heads(monkeypatch):
    """q / k / v as the QKV merge leaves them: transposed views of one [B, L, 3 * H * E] tensor
    (the primitive path; the fused one reads them in place: tests/runtime/test_fused_attention*.py)."""
    monkeypatch.setenv(ATTENTION_ENV, "primitives")
    eng = check(strided_heads_graph(2, 5, 2, 4), torch.randn(2, 5, 24))
    assert _names(eng).count("attention_default") == 6  # three dense copies of the strided heads, then the three steps


@needs_bf16
@pytest.mark.parametrize("masked", [False, True])
def test_attention_bf16(masked):
    q, k, v = _qkv(2, 3, 7, 7, 8, 8, torch.bfloat16)
    if masked:
        check(attention_graph(4), q, k, v, _padding_mask(2, 7, [7, 4]), rtol=BF16_RTOL)
    else:
        check(attention_graph(3), q, k, v, rtol=BF16_RTOL)


@pytest.mark.parametrize("lq,s", [(4, 4), (1, 3), (5, 3), (3, 6)])
def test_causal_attention_and_a_constant_mask(lq, s):
    q, k, v = _qkv(2, 2, lq, s, 8, 8)
    check(attention_graph(3, causal=True), q, k, v)
    # a constant (get_attr) mask, as a model's buffer: bool, then float
    for mask in (torch.rand(lq, s) > 0.3, torch.randn(1, 1, lq, s)):
        if mask.dtype == torch.bool:
            mask[:, 0] = True  # no fully masked row (tests/runtime/test_masked_rows.py has those)
        g = fx.Graph()
        xs = [g.placeholder(n) for n in "qkv"]
        root = nn.Module()
        root.register_buffer("mask", mask)
        g.output(g.call_function(attention_op(), (*xs, g.get_attr("mask"), None, False)))
        check(fx.GraphModule(root, g), q, k, v)


def _names(eng) -> list[str]:
    """The native steps of the (single) plan of the (single) segment, by the node they came from."""
    (seg,) = eng.segments()
    ((plan, _),) = seg._plans.values()
    return list(plan.step_names())


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=needs_bf16)])
def test_torchvision_vit_runs_its_encoder_on_the_engine(precision):
    """ViT (nn.MultiheadAttention captured by torch.export): LayerNorm, attention, every linear
    (the MHA out_proj reads a permuted value: copied dense first) in engine segments."""
    import torchvision

    import gml

    torch.manual_seed(0)
    m = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    with torch.no_grad():
        m.heads.head.weight.normal_()  # zero-initialised: the output would be 0
    x = torch.randn(2, 3, 32, 32)
    res = gml.optimize(m, x, precision=precision)
    assert res.engine is not None and not res.runtime.shape_fallbacks, str(res.runtime)
    ran = {n.op for n in res.runtime.nodes if n.runs_in == "engine"}
    assert {"attention", "LayerNorm"} <= ran
    assert not {n.op for n in res.runtime.torch_nodes} & {"attention", "LayerNorm", "FusedLinear", "Bf16Linear"}
    with torch.no_grad():
        ref, got = m(x), res.executable(x)
    tol = 1e-5 if precision == "fp32" else 2.0**-4
    assert float((got - ref).abs().max()) <= tol * float(ref.abs().max())


# ---------------------------------------------------------------- binary ops with a constant operand
class _NoNorm(nn.Module):
    """MobileBERT's NoNorm after a linear: ``x * w + b`` with constant vectors (HF's
    ``NoNorm``). Both are binary steps with a plan-owned constant operand; before, each stayed in
    torch ("no engine kernel for Mul", "add of a constant") and cut the plan into segments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.randn(8))
        self.bias = nn.Parameter(torch.randn(8))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x) * self.weight + self.bias)


def test_mul_and_add_of_a_constant_vector_run_in_the_plan():
    import gml

    torch.manual_seed(0)
    model, x = _NoNorm().eval(), torch.randn(2, 5, 8)
    r = gml.optimize(model, x, runtime="engine")
    assert r.runtime.path == "engine" and r.runtime.segments == 1, str(r.runtime)
    assert [impl for _, impl in r.engine.step_impls() if "ref" in impl] == []
    with torch.no_grad():
        torch.testing.assert_close(r.executable(x), model(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # another shape: the constants broadcast the same way
        y = torch.randn(3, 7, 8)
        torch.testing.assert_close(r.executable(y), model(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shapes",
    [((2, 5, 8), (8,)), ((2, 5, 8), (2, 5, 8)), ((2, 1, 8), (2, 5, 8)), ((2, 8, 3, 3), (2, 8, 1, 1))],
    ids=["row", "same", "first-broadcasts", "gate"],
)
def test_a_mul_of_two_computed_values(shapes):
    # a squeeze-excite gate (x * sigmoid(...) of shape N x C x 1 x 1) and the broadcasts around it
    gm = graph_of(gnn.Mul(), n_inputs=2, wiring=[(0, 1)])
    check(gm, *(torch.randn(s) for s in shapes))


@pytest.mark.parametrize("shapes", [((2, 8, 3, 3), (2, 8, 3, 3)), ((2, 8, 3, 3), (1, 8, 1, 1))], ids=["same", "bias"])
def test_add_relu_of_two_computed_values(shapes):
    # kernels.fp32.AddReLU: a residual sum no conv took (SE-ResNeXt's gated branch plus the shortcut)
    gm = graph_of(AddReLU(), n_inputs=2, wiring=[(0, 1)])
    eng = check(gm, *(torch.randn(s) for s in shapes))
    assert [n.runs_in for n in eng.report.nodes if n.op == "AddReLU"] == ["engine"]


@pytest.mark.parametrize(
    ("op", "xs", "ys"),
    [
        ("mul", (2, 1, 8), (1, 5, 8)),
        ("mul", (1, 1, 4, 4), (1, 6, 1, 1)),
        ("sub", (8,), (2, 5, 8)),
        ("sub", (2, 1, 3), (4, 1)),
    ],
    ids=["mul-3d", "mul-focalnet", "sub-first-broadcasts", "sub-both"],
)
def test_a_binary_broadcasting_both_operands_runs_in_the_plan(op, xs, ys):
    """oneDNN's binary broadcasts its second source only: the first is spread over a zero tensor of
    the output's shape first (HF FocalNet's ``(1, 1, H, W)`` gate times a ``(1, C, 1, 1)`` context
    sent its whole segment to torch at plan build)."""
    from torch.fx.passes.shape_prop import ShapeProp

    gm = graph_of(gnn.Mul() if op == "mul" else gnn.Add(-1), n_inputs=2, wiring=[(0, 1)])
    x, y = torch.randn(xs), torch.randn(ys)
    ShapeProp(gm).propagate(x, y)
    check(gm, x, y)


def test_a_mul_of_two_constants_stays_in_torch_with_its_reason():
    g = fx.Graph()
    root = nn.Module()
    root.mul, root.c0, root.c1 = gnn.Mul(), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    x = g.placeholder("x")
    prod = g.call_module("mul", (g.get_attr("c0"), g.get_attr("c1")))
    g.output(g.call_function(torch.add, (x, prod)))
    gm = fx.GraphModule(root, g)
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(torch.randn(2, 4))
    eng = compile_engine(gm, (torch.randn(2, 4),))
    assert "mul of two constants" in [n.reason for n in eng.report.torch_nodes], str(eng.report)


class _UnbindChunk(nn.Module):
    """timm's ViT attention takes q, k, v apart with ``qkv.unbind(0)``; other blocks ``chunk``. Both
    return views of their source: split pieces the engine aliases (they cut the plan before)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 16)
        left, right = self.proj(a).chunk(2, dim=-1)
        return torch.cat([right, left], -1) + x


def test_unbind_and_chunk_pieces_are_views_in_the_plan():
    import gml

    torch.manual_seed(0)
    model, x = _UnbindChunk().eval(), torch.randn(2, 5, 16)
    res = gml.optimize(model, x, runtime="engine")
    ops = {n.op for n in res.runtime.torch_nodes}
    assert not ops & {"unbind", "chunk", "split", "split_item"}, str(res.runtime)  # getitem: x.shape[0]
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- scalars, subtraction, rotary embedding, sizes
SCALARS = [gnn.MulScalar(0.5), gnn.MulScalar(-1), gnn.AddScalar(1.5), gnn.AddScalar(3.0, alpha=-1)]


@pytest.mark.parametrize("target", MATMUL_TARGETS, ids=lambda t: t.isa)
@pytest.mark.parametrize("op", SCALARS, ids=lambda m: f"{type(m).__name__}({m.extra_repr()})")
def test_a_scalar_op_on_its_own_and_after_a_linear(op, target):
    # x * 0.5, -x (Normalize: MulScalar(-1)), x + 1.5, x - 3.0: one eltwise linear, or the linear's post-op
    torch.manual_seed(0)
    eng = check(graph_of(op), torch.randn(2, 5, 8), target=target)
    assert [n.runs_in for n in eng.report.nodes] == ["engine"]
    eng = check(graph_of(nn.Linear(8, 6), op), torch.randn(2, 5, 8), target=target)
    assert len(eng.step_impls()) == 1, eng.step_impls()  # folded into the linear's step


@pytest.mark.parametrize(
    "shapes", [((2, 5, 8), (2, 5, 8)), ((2, 5, 8), (8,)), ((2, 8, 3, 3), (2, 8, 1, 1))], ids=["same", "row", "gate"]
)
def test_a_subtraction_of_two_computed_values(shapes):
    # Normalize writes x - y as gml.nn.Add(alpha=-1) (ATen's own formulation): a binary sub
    gm = graph_of(gnn.Add(-1), n_inputs=2, wiring=[(0, 1)])
    eng = check(gm, *(torch.randn(s) for s in shapes))
    assert [n.runs_in for n in eng.report.nodes] == ["engine"]


class _RotaryAttention(nn.Module):
    """EVA-02's attention (timm ``EvaAttention`` with ``apply_rot_embed_cat``): a class token, rotary
    sin / cos tables, ``rot(x) = stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)``, the
    casts back (``.to(dtype=x.dtype)``, ``type_as``) and ``B, N, C = x.shape``. Each of them was a
    torch node that cut the plan (111 segments in EVA-02-tiny; and ``reshape(x.shape)`` took a
    ``Size`` into the next segment, which then ran in torch for every shape)."""

    def __init__(self, dim: int = 16, heads: int = 2, tokens: int = 6) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        angle = torch.randn(tokens, dim // heads // 2).repeat_interleave(2, -1)
        self.register_buffer("rope", torch.cat([angle.sin(), angle.cos()], -1))

    @staticmethod
    def rot(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)

    def rope_of(self, x: torch.Tensor) -> torch.Tensor:
        sin, cos = self.rope.chunk(2, -1)
        return (x * cos + self.rot(x) * sin).to(dtype=x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q = torch.cat([q[:, :, :1, :], self.rope_of(q[:, :, 1:, :])], dim=2).type_as(v)
        k = torch.cat([k[:, :, :1, :], self.rope_of(k[:, :, 1:, :])], dim=2).type_as(v)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.proj(a.transpose(1, 2).reshape(b, n, c))


def test_rotary_embedding_attention_is_one_plan():
    import gml

    torch.manual_seed(0)
    model = _RotaryAttention().eval()
    x = torch.randn(2, 7, 16)  # a class token and 6 rotated tokens
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    # in torch: the model input's sizes only (x.shape, its items, cached per input shape)
    assert {n.op for n in res.runtime.torch_nodes} <= {"size", "ShapeValues", "getitem"}, str(res.runtime)
    assert [impl for _, impl in res.engine.step_impls() if "ref" in impl] == []
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)
        y = torch.randn(3, 7, 16)  # another batch: another plan, its own sizes
        torch.testing.assert_close(res.executable(y), model(y), rtol=1e-5, atol=1e-5)


class _SizeReadAfter(nn.Module):
    """A size of an engine value read by torch after the segment (``cumsum`` has no engine rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        rows = y.shape[0] * y.shape[1]
        return torch.cumsum(y, -1).reshape(rows, -1)


def test_a_size_made_in_a_segment_and_read_by_torch_is_the_segments_output():
    import gml

    torch.manual_seed(0)
    model = _SizeReadAfter().eval()
    res = gml.optimize(model, torch.randn(2, 3, 8), runtime="engine")
    size_nodes = [n for n in res.runtime.nodes if n.op == "size"]
    assert size_nodes and all(n.runs_in == "engine" for n in size_nodes), str(res.runtime)
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        for shape in [(2, 3, 8), (4, 1, 8)]:
            x = torch.randn(shape)
            torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)
    assert not res.runtime.shape_fallbacks, str(res.runtime)


class _ScalarScale(nn.Module):
    """DeBERTa's attention scale: ``sqrt(tensor(size) * factor)``, a 0-d tensor (oneDNN has no 0-d
    memory: a 0-d step read garbage, and the engine's output was off or NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * 3.0)
        return self.lin(x) / scale


def test_a_0d_tensor_stays_in_torch_with_its_reason():
    import gml

    torch.manual_seed(0)
    model, x = _ScalarScale().eval(), torch.randn(2, 5, 8)
    res = gml.optimize(model, x, runtime="engine")
    reasons = {n.op: n.reason for n in res.runtime.torch_nodes}
    assert reasons.get("MulScalar") == "a 0-d tensor (a scalar: torch computes it)", str(res.runtime)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


class _ShiftedWindows(nn.Module):
    """Swin's window plumbing (timm ``SwinTransformerBlock``): pad the token grid to whole windows
    with widths computed from its size (``(ws - H % ws) % ws``), roll it by half a window, take the
    windows apart with views, attend within each, and undo it all. F.pad and torch.roll ran in torch
    and cut each block into several segments (HF / timm Swin 39 segments)."""

    def __init__(self, dim: int = 8, ws: int = 3, shift: int = 1, value: float | None = None) -> None:
        super().__init__()
        self.ws, self.shift, self.value = ws, shift, value
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        ph, pw = (self.ws - h % self.ws) % self.ws, (self.ws - w % self.ws) % self.ws
        y = torch.nn.functional.pad(self.proj(x), (0, 0, 0, pw, 0, ph), value=self.value)
        y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        hp, wp = h + ph, w + pw
        win = y.view(b, hp // self.ws, self.ws, wp // self.ws, self.ws, c).permute(0, 1, 3, 2, 4, 5)
        win = win.reshape(-1, self.ws * self.ws, c)
        q, k, v = self.qkv(win).reshape(win.shape[0], -1, 3, 1, c).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, self.ws, self.ws, c)
        y = a.view(b, hp // self.ws, wp // self.ws, self.ws, self.ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        y = y.roll((self.shift, self.shift), (1, 2))
        return x + y[:, :h, :w, :]


@pytest.mark.parametrize(
    ("size", "value"), [((6, 6), None), ((5, 7), None), ((5, 4), 1.5)], ids=["whole", "padded", "padded-value"]
)
def test_shifted_windows_pad_and_roll_run_in_the_plan(size, value):
    import gml

    torch.manual_seed(0)
    model, x = _ShiftedWindows(value=value).eval(), torch.randn(2, *size, 8)
    res = gml.optimize(model, x, runtime="engine")
    assert {"pad", "roll"} <= {n.op for n in res.runtime.nodes if n.runs_in == "engine"}, str(res.runtime)
    # in torch: the input's sizes and the pad widths computed from them (once per shape)
    assert {n.op for n in res.runtime.torch_nodes} <= {"size", "ShapeValues", "getitem"}, str(res.runtime)
    assert not res.runtime.shape_fallbacks, str(res.runtime)
    assert [impl for _, impl in res.engine.step_impls() if "ref" in impl] == []
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)
        y = torch.randn(1, size[0], size[1] + 2, 8)  # another grid: other pad widths, another plan
        torch.testing.assert_close(res.executable(y), model(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shifts", "dims"), [(2, 1), ((-1, 3), (0, 2)), ((5, -7, 1), (1, 2, 1))], ids=["one", "two", "repeated-dim"]
)
def test_roll_of_an_engine_value(shifts, dims):
    import gml

    class Roll(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.roll(self.lin(x), shifts, dims) * 2.0

    torch.manual_seed(0)
    model, x = Roll().eval(), torch.randn(3, 4, 6)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.path == "engine", str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_roll_of_the_flattened_tensor_stays_in_torch_with_its_reason():
    import gml

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.roll(self.lin(x), 5)

    model, x = Flat().eval(), torch.randn(3, 6)
    res = gml.optimize(model, x, runtime="engine")
    assert [n.reason for n in res.runtime.torch_nodes if n.op == "roll"] == ["a roll of the flattened tensor (no dims)"]
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x))


class _WrittenOutWindowAttention(nn.Module):
    """Attention written out, as timm's Swin does in its shifted-window blocks: ``q * scale @ kᵀ``,
    a relative-position bias, the shift mask added through a 5-D view, ``nn.Softmax(dim=-1)``,
    ``@ v``. The attention pass does not match it (the mask's view); its matmuls and softmax ran in
    torch and cut each block into several segments."""

    def __init__(self, dim: int = 16, heads: int = 2, n: int = 9, windows: int = 2) -> None:
        super().__init__()
        self.heads, self.windows, self.scale = heads, windows, (dim // heads) ** -0.5
        self.qkv, self.proj, self.softmax = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Softmax(dim=-1)
        self.bias = nn.Parameter(torch.randn(heads, n, n))
        self.register_buffer("mask", torch.randn(windows, n, n).clamp(max=0) * 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1) + self.bias
        attn = attn.view(-1, self.windows, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = self.softmax(attn.view(-1, self.heads, n, n))
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


def test_attention_written_out_runs_its_matmuls_and_softmax_in_the_plan():
    import gml

    torch.manual_seed(0)
    model, x = _WrittenOutWindowAttention().eval(), torch.randn(4, 9, 16)  # 2 images x 2 windows
    res = gml.optimize(model, x, runtime="engine")
    ops = {n.op for n in res.runtime.nodes if n.runs_in == "engine"}
    assert {"matmul", "Softmax"} <= ops, str(res.runtime)
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    assert [impl for _, impl in res.engine.step_impls() if "ref" in impl] == []
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_matmul_with_a_vector_stays_in_torch_with_its_reason():
    from torch.fx.passes.shape_prop import ShapeProp

    g = fx.Graph()
    a, v = g.placeholder("a"), g.placeholder("v")
    g.output(g.call_function(torch.matmul, (a, v)))
    gm = fx.GraphModule(nn.Module(), g)
    x, y = torch.randn(3, 4), torch.randn(4)
    ShapeProp(gm).propagate(x, y)
    eng = compile_engine(gm, (x, y))
    reasons = [n.reason for n in eng.report.torch_nodes]
    assert reasons == ["matmul of a vector (the engine multiplies matrices and batches of them)"], str(eng.report)
    torch.testing.assert_close(eng(x, y), x @ y)


class _FocalContext(nn.Module):
    """HF FocalNet's global context: ``ctx.mean(2, keepdim=True).mean(3, keepdim=True)``, two means
    of one spatial dim each, gated back onto the map (both operands of the product broadcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.gate = nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = torch.nn.functional.gelu(self.conv(x))
        glob = ctx.mean(2, keepdim=True).mean(3, keepdim=True)
        return ctx + glob * self.gate(x) + x.mean(-1, keepdim=True)


def test_spatial_means_and_a_both_broadcast_product_run_in_the_plan():
    import gml

    torch.manual_seed(0)
    model, x = _FocalContext().eval(), torch.randn(1, 6, 7, 9)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.path == "engine" and len(res.engine.segments()) == 1, str(res.runtime)
    assert not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_mean_without_keepdim_stays_in_torch_with_its_reason():
    import gml

    class Mean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).mean(2) * 2.0

    model, x = Mean().eval(), torch.randn(1, 3, 5, 5)
    res = gml.optimize(model, x, runtime="engine")
    reasons = {n.op: n.reason for n in res.runtime.torch_nodes}
    assert reasons.get("mean") == "a mean without keepdim (the engine's pool keeps the dims)", str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_both_broadcast_product_with_a_constant_first_operand():
    """The operand spread first may be a model constant: the plan owns a copy of it (a view of a plan
    constant cannot be planned)."""
    import gml

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 1, 1)
            self.register_buffer("scale", torch.randn(1, 6, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * torch.sigmoid(self.conv(x))

    torch.manual_seed(0)
    model, x = Gate().eval(), torch.randn(1, 3, 5, 7)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.path == "engine" and not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


class _SoftmaxSpelled(nn.Module):
    """EfficientViT / LeViT / SHViT attention: ``q @ kᵀ * scale + bias``, the softmax as a method or
    a function, then ``v @ attnᵀ`` (a transpose of the softmax's output)."""

    def __init__(self, spelling: str, dim: int = 16, n: int = 12) -> None:
        super().__init__()
        self.spelling, self.qkv = spelling, nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = q @ k.transpose(-2, -1) * 0.25 + self.bias
        if self.spelling == "method":
            attn = attn.softmax(dim=-1)
        elif self.spelling == "F.softmax":
            attn = torch.nn.functional.softmax(attn, -1)
        else:
            attn = torch.softmax(attn, dim=-1)
        return v.transpose(-2, -1) @ attn.transpose(-2, -1)


@pytest.mark.parametrize("spelling", ["method", "F.softmax", "torch.softmax"])
def test_a_softmax_method_or_function_runs_in_the_plan(spelling):
    """Before: ``x.softmax(-1)`` had no rule (``nn.Softmax`` had), and the transpose after it was
    refused as "a value no lowered GML op made": efficientvit_m0 ran 25 segments, now 1."""
    import gml

    torch.manual_seed(0)
    model, x = _SoftmaxSpelled(spelling).eval(), torch.randn(2, 12, 16)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.torch_nodes, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_softmax_to_another_dtype_stays_in_torch_with_its_reason():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_method("softmax", (x, -1), {"dtype": torch.float64}))
    gm = fx.GraphModule(nn.Module(), g)
    eng = compile_engine(gm, [torch.randn(3, 5)])
    assert eng.report.path == "torch"
    assert [n.reason for n in eng.report.torch_nodes] == [
        "Softmax to torch.float64 (the engine keeps its input's dtype)"
    ]


class _CrossCovariance(nn.Module):
    """XCiT's cross-covariance attention: q and k transposed to ``[B, h, d, N]``, L2-normalized over
    the tokens (``F.normalize(q, dim=-1)``), then ``q @ kᵀ``, a softmax and ``@ v``."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 4, 1).unbind(0)
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        return (attn @ v).permute(0, 3, 1, 2).reshape(b, n, c)


def test_l2_normalize_runs_in_the_plan():
    """Before, each F.normalize ended an engine segment (xcit_nano: 20 segments, now 8)."""
    import gml

    torch.manual_seed(0)
    model, x = _CrossCovariance().eval(), torch.randn(2, 10, 16) * 3
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.shape_fallbacks, str(res.runtime)
    assert not [n for n in res.runtime.torch_nodes if n.op == "normalize"], str(res.runtime)
    assert [impl for _, impl in res.engine.step_impls()].count("gml:l2_norm") == 2
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(p=1.0, dim=-1), "F.normalize with p=1.0 (the engine divides by the Euclidean norm)"),
        (dict(dim=1), "F.normalize over dim 1 of a rank-3 value (the engine normalizes the last dim)"),
    ],
)
def test_another_normalize_stays_in_torch_with_its_reason(kw, reason):
    from torch.fx.passes.shape_prop import ShapeProp

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.nn.functional.normalize, (x,), kw))
    gm = fx.GraphModule(nn.Module(), g)
    t = torch.randn(2, 3, 5)
    ShapeProp(gm).propagate(t)
    eng = compile_engine(gm, [t])
    assert eng.report.path == "torch"
    assert [n.reason for n in eng.report.torch_nodes] == [reason]


class _RepeatKV(nn.Module):
    """Grouped K / V heads (Llama's ``repeat_kv``): ``kv[:, :, None].expand(...).reshape(...)``."""

    def __init__(self, add: bool = False) -> None:
        super().__init__()
        self.add = add

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        b, h, s, e = kv.shape
        wide = kv[:, :, None].expand(b, h, 2, s, e)
        if self.add:  # negative case: an expanded value read by arithmetic
            return q + wide.reshape(b, 2 * h, s, e) + wide.sum()
        return torch.nn.functional.scaled_dot_product_attention(q, *(wide.reshape(b, 2 * h, s, e),) * 2)


def test_an_expand_copied_by_a_reshape_runs_on_the_engine():
    """Before: "expand of a value that is not an attention mask": every ``repeat_kv`` ran in torch and
    split a decoder's plan per layer. After: the expand is a stride-0 view, the reshape one copy."""
    import gml

    q, kv = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    result = gml.optimize(_RepeatKV().eval(), (q, kv))
    assert result.runtime.runtime == "engine", str(result.runtime)
    with torch.no_grad():
        torch.testing.assert_close(result.executable(q, kv), _RepeatKV()(q, kv), rtol=1e-5, atol=1e-5)
    other = gml.optimize(_RepeatKV(add=True).eval(), (q, kv))
    assert "expand of a value read by other than" in str(other.runtime)
    with torch.no_grad():
        torch.testing.assert_close(other.executable(q, kv), _RepeatKV(add=True)(q, kv), rtol=1e-5, atol=1e-5)
