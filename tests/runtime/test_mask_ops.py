"""A padding mask's arithmetic on the engine (``to(bool)``, ``index``, ``&``, ``expand`` into an
attention's mask: gml.runtime.rules.attention) vs the Python executor, op by op."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.ir.attention import attention_op
from gml.runtime import compile_engine, unavailable_reason
from runtime.helpers import run_both

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
aten = torch.ops.aten


def _graph(build) -> fx.GraphModule:
    g = fx.Graph()
    g.output(build(g))
    return fx.GraphModule(nn.Module(), g)


def _impls(eng) -> list[str]:
    (seg,) = eng.segments()
    return list(next(iter(seg._plans.values()))[0].step_impls())


def _mask(b: int, s: int, keep: list[int]) -> torch.Tensor:
    m = torch.zeros(b, s, dtype=torch.long)
    for i, k in enumerate(keep):
        m[i, :k] = 1
    return m


def test_int64_mask_to_bool():
    gm = _graph(lambda g: g.call_function(aten.to.dtype, (g.placeholder("m"), torch.bool)))
    m = _mask(3, 7, [7, 4, 1])
    m[1, 2] = 5  # any nonzero is True
    ref, eng, got = run_both(gm, m)
    assert eng.report.path == "engine" and _impls(eng) == ["gml:mask_ne0"]
    assert got.dtype == torch.bool and torch.equal(got, ref)


def test_index_by_broadcast_aranges_and_by_arbitrary_indices():
    def build(g):
        x, i, j = g.placeholder("x"), g.placeholder("i"), g.placeholder("j")
        return g.call_function(aten.index.Tensor, (x, [i, j]))

    gm = _graph(build)
    x = _mask(3, 6, [6, 2, 4]).bool()
    i, j = torch.arange(3).view(3, 1, 1, 1), torch.arange(6).view(1, 1, 1, 6)
    ref, eng, got = run_both(gm, x, i, j)
    assert eng.report.path == "engine" and got.shape == (3, 1, 1, 6) and torch.equal(got, ref)
    xf = torch.randn(4, 5, 3)  # float rows, negative and repeated indices, a rest dim
    i2, j2 = torch.tensor([[0, -1], [2, 2]]), torch.tensor([4, -5])
    ref, eng, got = run_both(gm, xf, i2, j2)
    assert eng.report.path == "engine" and torch.equal(got, ref)
    with pytest.raises(IndexError, match="index 4 is out of bounds for size 4"):
        eng(xf, torch.tensor([[0, 4], [2, 2]]), j2)


def test_and_broadcasting_both_operands():
    gm = _graph(lambda g: g.call_function(aten.__and__.Tensor, (g.placeholder("a"), g.placeholder("b"))))
    a = torch.tensor([True, False, True, True, True]).view(1, 1, 5, 1)
    b = _mask(2, 5, [5, 3]).bool().view(2, 1, 1, 5)
    ref, eng, got = run_both(gm, a, b)
    assert eng.report.path == "engine" and _impls(eng) == ["gml:mask_and"]
    assert got.shape == (2, 1, 5, 5) and torch.equal(got, ref)


@pytest.mark.parametrize("keep", [[9, 9], [9, 4], [1, 6]])
def test_transformers_mask_chain_into_attention_is_one_plan(keep):
    """transformers' sdpa mask: to(bool) -> index by aranges -> & all-true -> expand -> attention."""
    b, h, s, e = 2, 2, 9, 8

    def build(g):
        q, k, v = (g.placeholder(n) for n in "qkv")
        m, i, j, ones = (g.placeholder(n) for n in ("m", "i", "j", "ones"))
        t = g.call_function(aten.to.dtype, (m, torch.bool))
        idx = g.call_function(aten.index.Tensor, (t, [i, j]))
        both = g.call_function(aten.__and__.Tensor, (ones, idx))
        full = g.call_method("expand", (both, [b, -1, s, s]))
        return g.call_function(attention_op(), (q, k, v, full, None, False))

    gm = _graph(build)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, e, generator=gen) for _ in range(3))
    i, j = torch.arange(b).view(b, 1, 1, 1), torch.arange(s).view(1, 1, 1, s)
    ones = torch.ones(1, 1, s, 1, dtype=torch.bool)
    ref, eng, got = run_both(gm, q, k, v, _mask(b, s, keep), i, j, ones)
    assert eng.report.path == "engine" and eng.report.segments == 1, str(eng.report)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_mask_ops_the_engine_does_not_take_stay_in_torch_with_the_reason():
    def build(g):
        x = g.placeholder("x")
        f = g.call_function(aten.to.dtype, (x, torch.float32))
        e = g.call_method("expand", (g.call_function(aten.to.dtype, (x, torch.bool)), [2, 3]))
        return f, e

    gm = _graph(build)
    eng = compile_engine(gm, (torch.ones(1, 3, dtype=torch.long),))
    reasons = {n.name: n.reason for n in eng.report.torch_nodes}
    assert reasons["to_dtype"] == "a conversion to torch.float32 (the engine converts masks to bool only)"
    assert reasons["expand"].startswith("expand of a value read by other than an attention (as its mask)")
    got = eng(torch.tensor([[1, 0, 2]]))
    assert torch.equal(got[1], torch.tensor([[True, False, True]] * 2))


def test_a_bitwise_and_of_uint8_tensors_is_never_computed_as_a_mask_and():
    gm = _graph(lambda g: g.call_function(aten.__and__.Tensor, (g.placeholder("a"), g.placeholder("b"))))
    a, b = torch.tensor([[6, 3, 255]], dtype=torch.uint8), torch.tensor([[3, 5, 16]], dtype=torch.uint8)
    eng = compile_engine(gm, (a, b))  # no dtype metadata: the plan sees the values and declines
    assert torch.equal(eng(a, b), a & b)
    assert any("& of u8 and u8" in r for r in eng.report.shape_fallbacks.values()), eng.report.shape_fallbacks
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(a, b)  # with metadata: stays in torch, with the reason
    eng = compile_engine(gm, (a, b))
    assert [n.reason for n in eng.report.torch_nodes] == [
        "& of torch.uint8, torch.uint8 tensors (the engine ands bool masks)"
    ]
    assert torch.equal(eng(a, b), a & b)
