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
READER_OPS = {"attention", "flatten", "split", "split_item", "cat", "to_bool", "index", "and", "expand_mask"}


def test_every_key_is_an_op_not_a_class_name():
    names = {k for k in TRANSLATION_RULES if isinstance(k, str)}
    assert names <= set(library.SCHEMAS) | MOVES | READER_OPS, sorted(names - set(library.SCHEMAS) - MOVES - READER_OPS)
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
