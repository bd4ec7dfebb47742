"""GML's patch GEMM for INT8 convs with few input channels (native/im2col_int8.h, issue #23): an RGB
stem on CPUs without VNNI.

Its arithmetic is exact for weights in [-64, 64] (vpmaddubsw pairs <= 2 * 255 * 64 < 32,767), so the
tests hold it to exact integer arithmetic: with an fp32 output, ``float32(S) * float32(src_scale *
w_scale) + bias`` bit for bit (S the direct conv's integer sum, padding at the zero point), at the
saturation bound too; with INT8 outputs, the Python executor and the direct engine conv within one
rounding step. Convs it cannot compute exactly (8-bit weights) or is not for (many channels, 1x1)
stay direct even when forced (``GML_WINOGRAD=1``, which forces GML's own INT8 convs).
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


KERNEL = "gml:im2col"


def _im2col_steps(eng) -> list[str]:
    return own_conv_steps(eng, KERNEL)


def _weight7(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Weights in [-64, 64]: the AVX2 tier's 7-bit range (docs/adr/011), what the kernel is exact for."""
    return torch.randint(-64, 65, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _qconv(cin, cout, k, spec, in_qp, out_qp, post=None, seed=0, bias=True):
    w = _weight7((cout, cin, *k), seed)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(cout, generator=gen) * 0.01 + 0.002
    b = torch.randn(cout, generator=gen) if bias else None
    return qm.QConv2d(w, scale, b, spec, in_qp, out_qp, post_op=post)


def _exact(x: torch.Tensor, zp: int, w: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """S: the conv of (x - zp) with w, zero padding in that shifted domain (float64: exact here)."""
    return F.conv2d(x.double() - zp, w.double(), stride=spec.stride, padding=spec.padding)


CASES = {  # (batch, Cin, Cout, H, W, kernel, stride, padding)
    "stem7x7s2": (1, 3, 64, 30, 26, (7, 7), (2, 2), (3, 3)),  # ResNet's stem, odd output counts
    "gray5x5": (2, 1, 17, 9, 11, (5, 5), (1, 1), (2, 2)),  # one channel, outputs past a 16-block
    "c8_3x3s2": (1, 8, 20, 10, 13, (3, 3), (2, 2), (1, 1)),
    "rect3x5_pad0": (3, 4, 16, 9, 12, (3, 5), (1, 2), (0, 1)),  # non-square, batch 3
    "c6_2x2": (1, 6, 5, 7, 7, (2, 2), (2, 2), (0, 0)),  # a window of 24 bytes, 5 outputs
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("in_qp", [IN, IN_ZP], ids=["zp0", "zp37"])
def test_fp32_output_is_the_exact_integer_sum_scaled(monkeypatch, case, in_qp):
    n, cin, cout, h, w, k, stride, pad = CASES[case]
    spec = ConvSpec(stride=stride, padding=pad)
    mod = _qconv(cin, cout, k, spec, in_qp, None)
    x = rand_u8(n, cin, h, w, seed=1)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert _im2col_steps(eng), eng.step_impls()
    scale = torch.tensor(in_qp.scale, dtype=torch.float32) * mod.weight_scale.float()
    want = _exact(x, in_qp.zero_point, mod.weight, spec).float() * scale.view(1, -1, 1, 1)
    want = want + mod.bias.float().view(1, -1, 1, 1)
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize("x_val,zp,w_val", [(255, 0, 64), (255, 0, -64), (0, 255, 64)])
def test_exact_at_the_int16_pair_bound(monkeypatch, x_val, zp, w_val):
    # every vpmaddubsw pair at 2 * 255 * 64 = 32,640 (32,767 saturates): a stem of constant extremes
    spec = ConvSpec(stride=(2, 2), padding=(3, 3))
    w = torch.full((16, 3, 7, 7), w_val, dtype=torch.int8)
    w[1::2] = -w_val  # both signs in one call
    x = torch.full((1, 3, 16, 16), x_val, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    mod = qm.QConv2d(w, torch.full((16,), 1e-3), None, spec, QParams(1.0, zp), None)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert _im2col_steps(eng), eng.step_impls()
    want = _exact(x, zp, w, spec).float() * 1e-3
    assert float(want.abs().max()) > 2.3e3  # 147 taps of 255 * 64 in the interior
    assert torch.equal(got, want), float((got - want).abs().max())


POSTS = {
    "relu": (IN, OUT, PostOp("relu")),
    "relu6": (IN_ZP, QParams(0.03, 0), PostOp("hardtanh", (0.0, 6.0))),
    "none": (IN_ZP, OUT, None),
}


@pytest.mark.parametrize("case", ["stem7x7s2", "gray5x5", "rect3x5_pad0"])
@pytest.mark.parametrize("post", list(POSTS))
def test_int8_outputs_match_the_executor_and_the_direct_conv(monkeypatch, case, post):
    n, cin, cout, h, w, k, stride, pad = CASES[case]
    in_qp, out_qp, post_op = POSTS[post]
    mod = _qconv(cin, cout, k, ConvSpec(stride=stride, padding=pad), in_qp, out_qp, post_op, seed=3)
    check_forced_conv(monkeypatch, mod, [rand_u8(n, cin, h, w, seed=2)], KERNEL, against_direct=True)


def test_residual_sum_with_its_zero_point(monkeypatch):
    n, cin, cout, h, w = 2, 3, 24, 12, 10
    spec = ConvSpec(stride=(1, 1), padding=(2, 2))
    wq = _weight7((cout, cin, 5, 5), 5)
    mod = qm.QConv2dAdd(wq, torch.full((cout,), 4e-3), torch.randn(cout), spec, IN, QParams(0.3, 101), QParams(0.4, 90))
    xs = [rand_u8(n, cin, h, w, seed=6), rand_u8(n, cout, h, w, seed=7)]
    check_forced_conv(monkeypatch, mod, xs, KERNEL, n_inputs=2)


@pytest.mark.parametrize(
    "cin,k,spec,wmax",
    [
        (3, (7, 7), ConvSpec(stride=(2, 2), padding=(3, 3)), 127),  # 8-bit weights: pairs could saturate
        (9, (3, 3), ConvSpec(stride=(2, 2), padding=(1, 1)), 64),  # more channels than it is for
        (3, (1, 1), ConvSpec(), 64),  # a 1x1 conv: no window to gather
        (4, (3, 3), ConvSpec(stride=(1, 1), padding=(2, 2), dilation=(2, 2)), 64),
        (4, (3, 3), ConvSpec(stride=(2, 2), padding=(1, 1), groups=2), 64),
    ],
    ids=["8bit", "c9", "1x1", "dilated", "grouped"],
)
def test_ineligible_convs_stay_direct_even_when_forced(monkeypatch, cin, k, spec, wmax):
    gen = torch.Generator().manual_seed(4)
    w = torch.randint(-wmax, wmax + 1, (8, cin // spec.groups, *k), dtype=torch.int8, generator=gen)
    w[0, 0, 0, 0] = wmax
    mod = qm.QConv2d(w, torch.full((8,), 0.01), None, spec, IN, OUT)
    check_forced_conv(monkeypatch, mod, [rand_u8(1, cin, 12, 12)], KERNEL, taken=False)


def test_two_threads_running_one_plan(monkeypatch):
    """The gathered patches live in the call's scratchpad (one slot per OpenMP thread): concurrent
    calls of one plan agree bit for bit with the same calls made one at a time."""
    mod = _qconv(3, 32, (7, 7), ConvSpec(stride=(2, 2), padding=(3, 3)), IN_ZP, OUT, PostOp("relu"), seed=8)
    calls = [[rand_u8(2, 3, 40, 36, seed=s)] for s in range(6)]
    eng, _ = engine_in_mode(monkeypatch, "1", mod, calls[0])
    assert _im2col_steps(eng), eng.step_impls()
    assert_concurrent_calls_agree(eng, calls)


def test_auto_considers_it_only_without_vnni(monkeypatch):
    from gml.runtime.target import detect_target

    mod = _qconv(3, 64, (7, 7), ConvSpec(stride=(2, 2), padding=(3, 3)), IN, OUT, PostOp("relu"))
    x = rand_u8(1, 3, 64, 64)
    with torch.no_grad():
        ref = mod(x)
    eng, got = engine_in_mode(monkeypatch, "auto", mod, [x])
    if not detect_target().int8_winograd:
        assert not _im2col_steps(eng), eng.step_impls()  # VNNI / AMX: not even timed
    assert_close_int(ref, got)  # whichever kernel the timing chose


def test_the_runtime_report_counts_them(monkeypatch):
    mod = _qconv(3, 16, (7, 7), ConvSpec(stride=(2, 2), padding=(3, 3)), IN, OUT, PostOp("relu"))
    eng, _ = engine_in_mode(monkeypatch, "1", mod, [rand_u8(1, 3, 20, 20)])
    assert eng.report.im2col_convs == 1 and "1 INT8 conv(s) with few input channels" in str(eng.report)
    eng0, _ = engine_in_mode(monkeypatch, "0", mod, [rand_u8(1, 3, 20, 20)])
    assert eng0.report.im2col_convs == 0 and "patch GEMM" not in str(eng0.report)
