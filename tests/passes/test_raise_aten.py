"""RaiseATen on the ATen calls a saved file holds (gml.io.load runs it): golden graphs and numerics."""

from __future__ import annotations

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
