from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from assets.models import SmallCNN
from gml.errors import GMLError, UnsupportedError
from gml.passes.fold_bn import FoldBatchNorm


def test_optimize_folds_bn_and_keeps_numerics():
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    res = gml.optimize(model, x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in res.module.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())  # caller's model untouched
    assert res.max_abs_err < 1e-4
    assert res.report.record("fold_bn").matches == 2
    assert not res.report.rolled_back
    torch.testing.assert_close(res.module(x), model(x), atol=1e-4, rtol=1e-4)


def test_optimize_with_explicit_passes():
    res = gml.optimize(SmallCNN().eval(), torch.randn(1, 3, 8, 8), passes=[FoldBatchNorm()])
    assert [r.name for r in res.report.records] == ["fold_bn"]


def test_optimize_refuses_training_mode():
    with pytest.raises(UnsupportedError, match="training mode"):
        gml.optimize(SmallCNN(), torch.randn(1, 3, 8, 8))


def test_unknown_pass_name():
    from gml.passes.pipeline import passes_by_name

    with pytest.raises(GMLError, match="Unknown pass"):
        passes_by_name(["fold_bn", "nope"])
