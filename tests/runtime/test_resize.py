"""Nearest-neighbour resizing on the engine (``F.interpolate`` / ``nn.Upsample``, mode ``nearest`` or
``nearest-exact``): one gather step (native/resize.h) whose source positions are torch's own, so the
output equals eager's bit for bit, for any factor, in plain or channels-last layouts. Before, every
interpolate ended an engine segment (GhostNetV2: 15 segments, now 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import gml
from gml.runtime import compile_engine, unavailable_reason
from gml.runtime.rules.shape import nearest_index

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _graph(**kw) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(F.interpolate, (x,), kw))
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize(
    "shape, kw",
    [
        ((2, 3, 5, 4), dict(scale_factor=2.0)),
        ((1, 4, 5, 7), dict(size=(10, 21))),
        ((1, 4, 7, 10), dict(size=(10, 7))),  # up in one dim, down in the other: uneven
        ((1, 3, 9, 9), dict(scale_factor=0.5)),
        ((1, 3, 6, 5), dict(scale_factor=(1.7, 2.3))),
        ((1, 3, 6, 5), dict(size=(11, 8), mode="nearest-exact")),
        ((2, 3, 9), dict(size=14)),
        ((1, 2, 3, 4, 5), dict(scale_factor=2.0)),
    ],
    ids=str,
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_nearest_resize_is_eagers_gather(shape, kw, channels_last):
    x = torch.randn(*shape)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    gm = _graph(**kw)
    eng = compile_engine(gm, [x])
    assert eng.report.path == "engine" and not eng.report.shape_fallbacks, str(eng.report)
    assert "gml:resize_nearest" in [impl for _, impl in eng.step_impls()]
    torch.testing.assert_close(eng(x), gm(x), rtol=0, atol=0)


def test_the_index_is_torchs_own():
    """Across factors where float rounding matters (torch computes ``floor(o * in / out)`` in float32)."""
    for n_in in range(1, 40):
        for n_out in (1, 3, 7, 2 * n_in, 3 * n_in + 1, max(1, n_in // 3)):
            want = F.interpolate(torch.arange(n_in).float().view(1, 1, n_in), size=n_out).flatten()
            assert nearest_index(n_in, n_out, None, "nearest") == want.long().tolist()


class GhostGate(nn.Module):
    """GhostNetV2's DFC attention: a pooled gate resized back to the feature map, times it."""

    def __init__(self, module: bool) -> None:
        super().__init__()
        self.conv, self.gate = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest") if module else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        g = torch.sigmoid(self.gate(F.avg_pool2d(y, 2)))
        g = self.up(g) if self.up is not None else F.interpolate(g, size=y.shape[-2:], mode="nearest")
        return y * g


@pytest.mark.parametrize("module", [False, True], ids=["F.interpolate", "nn.Upsample"])
def test_a_gate_resized_between_convs_is_one_segment(module):
    torch.manual_seed(0)
    model, x = GhostGate(module).eval(), torch.randn(1, 3, 12, 10)
    res = gml.optimize(model, x, runtime="engine")
    assert res.runtime.segments == 1 and not res.runtime.torch_nodes, str(res.runtime)
    assert not res.runtime.reference_steps and not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-6)


def test_bilinear_stays_in_torch_with_its_reason():
    gm = _graph(scale_factor=2.0, mode="bilinear")
    eng = compile_engine(gm, [torch.randn(1, 2, 4, 4)])
    assert eng.report.path == "torch"
    assert [n.reason for n in eng.report.torch_nodes] == [
        "interpolate mode 'bilinear' (the engine resizes by nearest neighbour)"
    ]
