"""Engine rules beyond the first INT8 subset (#13): non-clamp activations, qmul, 1-D / 3-D convs and
linear on rank > 2 inputs, each against the Python executor on odd shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gml.ir.values import ConvSpec, PostOp, QParams
from gml.kernels import fp32
from gml.quant import modules as qm
from gml.runtime import compile_engine, unavailable_reason
from runtime.helpers import check_engine, fit_qparams, graph_of, int8_weight, rand_u8

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

IN = QParams(0.05, 120)


# ---------------------------------------------------------------- standalone activations
@pytest.mark.parametrize("op", ["hardswish", "sigmoid", "hardsigmoid"])
@pytest.mark.parametrize("shape", [(2, 5, 3, 7), (1, 3, 1, 1), (3, 11), (2, 4, 9)], ids=str)
def test_activation(op, shape):
    x = rand_u8(*shape, seed=len(shape))
    real = {"hardswish": F.hardswish, "sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}[op](
        (x.float() - IN.zero_point) * IN.scale
    )
    out_qp = fit_qparams(real)
    # the executor's sigmoid / hardsigmoid round twice (onto 1/256 first, then onto out_qp), so up
    # to one step off on many elements; the engine rounds once: within half a step of the exact value
    eng = check_engine(graph_of(qm.QActivation(PostOp(op), IN, out_qp)), x, frac=1.0)
    with torch.no_grad():
        got = eng(x)
    exact = real / out_qp.scale + out_qp.zero_point
    assert float((got.float() - exact.clamp(0, 255)).abs().max()) <= 0.5 + 1e-3


def test_an_activation_without_an_eltwise_form_stays_in_torch_with_its_reason():
    from gml.runtime.rules import Call, rule_for

    rule, reason = rule_for(Call("qactivation", SimpleNamespace(op="elu", scalars=[1.0]), ()))
    assert rule is None and reason.startswith("INT8 elu: ") and "unknown oneDNN post-op 'elu'" in reason


# ---------------------------------------------------------------- qmul (squeeze-excitation)
@pytest.mark.parametrize(
    ("a_shape", "b_shape", "a_qp", "b_qp"),
    [
        ((1, 16, 7, 5), (1, 16, 1, 1), QParams(0.04, 0), QParams(1 / 256, 0)),  # SE: relu map * sigmoid gate
        ((2, 6, 3, 3), (2, 6, 1, 1), QParams(0.04, 0), QParams(0.01, 17)),  # a gate with a zero point
        ((2, 6, 1, 1), (2, 6, 4, 4), QParams(0.02, 3), QParams(0.05, 120)),  # the gate first
        ((3, 10), (3, 10), QParams(0.05, 120), QParams(0.03, 60)),  # same shapes, both zero points
        ((2, 3, 5), (5,), QParams(0.05, 0), QParams(0.02, 0)),  # rank broadcast
    ],
    ids=str,
)
def test_mul(a_shape, b_shape, a_qp, b_qp):
    a, b = rand_u8(*a_shape, seed=1), rand_u8(*b_shape, seed=2)
    probe = qm.QMul(a_qp, b_qp, QParams(1.0, 0))
    real = probe.backend.dequantize(a, a_qp) * probe.backend.dequantize(b, b_qp)
    out_qp = fit_qparams(real)
    gm = graph_of(qm.QMul(a_qp, b_qp, out_qp), n_inputs=2, wiring=[(0, 1)])
    check_engine(gm, a, b, frac=0.05)  # a rounding tie here and there (1 of 30 elements)


def test_mul_with_both_inputs_broadcast_runs_in_torch_for_that_shape():
    a, b = rand_u8(2, 1, 4, seed=1), rand_u8(1, 3, 4, seed=2)
    gm = graph_of(qm.QMul(IN, IN, QParams(0.1, 10)), n_inputs=2, wiring=[(0, 1)])
    eng = check_engine(gm, a, b, expect_engine=False)
    assert "both inputs broadcast" in str(eng.report)


# ---------------------------------------------------------------- 1-D and 3-D convolutions
def _calibrated(cls, x: torch.Tensor, cout: int, k: tuple[int, ...], spec: ConvSpec, seed=0, **kw):
    w, s = int8_weight((cout, x.shape[1] // spec.groups, *k), seed)
    b = torch.randn(cout, generator=torch.Generator().manual_seed(seed))
    probe = cls(w, s, b, spec, IN, None, **kw)
    return cls(w, s, b, spec, IN, fit_qparams(probe(x)), **kw)


CONV1D = {
    "k3": ((2, 8, 17), 12, (3,), ConvSpec((1, 1), (0, 1), (1, 1), 1)),
    "stride2_dil2": ((1, 6, 20), 5, (3,), ConvSpec((1, 2), (0, 2), (1, 2), 1)),
    "depthwise": ((1, 8, 9), 8, (5,), ConvSpec((1, 1), (0, 2), (1, 1), 8)),
    "length1": ((1, 4, 1), 3, (3,), ConvSpec((1, 1), (0, 1), (1, 1), 1)),
}


@pytest.mark.parametrize("case", sorted(CONV1D))
def test_conv1d(case):
    shape, cout, k, spec = CONV1D[case]
    x = rand_u8(*shape)
    conv = _calibrated(qm.QConv1d, x, cout, (1, *k), spec, post_op=PostOp("hardswish"))
    check_engine(graph_of(conv), x)


CONV3D = {
    "k3": ((1, 4, 5, 6, 7), 6, (3, 3, 3), ConvSpec((1, 1, 1), (1, 1, 1), (1, 1, 1), 1)),
    "temporal_stride": ((2, 3, 4, 5, 5), 8, (3, 1, 1), ConvSpec((2, 1, 1), (1, 0, 0), (1, 1, 1), 1)),
    "groups_odd": ((1, 6, 3, 3, 3), 9, (1, 3, 3), ConvSpec((1, 2, 2), (0, 1, 1), (1, 1, 1), 3)),
}


@pytest.mark.parametrize("case", sorted(CONV3D))
def test_conv3d(case):
    shape, cout, k, spec = CONV3D[case]
    x = rand_u8(*shape).contiguous(memory_format=torch.channels_last_3d)
    try:
        conv = _calibrated(qm.QConv3d, x, cout, k, spec)
    except ValueError as e:  # a torch without onednn::qconv_pointwise
        pytest.skip(str(e))
    check_engine(graph_of(conv), x)


# ---------------------------------------------------------------- linear on rank > 2
@pytest.mark.parametrize("shape", [(2, 7, 16), (1, 1, 16), (2, 3, 5, 16)], ids=str)
@pytest.mark.parametrize("post_op", [None, PostOp("gelu", (), "tanh"), PostOp("relu")], ids=str)
def test_linear_rank_above_2(shape, post_op):
    x = rand_u8(*shape)
    w, s = int8_weight((9, 16))
    b = torch.randn(9)
    kw = dict(post_op=post_op) if post_op is not None else {}
    probe = qm.QLinear(w, s, b, IN, None, **kw)
    check_engine(graph_of(qm.QLinear(w, s, b, IN, fit_qparams(probe(x)), **kw)), x)
    check_engine(graph_of(qm.QLinear(w, s, b, IN, None, **kw)), x)  # fp32 output


def test_linear_on_a_non_collapsible_view_is_copied_first():
    x = rand_u8(4, 3, 16).transpose(0, 1)  # [3, 4, 16] whose leading dims do not merge
    w, s = int8_weight((5, 16))
    check_engine(graph_of(qm.QLinear(w, s, None, IN, None)), x)


def test_fp32_linear_rank_3():
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 7)
    mod = fp32.FusedLinear(lin.weight.detach(), lin.bias.detach(), post_op=fp32.PostOp("relu"))
    if not getattr(mod, "fused", True):
        pytest.skip("fp32 kernels unavailable")
    gm = graph_of(mod)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        ref = gm(x)
        eng = compile_engine(gm, (x,))
        got = eng(x)
    assert eng.report.path == "engine", str(eng.report)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- 3-D pools (video models)
@pytest.mark.parametrize(
    ("k", "s", "p", "ceil"), [((3, 3, 3), (2, 2, 2), (1, 1, 1), False), ((1, 3, 3), (1, 2, 2), (0, 1, 1), True)]
)
def test_maxpool3d(k, s, p, ceil):
    x = rand_u8(2, 4, 5, 7, 6).contiguous(memory_format=torch.channels_last_3d)
    check_engine(graph_of(qm.QMaxPool3d(k, s, p, (1, 1, 1), ceil, IN, IN)), x)


@pytest.mark.parametrize(("size", "out"), [((4, 6, 6), (1, 1, 1)), ((4, 6, 6), (2, 3, 1))], ids=str)
def test_adaptive_avgpool3d(size, out):
    x = rand_u8(2, 8, *size).contiguous(memory_format=torch.channels_last_3d)
    check_engine(graph_of(qm.QAdaptiveAvgPool3d(out, IN, QParams(0.04, 110))), x)


# ---------------------------------------------------------------- data movement on INT8 values
@pytest.mark.parametrize(
    "moves",
    [
        [("permute", (0, 2, 3, 1)), ("reshape", (2, -1, 5))],  # NHWC view, then a reshape that copies
        [("transpose", (1, 3)), ("contiguous", ())],  # a strided view, then a copy into contiguous
        [("unsqueeze", (2,)), ("squeeze", (2,)), ("view", (2, 5, 12))],  # views of views
    ],
    ids=str,
)
def test_moves_run_as_views_or_copies(moves):
    x = torch.randn(2, 5, 3, 4)
    mods = [qm.Quantize(IN)] + [qm.QMove(m, a, IN, IN) for m, a in moves] + [qm.Dequantize(IN)]
    gm = graph_of(*mods)
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == [
        "reshape" if m == "view" else m for m, _ in moves
    ]
    eng = check_engine(gm, x, frac=0.0)
    assert eng.report.engine_nodes == len(mods)


def test_a_move_of_an_fp32_torch_value_stays_in_torch_with_its_reason():
    from torch import fx

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.sin, (x,))
    g.output(g.call_method("permute", (y, 0, 2, 1)))
    eng = compile_engine(fx.GraphModule(torch.nn.Module(), g), (torch.randn(2, 3, 4),))
    assert [(n.op, n.reason) for n in eng.report.torch_nodes][-1] == (
        "permute",
        "permute of a value no lowered GML op made (an fp32 torch op's output: runs in torch)",
    )
