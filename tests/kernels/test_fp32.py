from __future__ import annotations

import copy
import io
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.kernels import fp32 as k32
from gml.kernels.fp32 import AddReLU, FusedConv, FusedConvAdd, FusedLinear, PostOp

needs_onednn = pytest.mark.skipif(not k32.kernels_available(), reason="oneDNN fp32 kernels unavailable")

POST_OPS = [
    (nn.ReLU(), PostOp("relu")),
    (nn.ReLU6(), PostOp("hardtanh", (0.0, 6.0))),
    (nn.Hardtanh(-0.5, 0.25), PostOp("hardtanh", (-0.5, 0.25))),
    (nn.Sigmoid(), PostOp("sigmoid")),
    (nn.Tanh(), PostOp("tanh")),
    (nn.SiLU(), PostOp("swish")),
    (nn.Hardswish(), PostOp("hardswish")),
    (nn.Hardsigmoid(), PostOp("hardsigmoid")),
    (nn.LeakyReLU(0.2), PostOp("leaky_relu", (0.2,))),
    (nn.GELU(), PostOp("gelu", (), "none")),
    (nn.GELU(approximate="tanh"), PostOp("gelu", (), "tanh")),
]


def single_node(fn) -> tuple[fx.Node, dict]:
    gm = fx.symbolic_trace(fn)
    node = next(n for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
    return node, dict(gm.named_modules())


@pytest.mark.parametrize(("module", "expected"), POST_OPS, ids=lambda v: str(v))
def test_post_op_of_every_module_spelling(module, expected):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = module

        def forward(self, x):
            return self.act(x)

    node, modules = single_node(M())
    assert k32.post_op_of(node, modules) == expected
    x = torch.randn(64) * 4
    torch.testing.assert_close(expected.apply(x), module(x))


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x: F.relu(x), PostOp("relu")),
        (lambda x: torch.relu(x), PostOp("relu")),
        (lambda x: x.relu(), PostOp("relu")),
        (lambda x: F.relu6(x), PostOp("hardtanh", (0.0, 6.0))),
        (lambda x: F.hardtanh(x, -2.0, 2.0), PostOp("hardtanh", (-2.0, 2.0))),
        (lambda x: F.leaky_relu(x, 0.3), PostOp("leaky_relu", (0.3,))),
        (lambda x: F.leaky_relu(x), PostOp("leaky_relu", (0.01,))),
        (lambda x: F.gelu(x, approximate="tanh"), PostOp("gelu", (), "tanh")),
        (lambda x: torch.sigmoid(x), PostOp("sigmoid")),
        (lambda x: x.tanh(), PostOp("tanh")),
        (lambda x: F.silu(x), PostOp("swish")),
        (lambda x: F.hardswish(x), PostOp("hardswish")),
    ],
)
def test_post_op_of_function_and_method_spellings(fn, expected):
    node, modules = single_node(fn)
    assert k32.post_op_of(node, modules) == expected


def test_post_op_of_declines_with_a_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.elu = nn.ELU()

        def forward(self, x):
            return self.elu(x)

    node, modules = single_node(M())
    why = k32.post_op_of(node, modules)
    assert isinstance(why, str) and why.startswith("ELU has no oneDNN post-op")
    node, modules = single_node(lambda x: F.elu(x))
    assert "has no oneDNN post-op" in k32.post_op_of(node, modules)


def test_post_op_rejects_unknown_attr_and_prints_readably():
    with pytest.raises(ValueError, match="unknown oneDNN post-op"):
        PostOp("softplus")
    assert str(PostOp("hardtanh", (0.0, 6.0))) == "hardtanh(0, 6)"
    assert str(PostOp("gelu", (), "tanh")) == "gelu(tanh)"
    assert PostOp("relu").op_scalars == [None]  # never an empty Scalar?[] list (export)


