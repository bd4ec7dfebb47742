"""The direct call path of an engine model: its partitioned graph specialised to one input layout.

An :class:`~gml.runtime.compile.EngineModule` runs a partitioned graph: engine segments, the torch
nodes between them, and Python glue — the pytree flattening of the inputs, the export's guards,
the inputs' sizes (``sym_size``), the :class:`~gml.runtime.shape_values.ShapeValues` call and its
items, each segment's call through ``nn.Module.__call__`` and the key of its plan, the pytree
unflattening of the outputs. For one layout of the inputs (shape, strides, dtype of each) the glue
gives the same values on every call. :func:`specialise` takes those values from one call and
writes a :class:`DirectCall`: the nodes that read the inputs' data, in order, as straight-line
Python with the other values filled in. Before → after, MiniLM (``C…``: values kept)::

    ids, mask = tree_flatten_spec(([ids, mask], {}), in_spec); guards(ids, mask)
    n = sym_size(ids, 0); m = sym_size(mask, 1); v = shape_values(n, m); e0 = v[0]; ...
    out = engine_segment_0(ids, e0, e1, mask, e2, e3, e4, n, m)   # __call__, then its plan key
    return tree_unflatten((out[0], out[1]), out_spec)
    →
    out = engine_segment_0.run((ids, C0, C1, mask, C2, C3, C4, C5, C6), KEY)
    return unflatten([out[0], out[1]])

Why: on a VM whose caches another tenant empties between calls, every Python function a call
touches costs microseconds; on all-MiniLM-L6-v2 with an 11-token sentence (#23's row against ONNX
Runtime) the glue was about a quarter of a call made after 100 ms idle (docs/benchmarks.md).

Which nodes keep their value (*static* for one layout): a size read (``sym_size`` / ``size()`` /
``.shape`` / ``dim()`` / ``stride()`` / ``numel()``) of an input or of a static tensor; Python
arithmetic and ``getitem`` on static values; the ShapeValues and ShapeGuards calls (themselves
caches keyed by the inputs' sizes; a guard that held for this layout holds again); ``torch._assert``
on static values; constants (``get_attr``). Everything else runs on every call, in graph order: a
size of a tensor computed from data (``nonzero``) is not static.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import fx, nn

from gml.runtime.shape_values import ShapeGuards, ShapeValues

_SIZE_FUNCTIONS = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}
#: torch's hooks for every module (``nn.modules.module.register_module_forward_hook``)
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called")
#: and every global hook ``nn.Module.__call__`` honours (the backward ones too)
_ALL_GLOBAL_HOOKS = (*_GLOBAL_HOOKS, "_global_backward_pre_hooks", "_global_backward_hooks")
_GLOBAL_HOOK_DICTS = tuple(getattr(torch.nn.modules.module, h) for h in _ALL_GLOBAL_HOOKS)
_SIZE_METHODS = {"size", "dim", "stride", "numel"}
#: pure functions of Python numbers (and of sizes: a ``torch.Size`` is a tuple)
_SCALAR_FUNCTIONS = {
    *(getattr(operator, n) for n in ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos")),
    *(getattr(operator, n) for n in ("eq", "ne", "lt", "le", "gt", "ge", "not_", "and_", "or_", "getitem")),
    *(getattr(torch, n) for n in ("sym_max", "sym_min", "sym_int", "sym_float", "sym_not") if hasattr(torch, n)),
    math.ceil,
    math.floor,
    math.sqrt,
    max,
    min,
    len,
}


def any_global_hooks() -> bool:
    """Whether a hook is registered for every module (``nn.modules.module.register_module_*``:
    forward, forward-pre and backward ones): then a module's call must go through its ``__call__``.
    (torch registers into these dicts in place: bound once.)"""
    return any(_GLOBAL_HOOK_DICTS)  # (a dict is true when it holds a hook)


@runtime_checkable
class KeyedModule(Protocol):
    """A module whose call is ``run(inputs, plan_key(inputs))`` (an engine segment): the direct
    call passes the key itself when every input of the call is an input of the model or static."""

    def plan_key(self, inputs: Sequence[Any]) -> tuple: ...

    def run(self, inputs: Sequence[Any], key: tuple) -> Any: ...


class DirectCall:
    """``gm``'s call for one input layout: ``direct(*inputs)`` returns what ``gm(*inputs)`` does.

    ``code`` is the generated function (locals are the graph's node names, ``_k<i>`` the values it
    was written with); ``nodes`` the nodes it runs on every call, in order; ``keyed`` the segments
    it calls with their plan key computed once."""

    def __init__(self, code: str, env: dict[str, Any], nodes: list[str], keyed: list[str]) -> None:
        self.code = code
        self.nodes = nodes
        self.keyed = keyed
        exec(compile(code, "<gml direct call>", "exec"), env)  # our own text from node names, no file's
        # taken out of its globals: a function in its own globals would be one more reference cycle
        self._fn: Callable[..., Any] = env.pop("_direct")

    def __call__(self, *inputs: Any) -> Any:
        return self._fn(*inputs)


def static_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose value is fixed by its inputs' layouts (see the module's docstring)."""
    static: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if _is_static(gm, n, static):
            static.add(n)
    return static


