"""gml.runtime.direct_call: an engine model's partitioned graph specialised to one input layout (#23:
the glue around MiniLM's plan was a quarter of an 11-token call after 100 ms idle)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import fx, nn

from gml.errors import InputError
from gml.runtime import unavailable_reason
from gml.runtime.compile import MAX_PLANS, EngineSegment
from gml.runtime.direct_call import static_nodes

from .helpers import pos_embedding_graph

needs_engine = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


_pos_graph = pos_embedding_graph


def _engine(gm: fx.GraphModule, x: torch.Tensor):
    from gml.runtime.compile import compile_engine

    return compile_engine(gm, [x])


def _direct(eng, x: torch.Tensor):
    (entry,) = [d for k, (_, d, _) in eng._direct.items() if k[0][0] == tuple(x.shape)]
    return entry


def test_sizes_of_inputs_are_static_sizes_of_data_are_not() -> None:
    """Golden: which nodes keep their value for one layout. The size of ``x`` (a model input) and
    what is computed from it are static; the size of ``nonzero(y > 0.5)`` is not."""
    gm = _pos_graph(data_size=True)
    static = {n.name for n in static_nodes(gm)}
    assert "sym_size_int" in static  # x.shape[1]
    sizes = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert [n.name in static for n in sizes] == [True, False], static
    # arange / the embedding read no data but are not this module's business: ShapeValues caches them
    assert not static & {"arange", "pos", "unsqueeze"}


@needs_engine
def test_the_glue_runs_once_per_layout_and_the_numbers_are_the_graphs() -> None:
    """Golden: after ShapeValues took the position ids, the direct call of one layout is the
    segment's ``run`` with its plan key given, and the return; numbers equal to the graph's
    (the same plan), for two layouts and again after both."""
    gm = _pos_graph()
    xs = [torch.randn(2, L, 8) for L in (5, 9)]
    want = [gm(x) for x in xs]
    eng = _engine(gm, xs[0])
    with torch.no_grad():
        for x, w in zip(xs + xs, want + want):
            got = eng(x)
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, eng.graph_module(x), rtol=0, atol=0)
    direct = _direct(eng, xs[1])
    # no sym_size, no ShapeValues call, no getitem of its tuple: the segment and its output's item
    assert direct.nodes == ["engine_segment_0", "getitem_1"], direct.code
    assert direct.keyed == ["engine_segment_0"], direct.code
    assert len(eng._direct) == 2


@needs_engine
def test_a_size_of_data_is_read_on_every_call() -> None:
    """Negative: ``nonzero``'s size changes with the data; two inputs of one layout give two answers."""
    gm = _pos_graph(data_size=True)
    x1 = torch.randn(2, 5, 8)
    x2 = -x1
    eng = _engine(gm, x1)
    with torch.no_grad():
        for x in (x1, x2, x1, x2):
            torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)
    direct = _direct(eng, x1)
    # the second segment reads nonzero's tensor: its key is computed on every call
    assert direct.nodes[:4] == ["engine_segment_0", "getitem_1", "gt", "nonzero"], direct.code
    assert direct.keyed == ["engine_segment_0"] and "engine_segment_1" in direct.nodes, direct.code


@needs_engine
def test_a_hook_registered_after_the_first_call_runs() -> None:
    """A forward pre-hook on a segment (or on the graph) added after a layout's direct call was
    written takes the graph's own path, so the hook sees the call."""
    gm = _pos_graph()
    x = torch.randn(2, 5, 8)
    eng = _engine(gm, x)
    with torch.no_grad():
        eng(x)
        (seg,) = [m for m in eng.modules() if isinstance(m, EngineSegment)]
        seen: list[int] = []
        handle = seg.register_forward_pre_hook(lambda mod, args: seen.append(len(args)))
        torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)
        assert len(seen) == 1
        handle.remove()
        eng.graph_module.register_forward_hook(lambda mod, args, out: seen.append(-1))
        eng(x)
    assert seen == [seen[0], -1]


