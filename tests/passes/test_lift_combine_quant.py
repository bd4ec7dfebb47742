"""LiftCombineQuant on hand-built fx graphs (before → after), numerics, and skip reasons."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn
from torch.testing import FileCheck

from gml.ir import library
from gml.ir.values import TensorQParams as QParams
from gml.kernels.int8_ops import register as register_int8_ops
from gml.passes.lift_combine_quant import LiftCombineQuant, output_qparams, quantize_of
from gml.passes.manager import PassManager
from gml.passes.utils import modules_of

Q = torch.quantize_per_tensor
pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


def _gm(graph: fx.Graph, attrs: dict[str, torch.Tensor] | None = None) -> fx.GraphModule:
    root = nn.Module()
    for name, value in (attrs or {}).items():
        root.register_buffer(name, value)
    gm = fx.GraphModule(root, graph)
    gm.graph.lint()
    return gm


def _exact_pair(expected, got) -> None:
    assert len(expected) == len(got)
    for b, a in zip(expected, got):
        assert _same(b, a)


def _count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target or n.target == target)


def _run_pass(gm: fx.GraphModule, **kw):
    return LiftCombineQuant(**kw)(gm)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, QTensors included (same scale, zero point and integers)."""
    if a.is_quantized != b.is_quantized:
        return False
    if a.is_quantized:
        same_qp = a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
        return same_qp and torch.equal(a.int_repr(), b.int_repr())
    return torch.equal(a, b)


def test_lift_moves_quantize_above_view_chain_to_producer():
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    f = g.call_function(torch.flatten, (r, 1))
    v = g.call_method("reshape", (f, 2, -1))
    q = g.call_function(Q, (v, 0.05, 3, torch.quint8))
    g.output(q)
    gm = _gm(g)
    x_in = torch.randn(2, 3, 4, 4)
    expected = gm(x_in)

    res = _run_pass(gm)

    assert res.modified and res.matches == 1
    FileCheck().check("torch.relu").check("torch.quantize_per_tensor").check("torch.flatten").check("reshape").run(
        gm.code
    )
    quant = next(n for n in gm.graph.nodes if n.target is Q)
    assert quant.args[0].target is torch.relu  # reads the real producer now
    assert _count(gm, Q) == 1 and _count(gm, torch.flatten) == 1
    assert _same(gm(x_in), expected)
    assert "lifted: 1" in res.notes[0]


def test_lift_across_flatten_module():
    g = fx.Graph()
    root = nn.Module()
    root.flat = nn.Flatten()
    x = g.placeholder("x")
    f = g.call_module("flat", (x,))
    g.output(g.call_function(Q, (f, 0.1, 0, torch.quint8)))
    gm = fx.GraphModule(root, g)
    x_in = torch.rand(2, 3, 2)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.matches == 1
    quant = next(n for n in gm.graph.nodes if n.target is Q)
    assert quant.args[0].op == "placeholder"
    assert _same(gm(x_in), expected)


def test_lift_skips_view_with_two_users_and_says_why():
    g = fx.Graph()
    x = g.placeholder("x")
    f = g.call_function(torch.flatten, (x, 1))
    q = g.call_function(Q, (f, 0.1, 0, torch.quint8))
    s = g.call_function(torch.sum, (f,))  # a second reader of the fp32 view
    g.output((q, s))
    gm = _gm(g)
    code_before = gm.code
    res = _run_pass(gm)
    assert not res.modified
    assert gm.code == code_before
    assert len(res.skips) == 1
    assert res.skips[0].reason.startswith("flatten (torch.flatten) has 2 users")
    assert res.skips[0].pattern == "lift quantize"


def test_partial_lift_stops_at_multi_user_view():
    g = fx.Graph()
    x = g.placeholder("x")
    f = g.call_function(torch.flatten, (x, 1))  # 2 users: stays fp32
    v = g.call_method("view", (f, -1))  # single user: the quantize moves above it
    q = g.call_function(Q, (v, 0.1, 0, torch.quint8))
    g.output((q, f))
    gm = _gm(g)
    x_in = torch.rand(2, 3)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.matches == 1
    quant = next(n for n in gm.graph.nodes if n.target is Q)
    assert quant.args[0].target is torch.flatten
    assert "lifted above 1 view(s), then stopped" in res.skips[0].reason
    _exact_pair(expected, gm(x_in))


