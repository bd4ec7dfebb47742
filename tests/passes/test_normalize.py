from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.testing import FileCheck

from assets.models import OpaqueShortcut, OpaqueWriteThroughView, add_tail
from gml import nn as gnn
from gml.capture import MUTATES, RETURNS_MUTATED, capture
from gml.passes.manager import PassManager
from gml.passes.normalize import Normalize


def module_types(gm: fx.GraphModule) -> Counter[str]:
    mods = dict(gm.named_modules())
    return Counter(type(mods[n.target]).__name__ for n in gm.graph.nodes if n.op == "call_module")


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


class EveryVariant(nn.Module):
    """Uses every function/method spelling Normalize promises to rewrite."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu_ip = nn.ReLU(inplace=True)
        self.hswish_ip = nn.Hardswish(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.drop2d = nn.Dropout2d(0.1)

    def forward(self, x):
        x = self.conv(x)
        a = torch.relu(F.relu(x)).relu()
        b = x * 1.0
        b.relu_()
        b = F.relu(b, inplace=True)
        c = torch.relu_(x * 2)
        c = F.relu6(c) + F.relu6(c, inplace=False) + F.hardtanh(c, -0.5, 0.5)
        c = F.hardtanh_(c * 1.5) + torch.sigmoid(c) + c.sigmoid() + F.sigmoid(c)
        s = c * 0.25
        s.sigmoid_()
        d = torch.tanh(c) + c.tanh() + F.tanh(c) + s
        t = d * 1.0
        t.tanh_()
        e = F.gelu(d) + F.gelu(d, approximate="tanh") + F.silu(d) + F.hardswish(d) + F.hardsigmoid(d) + t
        e = F.leaky_relu(e, 0.2) + F.leaky_relu(e, negative_slope=0.3, inplace=False) + F.elu(e, 0.5)
        f = operator.add(e, a)
        f = torch.add(f, b, alpha=0.5)
        f = f.add(c)
        f += d
        f = f.add_(e)
        f = torch.add(f + 1, 3, alpha=2)
        f = 2 + f
        g = torch.mul(f, a) * b
        g = g.mul(c)
        g *= 0.5
        g.mul_(d)
        g = 0.5 * g
        g = self.relu_ip(g)
        g = self.hswish_ip(g)
        g = self.drop2d(self.drop(g))
        h = F.max_pool2d(g, 2)
        h = F.max_pool2d(h, kernel_size=3, stride=1, padding=1, dilation=1, ceil_mode=True)
        h = torch.max_pool2d(h, 2)
        h = F.dropout(h, 0.2, training=self.training)
        h = F.adaptive_avg_pool2d(h, (2, 2))
        h = torch.flatten(h, 1) + h.flatten(1) + h.flatten(start_dim=1, end_dim=-1)
        return h


def test_every_variant_normalizes_completely_and_bit_exactly():
    model = EveryVariant().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
    gm = fx.symbolic_trace(model)
    result = Normalize()(gm)

    assert op_nodes(gm) == []  # 0 call_function / call_method left
    assert result.skips == []
    assert result.notes[0] == f"coverage: {result.matches}/{result.matches} op call sites normalized (100.0%)"
    types = module_types(gm)
    assert "Dropout" not in types and "Dropout2d" not in types
    assert types["Add"] == 22 and types["AddScalar"] == 3
    assert types["Mul"] == 4 and types["MulScalar"] == 7
    assert types["ReLU"] == 7 and types["Sigmoid"] == 4 and types["Tanh"] == 4
    assert types["Flatten"] == 3 and types["MaxPool2d"] == 3 and types["Hardswish"] == 2
    assert not any(getattr(m, "inplace", False) for m in gm.modules())
    with torch.no_grad():
        assert torch.equal(gm(x), ref)


def test_golden_graph_small_block():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = F.relu(self.conv(x))
            return torch.flatten(F.adaptive_avg_pool2d(y + x, 1), 1)

    gm = fx.symbolic_trace(Block().eval())
    Normalize()(gm)
    FileCheck().check("self.conv").check("self.relu").check("self.add").check("self.adaptive_avg_pool").check(
        "self.flatten"
    ).run(gm.code)
    assert isinstance(gm.add, gnn.Add)
    assert gm.adaptive_avg_pool.output_size == 1
    assert (gm.flatten.start_dim, gm.flatten.end_dim) == (1, -1)


def test_arguments_are_kept():
    class M(nn.Module):
        def forward(self, x):
            x = F.gelu(x, approximate="tanh")
            x = F.leaky_relu(x, 0.17)
            x = F.hardtanh(x, -2.0, 3.0)
            x = F.max_pool2d(x, 3, 2, 1, 1, True)
            return torch.add(x, x, alpha=-0.25)

    gm = fx.symbolic_trace(M())
    Normalize()(gm)
    assert gm.gelu.approximate == "tanh"
    assert gm.leaky_relu.negative_slope == 0.17
    assert (gm.hardtanh.min_val, gm.hardtanh.max_val) == (-2.0, 3.0)
    mp = gm.max_pool
    assert (mp.kernel_size, mp.stride, mp.padding, mp.dilation, mp.ceil_mode) == (3, 2, 1, 1, True)
    assert gm.add.alpha == -0.25
    x = torch.randn(1, 2, 9, 9)
    assert torch.equal(gm(x), M()(x))


def test_new_modules_live_in_the_calling_submodule():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)

        def forward(self, x):
            return F.relu(self.conv(x) + x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(Block(), Block())

        def forward(self, x):
            return self.layer(x)

    gm = fx.symbolic_trace(Net())
    Normalize()(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == [
        "layer.0.conv", "layer.0.add", "layer.0.relu", "layer.1.conv", "layer.1.add", "layer.1.relu",
    ]  # fmt: skip


def test_shape_arithmetic_is_ignored_and_runtime_scalars_are_declined():
    class M(nn.Module):
        def forward(self, x):
            n = x.size(0) * 2 + 1  # Python ints: not a tensor op
            return torch.cumsum(x, 1) * x.size(1), n

    gm = fx.symbolic_trace(M())
    result = Normalize()(gm)
    reasons = {s.node: s.reason for s in result.skips}
    assert reasons == {"mul_1": "operand size_1 is a Python number computed at run time",
                       "cumsum": "no module form for torch.cumsum"}  # fmt: skip
    assert not result.modified and result.matches == 0
    assert result.notes[0] == "coverage: 0/2 op call sites normalized (0.0%)"
    assert "ignored 4 shape/scalar nodes (not tensor ops)" in result.notes


def test_runtime_argument_declined():
    class M(nn.Module):
        def forward(self, x, lo: float):
            return F.hardtanh(x, lo, 1.0)

    gm = fx.symbolic_trace(M())
    result = Normalize()(gm)
    assert [s.reason for s in result.skips] == [
        "argument min_val is computed at run time (lo), so it cannot be stored on a module"
    ]


def test_active_dropout_is_kept_with_reason():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return F.dropout(self.drop(x), 0.1)  # training defaults to True in F.dropout

    gm = fx.symbolic_trace(M().train())
    result = Normalize()(gm)
    assert sorted(s.reason for s in result.skips) == [
        "dropout called with training=True is random; call model.eval() and pass training=self.training to F.dropout",
        "dropout module is in training mode (random); call model.eval() first",
    ]
    assert module_types(gm)["Dropout"] == 1


class TestInPlace:
    def test_later_readers_see_the_out_of_place_result(self):
        class M(nn.Module):
            def forward(self, x):
                y = x * 2
                z = y.relu_()  # overwrites y; `y` below must read the relu'd values
                y.mul_(3)
                return y + z

        gm = fx.symbolic_trace(M())
        result = Normalize()(gm)
        assert result.skips == []
        x = torch.randn(3, 5)
        assert torch.equal(gm(x), M()(x))

    def test_overwrite_seen_through_an_inplace_result_is_made_out_of_place(self):
        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.act = nn.ReLU(inplace=True)

            def forward(self, x):
                a = x * 2
                b = a.add_(x)  # b *is* a (same object), not a view
                self.act(a)  # overwrites a, so b reads relu(2x + x) too
                return b * 1

        gm = fx.symbolic_trace(M())
        result = Normalize()(gm)
        assert result.skips == []
        assert not any(getattr(m, "inplace", False) for m in gm.modules())
        mul, add, act, out_mul = (n for n in gm.graph.nodes if n.op == "call_module")
        assert add.args[0] is mul and act.args == (add,) and out_mul.args[0] is act  # b reads relu's result
        x = torch.randn(3, 5)
        assert torch.equal(gm(x), M()(x))

    def test_view_read_later_is_declined(self):
        class M(nn.Module):
            def forward(self, x):
                y = x * 2
                v = y.view(-1)
                y.relu_()  # also changes v
                return v + 1

        gm = fx.symbolic_trace(M())
        result = Normalize()(gm)
        (skip,) = [s for s in result.skips if s.node == "relu_"]
        assert skip.reason == (
            "in-place op kept: view shares storage with the overwritten mul_1 and is read later by add"
        )
        x = torch.randn(2, 3)
        assert torch.equal(gm(x), M()(x))

    def test_input_and_buffer_mutation_declined(self):
        # symbolic_trace runs `self.count.add_(1)` eagerly on the real buffer, so build the graph by hand.
        root = nn.Module()
        root.register_buffer("count", torch.zeros(1))
        graph = fx.Graph()
        x = graph.placeholder("x")
        count = graph.get_attr("count")
        bumped = graph.call_method("add_", (count, 1))
        relu = graph.call_function(F.relu, (x,), {"inplace": True})
        graph.output(graph.call_function(operator.add, (relu, bumped)))
        gm = fx.GraphModule(root, graph)
        result = Normalize()(gm)
        assert sorted(s.reason for s in result.skips) == [
            "in-place op kept: it overwrites model input x in place, which the caller can observe",
            "in-place op kept: it overwrites parameter/buffer count in place, which persists across calls",
        ]
        assert gm(torch.ones(1)).item() == 2.0 and gm(torch.ones(1)).item() == 3.0  # state still advances

    def test_shared_inplace_module_flipped_only_if_every_site_is_safe(self):
        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.act = nn.ReLU(inplace=True)

            def forward(self, x):
                a = self.act(x * 1)
                b = x - 1
                keep = b.view(-1)
                self.act(b)  # overwrites b, visible through `keep`
                return a, keep

        model = M()
        gm = fx.symbolic_trace(model)
        result = Normalize()(gm)
        assert gm.act.inplace is True  # left alone: one site depends on the in-place write
        assert {s.node: s.reason for s in result.skips if s.node.startswith("act")} == {
            "act_1": "cannot make act out-of-place: view shares storage with the overwritten sub and is read later "
            "by output",
            "act": "act is also called in place at act_1, which must stay",
        }

    def test_user_module_objects_are_not_mutated(self):
        model = nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU(inplace=True)).eval()
        gm = fx.symbolic_trace(model)
        Normalize()(gm)
        assert model[1].inplace is True
        assert gm.get_submodule("1").inplace is False


class TestOpaqueWrites:
    """Calls Normalize has no module form for that overwrite an input (MViT's `_add_shortcut`)."""

    def _normalized(self, returning: bool):
        model = OpaqueShortcut(returning).eval()
        x = torch.randn(4, 16)
        gm = capture(model, (x,))
        result = Normalize()(gm)
        return model, gm, result, x

    def test_capture_records_which_input_a_call_overwrote(self):
        gm = capture(OpaqueShortcut().eval(), (torch.randn(4, 16),))
        (call,) = [n for n in gm.graph.nodes if n.meta.get(MUTATES)]
        assert call.target is add_tail
        assert call.meta[MUTATES] == ("lin",) and call.meta[RETURNS_MUTATED] == "lin"

    def test_call_returning_the_overwritten_tensor_is_read_by_later_readers(self):
        model, gm, result, x = self._normalized(True)
        assert [s.reason for s in result.skips] == ["no module form for assets.models.add_tail"]
        call = next(n for n in gm.graph.nodes if n.target is add_tail)
        mods = dict(gm.named_modules())
        relu = next(n for n in gm.graph.nodes if n.op == "call_module" and isinstance(mods[n.target], nn.ReLU))
        assert relu.args == (call,)  # was (lin,): the write is now a data dependence
        assert "made visible to later readers: assets.models.add_tail ×1" in " ".join(result.notes)
        gm.graph.eliminate_dead_code()  # a pass that takes ops to be pure can no longer drop the write
        gm.recompile()
        assert torch.equal(gm(x), model(x))

    def test_call_returning_nothing_becomes_return_overwritten(self):
        model, gm, result, x = self._normalized(False)
        assert not [s for s in result.skips if "overwrites" in s.reason]
        assert module_types(gm)["ReturnOverwritten"] == 1
        FileCheck().check("lin = self.lin(x)").check("overwrite = self.overwrite(lin, x)").check("(overwrite)").run(
            gm.code
        )
        gm.graph.eliminate_dead_code()
        gm.recompile()
        assert torch.equal(gm(x), model(x))

    def test_write_seen_through_a_view_read_later_is_declined(self):
        model, x = OpaqueWriteThroughView().eval(), torch.randn(3, 4)
        gm = capture(model, (x,))
        result = Normalize()(gm)
        (skip,) = [s for s in result.skips if s.node == "add_tail_silently"]
        assert skip.reason.startswith("opaque call overwrites mul in place: view shares storage")
        assert module_types(gm)["ReturnOverwritten"] == 0
        assert torch.equal(gm(x), model(x))

    def test_pure_opaque_calls_are_left_alone(self):
        class M(nn.Module):
            def forward(self, x):
                return torch.cumsum(x, 1) + x

        gm = capture(M().eval(), (torch.randn(2, 3),))
        assert not any(n.meta.get(MUTATES) for n in gm.graph.nodes)


def test_torchvision_resnet18_under_pass_manager():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None).eval()
    gm = fx.symbolic_trace(model)
    x = torch.randn(1, 3, 64, 64)
    out = PassManager([Normalize()]).run(gm, [(x,)])
    rec = out.report.record("normalize")
    assert rec.status == "applied" and rec.skips == []
    assert rec.matches == 8 + 17 + 1  # 8 residual adds, 17 in-place ReLU call sites, 1 flatten
    assert op_nodes(out.graph_module) == []
    assert rec.max_abs_err == 0.0


