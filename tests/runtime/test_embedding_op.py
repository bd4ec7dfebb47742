"""nn.Embedding on the engine (one gather step, gml.runtime.rules.shape) vs the Python executor."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.kernels import bf16 as kb
from gml.runtime import compile_engine, unavailable_reason
from runtime.helpers import graph_of, run_both

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _emb(num: int = 50, dim: int = 12, **kw) -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(num, dim, **kw).eval()


def _ids(*shape: int, num: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, num, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 11), (3, 7), (5,), (2, 3, 4), (1, 1)])
def test_embedding_lookup_is_exact(shape):
    gm = graph_of(_emb())
    ref, eng, got = run_both(gm, _ids(*shape))
    assert eng.report.path == "engine", str(eng.report)
    (seg,) = eng.segments()
    plan = next(iter(seg._plans.values()))[0]
    assert plan.step_impls() == ["gml:embedding_gather"]
    assert torch.equal(got, ref)


def test_embedding_then_layer_norm_is_one_plan_and_new_shapes_get_their_own():
    gm = graph_of(_emb(dim=16), nn.LayerNorm(16).eval())
    ref, eng, got = run_both(gm, _ids(2, 9))
    assert eng.report.path == "engine" and eng.report.segments == 1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for shape in ((4, 3), (1, 30)):
        x = _ids(*shape, seed=1)
        with torch.no_grad():
            torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)


def test_strided_ids_are_read_with_their_strides():
    gm = graph_of(_emb())
    ids = _ids(6, 4).t()  # a transposed view: not contiguous
    ref, eng, got = run_both(gm, ids)
    assert eng.report.path == "engine" and torch.equal(got, ref)


@pytest.mark.skipif(not kb.bf16_available(), reason="no native bf16")
def test_a_bf16_table_gives_bf16_rows():
    gm = graph_of(_emb().to(torch.bfloat16))
    ref, eng, got = run_both(gm, _ids(2, 5))
    assert eng.report.path == "engine" and got.dtype == torch.bfloat16 and torch.equal(got, ref)


def test_an_id_outside_the_vocabulary_is_a_clear_error():
    gm = graph_of(_emb(num=50))
    eng = compile_engine(gm, (_ids(1, 4),))
    bad = torch.tensor([[3, 50, 1, 2]])
    with pytest.raises(IndexError, match=r"embedding id 50 is outside the table's \[0, 50\)"):
        eng(bad)
    with pytest.raises(IndexError, match="embedding id -1"):
        eng(torch.tensor([[-1, 0, 1, 2]]))


def test_embeddings_the_engine_does_not_take_stay_in_torch_with_the_reason():
    gm = graph_of(_emb(max_norm=1.0))
    eng = compile_engine(gm, (_ids(1, 4),))
    assert [n.reason for n in eng.report.torch_nodes] == [
        "Embedding with max_norm (it renormalizes the table in place on every lookup)"
    ]
    g = fx.Graph()
    x = g.placeholder("x")
    root = nn.Module()
    root.emb = _emb()
    g.output(g.call_module("emb", (x,)))
    gm = fx.GraphModule(root, g)
    ids = _ids(2, 3).int()
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(ids)
    eng = compile_engine(gm, (ids,))
    assert [n.reason for n in eng.report.torch_nodes] == ["Embedding of torch.int32 ids (the engine reads int64 ids)"]
    with torch.no_grad():
        assert torch.equal(eng(ids), gm(ids))
