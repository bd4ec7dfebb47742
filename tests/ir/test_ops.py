"""torch.ops.gml: each op's fake kernel agrees with its Python implementation (shape, dtype), the
implementations compute what the GML kernels compute, and prepacked weights are cached state."""

from __future__ import annotations

import pytest
import torch

from gml.ir import library
from gml.kernels import int8_ops
from gml.kernels.registry import get_backend

int8_ops.register()
ops = library.ops()
BACKEND = get_backend(None).name


def _u8(*shape: int, cl: bool = True) -> torch.Tensor:
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    if cl and len(shape) in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return x


def _w(*shape: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(1))


def _cases():
    w2, w1, w3 = _w(4, 3, 3, 3), _w(4, 3, 3), _w(4, 3, 1, 3, 3)
    s4, b4 = torch.full((4,), 0.01), torch.zeros(4)
    u8 = torch.uint8
    yield (
        "qconv2d",
        ops.qconv.default,
        (_u8(2, 3, 8, 8), 0.1, 3, w2, s4, b4, [2, 2], [1, 1], [1, 1], 1, 0.2, 5, u8, "relu", [], "", BACKEND),
    )
    yield (
        "qconv2d_fp32_out",
        ops.qconv.default,
        (
            _u8(2, 3, 8, 8),
            0.1,
            3,
            w2,
            s4,
            None,
            [1, 1],
            [0, 0],
            [1, 1],
            1,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
            BACKEND,
        ),
    )
    yield (
        "qconv1d",
        ops.qconv.default,
        (_u8(2, 3, 9, cl=False), 0.1, 3, w1, s4, b4, [1], [1], [1], 1, 0.2, 5, u8, "none", [], "", BACKEND),
    )
    if get_backend(BACKEND).has_conv3d:
        yield (
            "qconv3d",
            ops.qconv.default,
            (
                _u8(1, 3, 2, 6, 6),
                0.1,
                3,
                w3,
                s4,
                b4,
                [1, 1, 1],
                [0, 1, 1],
                [1, 1, 1],
                1,
                0.2,
                0,
                u8,
                "relu",
                [],
                "",
                BACKEND,
            ),
        )
    yield "qlinear", ops.qlinear.default, (_u8(2, 5, 3), 0.1, 3, _w(4, 3), s4, b4, 0.2, 5, u8, "none", [], "", BACKEND)
    yield "qadd", ops.qadd.default, (_u8(1, 4, 5, 5), 0.1, 3, _u8(1, 4, 5, 5), 0.2, 4, 0.3, 2, "relu", BACKEND)
    yield "qmul", ops.qmul.default, (_u8(1, 4, 5, 5), 0.1, 3, _u8(1, 4, 1, 1), 0.2, 4, 0.3, 2, BACKEND)
    yield "qactivation", ops.qactivation.default, (_u8(1, 4, 5, 5), 0.1, 3, "hardtanh", [0.0, 6.0], 0.1, 3, BACKEND)
    yield "qmax_pool", ops.qmax_pool.default, (_u8(1, 4, 7, 7), 0.1, 3, [3, 3], [2, 2], [1, 1], [1, 1], True, BACKEND)
    yield (
        "qavg_pool2d",
        ops.qavg_pool2d.default,
        (_u8(1, 4, 7, 7), 0.1, 3, [2, 2], [2, 2], [0, 0], True, True, None, 0.1, 3, BACKEND),
    )
    yield "qadaptive_avg_pool", ops.qadaptive_avg_pool.default, (_u8(1, 4, 7, 7), 0.1, 3, [1, 1], 0.1, 3, BACKEND)
    yield "qmean", ops.qmean.default, (_u8(2, 4, 3, 3), 0.1, 3, [1], True, 0.1, 3, BACKEND)
    yield "qcat", ops.qcat.default, ([_u8(1, 2, 3, 3), _u8(1, 4, 3, 3)], [0.1, 0.2], [3, 4], 1, 0.2, 4, BACKEND)
    yield (
        "qbatch_norm",
        ops.qbatch_norm.default,
        (
            _u8(1, 4, 3, 3),
            0.1,
            3,
            torch.ones(4),
            torch.zeros(4),
            torch.zeros(4),
            torch.ones(4),
            1e-5,
            0.1,
            3,
            "none",
            BACKEND,
        ),
    )
    yield "quantize", ops.quantize.default, (torch.randn(1, 4, 3, 3), 0.1, 128)
    yield "dequantize", ops.dequantize.default, (_u8(1, 4, 3, 3), 0.1, 128)
    yield "requantize", ops.requantize.default, (_u8(1, 4, 3, 3), 0.1, 128, 0.2, 100)


CASES = list(_cases())


@pytest.mark.parametrize(("name", "op", "args"), CASES, ids=[c[0] for c in CASES])
def test_fake_kernel_matches_the_python_implementation(name, op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [
            mode.from_tensor(a)
            if isinstance(a, torch.Tensor)
            else [mode.from_tensor(t) for t in a]
            if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
            else a
            for a in args
        ]
        fake = op(*fake_args)
    assert tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype, name


def test_qconv_add_does_not_modify_its_residual():
    x, other = _u8(1, 3, 6, 6), _u8(1, 4, 6, 6)
    before = other.clone()
    args = (
        x,
        0.1,
        3,
        _w(4, 3, 3, 3),
        torch.full((4,), 0.01),
        torch.zeros(4),
        [1, 1],
        [1, 1],
        [1, 1],
        1,
        other,
        0.05,
        7,
        0.2,
        0,
        "relu",
        BACKEND,
    )
    if not get_backend(BACKEND).supports_conv_add:
        pytest.skip("no fused conv+add kernel on this backend")
    y = ops.qconv_add.default(*args)
    assert torch.equal(other, before) and y.shape == other.shape


def test_prepacked_weight_is_cached_per_weight_and_dropped_when_it_changes():
    int8_ops.clear_packs()
    x, w, s = _u8(1, 3, 6, 6), _w(4, 3, 3, 3), torch.full((4,), 0.01)
    args = [x, 0.1, 3, w, s, None, [1, 1], [1, 1], [1, 1], 1, 0.2, 5, torch.uint8, "none", [], "", BACKEND]
    y1 = ops.qconv.default(*args)
    (entry,) = int8_ops._PACKS[w].values()
    ops.qconv.default(*args)
    assert next(iter(int8_ops._PACKS[w].values())) is entry  # reused, not repacked
    w.mul_(-1)  # a write bumps the tensor version: the packing is stale and rebuilt
    y2 = ops.qconv.default(*args)
    assert next(iter(int8_ops._PACKS[w].values())) is not entry
    assert not torch.equal(y1, y2)