def test_combine_compares_values_not_nodes():
    # torch.ao gives every observer its own attribute: equal values live in different buffers.
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    s0, z0 = g.get_attr("scale_a"), g.get_attr("zp_a")
    q0 = g.call_function(Q, (r, s0, z0, torch.quint8))
    s1, z1 = g.get_attr("scale_b"), g.get_attr("zp_b")
    q1 = g.call_function(Q, (r, s1, z1, torch.quint8))
    q2 = g.call_function(Q, (r, 0.02, 5, torch.quint8))  # Python numbers, same values
    g.output((q0, q1, q2))
    attrs = {
        "scale_a": torch.tensor(0.02, dtype=torch.float64),
        "zp_a": torch.tensor(5),
        "scale_b": torch.tensor(0.02, dtype=torch.float64),
        "zp_b": torch.tensor(5),
    }
    gm = _gm(g, attrs)
    x_in = torch.randn(8)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.matches == 2
    assert _count(gm, Q) == 1
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert len(set(out.args[0])) == 1  # all three outputs are one quantize node now
    assert not any(n.op == "get_attr" and n.target == "scale_b" for n in gm.graph.nodes)  # dead attrs gone
    _exact_pair(expected, gm(x_in))


def test_combine_keeps_different_qparams_and_reports_the_values():
    g = fx.Graph()
    x = g.placeholder("x")
    q0 = g.call_function(Q, (x, 0.02, 0, torch.quint8))
    q1 = g.call_function(Q, (x, 0.03, 0, torch.quint8))
    q2 = g.call_function(Q, (x, 0.02, 4, torch.quint8))
    g.output((q0, q1, q2))
    gm = _gm(g)
    res = _run_pass(gm)
    assert not res.modified
    assert _count(gm, Q) == 3
    reasons = [s.reason for s in res.skips]
    assert reasons == [
        "qparams differ from quantize_per_tensor: scale 0.02 vs 0.03",
        "qparams differ from quantize_per_tensor: zero_point 0 vs 4",
    ]


def test_combine_through_getitem_of_multi_output_producer():
    # split → two getitem nodes for output 0 → view → quantize each: one tensor, one quantize.
    g = fx.Graph()
    x = g.placeholder("x")
    parts = g.call_function(torch.split, (x, 2, 1))
    a = g.call_function(operator.getitem, (parts, 0))
    b = g.call_function(operator.getitem, (parts, 0))
    other = g.call_function(operator.getitem, (parts, 1))
    qa = g.call_function(Q, (g.call_method("flatten", (a, 1)), 0.1, 2, torch.quint8))
    qb = g.call_function(Q, (g.call_method("flatten", (b, 1)), 0.1, 2, torch.quint8))
    qo = g.call_function(Q, (other, 0.1, 2, torch.quint8))  # a different output: stays separate
    g.output((qa, qb, qo))
    gm = _gm(g)
    x_in = torch.randn(2, 4, 3)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.matches == 3  # 2 lifts + 1 combine
    assert _count(gm, Q) == 2
    assert _count(gm, "flatten") == 1  # the rebuilt identical views merged too
    quant_inputs = sorted(n.args[0].args[1] for n in gm.graph.nodes if n.target is Q)
    assert quant_inputs == [0, 1]  # each quantize reads a getitem, never the tuple
    _exact_pair(expected, gm(x_in))


def test_slices_of_one_tensor_are_different_tensors():
    # y[:, -1] and y[:, 0] (an LSTM's last step): getitem with slice indices is a view, not a tuple
    # element; the pass used to hash the index (TypeError on Python 3.11) and was rolled back.
    g = fx.Graph()
    x = g.placeholder("x")
    last = g.call_function(operator.getitem, (x, (slice(None), -1)))
    first = g.call_function(operator.getitem, (x, (slice(None), 0)))
    qa = g.call_function(Q, (last, 0.1, 2, torch.quint8))
    qb = g.call_function(Q, (first, 0.1, 2, torch.quint8))
    g.output((qa, qb))
    gm = _gm(g)
    x_in = torch.randn(2, 5, 3)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.skips == [] and _count(gm, Q) == 2  # nothing to combine: two different values
    _exact_pair(expected, gm(x_in))


