"""The bf16 fused kernels (gml.kernels.bf16) against fp32 eager references.

Bound (docs/adr/007-bf16.md): a bf16 kernel rounds x and W to bf16 (8 significant bits, unit
roundoff u = 2^-8 each), accumulates their exact products in fp32 and rounds the output once, so
``|y_bf16 - y_fp32| <= L * (3u + K * 2^-24) * (|W| @ |x| + |b|)`` element by element, where K is
the dot length and L the post-op's largest slope (hardswish: 1.5; relu, clamps, sigmoid, tanh,
SiLU ≈ 1.1, GELU ≈ 1.13 all ≤ 1.5). :func:`gml.kernels.bf16.bf16_dot_bound` is that bound.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gml.kernels import bf16 as kb
from gml.kernels import fp32 as k32
from gml.kernels.fp32 import PostOp

needs_bf16 = pytest.mark.skipif(
    not (k32.kernels_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN bf16 kernels unavailable in this build/CPU",
)
pytestmark = needs_bf16

POST_OP_SLOPE = 1.5
POST_OPS = [
    PostOp("none"),
    PostOp("relu"),
    PostOp("hardtanh", (0.0, 6.0)),
    PostOp("sigmoid"),
    PostOp("tanh"),
    PostOp("swish"),
    PostOp("hardswish"),
    PostOp("leaky_relu", (0.2,)),
    PostOp("gelu", (), "none"),
    PostOp("gelu", (), "tanh"),
]


def _assert_within(got: torch.Tensor, ref: torch.Tensor, abs_dot: torch.Tensor, k: int) -> None:
    assert got.dtype == torch.bfloat16
    bound = POST_OP_SLOPE * kb.bf16_dot_bound(abs_dot, k)
    err = (got.float() - ref).abs()
    worst = float((err - bound).max())
    assert worst <= 0, f"error exceeds the bf16 bound by {worst:.3g} (max err {float(err.max()):.3g})"
    # and not trivially: the kernel really computed in bf16 (fp32 would be ~1e-6 off)
    assert float(err.max()) > 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("post_op", POST_OPS, ids=str)
def test_bf16_conv_post_ops_within_bound(post_op):
    torch.manual_seed(0)
    w, b = torch.randn(8, 6, 3, 3), torch.randn(8)
    x = torch.randn(2, 6, 9, 9)
    mod = kb.Bf16Conv.from_fused(k32.FusedConv(w, b, stride=(1, 1), padding=(1, 1), dilation=(1, 1), post_op=post_op))
    assert mod.weight.dtype == torch.bfloat16 and mod.bias.dtype == torch.bfloat16
    got = mod(x)
    ref = post_op.apply(F.conv2d(x, w, b, padding=1))
    abs_dot = F.conv2d(x.abs(), w.abs(), b.abs(), padding=1)
    _assert_within(got, ref, abs_dot, 6 * 9)
    assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(("groups", "dim"), [(1, 1), (3, 2), (1, 3)])
def test_bf16_conv_grouped_and_1d_3d(groups, dim):
    torch.manual_seed(1)
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[dim - 1](6, 9, 3, padding=1, groups=groups).eval()
    x = torch.randn(1, 6, *([7] * dim))
    mod = kb.Bf16Conv.from_fused(k32.FusedConv.from_conv(conv, PostOp("relu")))
    got = mod(x)
    ref = torch.relu(conv(x))
    fn = (F.conv1d, F.conv2d, F.conv3d)[dim - 1]
    abs_dot = fn(x.abs(), conv.weight.abs(), conv.bias.abs(), padding=1, groups=groups)
    _assert_within(got, ref.detach(), abs_dot.detach(), 6 // groups * 3**dim)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_bf16_conv_add_within_bound(relu, inplace):
    torch.manual_seed(2)
    w, b = torch.randn(8, 4, 3, 3), torch.randn(8)
    x, other = torch.randn(1, 4, 6, 6), torch.randn(1, 8, 6, 6)
    fused = k32.FusedConvAdd(w, b, stride=(1, 1), padding=(1, 1), dilation=(1, 1), relu=relu, inplace=inplace)
    mod = kb.Bf16ConvAdd.from_fused(fused)
    other16 = other.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    got = mod(x, other16.clone() if inplace else other16)
    ref = F.conv2d(x, w, b, padding=1) + other16.float()  # the residual arrives in bf16 already
    ref = torch.relu(ref) if relu else ref
    abs_dot = F.conv2d(x.abs(), w.abs(), b.abs(), padding=1) + other.abs()
    _assert_within(got, ref, abs_dot, 4 * 9)
    # an fp32 residual is converted (a copy), never written in place
    keep = other.clone()
    mod(x, other)
    assert torch.equal(other, keep)


@pytest.mark.parametrize("post_op", POST_OPS[:4] + POST_OPS[-2:], ids=str)
@pytest.mark.parametrize("shape", [(5, 32), (2, 7, 32)])
def test_bf16_linear_within_bound(post_op, shape):
    torch.manual_seed(3)
    w, b = torch.randn(24, 32), torch.randn(24)
    x = torch.randn(*shape)
    mod = kb.Bf16Linear.from_fused(k32.FusedLinear(w, b, post_op=post_op, rows=shape[0]))
    assert mod.backend == "onednn"
    got = mod(x)
    ref = post_op.apply(F.linear(x, w, b))
    _assert_within(got, ref, F.linear(x.abs(), w.abs(), b.abs()), 32)


def test_bf16_modules_take_bf16_inputs_and_state_dict_round_trips():
    torch.manual_seed(4)
    w, b = torch.randn(8, 16), torch.randn(8)
    mod = kb.Bf16Linear(w, b)
    x = torch.randn(3, 16)
    torch.testing.assert_close(mod(x), mod(x.to(torch.bfloat16)), rtol=0, atol=0)
    sd = mod.state_dict()
    assert sd["weight"].dtype == torch.bfloat16  # stored in bf16: half the bytes of fp32
    twin = kb.Bf16Linear(torch.zeros(8, 16), torch.zeros(8))
    twin.load_state_dict(sd)
    torch.testing.assert_close(twin(x), mod(x), rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(mod)(x), mod(x), rtol=0, atol=0)


def test_nonfinite_inputs_propagate_as_in_fp32():
    w, b = torch.randn(4, 3, 1, 1), torch.zeros(4)
    mod = kb.Bf16Conv(w, b, stride=(1, 1), padding=(0, 0), dilation=(1, 1), post_op=PostOp("relu"))
    x = torch.randn(1, 3, 2, 2)
    x[0, 0, 0, 0] = float("nan")
    assert torch.isnan(mod(x)[0, :, 0, 0]).all()  # the fused relu would map NaN to 0


def test_to_fp32_and_to_bf16_touch_only_their_dtype():
    i = torch.arange(3)
    assert kb.to_fp32(i) is i and kb.to_bf16(i) is i
    f = torch.randn(3)
    assert kb.to_fp32(f) is f
    assert kb.to_bf16(f).dtype == torch.bfloat16
    assert kb.to_fp32(kb.to_bf16(f)).dtype == torch.float32
    assert kb.to_fp32("x") == "x"


def test_capability_probe_follows_the_target():
    from gml.ir.target import Target

    if kb.bf16_unavailable_reason(Target("avx512_core_amx")) is None:  # oneDNN has bf16 at all
        assert "avx2" in kb.bf16_unavailable_reason(Target("avx2"))
        assert "avx512_core_vnni" in kb.bf16_unavailable_reason(Target("avx512_core_vnni"))
        assert kb.bf16_unavailable_reason(Target("avx512_core_bf16")) is None
    assert "avx2" in kb.cpu_description(Target("avx2"))
