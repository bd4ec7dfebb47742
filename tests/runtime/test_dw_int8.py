"""GML's depthwise INT8 conv (native/dw_int8.h, issue #23): MobileNet / EfficientNet / ConvNeXt-style
convs with one filter per channel, on CPUs without VNNI.

It multiplies two taps of a channel per ``vpmaddwd`` lane pair in int16 (``x - zp`` and the weight):
exact for any s8 weights, 8-bit included, so the tests hold it to exact integer arithmetic. With an
fp32 output, ``float32(S) * float32(src_scale * w_scale) + bias`` bit for bit (S the direct conv's
integer sum, padding at the zero point), at the range limits too; with INT8 outputs, the Python
executor and the direct engine conv within one rounding step. Convs it is not for (a channel
multiplier above 1, grouped convs, non-square or other windows, dilation) stay direct even when
forced (``GML_WINOGRAD=1``, which forces GML's own INT8 convs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gml.ir.values import ConvSpec, PostOp, QParams
from gml.quant import modules as qm
from runtime.helpers import (
    OWN_IN,
    OWN_IN_ZP,
    OWN_KERNEL_MARKS,
    OWN_OUT,
    assert_close_int,
    assert_concurrent_calls_agree,
    check_forced_conv,
    engine_in_mode,
    own_conv_steps,
    rand_u8,
)

pytestmark = OWN_KERNEL_MARKS

IN, IN_ZP, OUT = OWN_IN, OWN_IN_ZP, OWN_OUT

KERNEL = "gml:dw"


def _weight(c: int, k: int, seed: int, wmax: int = 127) -> torch.Tensor:
    """Depthwise weights [C, 1, k, k], the full 8-bit range by default (the kernel is exact for it)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-wmax - 1, wmax + 1, (c, 1, k, k), dtype=torch.int8, generator=gen)