def test_merged_views_keep_the_earliest_so_order_stays_valid():
    g = fx.Graph()
    x = g.placeholder("x")
    q1 = g.call_function(Q, (x, 0.1, 0, torch.quint8))
    late = g.call_method("reshape", (q1, -1))  # created first, so first among q1's users...
    with g.inserting_before(late):  # ...but the other view and its reader come earlier in the graph
        q2 = g.call_function(Q, (x, 0.1, 0, torch.quint8))
        early = g.call_method("reshape", (q2, -1))
        d = g.call_method("dequantize", (early,))
    g.output((d, late))
    gm = _gm(g)
    x_in = torch.rand(2, 3)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.matches == 1
    gm.graph.lint()  # the surviving view precedes both readers
    assert _count(gm, "reshape") == 1 and _count(gm, Q) == 1
    got = gm(x_in)
    assert torch.equal(got[0], expected[0]) and _same(got[1], expected[1])


def test_drop_dequantize_quantize_with_equal_qparams():
    # q1 → dq → flatten → q2(same values): after lift, q2 reads dq; the pair is a no-op.
    g = fx.Graph()
    x = g.placeholder("x")
    q1 = g.call_function(Q, (x, g.get_attr("s1"), g.get_attr("z1"), torch.quint8))
    dq = g.call_method("dequantize", (q1,))
    f = g.call_function(torch.flatten, (dq, 1))
    q2 = g.call_function(Q, (f, g.get_attr("s2"), g.get_attr("z2"), torch.quint8))
    g.output(g.call_method("dequantize", (q2,)))
    s = torch.tensor(0.04)
    gm = _gm(g, {"s1": s, "z1": torch.tensor(7), "s2": s.clone(), "z2": torch.tensor(7)})
    x_in = torch.randn(2, 3, 5)
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.notes == ["lifted: 1, combined: 0, dq→q dropped: 1"]
    assert _count(gm, Q) == 1 and _count(gm, "dequantize") == 1
    FileCheck().check("torch.quantize_per_tensor").check("torch.flatten").check("dequantize").run(gm.code)
    assert torch.equal(gm(x_in), expected)


def test_requantize_is_kept_with_reason():
    g = fx.Graph()
    x = g.placeholder("x")
    q1 = g.call_function(Q, (x, 0.04, 7, torch.quint8))
    dq = g.call_method("dequantize", (q1,))
    q2 = g.call_function(Q, (dq, 0.05, 7, torch.quint8))
    g.output(q2)
    gm = _gm(g)
    res = _run_pass(gm)
    assert not res.modified
    assert [s.reason for s in res.skips] == ["requantization, qparams differ: scale 0.04 vs 0.05"]


def test_float32_and_float64_scales_differ_and_the_reason_shows_it():
    a = QParams(torch.tensor([0.02], dtype=torch.float64), torch.tensor([0]), torch.quint8)
    b = QParams(torch.tensor([0.02]).double(), torch.tensor([0]), torch.quint8)  # via float32
    assert not a.equals(b)
    assert a.difference(b) == "scale 0.02 vs 0.019999999552965164"


def test_dtype_difference_is_reported():
    a = QParams(torch.tensor([0.1], dtype=torch.float64), torch.tensor([0]), torch.quint8)
    b = QParams(torch.tensor([0.1], dtype=torch.float64), torch.tensor([0]), torch.qint8)
    assert not a.equals(b)
    assert a.difference(b) == "dtype quint8 vs qint8"


def test_per_channel_quantize_is_not_lifted():
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.call_method("transpose", (x, 0, 1))
    q = g.call_function(torch.quantize_per_channel, (t, g.get_attr("s"), g.get_attr("z"), 0, torch.qint8))
    g.output(q)
    gm = _gm(g, {"s": torch.tensor([0.1, 0.2, 0.3]), "z": torch.zeros(3, dtype=torch.long)})
    res = _run_pass(gm)
    assert not res.modified
    assert res.skips[0].reason == "per-channel quantize (axis 0): a view may move the axis"