CONVS = [
    (nn.Conv1d(4, 6, 3, padding=1), (2, 4, 9)),
    (nn.Conv1d(4, 8, 5, stride=2, dilation=2, groups=2, bias=False), (1, 4, 20)),
    (nn.Conv2d(3, 8, 3, stride=2, padding=1), (2, 3, 11, 11)),
    (nn.Conv2d(8, 8, 3, padding=1, groups=8), (1, 8, 7, 7)),  # depthwise
    (nn.Conv2d(8, 16, 1, bias=False), (1, 8, 5, 5)),
    (nn.Conv2d(4, 4, 3, padding=2, dilation=2), (1, 4, 9, 9)),
    (nn.Conv2d(4, 4, 3, padding="same"), (1, 4, 6, 6)),
    (nn.Conv3d(2, 4, 3, padding=1), (1, 2, 5, 5, 5)),
]


@needs_onednn
@pytest.mark.parametrize(("conv", "shape"), CONVS, ids=lambda v: str(v))
@pytest.mark.parametrize("post", [PostOp(), PostOp("relu"), PostOp("gelu", (), "tanh"), PostOp("hardtanh", (0, 6))])
def test_fused_conv_matches_eager(conv, shape, post):
    torch.manual_seed(0)
    conv = conv.eval()
    x = torch.randn(shape)
    fused = FusedConv.from_conv(conv, post, input_size=shape)
    with torch.no_grad():
        ref = post.apply(conv(x))
        out = fused(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4
    assert fused.fused and isinstance(fused.packed(), torch.Tensor)


@needs_onednn
def test_fused_conv_output_is_channels_last_and_weight_is_prepacked():
    conv = nn.Conv2d(4, 8, 3, padding=1).eval()
    fused = FusedConv.from_conv(conv, PostOp("relu"), input_size=(1, 4, 8, 8))
    y = fused(torch.randn(1, 4, 8, 8))
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert fused.packed().is_mkldnn  # blocked oneDNN layout, reordered once


@needs_onednn
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_fused_conv_add_matches_eager_and_inplace_reuses_other(inplace, relu):
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1).eval()
    x = torch.randn(2, 8, 6, 6)
    other = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    ref = conv(x) + other
    ref = torch.relu(ref) if relu else ref
    fused = FusedConvAdd.from_conv(conv, relu=relu, inplace=inplace, input_size=x.shape)
    keep = other.clone()
    with torch.no_grad():
        out = fused(x, other)
    assert (out - ref.detach()).abs().max().item() < 1e-4
    assert (out.data_ptr() == other.data_ptr()) is inplace
    if not inplace:
        assert torch.equal(other, keep)


