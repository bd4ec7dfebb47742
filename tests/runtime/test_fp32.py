"""fp32 fused kernels (gml.kernels.fp32) through the engine vs the Python executor."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import gml
from gml.kernels.fp32 import FusedConv, FusedConvAdd, FusedLinear, PostOp
from gml.runtime import compile_engine, unavailable_reason
from runtime.helpers import check_engine, graph_of

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _conv(cin, cout, k, **kw) -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(cin, cout, k, **kw).eval()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "cin,cout,k,kw",
    [
        (3, 8, 3, dict(padding=1)),
        (8, 8, 3, dict(padding=1, groups=8)),
        (6, 9, (3, 5), dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1))),
        (4, 4, 3, dict(padding=3, stride=2)),
    ],
)
def test_fused_conv(cin, cout, k, kw, channels_last):
    x = torch.randn(2, cin, 9, 11)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    check_engine(graph_of(FusedConv.from_conv(_conv(cin, cout, k, **kw), PostOp("relu"))), x)


POST_OPS = [PostOp(), PostOp("hardtanh", (0.0, 6.0)), PostOp("swish"), PostOp("gelu", (), "none")]


@pytest.mark.parametrize("post_op", POST_OPS, ids=str)
def test_fused_conv_post_ops(post_op):
    x = torch.randn(1, 5, 7, 7)
    check_engine(graph_of(FusedConv.from_conv(_conv(5, 6, 3, padding=1), post_op)), x)


@pytest.mark.parametrize("relu", [False, True])
def test_fused_conv_add(relu):
    x, other = torch.randn(1, 6, 8, 8), torch.randn(1, 8, 8, 8)
    mod = FusedConvAdd.from_conv(_conv(6, 8, 3, padding=1), relu=relu, inplace=False)
    check_engine(graph_of(mod, n_inputs=2, wiring=[(0, 1)]), x, other)


@pytest.mark.parametrize("post_op", [PostOp(), PostOp("relu")], ids=str)
def test_fused_linear(post_op):
    torch.manual_seed(0)
    x = torch.randn(3, 20)
    check_engine(graph_of(FusedLinear.from_linear(nn.Linear(20, 7), post_op)), x)


@pytest.mark.slow
def test_optimized_resnet18_through_the_engine():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    gm = gml.optimize(model, (x,)).module
    eng = compile_engine(gm, (x,))
    assert eng.report.engine_nodes == 23, str(eng.report)  # every conv, residual adds fused, pools; fc (MKL) in torch
    with torch.no_grad():
        torch.testing.assert_close(eng(x), gm(x), rtol=1e-4, atol=1e-4)
