from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.testing import FileCheck

from gml.passes.fold_bn import LAYERNORM_AFFINE_REASON, LAYERNORM_REASON, FoldBatchNorm
from gml.passes.manager import PassManager

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so a wrong fold cannot pass by accident."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            if m.running_mean is not None:
                m.running_mean.copy_(torch.randn(n, generator=g))
                m.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.1)
            if m.affine:
                m.weight.data.copy_(torch.randn(n, generator=g))
                m.bias.data.copy_(torch.randn(n, generator=g))
    return model.eval()


def fold(model: nn.Module, *inputs: torch.Tensor, shapes: bool = False):
    gm = fx.symbolic_trace(model)
    if shapes:
        ShapeProp(gm).propagate(*inputs)
    result = FoldBatchNorm()(gm)
    return gm, result


def assert_close_to_eager(model: nn.Module, gm: fx.GraphModule, *inputs: torch.Tensor) -> float:
    with torch.no_grad():
        ref, out = model(*inputs), gm(*inputs)
    err = (ref - out).abs().max().item()
    assert err < 1e-5 * max(1.0, ref.abs().max().item()), err
    return err


def no_bn_left(gm: fx.GraphModule) -> bool:
    return not any(isinstance(m, BN_TYPES) for m in gm.modules())


CONV_CASES = [
    # (conv, bn, input shape)
    (nn.Conv1d(3, 8, 3, padding=1), nn.BatchNorm1d(8), (2, 3, 11)),
    (nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), (2, 3, 12, 12)),
    (nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), (1, 3, 9, 9)),
    (nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), (1, 8, 7, 7)),  # depthwise
    (nn.Conv2d(6, 9, 1, groups=3), nn.BatchNorm2d(9), (1, 6, 5, 5)),
    (nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(4), (1, 3, 6, 6)),
    (nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False), (1, 3, 6, 6)),
    (nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), (1, 2, 5, 5, 5)),
    (nn.ConvTranspose1d(4, 6, 3, stride=2), nn.BatchNorm1d(6), (2, 4, 7)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1, bias=False), nn.BatchNorm2d(6), (1, 4, 5, 5)),
    (nn.ConvTranspose2d(4, 6, 3, groups=2), nn.BatchNorm2d(6), (1, 4, 5, 5)),
    (nn.ConvTranspose2d(6, 6, 3, groups=6, bias=False), nn.BatchNorm2d(6, affine=False), (1, 6, 4, 4)),
    (nn.ConvTranspose3d(4, 9, 2, groups=1), nn.BatchNorm3d(9), (1, 4, 3, 3, 3)),
    (nn.ConvTranspose3d(6, 9, 2, groups=3, stride=2), nn.BatchNorm3d(9), (1, 6, 3, 3, 3)),
]


@pytest.mark.parametrize(
    ("conv", "bn", "shape"), CONV_CASES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "x"
)
def test_conv_family_folds_exactly(conv: nn.Module, bn: nn.Module, shape: tuple[int, ...]):
    model = randomize_bn(nn.Sequential(conv, bn, nn.ReLU()))
    x = torch.randn(shape)
    gm, result = fold(model, x)
    assert result.modified and result.matches == 1 and result.skips == []
    assert no_bn_left(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "2"]  # conv kept its name
    assert gm.get_submodule("0").bias is not None
    assert_close_to_eager(model, gm, x)
    assert isinstance(model[1], BN_TYPES) and model[0] is conv  # user's model untouched


def test_grouped_transpose_needs_the_regrouped_scale():
    # torch's fuse_conv_bn_weights(transpose=True) scales dim 1 as if there were one group; with groups=2
    # the (in, out/groups, k) weight has 3 columns for 6 output channels (torch 2.14 raises a shape error).
    conv = nn.ConvTranspose2d(4, 6, 3, groups=2)
    model = randomize_bn(nn.Sequential(conv, nn.BatchNorm2d(6)))
    x = torch.randn(2, 4, 6, 6)
    gm, _ = fold(model, x)
    assert_close_to_eager(model, gm, x)


def test_golden_graph_resnet_stem():
    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, bias=False)
            self.bn2 = nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))

    model = randomize_bn(Stem())
    x = torch.randn(1, 3, 16, 16)
    gm, result = fold(model, x)
    assert result.matches == 2 and result.notes == ["folded BatchNorm into Conv2d ×2"]
    FileCheck().check("self.conv1").check("torch.relu").check("self.conv2").check_not("bn").run(gm.code)
    assert {name for name, _ in gm.named_children()} == {"conv1", "conv2"}  # BN modules deleted
    assert_close_to_eager(model, gm, x)


