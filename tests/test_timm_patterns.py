"""The timm patterns of issue #16 on tiny local models (tests/assets/timm_like.py; no timm needed)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import gml
from assets.timm_like import (
    BnActNet,
    Conv2dSame,
    GlobalContextNet,
    SameNet,
    ShapeCheckNet,
    StdConvNet,
    ValueBranchNet,
    randomize_bn,
)
from gml.capture import SPECIALIZED
from gml.errors import InputError, TraceFailure
from gml.ir.layers import behaves_as
from gml.ir.library import gml_op_name
from gml.passes.base import GraphPass, PassResult
from gml.passes.manager import PassManager
from gml.passes.oplib import op_kind
from gml.quant.lower import coverage_of
from gml.quant.modules import QConv2dAdd

X = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _int8_counts(gm: fx.GraphModule) -> Counter[str]:
    """The INT8 compute ops of a lowered graph (``torch.ops.gml`` calls; the quantize at the edge
    of the INT8 region and dequantizes excluded)."""
    ops = (gml_op_name(n) for n in gm.graph.nodes)
    return Counter(op for op in ops if op is not None and op not in ("quantize", "dequantize", "requantize"))


# ---------------------------------------------------------------- 1. a subclass is not its base class
class RenamedConv(nn.Conv2d):
    """A subclass that only adds a constructor: it still computes nn.Conv2d."""

    def __init__(self) -> None:
        super().__init__(3, 4, 3)


def test_behaves_as_tells_an_overridden_forward_from_a_renamed_layer():
    assert behaves_as(nn.Conv2d(3, 4, 3), nn.Conv2d)
    assert behaves_as(RenamedConv(), nn.Conv2d)
    assert not behaves_as(Conv2dSame(3, 4, 3, stride=2), nn.Conv2d)
    gm = gml.capture(SameNet().eval(), leaf_modules=[Conv2dSame])
    node = next(n for n in gm.graph.nodes if n.target == "dw")
    assert op_kind(node, dict(gm.named_modules())) is None  # not "conv"


def test_conv2d_same_leaf_is_not_lowered_as_a_padding_free_conv():
    """tf_efficientnet_lite0: the strided depthwise Conv2dSame became QConv2d(padding=0) (cosine 0.61)."""
    torch.manual_seed(0)
    model = randomize_bn(SameNet()).eval()
    r = gml.quantize(model, 4, example_inputs=(X,), leaf_modules=[Conv2dSame])
    kept = {n: e.reason for e in r.coverage.kept_fp32 for n in e.nodes}
    assert "no INT8 kernel for Conv2dSame" in kept["dw"]
    assert r.accuracy.cosine > 0.99
    with torch.no_grad():
        assert _cos(r.module(X), model(X)) > 0.99


class DropPadding(GraphPass):
    """Deliberately wrong, as the old lowering was: the "same" conv loses its padding; the head
    pools, so the output keeps its shape. Tolerance None, like a quantizing pass."""

    name = "drop_padding"
    tolerance = None

    def call(self, gm: fx.GraphModule) -> PassResult:
        dw: nn.Conv2d = gm.get_submodule("dw")
        plain = nn.Conv2d(16, 16, 3, stride=2, groups=16, bias=False)
        plain.weight = dw.weight
        gm.dw = plain
        gm.recompile()
        return PassResult(gm, True, matches=1)


def test_pass_manager_rejects_a_rewrite_that_changes_an_intermediate_shape():
    model = SameNet().eval()
    gm = gml.capture(model, (X,), leaf_modules=[Conv2dSame])
    result = PassManager([DropPadding()]).run(gm, [(X,)])
    (rec,) = result.report.records
    assert rec.status == "rolled back"
    assert "changed shape from [1, 16, 14, 14] to [1, 16, 13, 13]" in rec.error
    assert isinstance(result.graph_module.get_submodule("dw"), Conv2dSame)


# ---------------------------------------------------------------- 2. broadcasting conv → add; honest coverage
def test_broadcasting_conv_add_is_declined_with_a_reason_and_the_rest_lowers():
    torch.manual_seed(0)
    model = randomize_bn(GlobalContextNet()).eval()
    r = gml.quantize(model, 4, example_inputs=(X,))
    assert not r.report.rolled_back
    kept = {n: e.reason for e in r.coverage.kept_fp32 for n in e.nodes}
    assert "broadcasts" in kept["mlp"]
    counts = _int8_counts(r.module)
    assert counts["qconv_add"] == 2  # the two ordinary residuals still fuse
    lowered = Counter(e.result for e in r.coverage.lowered)
    assert {k: lowered[k] for k in counts} == counts  # the report is the module's content
    assert r.accuracy.cosine > 0.99


def test_a_rewrite_the_kernel_rejects_is_declined_alone(monkeypatch: pytest.MonkeyPatch):
    """Per-rewrite isolation: a kernel that raises for one op declines that op, not the whole lowering."""

    def reject(self, *args):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(QConv2dAdd, "forward", reject)
    torch.manual_seed(0)
    r = gml.quantize(randomize_bn(GlobalContextNet()).eval(), 4, example_inputs=(X,))
    assert not r.report.rolled_back
    counts = _int8_counts(r.module)
    assert counts["qconv_add"] == 0 and counts["qconv"] >= 1 and counts["qlinear"] == 1
    reasons = [e.reason for e in r.coverage.kept_fp32]
    assert any("rejects QConv2dAdd here (could not create a primitive descriptor)" in why for why in reasons), reasons
    lowered = Counter(e.result for e in r.coverage.lowered)
    assert {k: lowered[k] for k in counts} == counts


def test_coverage_of_a_module_without_int8_kernels_says_nothing_was_lowered():
    gm = gml.capture(GlobalContextNet().eval(), (X,))
    cov = coverage_of(gm)
    assert cov.summary() == "lowered to INT8: nothing"


# ---------------------------------------------------------------- 3. functional BN (BatchNormAct2d)
def test_batchnormact_normalizes_to_a_module_and_folds_into_its_conv():
    torch.manual_seed(0)
    model = randomize_bn(BnActNet()).eval()
    r = gml.optimize(model, (X,))
    assert r.rel_err < 1e-5
    fold = r.report.record("fold_bn")
    # bn1, bn2: their F.batch_norm became nn.BatchNorm2d, then folded; bn3 (after the pool) folds
    # forward into the unpadded 1x1 conv
    assert fold.matches == 3
    left = [n for n in r.module.graph.nodes if n.op == "call_function" and n.target is F.batch_norm]
    assert not left


def test_functional_batch_norm_with_batch_statistics_is_declined_with_a_reason():
    class TrainBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.register_buffer("mean", torch.zeros(4))
            self.register_buffer("var", torch.ones(4))

        def forward(self, x):
            return F.batch_norm(self.conv(x), self.mean, self.var, training=True, momentum=0.0)

    from gml.passes.normalize import Normalize

    gm = gml.capture(TrainBN().eval(), (X,))
    result = Normalize()(gm)
    assert any("batch statistics" in s.reason for s in result.skips)


def test_every_bn_of_the_block_folds_and_the_model_quantizes():
    torch.manual_seed(0)
    r = gml.quantize(randomize_bn(BnActNet()).eval(), 4, example_inputs=(X,))
    assert _int8_counts(r.module)["QBatchNorm2d"] == 0  # every BN folded (bn3 into the next conv)
    assert r.accuracy.cosine > 0.99


# ---------------------------------------------------------------- 4. weight standardization
def test_standardized_weights_are_folded_once_and_the_convs_fuse_and_quantize():
    torch.manual_seed(0)
    model = StdConvNet().eval()
    r = gml.optimize(model, (X,))
    assert r.rel_err < 1e-5
    assert r.report.record("fold_constants").matches == 2
    assert not [n for n in r.module.graph.nodes if n.target is F.batch_norm]
    q = gml.quantize(model, 4, example_inputs=(X,))
    assert _int8_counts(q.module)["qconv"] == 2 and q.accuracy.cosine > 0.99


def test_fold_constants_keeps_an_op_that_writes_state():
    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # parameters, so fx records get_attr nodes instead of running the call at trace time
            self.w = nn.Parameter(torch.randn(2, 4), requires_grad=False)
            self.mean = nn.Parameter(torch.zeros(4), requires_grad=False)
            self.var = nn.Parameter(torch.ones(4), requires_grad=False)

        def forward(self, x):  # updates running statistics of a constant: state, not a constant
            return x + F.batch_norm(self.w, self.mean, self.var, training=True)

    from gml.passes.fold_constants import FoldConstants

    model = Running().eval()
    gm = fx.symbolic_trace(model)
    result = FoldConstants()(gm)
    assert result.matches == 0
    assert any("state-updating" in s.reason for s in result.skips)
    assert torch.equal(model.mean, torch.zeros(4))  # evaluated on copies


# ---------------------------------------------------------------- 5. shape-only Python
def test_shape_checks_in_forward_trace_by_specialising_to_the_example_shape():
    """Python reads heights and widths only: the graph is specialised to them, not to the batch."""
    torch.manual_seed(0)
    model = randomize_bn(ShapeCheckNet()).eval()
    gm = gml.capture(model, (X,))
    assert gm.meta[SPECIALIZED]["shapes"] == [(None, *X.shape[1:])]
    assert "timm_like.py" in gm.meta[SPECIALIZED]["why"][0]
    assert not gm.training
    r = gml.optimize(model, (X,))
    assert r.rel_err < 1e-5
    q = gml.quantize(model, 4, example_inputs=(X,))
    assert q.accuracy.cosine > 0.99
    for module in (gm, r.module, q.module):
        with pytest.raises(InputError, match=r"captured for \(\*, 3, 28, 28\)"):
            module(torch.randn(1, 3, 32, 32))
    x3 = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        want = model(x3)
        torch.testing.assert_close(gm(x3), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.executable(x3), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        assert q.executable(x3).shape == want.shape


class BatchReadNet(nn.Module):
    """Python reads the batch: ``B, C, H, W = x.shape`` then a loop over the batch items, a branch on
    B, or B as a Python number. The graph holds B: another batch is refused (with it in the message)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        if self.how == "loop":  # range(B): one graph node per item of the example's batch
            return torch.stack([y[i] * (i + 1) for i in range(b)])
        if self.how == "branch":  # a threshold no nearby batch crosses
            return y * 2 if b > 16 else y
        return y.reshape(int(b), c * h * w)  # int(): the batch as a Python number


