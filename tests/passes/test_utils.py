from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx import subgraph_rewriter

from gml.passes.utils import add_module, match_chain, remove_unused_nodes, replace_module


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)) + x)


def test_remove_unused_nodes_keeps_node_that_still_has_users():
    gm = fx.symbolic_trace(Residual().eval())
    conv = next(n for n in gm.graph.nodes if n.target == "conv")
    x = conv.args[0]  # read by conv AND by the residual add
    bn = next(n for n in gm.graph.nodes if n.target == "bn")
    # Rewire bn's users to conv (as a fold would), then ask to remove everything on the path.
    bn.replace_all_uses_with(conv)
    erased = remove_unused_nodes(gm.graph, [bn, conv, x])
    assert erased == 1  # only bn: conv and x still have users
    names = [n.name for n in gm.graph.nodes]
    assert "bn" not in names and "conv" in names
    assert len(x.users) == 2  # the skip connection still reads x
    gm.graph.lint()


def test_remove_unused_nodes_is_recursive_on_dead_chains():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    nodes = {n.name: n for n in gm.graph.nodes}
    out = nodes["output"]
    out.args = (nodes["input_1"],)  # the whole chain becomes dead
    assert remove_unused_nodes(gm.graph, [nodes["_2"]]) == 3
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "output"]


def test_match_chain_matches_module_types_and_every_spelling():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 3, 1)
            self.b = nn.BatchNorm2d(3)
            self.c = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            x = self.b(self.a(x)).relu()  # method spelling
            return F.relu(self.c(x))  # function spelling

    gm = fx.symbolic_trace(M().eval())
    m, skips = match_chain(gm, [nn.Conv2d, nn.BatchNorm2d, "relu"])
    assert [[n.name for n in mm.nodes] for mm in m] == [["a", "b", "relu"]]
    m2, _ = match_chain(gm, ["conv", "relu"])
    assert [[n.name for n in mm.nodes] for mm in m2] == [["c", "relu_1"]]
    assert skips == []


def test_match_chain_reports_fanout_as_skip():
    gm = fx.symbolic_trace(Residual().eval())
    conv = next(n for n in gm.graph.nodes if n.target == "conv")
    with gm.graph.inserting_after(conv):
        extra = gm.graph.call_function(operator.neg, (conv,))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((out.args[0], extra),)
    gm.recompile()
    matches, skips = match_chain(gm, [nn.Conv2d, nn.BatchNorm2d])
    assert matches == []
    assert len(skips) == 1 and skips[0].reason == "conv has 2 users, so it cannot be fused away"


def test_subgraph_rewriter_matches_call_module_by_name_not_type():
    """Why gml has match_chain: torch's rewriter compares call_module targets by attribute name."""

    class Pattern(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Named(Pattern):
        pass

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Linear(2, 2)

        def forward(self, x):
            return torch.relu(self.other(x))

    def replacement(x):
        return torch.sigmoid(x)

    same_name = fx.symbolic_trace(Named())
    other_name = fx.symbolic_trace(Renamed())
    assert len(subgraph_rewriter.replace_pattern(same_name, fx.symbolic_trace(Pattern()), replacement)) == 1
    assert subgraph_rewriter.replace_pattern(other_name, fx.symbolic_trace(Pattern()), replacement) == []
    # match_chain finds both, because it looks at the module type.
    assert len(match_chain(fx.symbolic_trace(Renamed()), [nn.Linear, "relu"])[0]) == 1


def test_add_and_replace_module():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    name = add_module(gm, "1", nn.ReLU())
    assert name == "1_1"
    replace_module(gm, "1", nn.Sigmoid())
    assert isinstance(gm.get_submodule("1"), nn.Sigmoid)
