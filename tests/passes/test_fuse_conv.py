from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.testing import FileCheck

from gml.kernels import fp32 as k32
from gml.kernels.fp32 import FusedConv, FusedConvAdd, PostOp
from gml.passes.fuse_conv import FuseConvActivation, FuseConvAdd
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize
from gml.passes.untie import UntieSharedModules

pytestmark = pytest.mark.skipif(not k32.kernels_available(), reason="oneDNN fp32 kernels unavailable")


def traced(model: nn.Module, *inputs: torch.Tensor, shapes: bool = True) -> fx.GraphModule:
    gm = fx.symbolic_trace(model.eval())
    if shapes:
        ShapeProp(gm).propagate(*inputs)
    return gm


def module_types(gm: fx.GraphModule) -> Counter[str]:
    mods = dict(gm.named_modules())
    return Counter(type(mods[n.target]).__name__ for n in gm.graph.nodes if n.op == "call_module")


def max_err(model: nn.Module, gm: fx.GraphModule, *inputs: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(*inputs) - gm(*inputs)).abs().max().item()


class ConvAct(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = act

    def forward(self, x):
        return self.act(self.conv(x))


def test_conv_relu_golden():
    model, x = ConvAct(nn.ReLU()), torch.randn(2, 3, 8, 8)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert result.modified and result.matches == 1 and result.skips == []
    FileCheck().check_count("self.conv(", 1, exactly=True).check_not("self.act").run(gm.code)
    assert module_types(gm) == Counter({"FusedConv": 1})
    assert gm.conv.post_op == PostOp("relu")
    assert set(gm.state_dict()) == {"conv.weight", "conv.bias"}  # the fused module kept the conv's name
    assert max_err(model, gm, x) < 1e-4
    assert gm(x).is_contiguous()  # 4-D model output restored to NCHW


@pytest.mark.parametrize(
    "act",
    [nn.ReLU6(), nn.Sigmoid(), nn.Tanh(), nn.SiLU(), nn.Hardswish(), nn.LeakyReLU(0.1), nn.GELU("tanh")],
    ids=lambda m: type(m).__name__,
)
def test_every_onednn_activation_fuses(act):
    model, x = ConvAct(act), torch.randn(1, 3, 8, 8) * 3
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert result.matches == 1 and module_types(gm) == Counter({"FusedConv": 1})
    assert max_err(model, gm, x) < 1e-4


def test_functional_activation_spelling_fuses():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return F.hardtanh(self.conv(x), -1.0, 2.0)

    model, x = M(), torch.randn(1, 3, 7, 7) * 3
    gm = traced(model, x)
    assert FuseConvActivation()(gm).matches == 1
    assert gm.conv.post_op == PostOp("hardtanh", (-1.0, 2.0))
    assert max_err(model, gm, x) < 1e-4


def test_unsupported_activation_is_skipped_with_reason_and_conv_still_lowered():
    model, x = ConvAct(nn.ELU()), torch.randn(1, 3, 6, 6)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert result.matches == 0
    assert [(s.node, s.reason) for s in result.skips] == [
        ("act", "post-op not fused: ELU has no oneDNN post-op (supported: " + ", ".join(k32.UNARY_ATTRS) + ")")
    ]
    assert module_types(gm) == Counter({"FusedConv": 1, "ELU": 1})
    assert gm.conv.post_op == k32.NO_POST_OP
    assert max_err(model, gm, x) < 1e-4


def test_conv_output_with_two_users_is_not_fused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.relu = nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.relu(y), y * 2

    model, x = M(), torch.randn(1, 3, 5, 5)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert [s.reason for s in result.skips] == ["conv output has 2 users"]
    assert gm.conv.post_op == k32.NO_POST_OP
    with torch.no_grad():
        for a, b in zip(gm(x), model(x)):
            assert (a - b).abs().max() < 1e-4


def test_ineligible_convs_are_reported():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.reflect = nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
            self.same_even = nn.Conv2d(3, 3, 4, padding="same")
            self.shared = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return self.shared(self.shared(self.same_even(self.reflect(x))))

    model, x = M(), torch.randn(1, 3, 8, 8)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    reasons = {s.node: s.reason for s in result.skips}
    assert reasons["reflect"] == "padding_mode='reflect' (oneDNN pads with zeros only)"
    assert reasons["same_even"] == "padding='same' with an even effective kernel is asymmetric"
    assert reasons["shared"] == "conv module shared is called at 2 sites (run UntieSharedModules first)"
    assert not result.modified


class Residual(nn.Module):
    """A BasicBlock tail; ``conv_first`` puts the conv on the left of the add."""

    def __init__(self, conv_first: bool = True, act: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = act if act is not None else nn.ReLU()
        self.conv_first = conv_first

    def forward(self, x):
        y = self.conv2(self.relu1(self.conv1(x)))
        return self.act(y + x if self.conv_first else x + y)


@pytest.mark.parametrize("conv_first", [True, False])
def test_residual_conv_add_relu_golden(conv_first):
    model, x = Residual(conv_first), torch.randn(2, 8, 6, 6)
    gm = traced(model, x)
    result = FuseConvAdd()(gm)
    assert result.matches == 1 and result.skips == []
    assert isinstance(gm.conv2, FusedConvAdd) and gm.conv2.relu
    assert not gm.conv2.inplace  # x is a model input: never overwritten
    FileCheck().check("self.conv1(x)").check("self.relu1(").check("self.conv2(relu1, x)").run(gm.code)
    FuseConvActivation()(gm)
    assert module_types(gm) == Counter({"FusedConv": 1, "FusedConvAdd": 1})
    assert max_err(model, gm, x) < 1e-4


def test_residual_accumulates_in_place_when_the_residual_is_dead():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.conv = nn.Conv2d(8, 8, 3, padding=1)
            self.relu = nn.ReLU()

        def forward(self, x):
            s = self.stem(x)
            return self.relu(self.conv(torch.tanh(s)) + s)

    model, x = Block(), torch.randn(1, 3, 6, 6)
    gm = traced(model, x)
    result = FuseConvAdd()(gm)
    assert gm.conv.inplace and "1/1 conv+add kernels accumulate in place into the residual" in result.notes
    FuseConvActivation()(gm)
    assert max_err(model, gm, x) < 1e-4
    gm2 = traced(model, x)
    FuseConvAdd(inplace=False)(gm2)
    assert not gm2.conv.inplace


def test_residual_that_is_also_the_conv_input_is_not_overwritten():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            s = self.stem(x)
            return self.conv(s) + s  # the kernel must not write into the tensor it convolves

    model, x = Block(), torch.randn(1, 3, 6, 6)
    gm = traced(model, x)
    FuseConvAdd()(gm)
    assert isinstance(gm.conv, FusedConvAdd) and not gm.conv.inplace
    assert max_err(model, gm, x) < 1e-4


def test_residual_read_after_the_add_is_not_overwritten():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            s = self.stem(x)
            return self.conv(s) + s, s * 3

    model, x = Block(), torch.randn(1, 3, 6, 6)
    gm = traced(model, x)
    FuseConvAdd()(gm)
    assert isinstance(gm.conv, FusedConvAdd) and not gm.conv.inplace
    with torch.no_grad():
        for a, b in zip(gm(x), model(x)):
            assert (a - b).abs().max() < 1e-4


def test_non_relu_activation_after_add_stays_and_is_reported():
    model, x = Residual(act=nn.Sigmoid()), torch.randn(1, 8, 5, 5)
    gm = traced(model, x)
    result = FuseConvAdd()(gm)
    assert result.matches == 1 and not gm.conv2.relu
    assert [s.reason for s in result.skips] == [
        "sigmoid after conv+add is not fused (the binary kernel fuses only relu after the add)"
    ]
    assert max_err(model, gm, x) < 1e-4


def test_add_declines_broadcast_groups_and_missing_shapes():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 4, 3, padding=1)
            self.g = nn.Conv2d(4, 4, 3, padding=1, groups=2)

        def forward(self, x, bias):
            return self.a(x) + bias, self.g(x) + x

    model = M()
    x, bias = torch.randn(1, 4, 5, 5), torch.randn(4, 1, 1)
    gm = traced(model, x, bias)
    result = FuseConvAdd()(gm)
    reasons = sorted(s.reason for s in result.skips)
    assert reasons == [
        "a: add operands have different shapes [1, 4, 5, 5] vs [4, 1, 1] (broadcast)",
        "g: groups=2: oneDNN's binary-add conv falls back to unfused ops for groups > 1",
    ]
    assert not result.modified
    gm = traced(model, x, bias, shapes=False)
    result = FuseConvAdd()(gm)
    assert "add operand shapes unknown (no tensor_meta: capture with example inputs)" in result.skips[0].reason


def test_view_after_channels_last_conv_still_works():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.relu = nn.ReLU()
            self.fc = nn.Linear(4 * 5 * 5, 2)

        def forward(self, x):
            y = self.relu(self.conv(x))
            return self.fc(y.view(y.size(0), -1))

    model, x = M(), torch.randn(2, 3, 5, 5)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert "1 .view() call(s) after fused convs became .reshape() (channels-last outputs)" in result.notes
    FileCheck().check(".reshape(").check_not(".view(").run(gm.code)
    assert max_err(model, gm, x) < 1e-4


def test_conv1d_and_conv3d_fuse():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv1d(3, 4, 3, padding=1)
            self.r1 = nn.ReLU()
            self.c3 = nn.Conv3d(2, 4, 3, padding=1)
            self.r3 = nn.SiLU()

        def forward(self, a, b):
            return self.r1(self.c1(a)), self.r3(self.c3(b))

    model, a, b = M(), torch.randn(2, 3, 10), torch.randn(1, 2, 4, 4, 4)
    gm = traced(model, a, b)
    assert FuseConvActivation()(gm).matches == 2
    assert module_types(gm) == Counter({"FusedConv": 2})
    with torch.no_grad():
        for o, r in zip(gm(a, b), model(a, b)):
            assert (o - r).abs().max() < 1e-4 and o.is_contiguous()


def test_resnet_like_block_through_the_pass_manager():
    """normalize → untie → fuse: BasicBlock with a shared in-place ReLU and a downsample branch."""

    class Basic(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
            self.down = nn.Conv2d(8, 16, 1, stride=2)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.relu(self.conv1(x))
            out = self.conv2(out)
            out += self.down(x)
            return self.relu(out)

    model, x = Basic().eval(), torch.randn(2, 8, 10, 10)
    gm = traced(model, x)
    passes = [Normalize(), UntieSharedModules(), FuseConvAdd(), FuseConvActivation()]
    result = PassManager(passes, strict=True).run(gm, [(x,), (torch.randn(2, 8, 10, 10),)])
    out = result.graph_module
    assert module_types(out) == Counter({"FusedConv": 2, "FusedConvAdd": 1})
    assert out.conv2.inplace and out.conv2.relu  # the downsample output is fresh and dead after
    assert result.report.skips == []
    assert max_err(model, out, x) < 1e-4


def test_fallback_is_noted_in_the_report(monkeypatch):
    monkeypatch.setattr(k32, "kernel_unavailable_reason", lambda: "oneDNN missing (test)")
    model, x = ConvAct(nn.ReLU()), torch.randn(1, 3, 6, 6)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert result.notes[0].startswith("oneDNN fp32 kernels unavailable (oneDNN missing (test))")
    assert isinstance(gm.conv, FusedConv) and not gm.conv.fused
    assert max_err(model, gm, x) < 1e-5


def test_conv_output_added_to_itself_is_not_fused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return torch.add(y, y)

    model, x = M(), torch.randn(1, 4, 5, 5)
    gm = traced(model, x)
    result = FuseConvAdd()(gm)
    assert not result.modified
    assert result.skips[0].reason == "conv: the add reads the conv output twice (x + x)"


def test_in_place_write_between_conv_and_add_blocks_the_move():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.other = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.conv(x)
            x = x.relu_()  # the conv read x before this write; a fused node at the add would not
            return y + self.other(x)

    model = M().eval()
    x = torch.randn(1, 4, 5, 5)
    gm = traced(model, x.clone())
    result = FuseConvAdd()(gm)
    assert [s.reason for s in result.skips] == ["in-place relu_ between the conv and the add"]
    with torch.no_grad():
        assert (gm(x.clone()) - model(x.clone())).abs().max().item() < 1e-4


def test_side_effect_of_a_dead_chain_is_kept():
    """relu_ on the input feeds only a dead conv+relu: fusing that chain must not erase the relu_."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu_in = nn.ReLU(inplace=True)
            self.dead = nn.Conv2d(4, 4, 3, padding=1)
            self.dead_relu = nn.ReLU()
            self.live = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            self.dead_relu(self.dead(self.relu_in(x)))
            return self.live(x)  # sees the rectified x

    model = M().eval()
    x = torch.randn(1, 4, 5, 5)
    gm = traced(model, x.clone())
    FuseConvActivation()(gm)
    FileCheck().check("self.relu_in(x)").run(gm.code)
    with torch.no_grad():
        assert (gm(x.clone()) - model(x.clone())).abs().max().item() < 1e-4


class _WriteThroughView(nn.Module):
    """relu_ on a flatten view of a conv output, read through the conv (found by the fuzzer)."""

    def __init__(self, through_view: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.act = nn.ReLU(inplace=True)
        self.through_view = through_view

    def forward(self, x):
        y = self.conv(x)
        v = y.flatten(1)
        if self.through_view:
            self.act(v)  # overwrites y too
            return y.permute(0, 1, 3, 2)
        return self.act(v) + 1


def test_conv_whose_output_is_written_through_a_view_is_not_fused():
    model, x = _WriteThroughView().eval(), torch.randn(1, 2, 1, 3)
    gm = traced(model, x)
    result = FuseConvActivation()(gm)
    assert module_types(gm)["FusedConv"] == 0 and module_types(gm)["Conv2d"] == 1
    (skip,) = [s for s in result.skips if s.node == "conv"]
    assert skip.reason == "its output is overwritten in place by act (through a view)"
    torch.testing.assert_close(gm(x), model(x))


def test_conv_whose_view_is_only_read_still_fuses():
    model, x = _WriteThroughView(through_view=False).eval(), torch.randn(1, 2, 1, 3)
    model.act.inplace = False  # the same graph without the write
    gm = traced(model, x)
    FuseConvActivation()(gm)
    assert module_types(gm)["FusedConv"] == 1
    torch.testing.assert_close(gm(x), model(x))


class ReadsResidualThroughAlias(nn.Module):
    """Issue #12's repro: the second conv reads the residual through ``detach`` / ``view_as``."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.c0 = nn.Conv2d(8, 8, 3, padding=1)
        self.c1 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        other = self.c0(x)
        alias = other.detach() if self.spelling == "detach" else other.view_as(other)
        return self.c1(alias) + other


@pytest.mark.parametrize("spelling", ["detach", "view_as"])
def test_conv_reading_its_residual_through_an_alias_does_not_accumulate_into_it(spelling):
    # Before gml.ir's one alias analysis, fuse_conv_add missed these aliases, set inplace=True and
    # the kernel overwrote its own input (error 0.424); fuse_conv was then rolled back and blamed.
    import gml

    model, x = ReadsResidualThroughAlias(spelling).eval(), torch.randn(1, 8, 16, 16)
    res = gml.optimize(model, (x,))
    assert res.report.rolled_back == []
    fused = [m for m in res.module.modules() if isinstance(m, FusedConvAdd)]
    assert len(fused) == 1 and not fused[0].inplace
    assert res.max_abs_err < 1e-4


def test_fuse_conv_add_declines_in_place_through_detach_with_reason():
    model, x = ReadsResidualThroughAlias("detach").eval(), torch.randn(1, 8, 16, 16)
    gm = traced(model, x)
    result = FuseConvAdd()(gm)
    assert result.matches == 1 and max_err(model, gm, x) < 1e-4
    (fused,) = [m for m in gm.modules() if isinstance(m, FusedConvAdd)]
    assert not fused.inplace