def _dwconv(c, k, spec, in_qp, out_qp, post=None, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(c, generator=gen) * 0.01 + 0.002
    b = torch.randn(c, generator=gen) if bias else None
    return qm.QConv2d(_weight(c, k, seed), scale, b, spec, in_qp, out_qp, post_op=post)


def _exact(x: torch.Tensor, zp: int, w: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """S: the depthwise conv of (x - zp) with w, zero padding in that shifted domain (float64: exact)."""
    return F.conv2d(x.double() - zp, w.double(), stride=spec.stride, padding=spec.padding, groups=w.shape[0])


CASES = {  # (batch, C, H, W, k, stride, padding)
    "3x3": (1, 32, 12, 11, 3, 1, 1),  # MobileNet's, odd widths (a 3-column tail)
    "3x3s2": (1, 24, 13, 10, 3, 2, 1),  # stride 2 on an odd and an even side
    "c13": (2, 13, 7, 9, 3, 1, 1),  # channels past the last 8-channel block, batch 2
    "5x5s2": (1, 40, 11, 14, 5, 2, 2),  # EfficientNet's
    "7x7": (1, 16, 9, 8, 7, 1, 3),  # ConvNeXt's
    "pad0": (1, 8, 6, 7, 3, 1, 0),  # a window that never leaves the image
    "tiny": (1, 8, 2, 1, 3, 1, 1),  # a 2 x 1 image: every window mostly padding
}


def _case(case: str):
    n, c, h, w, k, s, p = CASES[case]
    return n, c, h, w, k, ConvSpec(stride=(s, s), padding=(p, p), groups=c)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("in_qp", [IN, IN_ZP], ids=["zp0", "zp37"])
def test_fp32_output_is_the_exact_integer_sum_scaled(monkeypatch, case, in_qp):
    n, c, h, w, k, spec = _case(case)
    mod = _dwconv(c, k, spec, in_qp, None)
    x = rand_u8(n, c, h, w, seed=1)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert own_conv_steps(eng, KERNEL), eng.step_impls()
    scale = torch.tensor(in_qp.scale, dtype=torch.float32) * mod.weight_scale.float()
    want = _exact(x, in_qp.zero_point, mod.weight, spec).float() * scale.view(1, -1, 1, 1)
    want = want + mod.bias.float().view(1, -1, 1, 1)
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize("x_val,zp,w_val", [(255, 0, 127), (255, 0, -128), (0, 255, -128)])
def test_exact_at_the_range_limits(monkeypatch, x_val, zp, w_val):
    # every pair at |255 * 128| * 2 (int16 products would saturate; vpmaddwd's int32 pairs do not): a
    # 7x7 window of constant extremes, both signs in one call
    spec = ConvSpec(stride=(1, 1), padding=(3, 3), groups=16)
    w = torch.full((16, 1, 7, 7), w_val, dtype=torch.int8)
    w[1::2] = 127 if w_val < 0 else -128
    x = torch.full((1, 16, 9, 9), x_val, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    mod = qm.QConv2d(w, torch.full((16,), 1e-3), None, spec, QParams(1.0, zp), None)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert own_conv_steps(eng, KERNEL), eng.step_impls()
    want = _exact(x, zp, w, spec).float() * 1e-3
    assert float(want.abs().max()) > 1.5e3  # 49 taps of 255 * 128 in the interior
    assert torch.equal(got, want), float((got - want).abs().max())


POSTS = {
    "relu6": (IN_ZP, QParams(0.03, 0), PostOp("hardtanh", (0.0, 6.0))),  # MobileNetV2's
    "relu": (IN, OUT, PostOp("relu")),
    "none": (IN_ZP, OUT, None),
    "swish": (IN_ZP, QParams(0.05, 12), PostOp("swish")),  # EfficientNet's SiLU
    "hardswish": (IN, QParams(0.05, 12), PostOp("hardswish")),  # MobileNetV3's
}


@pytest.mark.parametrize("case", ["3x3", "3x3s2", "c13", "5x5s2", "7x7"])
@pytest.mark.parametrize("post", list(POSTS))
def test_int8_outputs_match_the_executor_and_the_direct_conv(monkeypatch, case, post):
    n, c, h, w, k, spec = _case(case)
    in_qp, out_qp, post_op = POSTS[post]
    mod = _dwconv(c, k, spec, in_qp, out_qp, post_op, seed=3)
    check_forced_conv(monkeypatch, mod, [rand_u8(n, c, h, w, seed=2)], KERNEL, against_direct=True)


@pytest.mark.parametrize("act", ["swish", "hardswish"])
@pytest.mark.parametrize("case", ["c13", "5x5s2"])
def test_act_stages_on_the_exact_sum(monkeypatch, act, case):
    # an fp32 output: the act of float32(S) * scale + bias, as torch computes it, within float
    # rounding (the kernel's exp is a polynomial, the 5 channels past the 8-block go through finish1)
    n, c, h, w, k, spec = _case(case)
    mod = _dwconv(c, k, spec, IN_ZP, None, PostOp(act), seed=11)
    x = rand_u8(n, c, h, w, seed=12)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert own_conv_steps(eng, KERNEL), eng.step_impls()
    scale = torch.tensor(IN_ZP.scale, dtype=torch.float32) * mod.weight_scale.float()
    pre = _exact(x, IN_ZP.zero_point, mod.weight, spec).float() * scale.view(1, -1, 1, 1) + mod.bias.view(1, -1, 1, 1)
    want = F.silu(pre) if act == "swish" else F.hardswish(pre)
    assert float(pre.min()) < -4 and float(pre.max()) > 4  # both tails of the act
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_residual_sum_with_its_zero_point(monkeypatch):
    n, c, h, w = 2, 24, 10, 9
    spec = ConvSpec(stride=(1, 1), padding=(1, 1), groups=c)
    mod = qm.QConv2dAdd(
        _weight(c, 3, 5), torch.full((c,), 4e-3), torch.randn(c), spec, IN, QParams(0.3, 101), QParams(0.4, 90)
    )
    xs = [rand_u8(n, c, h, w, seed=6), rand_u8(n, c, h, w, seed=7)]
    check_forced_conv(monkeypatch, mod, xs, KERNEL, n_inputs=2)


@pytest.mark.parametrize(
    "cin,cout,k,spec",
    [
        (8, 16, (3, 3), ConvSpec(stride=(1, 1), padding=(1, 1), groups=8)),  # channel multiplier 2
        (8, 8, (3, 3), ConvSpec(stride=(1, 1), padding=(1, 1), groups=4)),  # grouped, not depthwise
        (8, 8, (3, 5), ConvSpec(stride=(1, 1), padding=(1, 2), groups=8)),  # a non-square window
        (8, 8, (9, 9), ConvSpec(stride=(1, 1), padding=(4, 4), groups=8)),  # no compiled kernel
        (8, 8, (1, 1), ConvSpec(groups=8)),  # a per-channel scale, no window
        (8, 8, (3, 3), ConvSpec(stride=(1, 1), padding=(2, 2), dilation=(2, 2), groups=8)),
    ],
    ids=["multiplier2", "grouped", "3x5", "9x9", "1x1", "dilated"],
)
def test_ineligible_convs_stay_direct_even_when_forced(monkeypatch, cin, cout, k, spec):
    gen = torch.Generator().manual_seed(4)
    w = torch.randint(-64, 65, (cout, cin // spec.groups, *k), dtype=torch.int8, generator=gen)
    mod = qm.QConv2d(w, torch.full((cout,), 0.01), None, spec, IN, OUT)
    check_forced_conv(monkeypatch, mod, [rand_u8(1, cin, 12, 12)], KERNEL, taken=False)


def test_two_threads_running_one_plan(monkeypatch):
    """The tap-pair rows live in the call's scratchpad (one ring per OpenMP thread): concurrent calls
    of one plan agree bit for bit with the same calls made one at a time."""
    spec = ConvSpec(stride=(2, 2), padding=(2, 2), groups=24)
    mod = _dwconv(24, 5, spec, IN_ZP, OUT, PostOp("relu"), seed=8)
    calls = [[rand_u8(2, 24, 20, 18, seed=s)] for s in range(6)]
    eng, _ = engine_in_mode(monkeypatch, "1", mod, calls[0])
    assert own_conv_steps(eng, KERNEL), eng.step_impls()
    assert_concurrent_calls_agree(eng, calls)


def test_auto_considers_it_only_without_vnni(monkeypatch):
    from gml.runtime.target import detect_target

    spec = ConvSpec(stride=(1, 1), padding=(1, 1), groups=32)
    mod = _dwconv(32, 3, spec, IN, OUT, PostOp("relu"))
    x = rand_u8(1, 32, 28, 28)
    with torch.no_grad():
        ref = mod(x)
    eng, got = engine_in_mode(monkeypatch, "auto", mod, [x])
    if not detect_target().int8_winograd:
        assert not own_conv_steps(eng, KERNEL), eng.step_impls()  # VNNI / AMX: not even timed
    assert_close_int(ref, got)  # whichever kernel the timing chose


def test_the_runtime_report_counts_them(monkeypatch):
    spec = ConvSpec(stride=(1, 1), padding=(1, 1), groups=16)
    mod = _dwconv(16, 3, spec, IN, OUT, PostOp("relu"))
    eng, _ = engine_in_mode(monkeypatch, "1", mod, [rand_u8(1, 16, 10, 10)])
    assert eng.report.dw_convs == 1 and "1 depthwise INT8 conv(s)" in str(eng.report)
    eng0, _ = engine_in_mode(monkeypatch, "0", mod, [rand_u8(1, 16, 10, 10)])
    assert eng0.report.dw_convs == 0 and "tap-pair" not in str(eng0.report)
