"""The float stand-in of the INT8 ops (``gml.kernels.float_int8``) against their Python kernels.

Given the same uint8 inputs (dequantized for the stand-in), an op's stand-in and its kernel differ
only by the kernel's rounding of its output: at most half an output step, one step for the ops whose
torch kernel rounds an intermediate (average pools). Weights use this process's target's range
(``Target.int8``), where the kernels are exact on this CPU — ``make test`` runs this file under the
AVX2 and AVX512_CORE caps too."""

from __future__ import annotations

import pytest
import torch

from gml.ir.library import SCHEMAS
from gml.kernels import float_int8, int8_ops
from gml.runtime.target import detect_target

W_QMAX = min(127, detect_target().int8.weight_qmax)
S, Z = 0.05, 128  # the inputs' qparams
OUT = (0.06, 100)  # the outputs'


def _u8(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def _real(q: torch.Tensor, scale: float = S, zp: int = Z) -> torch.Tensor:
    return (q.float() - zp) * scale


def _weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-W_QMAX, W_QMAX + 1, shape, generator=g, dtype=torch.int8)
    return q, torch.rand(shape[0], generator=g) * 0.01 + 0.001


def _cases() -> dict[str, tuple[tuple, tuple]]:
    """op -> (kernel args with uint8 tensors, the float values' positions to dequantize)."""
    torch.manual_seed(0)
    x, other = _u8(1, 8, 7, 7), _u8(1, 6, 7, 7, seed=2)
    w, ws = _weight(6, 8, 3, 3)
    b = torch.linspace(-0.2, 0.2, 6)
    lw, lws = _weight(5, 8)
    geo = ([1, 1], [1, 1], [1, 1], 1)
    post = ("relu", [None], "")
    return {
        "quantize": ((torch.randn(2, 9) * 3, *OUT), ()),
        "dequantize": ((x, S, Z), (0,)),
        "requantize": ((x, S, Z, *OUT), (0,)),
        "qconv": ((x, S, Z, w, ws, b, *geo, *OUT, torch.uint8, *post), (0,)),
        "qconv_add": ((x, S, Z, w, ws, b, *geo, other, S, Z, *OUT, "relu"), (0, 10)),
        "qlinear": ((_u8(3, 8), S, Z, lw, lws, None, *OUT, torch.uint8, "none", [None], ""), (0,)),
        "qadd": ((x, S, Z, _u8(1, 8, 7, 7, seed=3), S, Z, *OUT, "none"), (0, 3)),
        "qmul": ((x, S, Z, _u8(1, 8, 7, 7, seed=3), S, Z, *OUT), (0, 3)),
        "qactivation": ((x, S, Z, "hardswish", [None], *OUT), (0,)),
        "qmax_pool": ((x, S, Z, [3, 3], [2, 2], [1, 1], [1, 1], False), (0,)),
        "qavg_pool2d": ((x, S, Z, [2, 2], [2, 2], [0, 0], False, True, None, *OUT), (0,)),
        "qadaptive_avg_pool": ((x, S, Z, [1, 1], *OUT), (0,)),
        "qbatch_norm": (
            (
                x,
                S,
                Z,
                torch.rand(8) + 0.5,
                torch.randn(8) * 0.1,
                torch.randn(8) * 0.1,
                torch.rand(8) + 0.5,
                1e-5,
                *OUT,
                "relu",
            ),
            (0,),
        ),
        "qmean": ((_u8(2, 5, 6), S, Z, [-1], True, *OUT), (0,)),
        "qcat": (([x, _u8(1, 8, 7, 7, seed=4)], [S, S], [Z, Z], 1, *OUT), ()),
    }


def test_every_int8_op_has_a_float_stand_in():
    assert set(float_int8.FLOAT) == set(SCHEMAS) == set(int8_ops.IMPLEMENTATIONS)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_the_stand_in_is_the_kernel_without_its_output_rounding(name):
    args, dequantized = _cases()[name]
    want = int8_ops.IMPLEMENTATIONS[name](*args)
    f_args = list(args)
    for i in dequantized:
        f_args[i] = _real(args[i])
    if name == "qcat":
        f_args[0] = [_real(t) for t in args[0]]
    got = float_int8.FLOAT[name](*f_args)
    assert got.dtype == torch.float32 and got.shape == want.shape
    if name in ("dequantize", "qmax_pool"):  # no output rounding: the same values
        want_real = want if want.is_floating_point() else _real(want)
        torch.testing.assert_close(got, want_real, rtol=0, atol=1e-6)
        return
    out_scale, out_zp = OUT
    want_real = want if want.is_floating_point() else _real(want, out_scale, out_zp)
    steps = float((got - want_real).abs().max()) / out_scale
    limit = 1.0 if name in ("qavg_pool2d", "qadaptive_avg_pool", "qmean") else 0.5
    assert steps <= limit + 1e-3, f"{name}: {steps:.3f} output steps apart"
    assert float(got.min()) >= -out_zp * out_scale - 1e-6 and float(got.max()) <= (255 - out_zp) * out_scale + 1e-6


def test_a_float_output_is_not_clamped():
    x = _u8(2, 8)
    w, ws = _weight(4, 8)
    got = float_int8.qlinear(_real(x), S, Z, w, ws, None, 1.0, 0, torch.float32, "none", [None], "")
    want = int8_ops.qlinear(x, S, Z, w, ws, None, 1.0, 0, torch.float32, "none", [None], "")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got.min()) < 0  # a clamp to [0, 255] would have cut it
