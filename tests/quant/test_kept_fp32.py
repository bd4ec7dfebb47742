"""Ops INT8 leaves out run gml.optimize's fused fp32 kernels (#16), or bf16 ones on request (#14).

Costs are injected (the suite runs with GML_COST_POLICY=off; decisions must not depend on timing),
and the whole-model guard is patched to a fixed verdict in each test.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.quantized.reference as nnqr
import torch.nn.functional as F
from torch import fx, nn

import gml
from gml.errors import InputError
from gml.ir import library
from gml.kernels import bf16 as kb
from gml.kernels.fp32 import FusedConv, FusedConvAdd
from gml.passes.base import Skip
from gml.passes.bf16 import BF16_TOLERANCE
from gml.passes.manager import PassManager
from gml.quant.cost_policy import Region, RegionCost
from gml.quant.float_remainder import FloatFromReference, UnfuseFloatModules

X = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))


class Residual(nn.Module):
    """conv+relu | GELU | conv → +skip → relu (conv+add+relu) | GELU | conv | mean → linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.c1(x))
        y = F.gelu(F.relu(self.c2(y) + y))
        y = self.c3(y)
        return self.fc(y.mean((2, 3)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Residual().eval()


def _slow(names: set[str]):
    """Regions covering any of ``names`` are 2 ms in INT8 vs 1 ms fp32; the others win."""

    def cost(region: Region) -> RegionCost:
        return RegionCost(2.0, 1.0) if names & set(region.covered) else RegionCost(1.0, 3.0)

    return cost


def _guard(monkeypatch, int8_ms: float, fp32_ms: float) -> None:
    import gml.quant.cost_policy as cp

    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (int8_ms, fp32_ms))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _types(gm: fx.GraphModule) -> dict[str, type]:
    mods = dict(gm.named_modules())
    return {n.name: type(mods[str(n.target)]) for n in gm.graph.nodes if n.op == "call_module"}


def _mod(gm: fx.GraphModule, node: str) -> nn.Module:
    return gm.get_submodule(str(next(n for n in gm.graph.nodes if n.name == node).target))


def _no_torch_ao_modules(gm: fx.GraphModule) -> None:
    for name, m in gm.named_modules():
        assert not isinstance(m, nni._FusedModule | nnqr.Conv2d | nnqr.Linear), f"{name}: {type(m)}"


def _quantize(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gml.quantize(_model(), 2, example_inputs=(X,), per_layer=False, **kw)


def test_a_kept_region_runs_gml_fused_fp32_kernels_on_the_engine(monkeypatch):
    """c1 (conv+relu) and the residual conv+add+relu kept fp32 by the cost policy: they run
    FusedConv[relu] / FusedConvAdd[relu] (gml.optimize's kernels), not torch.ao's containers."""
    _guard(monkeypatch, 1.0, 2.0)
    q = _quantize(cost_policy=_slow({"c1", "c2"}), keep_intermediates=True)
    types = _types(q.module)
    assert types["c1"] is FusedConv and _mod(q.module, "c1").post_op.attr == "relu"
    fused_add = [n for n, t in types.items() if t is FusedConvAdd]
    assert len(fused_add) == 1 and _mod(q.module, fused_add[0]).relu
    _no_torch_ao_modules(q.module)
    ops = Counter(library.gml_op_name(n) for n in q.module.graph.nodes if library.gml_op_name(n))
    assert ops["qconv"] == 1 and ops["qlinear"] == 1  # c3 and fc stay INT8
    # the report still says why c1 and c2 are fp32 (the fusions kept the lowering's entries)
    kept = {n: e.reason for e in q.coverage.kept_fp32 for n in e.nodes}
    assert "cost policy" in kept["c1"] and "cost policy" in kept["c2"]
    rows = {r.node: r for r in q.precisions}
    assert rows["c1"].precision == "fp32" and rows["c1"].op == "FusedConv" and "cost policy" in rows["c1"].why
    assert rows[fused_add[0]].op == "FusedConvAdd" and rows[fused_add[0]].precision == "fp32"
    assert {r.precision for r in q.precisions} == {"int8", "fp32"}
    if q.engine is not None:  # the native engine runs the fused fp32 kernels too
        where = {n.name: n.runs_in for n in q.runtime.nodes}
        assert where["c1"] == "engine" and where[fused_add[0]] == "engine"
        assert rows["c1"].runs_in == "engine"
    with torch.no_grad():
        ref = _model()(X)
        assert _cos(q.module(X), ref) > 0.999
        assert _cos(q.executable(X), ref) > 0.999
        assert _cos(q.module(X), q.reference(X)) > 0.999


class SamePadding(nn.Module):
    """c3 has ``padding="same"``: the INT8 conv declines string padding (a torch.ao reference module
    after lowering); GML's fused fp32 conv takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding="same")
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.c3(F.relu(self.c1(x)))).mean((2, 3)))


def test_an_op_without_int8_kernel_runs_gml_fp32_kernels_too():
    torch.manual_seed(0)
    model = SamePadding().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = gml.quantize(model, 2, example_inputs=(X,), per_layer=False, cost_policy="off")
    c3 = _mod(q.module, "c3")
    assert type(c3) is FusedConv and c3.post_op.attr == "relu"
    _no_torch_ao_modules(q.module)
    why = {n: e.reason for e in q.coverage.kept_fp32 for n in e.nodes}["c3"]
    assert "string padding" in why
    assert {r.node: r.precision for r in q.precisions}["c3"] == "fp32"
    # fp32 weights, not the reference's INT8-rounded ones
    assert torch.allclose(c3.weight.float(), model.c3.weight, atol=0.0)
    if q.engine is not None:
        assert {n.name: n.runs_in for n in q.runtime.nodes}["c3"] == "engine"
    with torch.no_grad():
        assert _cos(q.executable(X), model(X)) > 0.999


def test_guard_keeps_all_returns_the_gml_optimize_model_with_a_consistent_report(monkeypatch):
    _guard(monkeypatch, 3.0, 1.0)  # the whole INT8 model measured 3x slower than GML fp32
    q = _quantize(cost_policy=_slow(set()))
    opt = gml.optimize(_model(), (X,))
    assert q.precision == "fp32" and q.cost.all_fp32
    # exactly gml.optimize's model: same graph, same kernels, same outputs, same runtime
    graph = [(n.op, str(n.target)) for n in q.module.graph.nodes]
    assert graph == [(n.op, str(n.target)) for n in opt.module.graph.nodes]
    assert _types(q.module) == _types(opt.module)
    assert not any(library.gml_op_name(n) for n in q.module.graph.nodes)
    with torch.no_grad():
        assert torch.equal(q.module(X), opt.module(X))
        assert torch.allclose(q.executable(X), opt.executable(X), atol=1e-5)
    assert (q.engine is None) == (opt.engine is None) and q.runtime.path == opt.runtime.path
    # the report describes that model: fp32 pipeline passes, no INT8 op, every op fp32 with the numbers
    assert [r.name for r in q.report.records] == [r.name for r in opt.report.records]
    assert q.coverage.lowered == [] and q.coverage.summary().startswith("lowered to INT8: nothing")
    assert {r.precision for r in q.precisions} == {"fp32"} and len(q.precisions) >= 5
    assert all("INT8 model ran 3.00 ms vs 1.00 ms" in r.why for r in q.precisions)
    assert {e.nodes[0] for e in q.coverage.kept_fp32} == {r.node for r in q.precisions}
    where = {n.name: n.runs_in for n in q.runtime.nodes}
    assert all(r.runs_in == where.get(r.node, "torch") or not where for r in q.precisions)
    assert "gml.optimize's model is returned" in str(q.cost)
    assert q.accuracy.cosine > 0.99999
    with torch.no_grad():
        assert torch.allclose(q.executable(X), _model()(X), atol=1e-4)


def test_int8_faster_than_gml_fp32_keeps_int8(monkeypatch):
    _guard(monkeypatch, 0.9, 1.0)  # 10% faster: the margin (WHOLE_MARGIN) is met
    q = _quantize(cost_policy=_slow(set()))
    assert q.precision == "int8" and not q.cost.all_fp32
    assert Counter(library.gml_op_name(n) for n in q.module.graph.nodes)["qconv_add"] == 1


@pytest.mark.skipif(kb.bf16_unavailable_reason() is not None, reason="this CPU has no native bf16")
def test_mixed_bf16_fallback_runs_kept_ops_in_bf16_within_the_bf16_bound(monkeypatch):
    _guard(monkeypatch, 1.0, 2.0)
    q32 = _quantize(cost_policy=_slow({"c1", "c2"}))
    q16 = _quantize(cost_policy=_slow({"c1", "c2"}), fallback_precision="bf16")
    assert q16.fallback_precision == "bf16" and q16.precision == "int8"
    types = _types(q16.module)
    assert types["c1"] is kb.Bf16Conv and kb.Bf16ConvAdd in types.values()
    rows = {r.node: r for r in q16.precisions}
    assert rows["c1"].precision == "bf16" and "cost policy" in rows["c1"].why and "bf16 kernel" in rows["c1"].why
    assert Counter(r.precision for r in q16.precisions)["int8"] == Counter(r.precision for r in q32.precisions)["int8"]
    with torch.no_grad():
        a, b = q16.module(X), q32.module(X)
        assert a.dtype == torch.float32
        bound = BF16_TOLERANCE.atol + BF16_TOLERANCE.rtol * float(b.abs().max())
        assert float((a - b).abs().max()) <= bound
        # really bf16: the kept convs store bf16 weights (the INT8 step after them can absorb the rounding)
        assert _mod(q16.module, "c1").weight.dtype == torch.bfloat16
        assert float((q16.executable(X) - b).abs().max()) <= bound


def test_no_bf16_cpu_warns_and_falls_back_to_fp32(monkeypatch):
    _guard(monkeypatch, 1.0, 2.0)
    monkeypatch.setattr(
        kb, "bf16_unavailable_reason", lambda target=None: "this CPU has no avx512_bf16 / amx_bf16 (simulated)"
    )
    with pytest.warns(RuntimeWarning, match="bf16 requested but this CPU has no avx512_bf16"):
        q = gml.quantize(_model(), 2, example_inputs=(X,), per_layer=False, cost_policy=_slow({"c1"}),
                         fallback_precision="bf16")  # fmt: skip
    assert q.fallback_precision == "fp32"
    assert _types(q.module)["c1"] is FusedConv
    assert not any(isinstance(m, kb.bf16_kernel_modules()) for m in q.module.modules())
    assert "simulated" in q.precisions.summary()


def test_bad_fallback_precision_is_an_input_error():
    with pytest.raises(InputError, match="unknown precision 'fp16'"):
        gml.quantize(_model(), 2, example_inputs=(X,), fallback_precision="fp16")


def _encoder_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0).eval()


@pytest.mark.skipif(not kb.bf16_available(), reason="no native bf16 on this CPU")
def test_transformer_scheme_mixed_mode_runs_attention_in_bf16():
    """fallback_precision='bf16' with the transformer scheme: the GEMMs stay INT8, attention takes
    bf16 q/k/v (AttentionInBf16: casts around it; the engine's fused bf16 step), the rest fp32."""
    from gml.quant.transformer import ATTENTION_BF16

    layer, x = _encoder_layer(), torch.randn(2, 24, 64)
    q = gml.quantize(layer, 2, example_inputs=(x,), fallback_precision="bf16", cost_policy="off", per_layer=False)
    assert q.scheme == "transformer" and q.fallback_precision == "bf16"
    rows = {p.op: p for p in q.precisions}
    att = rows["attention (q·kᵀ, softmax, p·v)"]
    assert att.precision == "bf16" and "fallback_precision=bf16" in att.why
    assert sum(p.precision == "int8" for p in q.precisions) >= 3  # QKV, out-proj, MLP
    (node,) = [n for n in q.module.graph.nodes if n.meta.get(ATTENTION_BF16)]
    assert all(a.target is kb.to_bf16 for a in node.args[:3]) and [u.target for u in node.users] == [kb.to_fp32]
    rec = q.report.record("attention_bf16")
    assert rec.status == "applied" and rec.matches == 1
    fp32 = gml.quantize(layer, 2, example_inputs=(x,), cost_policy="off", per_layer=False)
    assert q.accuracy.cosine > 0.999 and abs(q.accuracy.cosine - fp32.accuracy.cosine) < 1e-3
    if q.engine is not None:
        from gml.runtime.rules.attention import fused_attention_cpu
        from gml.runtime.target import detect_target

        impls = {s.impl for s in q.engine.profile(x, rounds=1)}
        target = detect_target()
        if fused_attention_cpu(target) and not target.amx:
            assert "gml:attention_avx512_bf16" in impls, impls  # fused_attention_kernel's auto rule


def test_transformer_scheme_mixed_mode_on_a_cpu_without_bf16_warns_and_keeps_fp32(monkeypatch):
    monkeypatch.setattr(
        kb, "bf16_unavailable_reason", lambda target=None: "this CPU has no avx512_bf16 / amx_bf16 (simulated)"
    )
    with pytest.warns(RuntimeWarning, match="bf16 requested but this CPU has no avx512_bf16"):
        q = gml.quantize(_encoder_layer(), 2, example_inputs=(torch.randn(1, 8, 64),), fallback_precision="bf16",
                         cost_policy="off", per_layer=False)  # fmt: skip
    assert q.fallback_precision == "fp32"
    assert all(p.precision != "bf16" for p in q.precisions)


# ---------------------------------------------------------------- the two passes, golden graphs
class _Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nni.ConvReLU2d(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.b = nni.ConvAddReLU2d(nn.Conv2d(4, 4, 1), gml.nn.Add(), nn.ReLU())
        self.c = nnqr.Linear.from_float(nn.Linear(4, 2), _weight_qparams())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y = self.b(y, y)
        return self.c(y.mean((2, 3)))


def _weight_qparams() -> dict:
    return {"qscheme": torch.per_tensor_affine, "dtype": torch.qint8, "scale": 0.01, "zero_point": 0}


class _LeafContainers(fx.Tracer):
    """Keeps torch.ao's containers and reference modules as calls (as the lowered graph has them)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, nni._FusedModule | nnqr.Linear) or super().is_leaf_module(m, qualname)


def _trace(model: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(model, _LeafContainers().trace(model))


def test_unfuse_float_modules_golden():
    gm = _trace(_Containers().eval())
    res = PassManager([UnfuseFloatModules()]).run(gm, [(X,)])
    g = res.graph_module
    assert res.report.records[0].status == "applied" and res.report.records[0].matches == 2
    calls = [(n.name, type(g.get_submodule(str(n.target))).__name__, [str(a) for a in n.args])
             for n in g.graph.nodes if n.op == "call_module"]  # fmt: skip
    assert calls[:5] == [
        ("a", "Conv2d", ["x"]),
        ("a_relu", "ReLU", ["a"]),
        ("b", "Conv2d", ["a_relu"]),
        ("b_add", "Add", ["b", "a_relu"]),  # the residual goes to the second module
        ("b_relu", "ReLU", ["b_add"]),
    ]
    with torch.no_grad():
        assert torch.equal(g(X), _Containers().eval()(X))  # exact


def test_unfuse_skips_a_container_with_its_own_forward():
    class Odd(nni._FusedModule):
        def __init__(self) -> None:
            super().__init__(nn.Conv2d(3, 3, 1), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self[1](x) + self[0](x)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.odd = Odd()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.odd(x)

    res = PassManager([UnfuseFloatModules()]).run(_trace(M().eval()), [(X,)])
    rec = res.report.records[0]
    assert rec.status == "unchanged"
    assert rec.skips == [Skip("odd", "fused module with its own forward: kept as is", "Odd")]


def test_float_from_reference_runs_fp32_weights():
    model = _Containers().eval()
    gm = _trace(model)
    res = PassManager([FloatFromReference()]).run(gm, [(X,)])
    g = res.graph_module
    assert type(g.get_submodule("c")) is nn.Linear
    assert torch.equal(g.get_submodule("c").weight, model.c.weight)  # not model.c.get_weight()
    with torch.no_grad():
        y = g(X)
        want = F.linear(model.b(model.a(X), model.a(X)).mean((2, 3)), model.c.weight, model.c.bias)
        assert torch.allclose(y, want, atol=1e-6)
        assert not torch.equal(model.c.get_weight(), model.c.weight)  # the reference did round it


def test_unfuse_keeps_a_broadcasting_conv_add_with_the_reason():
    """gcresnet's global-context add: a conv on a pooled (1x1) map added to a full feature map. The
    conv alone would not have the container's shape: the container stays (negative case)."""

    class GC(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nni.ConvAdd2d(nn.Conv2d(3, 3, 1), gml.nn.Add())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x.mean((2, 3), keepdim=True), x)

    res = PassManager([UnfuseFloatModules()]).run(_trace(GC().eval()), [(X,)])
    rec = res.report.records[0]
    assert rec.status == "unchanged" and not res.report.rolled_back
    why = "the add broadcasts the conv output [1, 3, 1, 1] to [1, 3, 16, 16]: kept as is"
    assert [s.reason for s in rec.skips] == [why]