def test_stochastic_depth_is_dropout():
    ops = pytest.importorskip("torchvision.ops")
    # StochasticDepth.forward calls the fx-wrapped torchvision.ops.stochastic_depth(x, p, mode, self.training)
    model = nn.Sequential(ops.StochasticDepth(0.2, "row"))

    gm = fx.symbolic_trace(model.eval())
    result = Normalize()(gm)
    assert result.notes[1] == "rewritten: dropout ×1" and op_nodes(gm) == []

    result = Normalize()(fx.symbolic_trace(model.train()))
    assert [s.reason for s in result.skips] == [
        "dropout called with training=True is random; call model.eval() and pass training=self.training to F.dropout"
    ]


def test_functional_avg_pools_become_modules_with_every_argument():
    class M(nn.Module):
        def forward(self, x):
            a = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
            b = F.avg_pool2d(x, kernel_size=2, ceil_mode=True, divisor_override=3)
            return a.sum() + b.sum() + F.avg_pool1d(x.flatten(2), 2).sum()

    gm = fx.symbolic_trace(M())
    result = Normalize()(gm)
    pools = [m for m in gm.modules() if isinstance(m, (nn.AvgPool1d, nn.AvgPool2d))]
    assert not [s for s in result.skips if "pool" in s.pattern] and len(pools) == 3
    a, b = (m for m in pools if isinstance(m, nn.AvgPool2d))
    assert (a.kernel_size, a.stride, a.padding, a.count_include_pad) == (3, 1, 1, False)
    assert (b.kernel_size, b.stride, b.ceil_mode, b.divisor_override) == (
        2,
        2,
        True,
        3,
    )  # stride defaults to the kernel
    x = torch.randn(2, 3, 7, 7)
    assert torch.equal(gm(x), M()(x))


