"""gml.ir.match: chain and DAG patterns, commutative inputs, and rules whose check gives a reason."""

from __future__ import annotations

import torch
from torch import fx, nn

from gml.ir.match import Match, Op, Rule, Var, apply_rules, matches


def _gm(fn) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def test_chain_pattern_matches_any_spelling_of_a_kind():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return torch.relu(self.conv(x))

    gm = fx.symbolic_trace(M())
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    (m,) = matches(Op("relu", Op("conv", Var("x"), name="conv"), name="act"), relu, dict(gm.named_modules()))
    assert m["conv"].target == "conv" and m["x"].op == "placeholder" and m.root is relu


def test_dag_pattern_binds_a_shared_value_once():
    # SiLU spelled out: x * sigmoid(x) reads x twice; x * sigmoid(y) must not match
    silu = Op("mul", Var("x"), Op("sigmoid", Var("x")), commutative=True)
    gm_yes = _gm(lambda x: x * torch.sigmoid(x))
    gm_no = _gm(lambda x, y: x * torch.sigmoid(y))
    mul_yes = next(n for n in gm_yes.graph.nodes if n.op == "call_function" and "mul" in str(n.target))
    mul_no = next(n for n in gm_no.graph.nodes if n.op == "call_function" and "mul" in str(n.target))
    assert len(matches(silu, mul_yes)) == 1
    assert matches(silu, mul_no) == []


def test_dag_attention_shape():
    # two matmuls around a softmax: softmax(q @ k) @ v
    attn = Op("matmul", Op("softmax", Op("matmul", Var("q"), Var("k"), name="scores"), name="p"), Var("v"))
    gm = _gm(lambda q, k, v: torch.matmul(torch.softmax(torch.matmul(q, k), -1), v))
    root = [n for n in gm.graph.nodes if n.target is torch.matmul][-1]
    (m,) = matches(attn, root)
    assert [m[k].name for k in ("q", "k", "v")] == ["q", "k", "v"]


def test_commutative_pattern_tries_both_operand_orders():
    pat = Op("add", Op("relu", Var("a"), name="r"), Var("b"), commutative=True)
    gm = _gm(lambda x, y: y + torch.relu(x))
    add = next(n for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target))
    (m,) = matches(pat, add)
    assert m["a"].name == "x" and m["b"].name == "y"


class ReluOfRelu(Rule):
    """Replaces ``relu(relu(x))`` with ``relu(x)``."""

    name = "relu∘relu"
    pattern = Op("relu", Op("relu", Var("x"), name="inner"), name="outer")

    def check(self, m: Match) -> str | None:
        return f"inner relu has {len(m['inner'].users)} users" if len(m["inner"].users) > 1 else None

    def rewrite(self, m: Match) -> fx.Node:
        return m["inner"]


def test_rule_rewrites_and_reports_declines_with_the_reason():
    gm = _gm(lambda x: torch.relu(torch.relu(x)))
    report = apply_rules(gm, [ReluOfRelu()])
    gm.recompile()
    assert report.rewrites == {"relu∘relu": 1} and report.declined == []
    assert sum(n.target is torch.relu for n in gm.graph.nodes) == 1
    x = torch.randn(5)
    assert torch.equal(gm(x), torch.relu(x))

    def shared(x):
        r = torch.relu(x)
        return torch.relu(r) + r

    gm2 = _gm(shared)
    before = gm2.code
    report2 = apply_rules(gm2, [ReluOfRelu()])
    assert report2.total == 0 and gm2.code == before
    ((_node, rule, reason),) = report2.declined
    assert rule == "relu∘relu" and reason == "inner relu has 2 users"
