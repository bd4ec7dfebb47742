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
from gml.ir import library
from gml.models import default_input_shapes, load_model

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


def _tiny_tf_efficientnet() -> nn.Module:
    """timm's own EfficientNet builder at toy size, with TF "same" padding: ``Conv2dSame`` (padding
    from ``x.shape``: shape-only Python), ``BatchNormAct2d`` and squeeze-excite; the patterns of the
    tf_* families in a model that runs in a second (the sweep covers the real ones)."""
    from timm.models._efficientnet_builder import decode_arch_def
    from timm.models.efficientnet import EfficientNet

    torch.manual_seed(0)
    arch = decode_arch_def([["ds_r1_k3_s1_e1_c8"], ["ir_r1_k3_s2_e3_c16_se0.25"], ["ir_r1_k5_s2_e3_c24"]])
    return EfficientNet(arch, num_classes=10, num_features=32, stem_size=8, pad_type="same").eval()


def test_timm_model_folds_every_bn_and_quantizes_as_reported():
    model = _tiny_tf_efficientnet()
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"Conv2dSame", "BatchNormAct2d", "SqueezeExcite"} <= kinds
    opt = gml.optimize(model, (X,), n_check_inputs=1)
    assert _bn_left(opt.module) == 0
    assert opt.rel_err < 1e-4
    q = gml.quantize(model, 2, example_inputs=(X,), per_layer=False, cost_policy="off", keep_intermediates=True)
    assert not q.report.rolled_back
    in_graph = Counter(library.gml_op_name(n) or getattr(n.target, "__name__", "") for n in q.module.graph.nodes)
    reported = Counter(e.result for e in q.coverage.lowered)
    for op in ("qconv", "qconv_add", "qlinear", "constant_pad_nd"):
        assert in_graph[op] == reported[op], op
    # every conv and the classifier run INT8; the stride-2 "same" pads run on the integers
    assert in_graph["qconv"] + in_graph["qconv_add"] == sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert in_graph["constant_pad_nd"] >= 2
    with torch.no_grad():
        assert _cos(q.module(X), q.reference(X)) > 0.99
