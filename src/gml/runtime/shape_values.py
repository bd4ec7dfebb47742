"""Per-call torch glue of an engine model: values computed once per input shape, and a schedule
that keeps engine nodes together (#15: MiniLM on short sentences).

An exported transformer computes a lot from its inputs' *sizes* alone: position ids
(``position_ids[:, :L]``), token-type ids and their embeddings, the ``arange`` / ``unsqueeze`` /
``ge`` index arithmetic transformers' mask builder runs, ... On all-MiniLM-L6-v2 with an 11-token
sentence those were ~25 torch ops per call (~0.4 ms of a 1.8 ms call, AMD EPYC Zen 4, 1 thread)
around a 1.1 ms engine plan. Two rewrites of the partitioned graph remove them:

* :func:`cache_shape_values` — every node whose value depends only on the sizes of the model's
  inputs (``sym_size`` / ``size()`` of a placeholder) and on the model's constants is moved into
  one :class:`ShapeValues` module, which runs them once per distinct tuple of sizes and returns the
  cached results afterwards (a bounded cache, as the segments' plans are). Before → after::

      n = sym_size(ids, 1); p = slice(pos_ids, 1, 0, n); e = pos_emb(p); ...; y = segment(x, e)
      n = sym_size(ids, 1); vals = shape_values(n); e = vals[0]; y = segment(x, e)

  Not cached: anything reading an input's data, impure or random ops, and every node of a graph in
  which an in-place op reads a cached value (the cache would be corrupted).
* :func:`schedule_for_engine` — a torch node between engine nodes that does not depend on the
  engine run before it (the word-embedding lookup, the mask arithmetic) is moved before that run,
  so the run and the engine nodes after the torch node become one segment (one plan, one call).
  Data dependencies are kept; impure and in-place nodes are never moved.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

#: distinct input-size tuples a ShapeValues module keeps (as gml.runtime.compile.MAX_PLANS)
MAX_SHAPES = 8

_SIZE_OPS = (torch.ops.aten.sym_size.int,)


def _is_size_root(node: fx.Node) -> bool:
    """``sym_size(x, d)`` / ``x.size(d)`` / ``x.dim()`` / ``x.shape`` of a model input."""
    if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0].op != "placeholder":
        return False
    if node.op == "call_function" and node.target in _SIZE_OPS:
        return True
    if node.op == "call_method" and node.target in ("size", "dim"):
        return True
    return node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",)


def _mutates(node: fx.Node) -> bool:
    """An in-place op: ``x.add_(y)``, ``torch.relu_``, an aten overload with a mutable schema."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _random(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def static_nodes(gm: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """``(roots, static)``: the size reads of model inputs, and the nodes computed from them and
    constants only (graph order). Empty when an in-place op reads a static value."""
    roots: list[fx.Node] = []
    static: list[fx.Node] = []
    known: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            known.add(node)
            continue
        if node.op in ("placeholder", "output"):
            continue
        if _is_size_root(node):
            roots.append(node)
            known.add(node)
            continue
        if node.is_impure() or _mutates(node) or _random(node) or not node.users:
            continue
        if all(a in known for a in node.all_input_nodes):
            static.append(node)
            known.add(node)
    inside = set(static)
    if any(_mutates(n) and any(a in inside for a in n.all_input_nodes) for n in gm.graph.nodes):
        return roots, []
    return roots, static


class ShapeValues(nn.Module):
    """Values that depend only on the inputs' sizes: ``forward(*sizes) -> tuple``, computed by
    ``compute`` (a GraphModule of those nodes) once per distinct ``sizes`` and cached."""

    def __init__(self, compute: fx.GraphModule, ops: list[str]) -> None:
        super().__init__()
        self.compute = compute
        #: the ops it replaced (for the runtime report)
        self.ops = ops
        self._cache: OrderedDict[tuple, tuple] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()
        return state

    def forward(self, *sizes: Any) -> tuple:
        key = tuple(tuple(s) if isinstance(s, torch.Size) else s for s in sizes)
        out = self._cache.get(key)
        if out is None:
            with torch.no_grad():
                out = tuple(self.compute(*sizes))
            while len(self._cache) >= MAX_SHAPES:
                try:
                    self._cache.popitem(last=False)
                except KeyError:  # another thread emptied it first (each dict operation is atomic)
                    break
            self._cache[key] = out
        return out


def cache_shape_values(
    gm: fx.GraphModule,
    name: str = "shape_values",
    on_output: Callable[[fx.Node, fx.Node], None] | None = None,
) -> ShapeValues | None:
    """Move ``gm``'s static nodes (see :func:`static_nodes`) into one :class:`ShapeValues` call, in
    place; returns the module (None when there is nothing worth caching: fewer than 2 nodes).
    ``on_output(node, item)`` is called for each static node read outside with the ``getitem`` of
    the call that replaces it (the caller keeps what it knows of the node: that it is a size)."""
    graph = gm.graph
    roots, static = static_nodes(gm)
    if len(static) < 2:
        return None
    inside = set(static)
    outputs = [n for n in static if any(u not in inside for u in n.users)]
    used_roots = [r for r in roots if any(u in inside for u in r.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {r: sub.placeholder(r.name) for r in used_roots}
    for n in static:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = sub.get_attr(str(a.target))
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    module = ShapeValues(fx.GraphModule(gm, sub), [_op_name(n) for n in static])
    gm.add_submodule(name, module)
    # the size reads only read placeholders: put them (and the call) right after the last input
    # ... after the export's input guards, which read only the inputs: a failed guard keeps its message
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            anchor.append(n)
            anchor = n
    for r in used_roots:
        anchor.append(r)
        anchor = r
    with graph.inserting_after(anchor):
        call = graph.call_module(name, tuple(used_roots))
    anchor = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        if on_output is not None:
            on_output(o, item)
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        anchor = item
    for n in reversed(static):
        graph.erase_node(n)
    for n in list(graph.nodes):
        if n.op == "get_attr" and not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return module


class ShapeGuards(nn.Module):
    """An exported program's input guards (``_guards_fn``: ``torch._assert`` calls on the inputs'
    sizes, e.g. a sequence no longer than the position table) run once per distinct input layout:
    they read sizes only, so a layout that passed once passes again (~30 µs per call saved)."""

    def __init__(self, guards: nn.Module) -> None:
        super().__init__()
        self.guards = guards
        self._passed: set[tuple] = set()

    def forward(self, *args: Any) -> None:
        key = tuple(
            (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else (type(a), a) for a in args
        )
        if key not in self._passed:
            self.guards(*args)  # raises on a failed guard: nothing is remembered
            if len(self._passed) >= 64:
                self._passed.clear()
            self._passed.add(key)


def cache_guards(gm: fx.GraphModule) -> bool:
    """Wrap ``gm``'s export guards (``_guards_fn``) in :class:`ShapeGuards`, in place."""
    guards = getattr(gm, "_guards_fn", None)
    if not isinstance(guards, nn.Module) or isinstance(guards, ShapeGuards):
        return False
    gm._guards_fn = ShapeGuards(guards)
    return True


def _op_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(str(node.target))).__name__
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return str(getattr(t, "__name__", t))


def schedule_for_engine(graph: fx.Graph, engine: Any) -> int:
    """Move torch nodes that do not depend on the engine run before them ahead of that run, in
    place (see the module docstring); ``engine(node) -> bool`` says which nodes the engine runs.
    Returns how many nodes moved."""
    moved = 0
    first: fx.Node | None = None  # first node of the current engine run
    run: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            break
        if engine(node):
            if first is None:
                first = node
            run.add(node)
            continue
        if first is None:
            continue
        if node.is_impure() or _mutates(node) or any(a in run for a in node.all_input_nodes):
            first, run = None, set()  # the run ends here
            continue
        if any(a.op == "placeholder" and _after(a, first) for a in node.all_input_nodes):
            # an input defined after the run began (a later placeholder: inputs stay in their order)
            # cannot move ahead of it, so neither can this node; the run ends here
            first, run = None, set()
            continue
        for a in node.all_input_nodes:  # a constant read first after the run began moves along
            if a.op == "get_attr" and _after(a, first):
                first.prepend(a)
        first.prepend(node)
        moved += 1
    if moved:
        graph.lint()
    return moved


def _after(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` comes after ``b`` in graph order."""
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False