def _is_static(gm: fx.GraphModule, n: fx.Node, static: set[fx.Node]) -> bool:
    def known(a: Any) -> bool:  # static, or a model input (its layout is part of the key)
        return a in static or (isinstance(a, fx.Node) and a.op == "placeholder")

    if n.op == "get_attr":
        return True
    if n.op == "call_method":
        return n.target in _SIZE_METHODS and known(n.args[0])
    if n.op == "call_module":
        is_cache = isinstance(gm.get_submodule(str(n.target)), ShapeValues | ShapeGuards)
        return is_cache and all(known(a) for a in n.all_input_nodes)
    if n.op != "call_function":
        return False
    if n.target in _SIZE_FUNCTIONS or (n.target is getattr and n.args[1:] == ("shape",)):
        return known(n.args[0])
    pure = n.target in _SCALAR_FUNCTIONS or n.target is torch._assert
    # (not on a constant's tensor: ``w + b`` of two weights is computed on every call, as it was,
    # so a weight changed in place is read)
    return pure and all(a in static and a.op != "get_attr" for a in n.all_input_nodes)


def specialise(gm: fx.GraphModule, inputs: Sequence[Any], output: Any = None) -> DirectCall | None:
    """A :class:`DirectCall` of ``gm`` for ``inputs``' layouts, or None where the graph's glue is not
    what this path knows: inputs that the graph's codegen does not take as they are (a nested
    pytree, defaults), a module with hooks. Reads the static values by running only the static
    nodes (the ShapeValues and guards calls are cache hits after the call that ran the whole graph).
    ``output``: what that call returned (:func:`output_builder` checks its faster build against it)."""
    graph = gm.graph
    if gm._forward_pre_hooks or gm._forward_hooks:
        return None
    flat = graph.process_inputs(*inputs)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    given, defaults = placeholders[: len(inputs)], placeholders[len(inputs) :]
    if len(given) != len(inputs) or any(not n.args for n in defaults):  # (a default is the node's arg)
        return None
    if len(flat) != len(inputs) or any(a is not b for a, b in zip(flat, inputs)):
        return None
    static = static_nodes(gm)
    glob: dict[str, Any] = {"__builtins__": {}}
    env: dict[fx.Node, Any] = dict(zip(given, inputs))
    names: dict[fx.Node, str] = {n: n.name for n in given}
    for n in defaults:  # an argument traced as its default (gml.capture: ``mask=None``)
        env[n] = n.args[0]
        names[n] = f"_k{len(glob)}"
        glob[names[n]] = n.args[0]
    lines: list[str] = []
    nodes: list[str] = []
    keyed: list[str] = []
    bypassed: list[nn.Module] = []  # modules called without their __call__

    def const(value: Any) -> str:
        name = f"_k{len(glob)}"
        glob[name] = value
        return name

    def render(a: Any) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, tuple):
            return "(" + "".join(render(x) + ", " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(render(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in a.items()) + "}"
        if a is None or isinstance(a, bool | int | str) or (isinstance(a, float) and math.isfinite(a)):
            return repr(a)  # exact: an int's, a finite float's and a str's repr read back equal
        return const(a)

    last_use: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            last_use[a] = n
    for n in graph.nodes:
        value_of = lambda a: fx.node.map_arg(a, lambda x: env[x])  # noqa: E731
        if n.op == "placeholder":
            continue
        if n.op == "output":
            lines.append(f"return _unflatten({render(n.args[0])})")
            break
        if n in static:  # its value, computed now (cache hits) and kept
            env[n] = _run_node(gm, n, value_of(n.args), value_of(n.kwargs))
            names[n] = const(env[n])
            continue
        names[n] = n.name
        nodes.append(n.name)
        args, kwargs = n.args, n.kwargs
        if n.op == "call_function":
            fn = const(n.target)
        elif n.op == "call_method":
            fn, args = f"{render(args[0])}.{n.target}", args[1:]
        else:  # call_module
            mod = gm.get_submodule(str(n.target))
            if mod._forward_pre_hooks or mod._forward_hooks:
                return None
            bypassed.append(mod)
            fixed = all(a in static or a.op == "placeholder" for a in n.all_input_nodes)
            if isinstance(mod, KeyedModule) and not kwargs and fixed:
                key = mod.plan_key(value_of(args))  # fixed for this layout: computed once
                lines.append(f"{n.name} = {const(mod.run)}({render(tuple(args))}, {const(key)})")
                lines += _free(n, names, last_use, static)
                keyed.append(n.name)
                continue
            fn = const(mod.forward)  # no hooks: what __call__ would run
        call = ", ".join([render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()])
        lines.append(f"{n.name} = {fn}({call})")
        lines += _free(n, names, last_use, static)
    glob["_unflatten"] = output_builder(graph._codegen, output)
    # a hook registered since (on the graph, a module it calls, or for every module) runs as it
    # would: that call takes the graph's own path
    hooks = [f"{m}.{h}" for m in map(const, [gm, *bypassed]) for h in ("_forward_pre_hooks", "_forward_hooks")]
    hooks += [const(getattr(torch.nn.modules.module, h)) for h in _GLOBAL_HOOKS]
    params = ", ".join(names[n] for n in given)
    guard = f"if {' or '.join(hooks)}:\n        return {const(gm)}({params})\n"
    code = f"def _direct({params}):\n    {guard}" + "".join(f"    {line}\n" for line in lines)
    return DirectCall(code, glob, nodes, keyed)


def output_builder(codegen: Any, output: Any) -> Callable[[Any], Any]:
    """What turns the graph's flat outputs into what the model returns: the codegen's pytree
    unflattening, or, for a Hugging Face ``ModelOutput`` of tensors (``output``, the first call's
    result, is one), the same object built directly: its dataclass ``__init__`` sets each field
    through ``ModelOutput.__setattr__`` (which reads the class's fields each time) and
    ``__post_init__`` walks them again. 15 µs warm against 1.5 (BERT's pooled output), about 0.3 ms
    on a call after 100 ms idle (#23's 11-token sentence, docs/benchmarks.md session 28). The direct
    build is used only where it gives ``output`` again from ``output``'s own leaves — the same
    type, items in the same order and attributes, the same objects — so a ``transformers`` whose
    ``ModelOutput`` builds differently keeps its own path."""
    from torch.utils import _pytree as pytree

    default = codegen.process_outputs
    spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    cls = getattr(spec, "type", None)
    if output is None or not isinstance(cls, type) or type(output) is not cls or not _is_model_output(cls):
        return default
    children = spec.children()
    if spec.num_leaves != len(children) or not all(c.is_leaf() for c in children):
        return default  # (a tuple of hidden states inside: the pytree path)
    keys = tuple(spec.context)
    names = tuple(f.name for f in dataclasses.fields(cls))
    if not set(keys) <= set(names):
        return default
    new, set_attr, init, set_item = cls.__new__, object.__setattr__, OrderedDict.__init__, OrderedDict.__setitem__

    def build(flat: Sequence[Any]) -> Any:
        out = new(cls)
        init(out)
        for name in names:
            set_attr(out, name, None)
        for k, v in zip(keys, flat):
            set_attr(out, k, v)
            if v is not None:
                set_item(out, k, v)
        return out

    flat, got_spec = pytree.tree_flatten(output)
    if got_spec != spec:
        return default
    want, got = default(flat), build(flat)
    same = (
        type(got) is type(want)
        and list(got.keys()) == list(want.keys())
        and all(a is b for a, b in zip(got.values(), want.values()))
        and list(vars(got)) == list(vars(want))
        and all(vars(got)[k] is v for k, v in vars(want).items())
    )
    return build if same else default


def _is_model_output(cls: type) -> bool:
    """A ``transformers`` ``ModelOutput`` dataclass (recognised by name: transformers is not imported here)."""
    return (
        dataclasses.is_dataclass(cls)
        and issubclass(cls, OrderedDict)
        and any(c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.") for c in cls.__mro__)
    )


def _free(n: fx.Node, names: dict[fx.Node, str], last_use: dict[fx.Node, fx.Node], static: set[fx.Node]) -> list[str]:
    """``v = None`` for each call value whose last reader is ``n`` (intermediates are freed as the
    graph's own code frees them)."""
    done = [a for a in n.all_input_nodes if last_use.get(a) is n and a not in static and a.op != "placeholder"]
    return [f"{names[a]} = None" for a in done]


def _run_node(gm: fx.GraphModule, n: fx.Node, args: Any, kwargs: Any) -> Any:
    if n.op == "get_attr":
        obj: Any = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return obj
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "call_method":
        return getattr(args[0], str(n.target))(*args[1:], **kwargs)
    module: nn.Module = gm.get_submodule(str(n.target))
    return module(*args, **kwargs)