def test_linear_bn1d_folds_with_shape_metadata():
    model = randomize_bn(
        nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3, bias=False), nn.BatchNorm1d(3, affine=False))
    )
    x = torch.randn(4, 5)
    gm, result = fold(model, x, shapes=True)
    assert result.matches == 2 and no_bn_left(gm)
    assert_close_to_eager(model, gm, x)


class TestDeclined:
    def reasons(self, result) -> list[str]:
        return [s.reason for s in result.skips]

    def test_training_mode(self):
        model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).train()
        _gm, result = fold(model, torch.randn(2, 3, 4, 4))
        assert not result.modified
        assert self.reasons(result) == [
            "BatchNorm is in training mode: it normalises with batch statistics (call model.eval())"
        ]

    def test_no_running_stats(self):
        model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)).eval()
        _gm, result = fold(model, torch.randn(2, 3, 4, 4))
        assert self.reasons(result) == [
            "BatchNorm has no running statistics (track_running_stats=False): it normalises with batch "
            "statistics even in eval mode, so there are no constants to fold"
        ]

    def test_conv_output_read_elsewhere(self):
        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv2d(4, 4, 3, padding=1)
                self.bn = nn.BatchNorm2d(4)

            def forward(self, x):
                y = self.conv(x)
                return self.bn(y) + y

        model = randomize_bn(M())
        _gm, result = fold(model, torch.randn(1, 4, 5, 5))
        assert not result.modified
        (skip,) = result.skips
        assert (skip.node, skip.pattern) == ("bn", "Conv2d → BatchNorm")
        assert skip.reason == "conv output is also read by add; folding would change what they see"

    def test_bn_not_after_conv(self):
        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bn = nn.BatchNorm2d(3)
                self.w = nn.Parameter(torch.randn(4, 3, 1, 1))
                self.bn2 = nn.BatchNorm2d(4)

            def forward(self, x):
                return self.bn2(F.conv2d(self.bn(x), self.w))

        _gm, result = fold(randomize_bn(M()), torch.randn(1, 3, 4, 4))
        assert self.reasons(result) == [
            "BatchNorm reads x (x), not a conv or linear output; nothing to fold it into; "
            "nor into a following layer (no plain conv/linear reads it)",
            "conv/linear is a function call (torch.conv2d); only modules are folded",
        ]

    def test_linear_channel_mismatch_and_unknown_rank(self):
        # Linear(4, 6) on (2, 5, 4) gives (2, 5, 6); BatchNorm1d(5) normalises dim 1 (the 5), legally.
        mismatch = randomize_bn(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(5)))
        _, result = fold(mismatch, torch.randn(2, 5, 4), shapes=True)
        assert self.reasons(result) == ["channel mismatch: Linear has 6 outputs, BatchNorm 5"]

        # Same channel count by coincidence: only the rank says the fold would be wrong.
        square = randomize_bn(nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)))
        x = torch.randn(2, 5, 4)
        gm, result = fold(square, x, shapes=True)
        assert self.reasons(result) == ["Linear output is 3-D: BatchNorm1d normalises dim 1, not the Linear's features"]
        assert_close_to_eager(square, gm, x)

        _, result = fold(square, x, shapes=False)
        assert "no shape metadata" in self.reasons(result)[0]


def test_shared_conv_gets_its_own_folded_copy():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.conv(x)) + self.conv(x * 2)  # second site has no BN

    model = randomize_bn(M())
    x = torch.randn(1, 3, 6, 6)
    gm, result = fold(model, x)
    assert result.matches == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["conv_folded", "conv"]
    assert_close_to_eager(model, gm, x)


def test_get_attr_reader_of_conv_weight_keeps_original():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.bn = nn.BatchNorm2d(2)

        def forward(self, x):
            return self.bn(self.conv(x)) * self.conv.weight.sum()

    model = randomize_bn(M())
    x = torch.randn(1, 2, 3, 3)
    gm, _ = fold(model, x)
    assert "conv_folded" in dict(gm.named_modules())
    assert_close_to_eager(model, gm, x)


