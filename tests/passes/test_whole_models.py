"""normalize → untie → fold_bn on real torchvision models (random init, eval), through the PassManager."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from gml import capture
from gml.passes.fold_bn import FoldBatchNorm
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize
from gml.passes.untie import UntieSharedModules

torchvision = pytest.importorskip("torchvision")

# model, input size, BatchNorms, residual adds, shared ReLU call sites to untie
MODELS = [
    ("resnet18", 64, 20, 8, 8),
    ("resnet50", 64, 53, 16, 32),
    ("mobilenet_v2", 64, 52, 10, 0),
]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    # Fresh BatchNorms are nearly the identity (mean 0, var 1, gamma 1, beta 0), which would let a
    # wrong fold pass; give them non-trivial statistics of a trained net's size.
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1, generator=g)
            m.running_var.uniform_(0.5, 2.0, generator=g)
            m.weight.data.uniform_(0.25, 1.0, generator=g)
            m.bias.data.uniform_(-0.1, 0.1, generator=g)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "size", "n_bn", "n_add", "n_untie"), MODELS, ids=[m[0] for m in MODELS])
def test_normalize_untie_fold(name: str, size: int, n_bn: int, n_add: int, n_untie: int):
    model = build(name)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        ref = model(x)
    gm = capture(model, (x,))
    out = PassManager([Normalize(), UntieSharedModules(), FoldBatchNorm()], strict=True).run(gm, [(x,)])
    report, result = out.report, out.graph_module

    normalize, untie, fold = (report.record(p) for p in ("normalize", "untie", "fold_bn"))
    assert report.rolled_back == [] and report.skips == []
    assert normalize.notes[0].endswith("(100.0%)") and normalize.max_abs_err == 0.0
    assert untie.matches == n_untie
    assert fold.matches == n_bn and fold.notes == [f"folded BatchNorm into Conv2d ×{n_bn}"]

    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in result.modules())
    assert [n for n in result.graph.nodes if n.op in ("call_function", "call_method")] == []
    sites = Counter(str(n.target) for n in result.graph.nodes if n.op == "call_module")
    assert max(sites.values()) == 1
    assert sum(type(result.get_submodule(t)).__name__ == "Add" for t in sites) == n_add

    with torch.no_grad():
        err = (result(x) - ref).abs().max().item()
    assert err < 1e-4, err
