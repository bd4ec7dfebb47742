"""gml.runtime.shape_values: size-only values computed once per input shape, and the schedule that
keeps engine nodes in one segment (#15: MiniLM on short sentences)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from gml.errors import InputError
from gml.runtime import unavailable_reason
from gml.runtime.shape_values import ShapeValues, cache_shape_values, schedule_for_engine, static_nodes
from gml.testing.tokens import padded_tokens

from .helpers import pos_embedding_graph

needs_engine = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


_pos_graph = pos_embedding_graph


def test_size_only_nodes_are_cached_per_shape() -> None:
    gm = _pos_graph()
    xs = [torch.randn(2, L, 8) for L in (5, 9, 5)]
    want = [gm(x) for x in xs]
    mod = cache_shape_values(gm)
    assert isinstance(mod, ShapeValues) and sorted(mod.ops) == ["Embedding", "arange", "unsqueeze"]
    targets = [n.target for n in gm.graph.nodes if n.op != "placeholder"]
    assert torch.arange not in targets and "pos" not in targets  # golden: moved into the module
    calls = []
    inner = mod.compute.forward
    mod.compute.forward = lambda *a: calls.append(a) or inner(*a)
    for x, w in zip(xs, want):
        torch.testing.assert_close(gm(x), w, rtol=0, atol=0)
    assert calls == [(5,), (9,)]  # the third call (L = 5 again) is served from the cache


def test_nothing_is_cached_when_an_in_place_op_reads_a_size_only_value() -> None:
    gm = _pos_graph(in_place=True)
    roots, static = static_nodes(gm)
    assert [r.name for r in roots] == ["sym_size_int"] and static == []
    assert cache_shape_values(gm) is None


def test_values_of_the_input_data_are_not_cached() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    a = g.call_function(torch.arange, (n,))
    y = g.call_function(operator.add, (x, a))  # reads x's data
    g.output(g.call_function(torch.mul, (y, 2)))
    gm = fx.GraphModule(nn.Module(), g)
    _, static = static_nodes(gm)
    assert [s.name for s in static] == ["arange"]
    assert cache_shape_values(gm) is None  # one node: not worth a module


def test_schedule_moves_independent_torch_nodes_ahead_of_an_engine_run() -> None:
    g = fx.Graph()
    x, m = g.placeholder("x"), g.placeholder("m")
    e1 = g.call_function(torch.relu, (x,))  # "engine"
    t1 = g.call_function(torch.neg, (m,))  # torch, independent of e1: moves before e1
    e2 = g.call_function(torch.add, (e1, t1))  # "engine"
    t2 = g.call_function(torch.abs, (e2,))  # torch, depends on the run: stays, ends the run
    e3 = g.call_function(torch.relu, (t2,))
    g.output(e3)
    engine = {e1, e2, e3}
    moved = schedule_for_engine(g, lambda n: n in engine)
    assert moved == 1
    order = [n.name for n in g.nodes if n.op == "call_function"]
    assert order == [t1.name, e1.name, e2.name, t2.name, e3.name]


def _segment(eng: nn.Module):
    from gml.runtime.compile import EngineSegment

    (seg,) = [m for m in eng.modules() if isinstance(m, EngineSegment)]
    return seg


@needs_engine
def test_a_per_shape_input_is_checked_for_nan_once_per_shape(monkeypatch) -> None:
    """The position embedding reaches the engine segment from ShapeValues: its NaN / Inf check runs
    once per input shape, the caller's tensor's on every call (a reduction per call costs 1–3 ms
    on a cold CPU: docs/benchmarks.md, session 20)."""
    from gml.runtime import compile as rc

    gm = _pos_graph()
    xs = [torch.randn(2, L, 8) for L in (5, 5, 9, 5)]
    want = [gm(x) for x in xs]
    eng = rc.compile_engine(gm, [xs[0]])
    seg = _segment(eng)
    assert len(seg.per_shape) == 1  # golden: the embedding's item, not x
    checked: list[int] = []
    inner = rc._finite_inputs
    monkeypatch.setattr(rc, "_finite_inputs", lambda ts: checked.append(len(ts)) or inner(ts))
    with torch.no_grad():
        for x, w in zip(xs, want):
            torch.testing.assert_close(eng(x), w, rtol=1e-5, atol=1e-5)
    # x on every call (4); the embedding once for L = 5 (its check at compile time already ran
    # before the patch) and once for L = 9
    assert checked.count(1) == 5, checked


@needs_engine
def test_a_nan_in_a_per_shape_input_still_gives_eager_numbers() -> None:
    """The once-per-shape check is remembered as "not finite" too: every call takes the Python
    executor, which propagates the NaN as eager does."""
    from gml.runtime.compile import compile_engine

    gm = _pos_graph()
    with torch.no_grad():
        gm.pos.weight[3, 0] = float("nan")
    x = torch.randn(2, 5, 8)
    want = gm(x)
    assert want.isnan().any()
    eng = compile_engine(gm, [x])
    assert _segment(eng).per_shape
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(eng(x), want, rtol=1e-5, atol=1e-5, equal_nan=True)


# ---------------------------------------------------------------- whole models on the engine
transformers = pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 1000}  # fmt: skip


_tokens = padded_tokens


@needs_engine
@pytest.mark.parametrize("scheme", ["fp32", "int8"])
def test_a_bert_encoder_is_one_engine_segment_with_padded_batches(scheme: str) -> None:
    """Small random BERT: the whole model (word-embedding lookup, the embeddings' adds and LayerNorm,
    the padding mask's arithmetic, the encoder, the pooler) is ONE engine plan; the position /
    token-type embeddings and the mask's index tensors are size-only values (computed once per
    shape). Numerics vs the Python executor at other batch sizes / lengths, padded."""
    import gml

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    example = _tokens(2, 12, 7)
    if scheme == "fp32":
        res = gml.optimize(model, example)
        ref_mod = res.module
    else:
        res = gml.quantize(model, [_tokens(2, 12, 5), _tokens(2, 12)], example_inputs=example, scheme="transformer")
        ref_mod = res.module
    eng = res.executable
    assert res.runtime.segments == 1, str(res.runtime)
    cached = [n for n in res.runtime.torch_nodes if n.op == "ShapeValues"]
    assert len(cached) == 1 and "computed once per input shape" in cached[0].reason
    in_torch = {n.op for n in res.runtime.torch_nodes}  # the embeddings and the mask run in the plan
    assert in_torch == {"ShapeValues", "getitem", "size", "ShapeGuards"}, str(res.runtime)
    for batch, seq, pad in ((2, 12, 7), (3, 20, 11), (1, 1, None), (3, 20, 4)):
        ids, mask = _tokens(batch, seq, pad)
        with torch.no_grad():
            got, want = eng(ids, mask), ref_mod(ids, mask)
        for k in ("last_hidden_state", "pooler_output"):
            g, w = getattr(got, k), getattr(want, k)
            tol = 1e-4 if scheme == "fp32" else 0.05
            assert float((g - w).abs().max()) <= tol * max(1.0, float(w.abs().max())), (k, batch, seq)
    assert not res.runtime.shape_fallbacks, res.runtime.shape_fallbacks


@needs_engine
def test_the_export_guards_still_refuse_a_sequence_longer_than_the_position_table_every_time() -> None:
    import gml

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**{**SMALL, "max_position_embeddings": 32})).eval()
    res = gml.optimize(model, _tokens(1, 8))
    assert any(n.op == "ShapeGuards" for n in res.runtime.torch_nodes), str(res.runtime)
    for _ in range(2):  # a failed guard is not remembered as passed
        with pytest.raises(InputError, match=r"Guard failed: input_ids.size\(\)\[1\] <= 32"):
            res.executable(*_tokens(1, 40))
    with torch.no_grad():
        got, want = res.executable(*_tokens(1, 32)), model(*_tokens(1, 32))
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["fp32", "int8"])
def test_the_python_executor_caches_the_glue_too(scheme: str) -> None:
    """Where torch runs the graph (``runtime="torch"``, or the runtime choice picked it), the result's
    executable runs the size-only values and the export guards once per shape as the engine path
    does (HF Swin's guard function read 5,700 sizes per call), on a copy of ``module`` that shares its
    weights and forward pre-hooks; ``module`` stays the graph that is saved."""
    import gml
    from gml.runtime.shape_values import ShapeGuards

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    example = _tokens(2, 12, 7)
    if scheme == "fp32":
        res = gml.optimize(model, example, runtime="torch")
    else:
        res = gml.quantize(model, 2, example_inputs=example, runtime="torch", cost_policy="off")
    run = res.executable
    assert res.engine is None and run is not res.module and res.executable is run
    graph = run.graph_module  # the copy run by torch, inside the executor's input checks
    assert isinstance(graph._guards_fn, ShapeGuards) and isinstance(graph.shape_values, ShapeValues)
    assert not any(n.op == "call_module" and n.target == "shape_values" for n in res.module.graph.nodes)
    for batch, seq, pad in ((2, 12, 7), (3, 20, 11)):
        ids, mask = _tokens(batch, seq, pad)
        with torch.no_grad():
            got, want = run(ids, mask), res.module(ids, mask)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
    with pytest.raises(InputError, match="Guard failed"):  # longer than the position table
        run(*_tokens(1, 600))
    seen: list[int] = []
    res.module.register_forward_pre_hook(lambda mod, args: seen.append(len(args)))
    with torch.no_grad():
        run(*example)
    assert seen == [2]
    if scheme == "int8":  # the INT8 model's refusal of autograd inputs holds on the copy too
        with pytest.raises(InputError, match="for inference"):
            run(example[0], example[1].float().requires_grad_())


def test_a_loaded_export_runs_on_its_python_executor_copy(tmp_path) -> None:
    """A saved model loads as torch.export's module, whose forward pre-hooks take kwargs and read
    its own attributes (``validate_inputs``): the executor's copy calls them as registered. Before,
    every saved transformer failed to load outside the test suite — loading times the engine
    against this copy (``cost_policy="measure"``, the default), and the copy called the hook
    without its kwargs. And the engine plans it as one segment, as the model before saving (the
    file holds ATen calls: ``aten.linear``, ``aten.layer_norm``, ``aten.add``, which ran in torch)."""
    import gml
    from gml.io import load
    from gml.runtime.compile import python_executor
    from gml.runtime.options import EngineOptions

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    example = _tokens(2, 12, 7)
    path = tmp_path / "bert.pt2"
    fresh = gml.optimize(model, example)
    fresh.save(str(path))
    if fresh.engine is not None:  # the file's ATen calls are raised back to what the engine reads: one plan again
        assert len(load(path).segments()) == len(fresh.engine.segments()) == 1
    gm = load(path, runtime="torch")
    run = python_executor(gm)
    assert run is not gm  # the copy caches the glue (the export's guards), so it is the one called
    for batch, seq, pad in ((2, 12, 7), (3, 20, 11)):
        ids, mask = _tokens(batch, seq, pad)
        with torch.no_grad():
            got, want = run(ids, mask), model(ids, mask)
        torch.testing.assert_close(got["last_hidden_state"], want.last_hidden_state, atol=1e-4, rtol=1e-4)
    loaded = load(path, options=EngineOptions(cost_policy="measure"))  # times the engine against the copy
    with torch.no_grad():
        got = loaded(*example)["last_hidden_state"]
    torch.testing.assert_close(got, model(*example).last_hidden_state, atol=1e-4, rtol=1e-4)