@needs_engine
def test_the_engine_model_skips_module_dispatch_only_while_nothing_needs_it(monkeypatch) -> None:
    """``EngineModule.__call__`` runs ``forward`` itself, and gives way to ``nn.Module.__call__``
    for a hook on the model (forward, pre-forward, one that changes the output), a hook for every
    module, and torch.fx's tracer (which patches ``nn.Module.__call__``): each is seen."""
    gm = _pos_graph()
    x = torch.randn(2, 5, 8)
    eng = _engine(gm, x)
    want = gm(x)
    dispatched: list[str] = []
    module_call = nn.Module.__call__

    def counting_call(self, *args, **kwargs):
        dispatched.append(type(self).__name__)
        return module_call(self, *args, **kwargs)

    with torch.no_grad():
        eng(x)
        monkeypatch.setattr(nn.Module, "__call__", counting_call)
        got = eng(x)  # fx's condition: nn.Module.__call__ replaced -> taken
        monkeypatch.undo()
        assert dispatched and dispatched[0] == "EngineModule"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        seen: list[str] = []
        handle = eng.register_forward_pre_hook(lambda mod, args: seen.append("pre"))
        eng(x)
        handle.remove()
        handle = eng.register_forward_hook(lambda mod, args, out: out * 2)
        torch.testing.assert_close(eng(x), want * 2, rtol=1e-5, atol=1e-5)
        handle.remove()
        handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
        try:
            eng(x)
        finally:
            handle.remove()
        assert seen[0] == "pre" and "EngineModule" in seen[1:]
        n = len(seen)
        torch.testing.assert_close(eng(x), want, rtol=1e-5, atol=1e-5)  # no hook left: forward itself
        assert len(seen) == n


def test_an_fx_trace_through_an_engine_model_sees_it_as_a_module() -> None:
    """A model holding an engine model, traced by torch.fx with the engine model as a leaf, records a
    ``call_module`` node (the tracer's patched ``nn.Module.__call__`` is honoured)."""
    from gml.runtime.compile import EngineModule, RuntimeReport

    inner = EngineModule(fx.symbolic_trace(nn.ReLU()), RuntimeReport("torch"), [torch.randn(2, 3)])

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1

    class Leaf(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, EngineModule) or super().is_leaf_module(m, name)

    graph = Leaf().trace(Outer())
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["inner"]


@needs_engine
def test_layouts_beyond_the_bound_are_dropped_and_still_right() -> None:
    gm = _pos_graph()
    xs = [torch.randn(1, L, 8) for L in range(2, 3 + MAX_PLANS)]
    eng = _engine(gm, xs[0])
    with torch.no_grad():
        for x in xs + xs[:2]:
            torch.testing.assert_close(eng(x), gm(x), rtol=1e-5, atol=1e-5)
    assert 1 <= len(eng._direct) <= MAX_PLANS


@needs_engine
def test_a_copy_rebuilds_its_direct_calls() -> None:
    gm = _pos_graph()
    x = torch.randn(2, 5, 8)
    eng = _engine(gm, x)
    with torch.no_grad():
        eng(x)
        twin = copy.deepcopy(eng)
        assert twin._direct == {} and twin.refuses_nonfinite is False
        torch.testing.assert_close(twin(x), gm(x), rtol=1e-5, atol=1e-5)
        assert len(twin._direct) == 1


@needs_engine
def test_a_wrong_input_is_still_refused_after_the_first_call() -> None:
    """The direct call is for layouts that passed the model's input check: another dtype, a dict,
    a missing input still get the check's message."""
    gm = _pos_graph()
    x = torch.randn(2, 5, 8)
    eng = _engine(gm, x)
    with torch.no_grad():
        eng(x)
        with pytest.raises(InputError, match="expects"):
            eng(x.double())
        with pytest.raises(InputError, match="input 0 is a dict"):
            eng({"x": x})
        with pytest.raises(InputError, match="takes 1 input"):
            eng()