@pytest.mark.parametrize("how", ["loop", "branch", "reshape"])
def test_a_read_of_the_batch_pins_it(how):
    model = BatchReadNet(how).eval()
    gm = gml.capture(model, (X,))
    assert gm.meta[SPECIALIZED]["shapes"] == [tuple(X.shape)]
    with pytest.raises(InputError, match=r"captured for \(1, 3, 28, 28\)"):
        gm(torch.randn(2, 3, 28, 28))
    torch.testing.assert_close(gm(X), model(X))


class HeightReadNet(nn.Module):
    """Reads the height through an intermediate tensor (a pad computed from it, as Conv2dSame)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ih, iw = x.shape[-2:]
        pad_h = max((math.ceil(ih / 2) - 1) * 2 + 3 - ih, 0)
        pad_w = max((math.ceil(iw / 2) - 1) * 2 + 3 - iw, 0)
        y = self.conv(F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2]))
        return y.flatten(1) if y.shape[-1] > 4 else y.mean((2, 3))


def test_heights_read_through_pads_leave_the_batch_free():
    model = HeightReadNet().eval()
    gm = gml.capture(model, (X,))
    assert gm.meta[SPECIALIZED]["shapes"] == [(None, 3, 28, 28)]
    for b in (2, 5, 1):
        x = torch.randn(b, 3, 28, 28)
        torch.testing.assert_close(gm(x), model(x))


def test_rank_asserts_guard_the_rank_only():
    gm = gml.capture(BnActNet().eval(), (X,))
    assert gm.meta[SPECIALIZED]["shapes"] == [4]
    gm(torch.randn(2, 3, 20, 20))  # another batch and size: fine
    with pytest.raises(InputError, match="4-D input"):
        gm(torch.randn(3, 20, 20))


def test_value_dependent_control_flow_still_fails_clearly():
    with pytest.raises(TraceFailure, match=r"data-dependent control flow .* `if y.sum\(\) > 0:`"):
        gml.capture(ValueBranchNet().eval(), (X,))


# ---------------------------------------------------------------- 6. leaves get their traced layout
class RecordingLeaf(nn.Module):
    """An opaque leaf that remembers the layouts it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 8, 3)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.is_contiguous())
        return self.conv(x)