def test_qparams_computed_at_run_time_cannot_be_compared():
    g = fx.Graph()
    x = g.placeholder("x")
    scale = g.call_function(torch.amax, (x,))
    q0 = g.call_function(Q, (x, scale, 0, torch.quint8))
    q1 = g.call_function(Q, (x, 0.1, 0, torch.quint8))
    g.output((q0, q1))
    gm = _gm(g)
    res = _run_pass(gm)
    assert not res.modified
    assert res.skips[0].reason == "cannot compare qparams: scale is computed at run time (amax)"


class Quantize(nn.Module):
    """A user module that happens to be called ``Quantize`` and stores ``output_scale`` buffers."""

    def __init__(self, scale: float, zp: int) -> None:
        super().__init__()
        self.register_buffer("output_scale", torch.tensor(scale, dtype=torch.float64))
        self.register_buffer("output_zp", torch.tensor(zp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(x / float(self.output_scale)) + int(self.output_zp), 0, 255).to(torch.uint8)


def test_gml_quantize_ops_lift_combine_and_cancel():
    register_int8_ops()
    quantize, dequantize = library.op("quantize"), library.op("dequantize")
    g = fx.Graph()
    x = g.placeholder("x")
    v = g.call_method("view", (x, -1))
    a = g.call_function(quantize, (v, 0.1, 3))
    b = g.call_function(quantize, (x, 0.1, 3))  # same tensor, same values: merges with the lifted a
    d = g.call_function(dequantize, (b, 0.1, 3))
    c = g.call_function(quantize, (d, 0.1, 3))  # dequantize → quantize with equal qparams: a no-op
    g.output((a, c))
    gm = fx.GraphModule(nn.Module(), g)
    mods = modules_of(gm)
    assert quantize_of(gm, a, mods).qparams.dtype == torch.uint8
    x_in = torch.rand(2, 3) * 20
    expected = gm(x_in)
    res = _run_pass(gm)
    assert res.notes == ["lifted: 1, combined: 1, dq→q dropped: 1"]
    ops = [library.gml_op_name(n) for n in gm.graph.nodes]
    assert ops.count("quantize") == 1 and "dequantize" not in ops
    got = gm(x_in)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_modules_are_not_recognised_by_class_name():
    # ADR 005: a module called "Quantize" is not a quantize op because of its name (no duck typing)
    root = nn.Module()
    root.qa, root.qb = Quantize(0.1, 3), Quantize(0.1, 3)
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_module("qa", (x,)), g.call_module("qb", (x,))))
    gm = fx.GraphModule(root, g)
    assert quantize_of(gm, next(n for n in gm.graph.nodes if n.op == "call_module"), modules_of(gm)) is None
    assert not _run_pass(gm).modified


def test_output_qparams_reads_gml_op_arguments_and_views():
    g = fx.Graph()
    q = g.call_function(library.op("quantize"), (g.placeholder("x"), 0.25, 9))
    v = g.call_method("flatten", (q,))
    g.output(v)
    gm = fx.GraphModule(nn.Module(), g)
    qp = output_qparams(gm, v, modules_of(gm))
    assert qp is not None and qp.scale.item() == 0.25 and qp.zero_point.item() == 9


def test_reference_graph_through_pass_manager_is_exact():
    from gml.quant.frontend import prepare_reference

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.pool = nn.AdaptiveAvgPool2d(2)
            self.fc = nn.Linear(32, 4)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 10)
    ref = prepare_reference(Net().eval(), (x,), 2, progress=False).graph_module
    n_q = _count(ref, Q)
    result = PassManager([LiftCombineQuant()], strict=True).run(ref, [(x,), (torch.randn(3, 3, 10, 10),)])
    rec = result.report.record("lift_combine_quant")
    assert rec.status == "applied" and rec.max_abs_err == 0.0
    # flatten's shared-qparams quantize moved above it and cancelled against the pool's.
    assert rec.notes == ["lifted: 1, combined: 0, dq→q dropped: 1"]
    assert _count(result.graph_module, Q) == n_q - 1
