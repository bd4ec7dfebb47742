"""The translation table (gml.runtime.rules): keyed by op, one family per op, no class-name keys."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.ir import library
from gml.runtime.rules import TRANSLATION_RULES, Call, TranslationRule, _table, always, rule_for
from gml.runtime.rules.shape import MOVES

#: ops the reader names that are neither gml library ops nor view methods: gml.attention (its schema
#: is gml.ir.attention's), torch.flatten, split pieces, the padding mask's arithmetic
READER_OPS = {
    "attention",
    "softmax",
    "interpolate",
    "normalize",
    "addcmul",
    "sum",
    "flatten",
    "split",
    "split_item",
    "cat",
    "stack",
    "size",
    "pad",
    "roll",
    "matmul",
    "mean",
    "to_bool",
    "index",
    "and",
    "expand_mask",
}


def test_every_key_is_an_op_not_a_class_name():
    names = {k for k in TRANSLATION_RULES if isinstance(k, str)}
    ops = set(library.vocabulary())  # the INT8 table and every op declared in its own module (gml.group_norm)
    assert names <= ops | MOVES | READER_OPS, sorted(names - ops - MOVES - READER_OPS)
    others = [k for k in TRANSLATION_RULES if not isinstance(k, str)]
    assert others and all(isinstance(k, type) or callable(k) for k in others)


def test_a_module_is_matched_by_its_class_not_its_name():
    class LayerNorm(nn.Module):  # a model's own LayerNorm: not torch's
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    x = fx.Graph().placeholder("x")
    rule, reason = rule_for(Call(LayerNorm, LayerNorm(), (x,)))
    assert rule is None and reason == "no engine kernel for LayerNorm"
    rule, reason = rule_for(Call(nn.LayerNorm, nn.LayerNorm(8), (x,)))
    assert rule is TRANSLATION_RULES[nn.LayerNorm] and reason is None


def test_an_op_in_two_families_is_refused():
    one = TranslationRule(always, lambda *a: None)
    with pytest.raises(AssertionError, match=r"\['qconv'\] given twice"):
        _table({"qconv": one}, {"qconv": one})


def test_basic_indexing_is_a_view_and_other_indexing_is_not():
    """``x[..., ::2]`` (RoPE's even half), ``x[:, :c]``, ``x[0, None]`` are views the engine aliases,
    also of a segment's own placeholder (no metadata: the partition vetted it); an index tensor,
    a list or a bool gathers, and a tuple's item is a split piece."""
    import operator

    from gml.runtime.rules import read_call

    g = fx.Graph()
    x = g.placeholder("x")  # a segment input: no metadata
    tup = g.call_function(torch.split, (x, 2))
    ids = g.placeholder("ids")
    basic = [(Ellipsis, slice(None, None, 2)), (slice(None), slice(None, 3)), (0, None), slice(1, None)]
    other = [[0, 2], (slice(None), ids), True]
    nodes = [g.call_function(operator.getitem, (x, i)) for i in [*basic, *other]]
    piece = g.call_function(operator.getitem, (tup, 0))
    gm = fx.GraphModule(nn.Module(), g)
    ops = [(c.op if (c := read_call(gm, n)) is not None else None) for n in nodes]
    assert ops == ["getitem"] * len(basic) + [None] * len(other)
    assert read_call(gm, piece).op == "split_item"