def test_double_precision_model():
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5))).double()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    gm, result = fold(model, x)
    assert result.matches == 1 and gm.get_submodule("0").weight.dtype == torch.float64
    with torch.no_grad():
        assert (model(x) - gm(x)).abs().max().item() < 1e-12


class TestLayerNormRefused:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)
            self.fc2 = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc2(self.ln(self.fc1(x)))

    def test_linear_layernorm_linear_left_alone(self):
        model = self.Block().eval()
        x = torch.randn(3, 8)
        gm, result = fold(model, x, shapes=True)
        assert not result.modified and result.matches == 0
        assert [(s.pattern, s.reason) for s in result.skips] == [
            ("Linear → LayerNorm", LAYERNORM_REASON),
            ("LayerNorm → Linear", LAYERNORM_AFFINE_REASON),
        ]
        FileCheck().check("self.fc1").check("self.ln").check("self.fc2").run(gm.code)
        assert_close_to_eager(model, gm, x)

    def test_the_seed_recipe_is_wrong(self):
        """The 'fold LayerNorm into Linear' recipe, with statistics taken from one batch, fails on another."""
        torch.manual_seed(0)
        lin, ln = nn.Linear(8, 8), nn.LayerNorm(8)
        x1, x2 = torch.randn(4, 8), torch.randn(4, 8) * 3 + 1
        with torch.no_grad():
            z = lin(x1)
            mean, var = z.mean(), z.var(unbiased=False)  # the best single constant the recipe could use
            scale = ln.weight / torch.sqrt(var + ln.eps)
            w, b = lin.weight * scale[:, None], scale * (lin.bias - mean) + ln.bias
            assert (F.linear(x2, w, b) - ln(lin(x2))).abs().max() > 0.1


def test_under_pass_manager_reports_and_checks():
    model = randomize_bn(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    )
    x = torch.randn(2, 3, 12, 12)
    out = PassManager([FoldBatchNorm()], strict=True).run(fx.symbolic_trace(model), [(x,)])
    rec = out.report.record("fold_bn")
    assert rec.status == "applied" and rec.matches == 2 and rec.nodes_before - rec.nodes_after == 2
    assert rec.max_abs_err is not None and rec.max_abs_err < 1e-5


class TestFoldIntoNext:
    """A BN no conv precedes folds into the unpadded conv / the Linear that reads it."""

    @pytest.mark.parametrize("groups", [1, 2])
    def test_bn_then_unpadded_conv_folds_exactly(self, groups: int):
        model = randomize_bn(nn.Sequential(nn.MaxPool2d(2), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, groups=groups)))
        x = torch.randn(2, 4, 10, 10)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 1 and "next Conv2d" in result.notes[0]
        assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)

    def test_bn_then_linear_folds(self):
        model = randomize_bn(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(5), nn.Linear(5, 3)))
        x = torch.randn(4, 5)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 1
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)

    def test_bn_then_padded_conv_is_declined_with_the_reason(self):
        model = randomize_bn(nn.Sequential(nn.MaxPool2d(2), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, padding=1)))
        _, result = fold(model, torch.randn(1, 4, 8, 8), shapes=True)
        assert result.matches == 0
        assert "only exact without padding" in result.skips[0].reason