@needs_onednn
@pytest.mark.parametrize("backend", ["onednn", "mkl"])
@pytest.mark.parametrize("shape", [(1, 32), (5, 32), (2, 3, 32)])
def test_fused_linear_matches_eager_on_each_backend(backend, shape):
    if backend == "mkl" and not k32.mkl_linear_available():
        pytest.skip("no MKL packed GEMM")
    torch.manual_seed(0)
    lin = nn.Linear(32, 24).eval()
    x = torch.randn(shape)
    fused = FusedLinear(lin.weight, lin.bias, rows=x.numel() // 32, backend=backend)
    assert fused.backend == backend
    with torch.no_grad():
        assert (fused(x) - lin(x)).abs().max().item() < 1e-4


@needs_onednn
def test_fused_linear_post_op_always_runs_on_onednn():
    lin = nn.Linear(16, 8).eval()
    fused = FusedLinear(lin.weight, lin.bias, post_op=PostOp("gelu", (), "none"), rows=1, backend="mkl")
    assert fused.backend == "onednn"  # MKL has no epilogue: a post-op would not be fused there
    x = torch.randn(1, 16)
    with torch.no_grad():
        assert (fused(x) - F.gelu(lin(x))).abs().max().item() < 1e-5


def test_choose_linear_backend_rule(monkeypatch):
    monkeypatch.setattr(k32, "kernel_unavailable_reason", lambda: None)
    monkeypatch.setattr(k32, "mkl_linear_available", lambda: True)
    assert k32.choose_linear_backend(8, 512, 1000) == "onednn"  # batch: oneDNN ~2x MKL here
    assert k32.choose_linear_backend(1, 512, 1000) == "mkl"  # GEMV with a large weight
    assert k32.choose_linear_backend(1, 64, 32) == "aten"  # tiny: oneDNN's call cost dominates
    assert k32.choose_linear_backend(4, 64, 32) == "aten"
    assert k32.choose_linear_backend(None, 64, 32) == "onednn"
    monkeypatch.setattr(k32, "kernel_unavailable_reason", lambda: "no oneDNN")
    assert k32.choose_linear_backend(8, 512, 1000) == "aten"


@needs_onednn
def test_state_dict_keeps_dense_weights_and_reload_repacks():
    conv = nn.Conv2d(4, 4, 3, padding=1).eval()
    fused = FusedConv.from_conv(conv, PostOp("relu"), input_size=(1, 4, 6, 6))
    x = torch.randn(1, 4, 6, 6)
    fused(x)  # packs
    sd = fused.state_dict()
    assert set(sd) == {"weight", "bias"} and not sd["weight"].is_mkldnn
    new = {"weight": torch.randn_like(sd["weight"]), "bias": torch.randn_like(sd["bias"])}
    fused.load_state_dict(new)
    ref = torch.relu(F.conv2d(x, new["weight"], new["bias"], padding=1))
    with torch.no_grad():
        assert (fused(x) - ref).abs().max().item() < 1e-4  # the packed copy followed the new weight


@needs_onednn
def test_deepcopy_and_pickle_drop_the_packed_copy():
    lin = nn.Linear(8, 4).eval()
    fused = FusedLinear(lin.weight, lin.bias, rows=2, backend="onednn")
    x = torch.randn(2, 8)
    fused(x)
    twin = copy.deepcopy(fused)  # oneDNN tensors cannot be deep-copied: must not be attempted
    assert twin._packed is None
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.allclose(twin(x), lin(x), atol=1e-5) and torch.allclose(again(x), lin(x), atol=1e-5)


def test_fallback_without_onednn_computes_the_same_math(monkeypatch):
    monkeypatch.setattr(k32, "kernel_unavailable_reason", lambda: "oneDNN missing (test)")
    conv = nn.Conv2d(3, 4, 3, padding=1).eval()
    fused = FusedConv.from_conv(conv, PostOp("leaky_relu", (0.1,)))
    add = FusedConvAdd.from_conv(conv, relu=True, inplace=True)
    lin = nn.Linear(6, 5).eval()
    flin = FusedLinear(lin.weight, lin.bias, post_op=PostOp("tanh"), rows=1)
    assert not fused.fused and not add.fused and flin.backend == "aten"
    assert "UNFUSED fallback" in repr(fused)
    x, o, v = torch.randn(1, 3, 5, 5), torch.randn(1, 4, 5, 5), torch.randn(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), F.leaky_relu(conv(x), 0.1))
        torch.testing.assert_close(add(x, o), torch.relu(conv(x) + o))
        torch.testing.assert_close(flin(v), torch.tanh(lin(v)))
    assert k32.describe_kernels().startswith("fp32 kernels: unfused ATen fallback")


def test_add_relu_and_fused_matmul_add_relu():
    a, b = torch.randn(2, 8, 4, 4), torch.randn(8, 1, 1)
    assert torch.equal(AddReLU()(a, b), torch.relu(a + b))
    x, w, bias = torch.randn(3, 16), torch.randn(16, 8), torch.randn(8)
    out = k32.fused_matmul_add_relu(x, w, bias)
    assert (out - torch.relu(x @ w + bias)).abs().max().item() < 1e-5
    gm = fx.symbolic_trace(lambda x, w, b: k32.fused_matmul_add_relu(x, w, b))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [k32.fused_matmul_add_relu]


def test_conv_padding_same_and_valid():
    assert k32.conv_padding(nn.Conv2d(1, 1, 5, padding="same")) == (2, 2)
    assert k32.conv_padding(nn.Conv2d(1, 1, 3, padding="valid")) == (0, 0)
    assert "asymmetric" in k32.conv_padding(nn.Conv2d(1, 1, 4, padding="same"))
    assert operator.eq(k32.conv_padding(nn.Conv1d(1, 1, 3, padding=1)), (1,))
