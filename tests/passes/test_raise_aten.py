"""RaiseATen on the ATen calls a saved file holds (gml.io.load runs it): golden graphs and numerics."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from gml.passes.raise_aten import RaiseATen

aten = torch.ops.aten


def _graph(build) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    return fx.GraphModule(torch.nn.Module(), g)


def test_an_alias_is_the_tensor_itself_and_an_average_pool_is_raised():
    """Before: ``alias(x) → relu → avg_pool2d``; after: ``torch.relu(x) → F.avg_pool2d``, no alias."""
    gm = _graph(
        lambda g, x: g.call_function(
            aten.avg_pool2d.default,
            (g.call_function(aten.relu.default, (g.call_function(aten.alias.default, (x,)),)), [2, 2]),
        )
    )
    x = torch.randn(1, 3, 8, 8)
    want = gm(x)
    result = RaiseATen()(gm)
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert targets == [torch.relu, F.avg_pool2d]
    relu = next(n for n in result.graph_module.graph.nodes if n.target is torch.relu)
    assert relu.args[0].op == "placeholder"
    assert torch.equal(result.graph_module(x), want)


def test_an_op_with_no_torch_level_form_stays_aten_and_is_counted():
    """Negative case: ``aten.roll`` (Swin's shifted windows) has no entry: it stays, named in the notes."""
    gm = _graph(lambda g, x: g.call_function(aten.roll.default, (x, [1], [2])))
    result = RaiseATen()(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.roll.default]
    assert any("1 left as ATen" in note for note in result.notes), result.notes


class _Normalize(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * 2


def test_f_normalize_as_export_writes_it_is_raised_back():
    """Before: ``linalg_vector_norm → clamp_min → expand_as → div`` (export's F.normalize, as a saved
    XCiT holds it: 13 engine segments where the fresh model has 8); after: one ``F.normalize``,
    the engine's L2NormStep. Bit-exact: F.normalize runs those very ops."""
    x = torch.randn(2, 5, 16)
    gm = torch.export.export(_Normalize(), (x,)).module()
    assert any(n.target is aten.linalg_vector_norm.default for n in gm.graph.nodes)
    want = gm(x)
    result = RaiseATen()(gm)
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert F.normalize in targets and aten.linalg_vector_norm.default not in targets
    (call,) = [n for n in result.graph_module.graph.nodes if n.target is F.normalize]
    assert call.kwargs == {"p": 2.0, "dim": -1, "eps": 1e-12}
    assert torch.equal(result.graph_module(x), want)


def test_a_norm_over_two_dims_is_not_a_normalize():
    """Negative case: the same ops over dims [1, 2] are not F.normalize (which takes one dim)."""
    from gml.passes.raise_aten import _written_normalize

    def build(g, x):
        norm = g.call_function(aten.linalg_vector_norm.default, (x, 2.0, [1, 2], True))
        clamped = g.call_function(aten.clamp_min.default, (norm, 1e-12))
        return g.call_function(aten.div.Tensor, (x, g.call_function(aten.expand_as.default, (clamped, x))))

    gm = _graph(build)
    div = next(n for n in gm.graph.nodes if n.target is aten.div.Tensor)
    assert "over several dims" in _written_normalize(div)
    x = torch.randn(2, 3, 4)
    want = gm(x)
    result = RaiseATen()(gm)
    assert F.normalize not in [n.target for n in result.graph_module.graph.nodes]
    assert torch.equal(result.graph_module(x), want)


class _Rotary(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32).type_as(x)  # Llama's RMSNorm on an fp32 model, Gemma's type_as: identities
        return torch.cat((-h[..., 4:], h[..., :4]), dim=-1).to(torch.bfloat16)  # rotate_half, then a real cast


def test_neg_is_raised_and_an_identity_cast_is_the_tensor():
    """Before: ``aten.to.dtype(x, float32)`` / ``aten.type_as(x, x)`` of an fp32 ``x`` and ``aten.neg``
    (export's Llama, Gemma); after: no identity cast (torch returns ``x`` itself) and ``torch.neg``
    (Normalize's MulScalar(-1)). The
    cast to bf16 is a real conversion: it stays (negative case)."""
    x = torch.randn(2, 3, 8)
    gm = torch.export.export(_Rotary(), (x,)).module()
    casts = [n for n in gm.graph.nodes if n.target is aten.to.dtype]
    assert len(casts) == 2
    want = gm(x)
    result = RaiseATen()(gm)
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.neg in targets and aten.neg.default not in targets and aten.type_as.default not in targets
    (cast,) = [n for n in result.graph_module.graph.nodes if n.target is aten.to.dtype]
    assert cast.args[1] is torch.bfloat16
    assert torch.equal(result.graph_module(x), want)


def test_a_linear_on_a_piece_of_a_packed_weight_is_an_nn_linear_sharing_it():
    """Before: ``w_q, w_kv = split_with_sizes(W, [4, 8]); linear(x, w_kv, b_kv)`` (nn.MultiheadAttention's
    cross-attention, in a torch.export graph); after: an ``nn.Linear`` whose weight is a view of W
    (no copy) and the same numbers. Negative: a piece of a computed tensor stays a call."""
    owner = torch.nn.Module()
    owner.w = torch.nn.Parameter(torch.randn(12, 6), requires_grad=False)
    owner.b = torch.nn.Parameter(torch.randn(12), requires_grad=False)
    g = fx.Graph()
    x = g.placeholder("x")
    w, b = g.get_attr("w"), g.get_attr("b")
    ws = g.call_function(aten.split_with_sizes.default, (w, [4, 8]))
    bs = g.call_function(aten.split_with_sizes.default, (b, [4, 8]))
    kv = g.call_function(
        aten.linear.default, (x, g.call_function(operator.getitem, (ws, 1)), g.call_function(operator.getitem, (bs, 1)))
    )
    doubled = g.call_function(aten.mul.Tensor, (w, 2.0))  # computed: its piece is no constant
    other = g.call_function(
        aten.linear.default,
        (x, g.call_function(operator.getitem, (g.call_function(aten.split_with_sizes.default, (doubled, [4, 8])), 0))),
    )
    g.output((kv, other))
    gm = fx.GraphModule(owner, g)
    x_val = torch.randn(3, 6)
    want = gm(x_val)
    result = RaiseATen()(gm)
    out = result.graph_module
    linears = [m for m in out.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 1 and linears[0].weight.untyped_storage().data_ptr() == owner.w.untyped_storage().data_ptr()
    assert sum(n.target is aten.linear.default for n in out.graph.nodes) == 1  # the computed one
    got = out(x_val)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
