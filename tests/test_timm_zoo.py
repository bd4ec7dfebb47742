"""A few real timm models through optimize and quantize (skipped without timm; ~seconds at 64x64).

The full sweep is benchmarks/zoo_sweep.py (docs/coverage.md).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gml
from gml.errors import ModelLoadError
from gml.models import default_input_shapes, load_model
from gml.quant.modules import GMLQuantModuleBase, Quantize

timm = pytest.importorskip("timm")

X = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _bn_left(gm: torch.fx.GraphModule) -> int:
    mods = dict(gm.named_modules())
    return sum(
        isinstance(mods.get(str(n.target)), nn.modules.batchnorm._BatchNorm) or n.target is F.batch_norm
        for n in gm.graph.nodes
    )


def test_timm_names_build_with_random_weights_and_their_default_shape():
    model = load_model("timm:resnet10t")
    assert not model.training
    assert default_input_shapes(model, "timm:resnet10t") == [(1, 3, 176, 176)]
    with pytest.raises(ModelLoadError, match="did you mean"):
        load_model("timm:resnet10tt")


def test_timm_model_folds_every_bn_and_quantizes_as_reported():
    """tf_mobilenetv3_small_minimal_100: Conv2dSame ("same" padding from x.shape: shape-only Python)
    and BatchNormAct2d, the smallest timm model with both (the sweep covers the rest)."""
    torch.manual_seed(0)
    model = timm.create_model("tf_mobilenetv3_small_minimal_100", pretrained=False).eval()
    opt = gml.optimize(model, (X,))
    assert _bn_left(opt.module) == 0
    assert opt.rel_err < 1e-4
    q = gml.quantize(model, 2, example_inputs=(X,), per_layer=False)
    assert not q.report.rolled_back
    mods = dict(q.module.named_modules())
    counts = Counter(
        type(m).__name__
        for n in q.module.graph.nodes
        if isinstance(m := mods.get(str(n.target)), GMLQuantModuleBase) and not isinstance(m, Quantize)
    )
    assert Counter(e.result for e in q.coverage.lowered) == counts
    assert counts["QBatchNorm2d"] == 0
    with torch.no_grad():
        assert _cos(q.module(X), q.reference(X)) > 0.99
