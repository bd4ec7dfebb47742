"""A pad before a conv in the engine's plan (gml.runtime.rules: shape.emit_pad, conv._absorb_pad).

timm's "same" padding (``tf_efficientnet_*``, ``tf_mixnet_*``, ...) pads a stride-2 conv's input by
widths computed from its size: ``(math.ceil(ih / s) - 1) * s + (k - 1) * d + 1 - ih``. Those sizes
are segment nodes (true division and ``math.ceil`` included), and a zero pad (an INT8 model's: the
zero point) read by a conv is that conv's own padding: no step writes the padded copy. Before, the
true division cut tf_efficientnet_lite0's plan into 5 segments and its 8 pads were 20% of its fp32
plan (AMD EPYC Zen 4). A pad the conv cannot take is written as before; every case is checked
against eager.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gml
from gml.runtime import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


class SamePad(nn.Module):
    """timm's ``pad_same`` then a conv (``Conv2dSame``); ``value`` the pad's fill."""

    def __init__(self, k: int = 3, stride: int = 2, depthwise: bool = False, value: float = 0.0) -> None:
        super().__init__()
        self.k, self.s, self.value = k, stride, value
        self.pre = nn.Conv2d(3, 8, 1)  # no activation: an INT8 model's pad fills a non-zero zero point
        self.conv = nn.Conv2d(8, 8, k, stride, groups=8 if depthwise else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        ih, iw = x.size()[-2:]
        ph = (math.ceil(ih / self.s) - 1) * self.s + self.k - ih
        pw = (math.ceil(iw / self.s) - 1) * self.s + self.k - iw
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=self.value)
        return self.conv(x)


def _steps(res) -> list[tuple[str, str]]:
    """``(node, implementation)`` of every native step of every plan of the result's engine."""
    return list(res.engine.step_impls())


def _segments(res) -> int:
    return len(res.engine.segments())


@pytest.mark.parametrize("depthwise", [False, True], ids=["dense", "depthwise"])
@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("size", [(16, 16), (15, 18)], ids=["even", "odd"])
def test_a_same_pad_is_the_convs_own_padding(depthwise, k, size):
    torch.manual_seed(0)
    model, x = SamePad(k, depthwise=depthwise).eval(), torch.randn(1, 3, *size)
    res = gml.optimize(model, x, runtime="engine")
    assert _segments(res) == 1, str(res.runtime)
    assert not [s for s in _steps(res) if s[0].startswith("pad")], _steps(res)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)
        y = torch.randn(2, 3, size[0] + 3, size[1] + 1)  # other widths: another plan
        torch.testing.assert_close(res.executable(y), model(y), rtol=1e-5, atol=1e-5)


def test_a_pad_with_another_value_is_written():
    """A pad of 1.5 is not a conv's zero padding: the pad's steps stay, the numbers are eager's."""
    torch.manual_seed(0)
    model, x = SamePad(value=1.5).eval(), torch.randn(1, 3, 12, 12)
    res = gml.optimize(model, x, runtime="engine")
    assert [s for s in _steps(res) if s[0].startswith("pad")], _steps(res)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


class PadWiderThanTheWindow(nn.Module):
    """Pads of 3 (computed from a size, so no pass folds them) before a 3 x 3 conv: some windows
    see only padding, which oneDNN's jitted convs do not take as padding."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.conv = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        p = x.size(-1) // x.size(-1) * 3
        return self.conv(F.pad(x, (p, p, p, p)))


def test_a_pad_wider_than_the_window_is_written():
    torch.manual_seed(0)
    model, x = PadWiderThanTheWindow().eval(), torch.randn(1, 3, 8, 8)
    res = gml.optimize(model, x, runtime="engine")
    assert [s for s in _steps(res) if s[0].startswith("pad")], _steps(res)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


class PadReadTwice(nn.Module):
    """The padded value read by the conv and by an add (and returned): written once, for them."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.conv = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pre(x)
        p = F.pad(x, (0, x.size(-1) % 2 + 1, 0, x.size(-2) % 2 + 1))
        return self.conv(p), p * 2.0


class PadThenSumIntoItsSource(nn.Module):
    """``x`` padded, then ``conv(z) + x`` accumulated in ``x``'s memory (the residual sum: ``x`` is
    not read after it in the graph), then the pad read: the pad must read ``x`` before the sum
    overwrites it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.pre2 = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 1)
        self.res, self.conv = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, 2)

    def forward(self, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, z = self.pre(inp), self.pre2(inp)
        p = F.pad(x, (0, x.size(-1) % 2 + 1, 0, x.size(-2) % 2 + 1), value=0.5)  # written, not absorbed
        y = self.res(z) + x
        return self.conv(p), y


@pytest.mark.parametrize("model", [PadReadTwice, PadThenSumIntoItsSource], ids=["read-twice", "sum-into-source"])
def test_a_pad_read_by_more_than_a_conv_matches_eager(model):
    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(1, 3, 10, 10)
    res = gml.optimize(m, x, runtime="engine")
    assert res.engine is not None, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("depthwise", [False, True], ids=["dense", "depthwise"])
def test_an_int8_same_pad_is_the_qconvs_padding(depthwise):
    """The lowered INT8 pad (``torch.constant_pad_nd`` of the integers with the zero point, here not
    0) is the qconv's padding: one segment, no pad step, the Python executor's integers."""
    torch.manual_seed(0)
    model, x = SamePad(depthwise=depthwise).eval(), torch.randn(1, 3, 16, 16)
    q = gml.quantize(model, 4, example_inputs=(x,), per_layer=False, cost_policy="off", keep_broken=True)
    assert q.precision == "int8", q.precision_reason
    assert _segments(q) == 1, str(q.runtime)
    assert not [s for s in _steps(q) if s[0].startswith("constant_pad")], _steps(q)
    with torch.no_grad():
        torch.testing.assert_close(q.executable(x), q.module(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "pad", [nn.ConstantPad2d(1, 0.0), nn.ZeroPad2d((1, 2, 0, 1)), nn.ConstantPad2d(1, -0.5)], ids=repr
)
def test_a_pad_module_is_planned_like_f_pad(pad):
    """BiT's stem: conv → ``nn.ConstantPad2d(1, 0)`` → max pool. The module had no rule, so it ended
    the segment (resnetv2_50x1_bit: 2 segments); it is the F.pad rule's now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), pad, nn.MaxPool2d(3, 2), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(1, 3, 13, 12)
    res = gml.optimize(model, x, runtime="engine")
    assert _segments(res) == 1 and str(res.runtime).startswith("runtime: engine"), str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)
