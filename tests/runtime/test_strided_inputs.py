"""A segment input that is a non-dense view (a channel slice of an NHWC tensor: what ``torch.split``
gives a mixed-kernel conv in timm's mixnet_s) is planned with the strides it is called with.

The plan used to be compiled from ``clone()`` copies of the inputs, which are dense: the engine then
read the slice as if it were dense NHWC and returned wrong numbers (caught only by the agreement
check in ``gml.optimize``, which then kept mixnet_s in torch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.kernels.fp32 import FusedConv, PostOp
from gml.runtime import unavailable_reason
from gml.runtime.compile import same_layout_copy
from runtime.helpers import calibrated_qconv, check_engine, graph_of, rand_u8

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _nhwc_channel_slice(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    v = x.contiguous(memory_format=torch.channels_last)[:, lo:hi]
    assert not v.is_contiguous() and not v.is_contiguous(memory_format=torch.channels_last)
    return v


@pytest.mark.parametrize("k,groups", [(1, 1), (3, 5), (3, 1)])
def test_fp32_conv_on_a_channel_slice_of_an_nhwc_tensor(k, groups):
    torch.manual_seed(0)
    x = _nhwc_channel_slice(torch.randn(1, 12, 7, 9), 5, 10)  # 5 channels at offset 5, W stride 12
    conv = nn.Conv2d(5, 10, k, padding=k // 2, groups=groups).eval()
    check_engine(graph_of(FusedConv.from_conv(conv, PostOp("relu"))), x)


def test_int8_conv_on_a_channel_slice_of_an_nhwc_tensor():
    x = rand_u8(2, 11, 5, 6)[:, 3:9]  # 6 of 11 channels: strides (330, 1, 66, 11), offset 3
    assert not x.is_contiguous(memory_format=torch.channels_last)
    mod = calibrated_qconv(x, cout=7, k=3, padding=(1, 1))
    check_engine(graph_of(mod), x)


class MixedConv(nn.Module):
    """mixnet's MixedConv2d: split the channels, a conv of another kernel size per chunk, concat."""

    def __init__(self) -> None:
        super().__init__()
        self.pw = nn.Conv2d(4, 12, 1)
        self.dw = nn.ModuleList([nn.Conv2d(6, 6, k, padding=k // 2, groups=6) for k in (3, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(self.pw(x), [6, 6], dim=1)
        return torch.cat([c(t) for c, t in zip(self.dw, chunks)], dim=1)


def test_optimize_runs_a_mixed_conv_on_the_engine():
    torch.manual_seed(0)
    x = torch.randn(1, 4, 10, 10).contiguous(memory_format=torch.channels_last)
    r = gml.optimize(MixedConv().eval(), (x,))
    assert r.engine is not None, str(r.runtime)
    with torch.no_grad():
        torch.testing.assert_close(r.executable(x), r.module(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(24.0).reshape(2, 3, 4)[:, 1:],
        torch.arange(6.0).reshape(1, 6).expand(3, 6),  # overlapping (stride 0)
        torch.empty(0, 3),
    ],
    ids=["slice", "expanded", "empty"],
)
def test_same_layout_copy_keeps_shape_strides_and_values(t):
    c = same_layout_copy(t)
    assert c.shape == t.shape and c.stride() == t.stride() and torch.equal(c, t)
    assert c.numel() == 0 or c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