def test_a_leaf_gets_the_memory_format_it_was_traced_with():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), RecordingLeaf()).eval()
    r = gml.optimize(model, (X,), leaf_modules=[RecordingLeaf])
    rec = r.report.record("leaf_memory_format")
    fused = r.report.record("fuse_conv")
    leaf = r.module.get_submodule("2")
    leaf.seen.clear()
    r.module(X)
    assert leaf.seen == [True]
    if fused.matches:  # the fused conv writes channels-last: the pass converted it back
        assert rec.matches == 1
    assert r.rel_err < 1e-5


def test_functional_conv_and_linear_on_stored_weights_get_module_forms():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 3, 3, 3))
            self.fc = nn.Parameter(torch.randn(10, 8))

        def forward(self, x):
            y = F.conv2d(x, self.w, None, 2, 1)
            return F.linear(y.mean((2, 3)), self.fc)

    from gml.passes.normalize import Normalize

    model = Functional().eval()
    gm = gml.capture(model, (X,))
    Normalize()(gm)
    kinds = Counter(type(m).__name__ for m in gm.modules())
    assert kinds["Conv2d"] == 1 and kinds["Linear"] == 1
    assert torch.equal(gm(X), model(X))  # the very same calls: bit-exact


class CachingLeaf(nn.Module):
    """A user's leaf that keeps what it sees (a cache on ``self``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return x * 2


class ReadsAfterLeafNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = CachingLeaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.leaf(x)
        return y[..., :-1] if y.shape[-1] > 8 else y


def test_the_batch_probe_never_calls_a_users_leaf():
    """The probe would hand it fake tensors: it is not called, and what it reads counts as pinned."""
    model = ReadsAfterLeafNet().eval()
    gm = gml.capture(model, (X,), leaf_modules=["leaf"])
    assert gm.meta[SPECIALIZED]["shapes"] == [tuple(X.shape)]
    assert type(model.leaf.seen) is torch.Tensor
