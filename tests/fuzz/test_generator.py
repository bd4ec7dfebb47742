"""The random-model generator itself: valid, deterministic, faithfully traced, paste-able."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from torch import fx, nn

from gml.testing.graphgen import L, ModelSpec, build, infer_shapes
from gml.testing.strategies import fuzz_settings, model_specs


def _outs(y):
    return list(y) if isinstance(y, tuple) else [y]


@fuzz_settings(60)
@given(spec=model_specs())
def test_generated_models_run_trace_and_match_their_shapes(spec):
    model = build(spec)
    x = spec.example_inputs()
    before = [t.clone() for t in x]
    with torch.no_grad():
        eager = _outs(model(*x))
    # no in-place op reaches a model input (#11: `.contiguous()` of an already contiguous permute
    # is the input itself, which the generator took for a fresh copy)
    assert all(torch.equal(a, b) for a, b in zip(before, x))
    with torch.no_grad():
        traced = _outs(fx.symbolic_trace(model)(*x))
    shapes = infer_shapes(spec)
    assert [tuple(t.shape) for t in eager] == [shapes[o] for o in spec.outputs]
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)  # the trace records exactly the ops eager runs
    assert not any(m.training for m in model.modules())


@settings(max_examples=30, derandomize=True, database=None, deadline=None)
@given(spec=model_specs())
def test_repr_is_python_that_rebuilds_the_same_model(spec):
    again = eval(repr(spec), {"ModelSpec": ModelSpec, "L": L})
    assert again == spec
    a, b = build(spec).state_dict(), build(again).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_spellings_reach_the_graph():
    spec = ModelSpec(
        inputs=[(2, 4, 6, 6)],
        layers=[
            L("conv", 0, out=4, k=3, pad=1),  # 1
            L("bn", 1),  # 2
            L("act", 2, form="method_inplace"),  # 3: x.relu_()
            L("add", 3, 1, form="alpha"),  # 4: torch.add(.., alpha=0.5)
            L("reuse", 4, of=0),  # 5: conv0 called a second time
            L("act", 5, kind="gelu", form="functional"),  # 6
            L("permute", 6, perm=(0, 1, 3, 2), form="transpose"),  # 7
            L("flatten", 7, form="reshape"),  # 8
            L("linear", 8, out=3, form="functional"),  # 9: F.linear on get_attr weights
        ],
        outputs=[9, 2],
    )
    gm = fx.symbolic_trace(build(spec))
    code = gm.code
    for text in ("self.conv0(x)", ".relu_()", "alpha = 0.5", "torch._C._nn.gelu", ".transpose(2, 3)", ".reshape("):
        assert text in code, text
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"].count("conv0") == 2
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} == {"w8", "b8"}
    assert isinstance(gm.bn1, nn.BatchNorm2d)
    # running statistics are non-trivial, so folding them is really tested
    assert gm.bn1.running_var.min() >= 0.2 and not torch.allclose(gm.bn1.running_mean, torch.zeros(4))


def test_invalid_spec_names_the_layer():
    with pytest.raises(ValueError, match=r"layer 1 L\('conv', 1\): conv needs a rank-3/4/5 input, got \(2, 3\)"):
        build(ModelSpec(inputs=[(2, 8)], layers=[L("linear", 0, out=3), L("conv", 1)]))
    with pytest.raises(ValueError, match="reused conv expects 3 channels"):
        infer_shapes(ModelSpec(inputs=[(1, 3, 4, 4)], layers=[L("conv", 0, out=5), L("reuse", 1, of=0)]))
    with pytest.raises(ValueError, match="unknown options"):
        L("conv", 0, kernel=3)


def test_contiguous_may_return_its_input():
    """Why the generator treats ``.contiguous()`` as an alias of its source: a permute that only
    moves size-1 dims is already contiguous, so ``.contiguous()`` returns the same storage."""
    x = torch.randn(1, 1, 4)
    assert x.permute(1, 0, 2).contiguous().data_ptr() == x.data_ptr()