def test_identity_modules_are_removed_but_not_subclasses():
    from gml.capture import trace

    class Tap(nn.Identity):
        """A subclass may do more than return its input (here: count calls); it stays."""

        calls = 0

        def forward(self, x):
            Tap.calls += 1
            return x

    model = nn.Sequential(nn.Conv2d(2, 2, 1), nn.Identity(), Tap(), nn.ReLU()).eval()
    gm = trace(model, leaf_modules=[Tap])
    result = Normalize()(gm)
    assert module_types(gm) == Counter({"Conv2d": 1, "Tap": 1, "ReLU": 1})
    FileCheck().check('_0 = getattr(self, "0")(input_1)').check('_2 = getattr(self, "2")(_0)').run(gm.code)
    assert "nn.Identity ×1" in result.notes[1]
    x = torch.randn(1, 2, 3, 3)
    calls = Tap.calls
    assert torch.equal(gm(x), model(x)) and Tap.calls == calls + 2


class _SqueezeExcite(nn.Module):
    """timm's SqueezeExcite: the squeeze a spatial mean, the reduce conv's activation in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.reduce, self.act = nn.Conv2d(8, 2, 1), nn.SiLU(inplace=True)
        self.expand = nn.Conv2d(2, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        s = self.act(self.reduce(y.mean((2, 3), keepdim=True)))
        return y * self.expand(s).sigmoid()


def test_spatial_mean_becomes_an_adaptive_pool_bit_exactly():
    model, x = _SqueezeExcite().eval(), torch.randn(2, 8, 7, 9)
    gm = capture(model, (x,))
    result = Normalize()(gm)
    assert module_types(gm)["AdaptiveAvgPool2d"] == 1 and not [n for n in op_nodes(gm) if n.target == "mean"]
    assert not [s for s in result.skips if "mean" in s.pattern]
    (pool,) = [m for m in gm.modules() if isinstance(m, nn.AdaptiveAvgPool2d)]
    assert pool.output_size == 1
    for x in (torch.randn(2, 8, 7, 9), torch.randn(1, 8, 5, 5).contiguous(memory_format=torch.channels_last)):
        assert torch.equal(gm(x), model(x))


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda x: x.mean((2, 3)), "mean over dim=(2, 3) keepdim=False dtype=None"),
        (lambda x: x.mean(1, keepdim=True), "mean over dim=1 keepdim=True dtype=None"),
        (lambda x: x.flatten(2).mean(-1, keepdim=True), "mean of a 3-D tensor"),
        (lambda x: x.mean(), "mean over dim=None keepdim=False dtype=None"),
    ],
)
def test_other_means_keep_their_call_with_the_reason(call, reason):
    class M(nn.Module):
        def forward(self, x):
            return call(x)

    x = torch.randn(2, 3, 4, 5)
    gm = capture(M(), (x,))
    result = Normalize()(gm)
    (skip,) = [s for s in result.skips if "mean" in s.pattern]
    assert skip.reason.startswith(reason), skip.reason
    assert torch.equal(gm(x), call(x))


def test_an_activation_made_out_of_place_no_longer_records_its_write():
    """Shape propagation records that ``SiLU(inplace=True)`` overwrote the reduce conv's output
    (``MUTATES``); once Normalize makes the module out of place that record is stale, and the conv
    fusion read it as "its output is overwritten in place" and left every squeeze-excite reduce
    conv of timm's EfficientNets unfused (and so in torch)."""
    model, x = _SqueezeExcite().eval(), torch.randn(2, 8, 7, 9)
    gm = capture(model, (x,))
    (act,) = [n for n in gm.graph.nodes if n.target == "act"]
    assert act.meta.get(MUTATES) == ("reduce",)  # the capture saw the write
    Normalize()(gm)
    assert not [n.name for n in gm.graph.nodes if n.meta.get(MUTATES)]
    import gml

    fused = gml.optimize(model, x, runtime="torch").report.record("fuse_conv")
    assert fused.skips == [] and fused.matches == 2  # reduce + SiLU and expand + sigmoid, one kernel each