class MixedConv(nn.Module):
    """timm's MixedConv2d: channel groups convolved with different kernels, concatenated, then BN."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 4, 5, padding=2, bias=False)])
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        a, b = torch.split(x, [2, 2], 1)
        return self.bn(torch.cat([self.convs[0](a), self.convs[1](b)], 1))


def test_bn_after_a_concat_of_convs_folds_into_each_slice():
    model = randomize_bn(MixedConv())
    x = torch.randn(2, 4, 8, 8)
    gm, result = fold(model, x, shapes=True)
    assert result.matches == 1 and "channel concat" in result.notes[0]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-4)


def test_bn_after_a_concat_of_one_conv_with_itself_is_not_folded():
    """Found by the fuzzer: cat(y, y) of one conv output; each half would need its own folding."""

    class SelfCat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(6)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(torch.cat([y, y], 1))

    model = randomize_bn(SelfCat())
    x = torch.randn(1, 3, 4, 4)
    gm, result = fold(model, x, shapes=True)
    assert result.matches == 0
    torch.testing.assert_close(gm(x), model(x))


class LinearNorm(nn.Module):
    """timm's LeViT ``LinearNorm``: a Linear on ``(B, N, C)``, BN1d on the tokens flattened into the
    batch, reshaped back; the BN is per output feature of the Linear (#16)."""

    def __init__(self, cin: int = 6, cout: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(cin, cout, bias=False)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class TestFoldThroughReshape:
    def test_golden_graph_levit_linear_norm(self):
        model = randomize_bn(nn.Sequential(LinearNorm(), nn.Hardswish(), LinearNorm(8, 4)))
        x = torch.randn(2, 5, 6)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 2 and result.skips == []
        assert result.notes == ["folded BatchNorm into conv/linear through a reshape ×2"]
        # the BN is gone, and so is the flatten → reshape_as round trip: Linear → Hardswish → Linear
        assert [(n.op, str(n.target)) for n in gm.graph.nodes][1:-1] == [
            ("call_module", "0.linear"),
            ("call_module", "1"),
            ("call_module", "2.linear"),
        ]
        FileCheck().check_not("flatten").check_not("reshape").check_not("bn").run(gm.code)
        assert no_bn_left(gm)
        assert gm.get_submodule("0.linear").bias is not None  # BN's shift became the bias
        assert_close_to_eager(model, gm, x)
        x2 = torch.randn(3, 7, 6)  # another batch and token count: the fold is not tied to the traced shape
        torch.testing.assert_close(gm(x2), model(x2), atol=1e-5, rtol=1e-4)

    def test_under_pass_manager_levit_shapes(self):
        model = randomize_bn(LinearNorm(16, 32))
        x = torch.randn(1, 49, 16)
        out = PassManager([FoldBatchNorm()], strict=True).run(fx.symbolic_trace(model), [(x,)])
        rec = out.report.record("fold_bn")
        assert rec.status == "applied" and rec.matches == 1 and rec.max_abs_err is not None
        assert no_bn_left(out.graph_module)
        torch.testing.assert_close(out.graph_module(x), model(x), atol=1e-5, rtol=1e-4)

    def test_conv_then_reshape_keeps_channels(self):
        """(N, C, H, W) → reshape (N, C, H·W) → BN1d(C): each element keeps its channel."""

        class ConvSeq(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm1d(4)

            def forward(self, x):
                y = self.conv(x)
                return self.bn(y.reshape(y.shape[0], y.shape[1], -1)) + 1

        model = randomize_bn(ConvSeq())
        x = torch.randn(2, 3, 5, 5)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 1 and no_bn_left(gm)
        assert_close_to_eager(model, gm, x)

    def test_transpose_in_the_chain_is_declined_with_the_reason(self):
        class Transposed(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

            def forward(self, x):  # (B, N, C) → (B, C, N): BN normalises over C, but by way of a transpose
                return self.bn(self.linear(x).transpose(1, 2))

        model = randomize_bn(Transposed())
        x = torch.randn(2, 6, 6)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 0 and not no_bn_left(gm)
        assert "not a conv or linear output" in result.skips[0].reason
        torch.testing.assert_close(gm(x), model(x))

    def test_channels_regrouped_is_declined_with_the_reason(self):
        """(B, N, 8) → (B·N·2, 4) → BN1d(4): element f is feature f mod 8 before, f mod 4 after."""

        class Regrouped(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(4)

            def forward(self, x):
                y = self.linear(x)
                return self.bn(y.reshape(-1, 4)).reshape_as(y)

        model = randomize_bn(Regrouped())
        x = torch.randn(2, 3, 6)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 0
        (skip,) = result.skips
        assert "elements change channel" in skip.reason and "(2, 3, 8) has 8 channels" in skip.reason
        torch.testing.assert_close(gm(x), model(x))

    def test_value_read_elsewhere_is_declined_with_the_reason(self):
        class TwoReaders(LinearNorm):
            def forward(self, x):
                y = self.linear(x)
                return self.bn(y.flatten(0, 1)).reshape_as(y) + y

        model = randomize_bn(TwoReaders())
        x = torch.randn(2, 5, 6)
        gm, result = fold(model, x, shapes=True)
        assert result.matches == 0
        assert "also read(s) a value before the BatchNorm" in result.skips[0].reason
        torch.testing.assert_close(gm(x), model(x))

    def test_no_shape_metadata_is_declined_with_the_reason(self):
        model = randomize_bn(LinearNorm())
        _, result = fold(model, torch.randn(2, 5, 6))
        assert result.matches == 0 and "no shape metadata" in result.skips[0].reason
