"""GML's INT8 Winograd, F(2x2, 3x3) and F(4x4, 3x3) (native/winograd_int8.h, docs/adr/010-winograd-conv.md,
issue #23).

Its arithmetic is exact: every output equals the direct conv's int32 sum before the output stage
(F(4x4, 3x3) while |S| < 2^25, which the engine checks per conv from the weights).
So the tests hold it to exact integer arithmetic, not to a bound:

* with an fp32 output and no post-op, ``float32(S) * float32(src_scale * w_scale) + bias`` bit for
  bit, S the exact integer sum (float64 conv of integers, exact at these sizes), at the extremes of
  the int16 / int32 ranges too;
* with INT8 outputs (ReLU, ReLU6, a residual with its zero point, a source zero point), the Python
  executor (oneDNN through torch) and the direct engine conv within one rounding step on few
  elements, as every INT8 kernel pair is compared (runtime.helpers.assert_close_int).

``GML_WINOGRAD=1`` forces it on any CPU with AVX2, with the larger tile its weights allow
(``TILES["4x4"]``), ``f2x3`` with 2x2 tiles (``TILES["2x2"]``); ``auto`` considers it only on
targets without VNNI (``Target.int8_winograd``), each tile timed against the direct conv.
``make test`` runs this file again under ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``AVX512_CORE``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gml.ir.target import Target
from gml.ir.values import ConvSpec, PostOp, QParams
from gml.quant import modules as qm
from gml.runtime.target import detect_target
from runtime.helpers import (
    OWN_IN,
    OWN_IN_ZP,
    OWN_KERNEL_MARKS,
    OWN_OUT,
    assert_close_int,
    assert_concurrent_calls_agree,
    check_forced_conv,
    engine_in_mode,
    int8_weight,
    own_conv_steps,
    rand_u8,
)

pytestmark = OWN_KERNEL_MARKS

IN, IN_ZP, OUT = OWN_IN, OWN_IN_ZP, OWN_OUT
OTHER = QParams(0.3, 101)


KERNEL = "gml:winograd_f"  # either tile
#: GML_WINOGRAD mode -> the kernel it forces where eligible (the suite's weights keep F(4x4, 3x3) exact)
TILES = {"2x2": ("f2x3", "gml:winograd_f2x3+s16"), "4x4": ("1", "gml:winograd_f4x3+s16")}
tiles = pytest.mark.parametrize("tile", list(TILES))


def _winograd_steps(eng, kernel: str = KERNEL) -> list[str]:
    return own_conv_steps(eng, kernel)


def _qconv(cin: int, cout: int, in_qp: QParams, out_qp: QParams | None, post: PostOp | None = None, seed: int = 0):
    w, s = int8_weight((cout, cin, 3, 3), seed)
    b = torch.randn(cout, generator=torch.Generator().manual_seed(seed))
    return qm.QConv2d(w, s, b, ConvSpec(padding=(1, 1)), in_qp, out_qp, post_op=post)


def _exact_sum(x: torch.Tensor, zp: int, w: torch.Tensor) -> torch.Tensor:
    """S = sum over (c, 3, 3) of (x - zp) * w, zero padding in the shifted domain (float64: exact)."""
    return F.conv2d(x.double() - zp, w.double(), padding=1)


SHAPES = [  # (batch, Cin, Cout, H, W): odd channels (a zero channel pair), outputs off 8 / 16, odd sizes,
    (1, 16, 24, 7, 7),  # one-pixel rows, batch > 1, a channel tail past 16
    (3, 21, 13, 5, 9),
    (2, 5, 7, 1, 4),
    (1, 35, 40, 30, 34),  # 255 tiles: several chunks, each thread its own
    (2, 64, 16, 2, 3),
    (5, 8, 17, 2, 2),  # 5 tiles, 1 tile, 2 tiles: every micro-kernel height (a chunk's tail rows;
    (1, 6, 16, 2, 2),  # 16 and 45 tiles above take 4 and 3)
    (1, 10, 16, 4, 2),
]


@tiles
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_qp", [IN, IN_ZP], ids=["zp0", "zp37"])
def test_fp32_output_is_the_exact_integer_sum_scaled(monkeypatch, shape, in_qp, tile):
    mode, kernel = TILES[tile]
    n, cin, cout, h, w = shape
    mod = _qconv(cin, cout, in_qp, None)
    x = rand_u8(n, cin, h, w)
    eng, got = engine_in_mode(monkeypatch, mode, mod, [x])
    assert _winograd_steps(eng, kernel), eng.step_impls()
    s = _exact_sum(x, in_qp.zero_point, mod.weight)
    scale = torch.tensor(in_qp.scale, dtype=torch.float32) * mod.weight_scale.float()
    want = s.float() * scale.view(1, -1, 1, 1) + mod.bias.float().view(1, -1, 1, 1)
    assert torch.equal(got, want), float((got - want).abs().max())


def test_exact_at_the_range_limits(monkeypatch):
    # |d| = 255 everywhere (u8 255 against a zero point of 0, and 0 against 255), |w| = 128 / 127,
    # 1,000 channels: |4 S| ~ 1.2e9 of int32's 2.1e9, U' = 1,152 and V = 1,020 at their bounds
    cin, cout = 1000, 8
    w = torch.full((cout, cin, 3, 3), -128, dtype=torch.int8)
    w[1::2] = 127
    w[2, :, 1, 1] = 5  # not all alike
    scales = torch.full((cout,), 1e-6)
    for x, zp in (
        (torch.full((1, cin, 4, 5), 255, dtype=torch.uint8), 0),
        (torch.zeros(1, cin, 4, 5, dtype=torch.uint8), 255),
    ):
        x = x.contiguous(memory_format=torch.channels_last)
        mod = qm.QConv2d(w, scales, None, ConvSpec(padding=(1, 1)), QParams(1.0, zp), None)
        eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
        assert _winograd_steps(eng, TILES["2x2"][1]), eng.step_impls()  # far beyond F(4x4, 3x3)'s bound
        s = _exact_sum(x, zp, w)
        assert float(s.abs().max()) > 2.5e8  # the test reaches the range it claims
        assert torch.equal(got, s.float() * 1e-6), float((got - s.float() * 1e-6).abs().max())


def _bound_weights(cin: int, cout: int, mag: int) -> torch.Tensor:
    """Weights of magnitude ``mag`` everywhere, output channel 0 all positive (its sum reaches
    255 * 9 * cin * mag on an all-255 input), the rest of mixed signs."""
    w = torch.full((cout, cin, 3, 3), mag, dtype=torch.int8)
    w[1:, ::2] = -mag
    w[2, :, 1, 1] = 1
    return w


def test_f4x3_exact_at_its_bound(monkeypatch):
    # 1,000 channels of |w| = 14: max_k sum |w| * 255 = 32,130,000 < 2^25 = 33,554,432, and the
    # all-255 input (zero point 0) reaches it: 576 S wraps int32 many times over, S comes back exact
    cin, cout = 1000, 8
    w = _bound_weights(cin, cout, 14)
    for x, zp in (
        (torch.full((1, cin, 6, 5), 255, dtype=torch.uint8), 0),
        (torch.zeros(1, cin, 6, 5, dtype=torch.uint8), 255),
        # zero point 128: |V| up to 100 * 128 (int16) on a checkerboard of extremes
        ((torch.arange(30).view(1, 1, 6, 5) % 2 * 255).expand(1, cin, 6, 5).to(torch.uint8), 128),
    ):
        x = x.contiguous(memory_format=torch.channels_last)
        mod = qm.QConv2d(w, torch.full((cout,), 1e-6), None, ConvSpec(padding=(1, 1)), QParams(1.0, zp), None)
        eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
        assert _winograd_steps(eng, TILES["4x4"][1]), eng.step_impls()
        s = _exact_sum(x, zp, w)
        if zp != 128:
            assert float(s.abs().max()) > 0.9 * 255 * 9 * cin * 14  # the test reaches the bound it claims
        assert torch.equal(got, s.float() * 1e-6), float((got - s.float() * 1e-6).abs().max())


def test_weights_past_the_f4x3_bound_take_2x2_tiles(monkeypatch):
    # |w| = 15: 255 * 9,000 * 15 = 34,425,000 >= 2^25, so F(4x4, 3x3) could be inexact: forced, the
    # conv takes F(2x2, 3x3) (exact up to 1,827 channels) and still equals the exact sum
    cin, cout = 1000, 8
    w = _bound_weights(cin, cout, 15)
    x = torch.full((1, cin, 6, 5), 255, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    mod = qm.QConv2d(w, torch.full((cout,), 1e-6), None, ConvSpec(padding=(1, 1)), QParams(1.0, 0), None)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert _winograd_steps(eng, TILES["2x2"][1]), eng.step_impls()
    s = _exact_sum(x, 0, w)
    assert float(s.abs().max()) >= 2**25
    assert torch.equal(got, s.float() * 1e-6)


def test_the_bound_counts_the_source_zero_point(monkeypatch):
    # |w| = 15 past the bound at zero point 0 (above); at zero point 128 |x - zp| <= 128, so
    # 128 * 135,000 = 17,280,000 < 2^25: 4x4 tiles, exact on a checkerboard of 0 and 255
    cin, cout = 1000, 8
    mod = qm.QConv2d(_bound_weights(cin, cout, 15), torch.full((cout,), 1e-6), None, ConvSpec(padding=(1, 1)),
                     QParams(1.0, 128), None)  # fmt: skip
    x = (torch.arange(30).view(1, 1, 6, 5) % 2 * 255).expand(1, cin, 6, 5).to(torch.uint8)
    x = x.contiguous(memory_format=torch.channels_last)
    eng, got = engine_in_mode(monkeypatch, "1", mod, [x])
    assert _winograd_steps(eng, TILES["4x4"][1]), eng.step_impls()
    assert torch.equal(got, _exact_sum(x, 128, mod.weight).float() * 1e-6)


POSTS = {
    "relu": (IN, OUT, PostOp("relu")),
    "relu6": (IN_ZP, QParams(0.03, 0), PostOp("hardtanh", (0.0, 6.0))),
    "none": (IN_ZP, OUT, None),
    "swish": (IN_ZP, OUT, PostOp("swish")),  # the act stage of the output stage (shared by GML's INT8 convs)
    "hardswish": (IN, OUT, PostOp("hardswish")),
}


@tiles
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("post", list(POSTS))
def test_int8_outputs_match_the_executor_and_the_direct_conv(monkeypatch, shape, post, tile):
    mode, kernel = TILES[tile]
    n, cin, cout, h, w = shape
    in_qp, out_qp, post_op = POSTS[post]
    mod = _qconv(cin, cout, in_qp, out_qp, post_op, seed=3)
    check_forced_conv(monkeypatch, mod, [rand_u8(n, cin, h, w, seed=2)], kernel, against_direct=True, mode=mode)


@tiles
@pytest.mark.parametrize("relu", [True, False])
def test_residual_sum_with_its_zero_point(monkeypatch, relu, tile):
    n, cin, cout, h, w = 2, 12, 20, 9, 6
    wq, s = int8_weight((cout, cin, 3, 3), 5)
    mod = qm.QConv2dAdd(
        wq, s, torch.randn(cout), ConvSpec(padding=(1, 1)), IN, OTHER, QParams(0.4, 0 if relu else 90), relu=relu
    )
    xs = [rand_u8(n, cin, h, w, seed=6), rand_u8(n, cout, h, w, seed=7)]
    check_forced_conv(monkeypatch, mod, xs, TILES[tile][1], n_inputs=2, mode=TILES[tile][0])


@pytest.mark.parametrize(
    "spec,k",
    [
        (ConvSpec(stride=(2, 2), padding=(1, 1)), 3),
        (ConvSpec(padding=(0, 0)), 3),
        (ConvSpec(padding=(2, 2), dilation=(2, 2)), 3),
        (ConvSpec(padding=(1, 1), groups=2), 3),
        (ConvSpec(), 1),
    ],
    ids=["stride2", "pad0", "dilated", "grouped", "1x1"],
)
def test_ineligible_convs_stay_direct_even_when_forced(monkeypatch, spec, k):
    w, s = int8_weight((8, 8 // spec.groups, k, k), 1)
    mod = qm.QConv2d(w, s, None, spec, IN, OUT)
    check_forced_conv(monkeypatch, mod, [rand_u8(1, 8, 8, 8)], KERNEL, taken=False)


def test_too_many_channels_for_int32_stay_direct(monkeypatch):
    # past 1,827 input channels |4 S| could leave int32: the direct conv, even when forced (uniform
    # 7-bit weights: far past F(4x4, 3x3)'s bound too)
    mod = _qconv(1840, 8, IN, OUT)
    eng, _ = engine_in_mode(monkeypatch, "1", mod, [rand_u8(1, 1840, 3, 3)])
    assert not _winograd_steps(eng), eng.step_impls()


def test_auto_considers_it_only_without_vnni(monkeypatch):
    mod = _qconv(64, 64, IN, OUT, PostOp("relu"))
    x = rand_u8(1, 64, 28, 28)
    with torch.no_grad():
        ref = mod(x)
    eng, got = engine_in_mode(monkeypatch, "auto", mod, [x])
    if not detect_target().int8_winograd:
        assert not _winograd_steps(eng), eng.step_impls()  # VNNI / AMX: not even timed
    assert_close_int(ref, got)  # whichever kernel the timing chose


@pytest.mark.parametrize(
    "isa,expect",
    [
        ("avx2", True),
        ("avx512_core", True),
        ("avx2_vnni", False),
        ("avx512_core_vnni", False),
        ("avx512_core_amx", False),
        ("sse41", False),
    ],
)
def test_the_target_says_where_int8_winograd_is_considered(isa, expect):
    assert Target(isa).int8_winograd is expect


@tiles
def test_weights_beyond_seven_bits_are_exact_too(monkeypatch, tile):
    # the tier's weight range does not bound Winograd: full 8-bit weights on any CPU
    w = torch.randint(-128, 128, (16, 24, 3, 3), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
    mod = qm.QConv2d(w, torch.full((16,), 0.01), None, ConvSpec(padding=(1, 1)), IN_ZP, None)
    x = rand_u8(1, 24, 10, 10, seed=4)
    eng, got = engine_in_mode(monkeypatch, TILES[tile][0], mod, [x])
    assert _winograd_steps(eng, TILES[tile][1]), eng.step_impls()
    want = _exact_sum(x, IN_ZP.zero_point, w).float() * (torch.tensor(IN_ZP.scale) * torch.tensor(0.01))
    assert torch.equal(got, want)


@tiles
def test_two_threads_running_one_plan(monkeypatch, tile):
    """V and M live in the call's scratchpad (one slot per OpenMP thread when each thread takes whole
    chunks): concurrent calls of one plan agree bit for bit with the same calls made one at a time."""
    mod = _qconv(24, 40, IN_ZP, OUT, PostOp("relu"), seed=4)
    calls = [[rand_u8(2, 24, 17 * 2, 19 * 2, seed=s)] for s in range(6)]  # 180 tiles of 4x4: chunks per thread
    eng, _ = engine_in_mode(monkeypatch, TILES[tile][0], mod, calls[0])
    assert _winograd_steps(eng, TILES[tile][1]), eng.step_impls()
    assert_concurrent_calls_agree(eng, calls)


def test_the_report_says_which_tiles(monkeypatch):
    mod = _qconv(16, 16, IN, OUT)
    eng, _ = engine_in_mode(monkeypatch, "1", mod, [rand_u8(1, 16, 8, 8)])
    assert eng.report.winograd_4x4_convs == 1, eng.step_impls()
    assert "1 3x3 conv(s) run as Winograd, 0 F(2x2, 3x3), 1 INT8 F(4x4, 3x3)" in str(eng.report)
    eng, _ = engine_in_mode(monkeypatch, "f2x3", mod, [rand_u8(1, 16, 8, 8)])
    assert eng.report.winograd_4x4_convs == 0 and "run as Winograd, F(2x2, 3x3)" in str(eng.report)