class _TimmLayerNorm(nn.LayerNorm):
    """timm's LayerNorm: a subclass whose own forward calls F.layer_norm (traced through)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def test_functional_layer_norm_with_stored_parameters_becomes_the_module():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.bare = _TimmLayerNorm(8, eps=1e-6), _TimmLayerNorm(8, elementwise_affine=False)
            self.scale = nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            computed = F.layer_norm(x, (8,), self.scale * 2)  # a weight computed at run time
            return self.norm(x) + self.bare(x) + computed

    model = M().eval()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    x = torch.randn(2, 5, 8)
    gm = capture(model, (x,))
    result = Normalize()(gm)
    norms = [m for m in gm.modules() if type(m) is nn.LayerNorm]
    assert sorted((m.eps, m.elementwise_affine) for m in norms) == [(1e-6, True), (1e-5, False)]
    assert any(m.weight is model.norm.weight for m in norms)  # shared, not copied
    (skip,) = [s for s in result.skips if "layer_norm" in s.pattern]
    assert skip.reason == "weight is computed at run time, not a stored parameter or buffer"
    assert torch.equal(gm(x), model(x))


class _SignsAndCasts(nn.Module):
    """timm's rotary embedding: ``-x[..., 1::2]``, a product cast back with ``.to(dtype=x.dtype)``,
    ``type_as``; and the subtractions a model writes."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)
        b = (a * 0.5).to(dtype=x.dtype).type_as(y).float()
        c = torch.sub(x, y, alpha=2) - 3.0
        d = x.neg() + torch.neg(y)
        d -= y
        return a + b + c + d


