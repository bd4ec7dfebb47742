"""FoldPadIntoConv (exact) and the INT8 zero pad on the integers (QPad): timm's Conv2dSame after
shape specialisation is ``F.pad(x, [0, 1, 0, 1]) → conv(padding=0)`` (asymmetric: stays a pad)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

import gml
from gml.ir import library
from gml.passes.fold_pad import FoldPadIntoConv

X = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))


class Pads(nn.Module):
    """symmetric F.pad → conv (folds); asymmetric F.pad → strided depthwise conv (stays);
    ZeroPad2d → max pool (no conv: stays); reflect pad → conv (not zeros: stays)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, groups=8)
        self.zpad = nn.ZeroPad2d(1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.c4 = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.c1(F.pad(x, [1, 1, 1, 1])))
        y = F.relu(self.c2(F.pad(y, [0, 1, 0, 1])))
        y = F.max_pool2d(self.zpad(y), 2)
        y = F.relu(self.c3(F.pad(y, [1, 1, 1, 1], mode="reflect")))
        return self.c4(y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Pads().eval()


def test_symmetric_zero_pad_folds_into_the_conv_golden():
    gm = fx.symbolic_trace(_model())
    ref = gm(X)
    result = FoldPadIntoConv()(gm)
    out = result.graph_module
    assert result.matches == 1
    nodes = {n.name: n for n in out.graph.nodes}
    assert nodes["c1"].args[0].op == "placeholder"  # the pad before c1 is gone
    assert out.get_submodule("c1").padding == (1, 1)
    assert torch.equal(out(X), ref)  # exact
    reasons = {s.node: s.reason for s in result.skips}
    assert "asymmetric pad [0, 1, 0, 1]" in reasons["pad_1"]
    assert reasons["zpad"] == "no conv reads the pad"
    assert "reflect pad" in reasons["pad_2"]


def test_a_subclass_with_its_own_forward_keeps_its_pad():
    class OwnForward(nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = OwnForward(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(F.pad(x, [1, 1, 1, 1]))

    class Leaf(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, OwnForward) or super().is_leaf_module(m, name)

    model = M().eval()
    gm = fx.GraphModule(model, Leaf().trace(model))
    # a leaf: the conv's forward is opaque, so its padding attribute is not what it computes
    result = FoldPadIntoConv()(gm)
    assert result.matches == 0
    assert "has its own forward" in result.skips[0].reason


def test_int8_pads_run_on_the_integers_and_match_the_reference(tmp_path):
    model = _model()
    q = gml.quantize(model, 4, example_inputs=(X,), cost_policy="off", per_layer=False, keep_intermediates=True)
    ops = [library.gml_op_name(n) or str(getattr(n.target, "__name__", n.target)) for n in q.module.graph.nodes]
    # the asymmetric pad and the pad before the max pool run on uint8: no dequantize/quantize around them
    assert ops.count("constant_pad_nd") == 2
    assert ops.count("dequantize") == 1 and ops.count("quantize") == 2  # only around the reflect pad
    kept = [e for e in q.coverage.kept_fp32 if e.op in ("F.pad", "ZeroPad2d")]
    why = "a reflect pad with value None has no INT8 replay (only zero pads); kept in fp32"
    assert [e.reason for e in kept] == [why]
    with torch.no_grad():
        a, b = q.module(X), q.reference(X)
        assert float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.999
        assert torch.allclose(q.executable(X), a, atol=1e-4)
    q.save(str(tmp_path / "pads.pt2"))  # the uint8 pad exports (an aten op) and loads back
    from gml.io import load

    with torch.no_grad():
        assert torch.equal(load(str(tmp_path / "pads.pt2"), runtime="torch")(X), a)
        assert torch.allclose(load(str(tmp_path / "pads.pt2"))(X), a, atol=1e-4)  # rebuilt on the engine