@needs_engine
def test_the_int8_refusal_of_nan_holds_on_the_direct_call_without_a_hook() -> None:
    """An INT8 engine model refuses NaN / Inf itself (a flag, not a forward pre-hook that would take
    every call through ``nn.Module``'s slow path), on the first call of a layout and later ones."""
    import gml

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    res = gml.quantize(model, [torch.randn(2, 3, 8, 8) for _ in range(4)], example_inputs=(x,), cost_policy="off")
    eng = res.engine
    if eng is None:
        pytest.skip(f"no engine model: {res.runtime}")
    assert eng.refuses_nonfinite and not eng._forward_pre_hooks
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with torch.no_grad():
        res.executable(x)
        with pytest.raises(InputError, match="NaN"):
            res.executable(bad)
        with pytest.raises(InputError, match="NaN"):
            res.executable(torch.full((1, 3, 8, 8), float("inf")))  # a new layout


class _WithDefault(nn.Module):
    """``forward(x, mask=None)``: gml.capture traces ``mask`` as its default (a placeholder the
    call never passes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        if mask is not None:
            y = y + mask
        return self.ln(y).cumsum(-1)  # cumsum: a torch node after the segment


@needs_engine
def test_an_argument_traced_as_its_default_is_a_kept_value() -> None:
    import gml

    torch.manual_seed(0)
    model = _WithDefault().eval()
    res = gml.optimize(model, torch.randn(2, 8), runtime="engine")
    eng = res.executable
    with torch.no_grad():
        for rows in (2, 2, 5, 5):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(eng(x), model(x), rtol=1e-5, atol=1e-5)
    directs = [layout.direct for layout in eng._direct.values()]
    assert len(directs) == 2 and all(d is not None for d in directs), eng.graph_module.code
    assert "cumsum" in directs[0].nodes, directs[0].code


@needs_engine
def test_a_hugging_face_output_is_built_directly_and_is_the_same_object() -> None:
    """A ``ModelOutput`` of tensors comes back as the same object its own ``__init__`` would build (type,
    items in order, attributes, None fields), from a builder that skips the dataclass machinery; a
    ``transformers`` that built it otherwise would keep the pytree path (:func:`output_builder`)."""
    transformers = pytest.importorskip("transformers")
    import gml
    from gml.runtime.direct_call import output_builder

    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(1, 100, (1, 7))
    mask = torch.ones(1, 7, dtype=torch.long)
    eng = gml.optimize(model, (ids, mask)).engine
    assert eng is not None
    with torch.no_grad():
        want = model(ids, mask)
        first, again = eng(ids, mask), eng(ids, mask)  # the graph's path, then the direct call
    (layout,) = eng._direct.values()
    builder = layout.direct._fn.__globals__["_unflatten"]
    assert builder != eng.graph_module.graph._codegen.process_outputs, "the direct build was not taken"
    for got in (first, again):
        assert type(got) is type(want) and list(got.keys()) == list(want.keys())
        assert got.hidden_states is None and got.attentions is None
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["pooler_output"], want.pooler_output, rtol=1e-4, atol=1e-4)
        assert got.to_tuple()[1] is got.pooler_output
    assert again is not first and again.last_hidden_state is not first.last_hidden_state

    # an output whose own build differs from the direct one keeps the pytree path
    class Odd(type(want)):
        def __post_init__(self) -> None:
            super().__post_init__()
            object.__setattr__(self, "extra", 1)

    Odd = dataclasses.dataclass(Odd)
    odd = Odd(last_hidden_state=want.last_hidden_state, pooler_output=want.pooler_output)
    codegen = torch.fx.graph._PyTreeCodeGen(
        torch.fx.graph._PyTreeInfo([], None, torch.utils._pytree.tree_flatten(odd)[1])
    )
    assert output_builder(codegen, odd) == codegen.process_outputs