def test_signs_subtractions_and_casts_that_change_nothing_normalize_bit_exactly():
    model = _SignsAndCasts().eval()
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    gm = capture(model, (x, y))
    result = Normalize()(gm)
    mods = dict(gm.named_modules())
    scalars = sorted(
        (type(m).__name__, m.other, getattr(m, "alpha", 1))
        for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(m := mods[n.target], gnn.MulScalar | gnn.AddScalar)
    )
    # -x[..., 1::2], x.neg(), torch.neg(y); a * 0.5; (...) - 3.0
    assert scalars == [("AddScalar", 3.0, -1), *[("MulScalar", -1, 1)] * 3, ("MulScalar", 0.5, 1)]
    adds = sorted(
        mods[n.target].alpha for n in gm.graph.nodes if n.op == "call_module" and type(mods[n.target]) is gnn.Add
    )
    assert adds == [-2, -1, 1, 1, 1, 1]  # sub(x, y, alpha=2), d -= y, and the four sums
    assert not [n for n in op_nodes(gm) if n.target in ("to", "type_as", "float", "neg", "sub", operator.sub)]
    assert not [n for n in gm.graph.nodes if n.target is getattr and n.args[1] == "dtype"]  # x.dtype went too
    assert "rewritten" in " ".join(result.notes) and ".to() (no change) ×1" in " ".join(result.notes)
    assert torch.equal(gm(x, y), model(x, y))


@pytest.mark.parametrize(
    ("call", "kept"),
    [
        (lambda x: x.to(torch.float64), "to"),  # a real conversion
        (lambda x: x.to(torch.float32, copy=True), "to"),  # a copy on request
        (lambda x: x.to(dtype=torch.bfloat16).float(), "to"),
        (lambda x: 2.0 - x, operator.sub),  # a number minus a tensor: no module form
    ],
    ids=["float64", "copy", "bf16-roundtrip", "rsub"],
)
def test_casts_that_convert_or_copy_and_a_number_minus_a_tensor_keep_their_call(call, kept):
    class M(nn.Module):
        def forward(self, x):
            return call(x)

    x = torch.randn(2, 8)
    gm = capture(M(), (x,))
    result = Normalize()(gm)
    assert [n for n in op_nodes(gm) if n.target == kept]
    if kept is operator.sub:
        (skip,) = [s for s in result.skips if "sub" in s.pattern]
        assert skip.reason == "a number minus a tensor has no module form"
    assert torch.equal(gm(x), call(x))
