"""Capture a model as a ``torch.fx.GraphModule`` and fill shape metadata.

``torch.fx.symbolic_trace`` fails on data-dependent control flow (``if x.sum() > 0``), on iterating
over tensors, and on some Python constructs. Its errors point deep inside torch; :func:`capture`
turns them into a :class:`~gml.errors.TraceFailure` that names the submodule, the user's source
line and what to do about it (leaf modules, ``concrete_args``, ``torch.where``).
"""

from __future__ import annotations

import copy
import math
import os
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata

from gml.errors import InputError, TraceFailure, UnsupportedError, did_you_mean, first_few
from gml.ir.alias import MUTATES
from gml.ir.layers import torch_layer_base
from gml.ir.values import INPUT_NAME, cloned
from gml.models import child_names
from gml.outputs import same_outputs

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # the separator keeps torchvision/ a user dir
_GML_DIR = os.path.dirname(__file__) + os.sep


class _Tracer(fx.Tracer):
    """A tracer with configurable leaf modules that remembers which submodule it was inside."""

    def __init__(self, leaf_types: tuple[type, ...] = (), leaf_names: Iterable[str] = ()) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_names = set(leaf_names)
        self.stack: list[str] = []
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        if torch_layer_base(m) is not None:
            return True  # e.g. torchvision's Conv3DSimple: an nn.Conv3d by another name
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.stack[-1]
            raise
        finally:
            self.stack.pop()


#: ``node.meta`` / ``GraphModule.meta`` key: the input shapes a graph was specialised to (see
#: :class:`_ShapeTracer`), and why.
SPECIALIZED = "gml_specialized_shapes"

_SHAPE_ATTRS = frozenset({"shape", "ndim"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel"})
_ARITH_MODULES = ("_operator", "operator", "builtins", "math")


def _is_shape_query(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _SHAPE_ATTRS
    return node.op == "call_method" and node.target in _SHAPE_METHODS


def _shape_only(node: fx.Node) -> bool:
    """Whether ``node``'s value is computed from tensor *shapes* and literals only (``x.shape[-2] < 7``,
    ``math.ceil(x.size(2) / 2)``), not from any tensor's values."""
    work, seen = [node], set()
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_shape_query(n):
            continue  # what the tensor holds does not matter, only its size
        if n.op != "call_function" or getattr(n.target, "__module__", None) not in _ARITH_MODULES:
            return False
        work.extend(n.all_input_nodes)
    return True


try:
    from torch.fx._symbolic_trace import _maybe_revert_all_patches as _revert_patches
except ImportError:  # pragma: no cover - older torch: no concrete evaluation of module calls
    import contextlib

    _revert_patches = contextlib.nullcontext  # type: ignore[assignment]


#: tensor attributes :class:`_ShapeProxy` answers from the example input instead of recording them
_STATIC_TENSOR_FACTS = frozenset({"device", "dtype", "is_cuda", "is_cpu", "is_meta", "is_quantized", "layout"})


class _ShapeProxy(fx.Proxy):
    """A proxy that turns into the example input's concrete number where Python needs one
    (``int()``, ``math.ceil``, ``range()``, ``len()``), if the value is shape-only."""

    def _concrete(self, why: str) -> Any:
        return self.tracer.concrete(self, why)  # type: ignore[union-attr]

    def __getattr__(self, k: str) -> Any:
        # a tensor's rank: asserted everywhere (timm's BatchNormAct2d: `_assert(x.ndim == 4)`); as a
        # graph value it would be one more reader of the tensor and block folding into its producer
        if k in ("ndim", "dim"):
            value = self.tracer.values.get(self.node)  # type: ignore[union-attr]
            if isinstance(value, torch.Tensor):
                self.tracer.ranks_used = True  # type: ignore[union-attr]
                return value.ndim if k == "ndim" else value.dim
        # where a tensor lives and its dtype are facts of the example, not values: timm's EfficientViT
        # asks `if v.device.type != 'meta':`; the captured graph runs on CPU with the example's dtypes
        if k in _STATIC_TENSOR_FACTS:
            value = self.tracer.values.get(self.node)  # type: ignore[union-attr]
            if isinstance(value, torch.Tensor):
                return getattr(value, k)
        return super().__getattr__(k)

    def __index__(self) -> int:
        return self._concrete("an index")

    def __int__(self) -> int:
        return int(self._concrete("int()"))

    def __float__(self) -> float:
        return float(self._concrete("float()"))

    def __ceil__(self) -> int:
        return math.ceil(self._concrete("math.ceil"))

    def __floor__(self) -> int:
        return math.floor(self._concrete("math.floor"))

    def __trunc__(self) -> int:
        return math.trunc(self._concrete("math.trunc"))

    def __round__(self, ndigits: int | None = None) -> Any:
        return round(self._concrete("round()"), ndigits)

    def __len__(self) -> int:
        return len(self._concrete("len()"))


def _plain_getattr(obj: Any, name: str) -> Any:
    """``getattr`` that bypasses the tracer's patched ``nn.Module.__getattr__`` (which returns proxies)."""
    if isinstance(obj, nn.Module):
        for table in ("_parameters", "_buffers", "_modules"):
            found = obj.__dict__.get(table, {})
            if name in found:
                return found[name]
    return object.__getattribute__(obj, name)


def _attr_of(root: nn.Module, target: str) -> Any:
    """What a ``get_attr`` node of ``target`` reads, past the tracer's patched ``__getattr__``."""
    obj: Any = root
    for part in target.split("."):
        obj = _plain_getattr(obj, part)
    return obj


class _ShapeTracer(_Tracer):
    """A tracer that also runs the model on the example inputs, node by node, as it records them.

    Where Python in ``forward`` needs a concrete number or bool that depends only on tensor shapes
    (``if x.shape[-2] < self.kernel``, timm's ``Conv2dSame`` padding from ``x.size()``), it gets the
    example input's value, and the graph holds the result as a constant: the graph is *specialised*
    to the example's input shapes (:data:`SPECIALIZED`; :class:`gml.nn.InputGuard` refuses other
    shapes). A bool from tensor *values* (``if x.sum() > 0``) still fails, as it must.
    """

    def __init__(
        self, example_inputs: Sequence[Any] = (), leaf_types: tuple[type, ...] = (), leaf_names: Iterable[str] = ()
    ) -> None:
        # default arguments: unpickling a GraphModule re-creates its tracer class with none
        super().__init__(leaf_types, leaf_names)
        self.example_inputs = list(example_inputs)
        self.values: dict[fx.Node, Any] = {}
        self.n_placeholders = 0
        self.specialized: list[str] = []
        #: each shape-only node Python read, with the example's value it got (:func:`_batch_free_inputs`)
        self.reads: list[tuple[fx.Node, Any]] = []
        self.ranks_used = False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapeProxy(node, self)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: Any = None, type_expr: Any = None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        try:
            if kind == "call_module":
                # the tracer patches nn.Module.__call__ / __getattr__ (and wrapped functions) while it
                # runs: a leaf's concrete run must see the real ones (reverting costs ~ms: only here)
                with _revert_patches():
                    self._evaluate(node)
            else:
                self._evaluate(node)
        except Exception:  # no concrete value: a later concrete() on it fails with the usual message
            pass
        return node

    def _evaluate(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            i = self.n_placeholders
            self.n_placeholders += 1
            if i < len(self.example_inputs):
                x = self.example_inputs[i]
                self.values[node] = x.clone() if isinstance(x, torch.Tensor) else x
            return
        if node.op == "get_attr":
            self.values[node] = _attr_of(self.root, str(node.target))
            return
        if node.op == "output" or any(a not in self.values for a in node.all_input_nodes):
            return
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.values[n])
        with torch.no_grad():
            if node.op == "call_function":
                self.values[node] = node.target(*args, **kwargs)
            elif node.op == "call_method":
                self.values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "call_module":
                self.values[node] = self.root.get_submodule(node.target)(*args, **kwargs)

    def concrete(self, proxy: fx.Proxy, why: str) -> Any:
        node = proxy.node
        if node not in self.values or not _shape_only(node):
            raise fx.proxy.TraceError(
                "symbolically traced variables cannot be used as inputs to control flow"
                if why == "control flow"
                else f"a traced tensor value is used as a Python number ({why})"
            )
        value = self.values[node]
        frame = _user_frame_now()
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
        self.specialized.append(f"{why} on a shape{where}")
        self.reads.append((node, value))
        return value

    def to_bool(self, obj: fx.Proxy) -> bool:
        return bool(self.concrete(obj, "control flow"))

    def iter(self, obj: fx.Proxy) -> Any:
        if obj.node in self.values and _shape_only(obj.node):
            return iter(self.concrete(obj, "iteration"))
        return super().iter(obj)


def _as_torch_layers(gm: fx.GraphModule) -> None:
    """Swap leaf modules that are renamed torch.nn layers (:func:`torch_layer_base`) for instances
    of that layer sharing their state, so passes and torch.ao match them by type."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        m = gm.get_submodule(str(node.target))
        base = torch_layer_base(m)
        if base is None:
            continue
        plain = base.__new__(base)
        plain.__dict__ = {k: dict(v) if isinstance(v, dict) else v for k, v in m.__dict__.items()}
        parent, _, name = str(node.target).rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, name, plain)


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and gml: the user's line that failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _GML_DIR))]
    return user[-1] if user else None


def _explain(exc: BaseException) -> str:
    text = str(exc)
    # before "control flow": fx's iteration message mentions control flow too
    if "iterate" in text or "len(" in text or "__len__" in text:
        return "iteration over, or len() of, a traced tensor"
    if "control flow" in text:
        return "data-dependent control flow (a Python `if`/`while` on a tensor value)"
    if "Proxy" in text or "symbolically traced" in text:
        return f"a Python operation torch.fx cannot record ({text.splitlines()[0]})"
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _leaf_spec(leaf_modules: Sequence[str | type]) -> tuple[tuple[type, ...], list[str]]:
    types = tuple(m for m in leaf_modules if isinstance(m, type))
    names = [m for m in leaf_modules if isinstance(m, str)]
    return types, names


def check_leaf_names(model: nn.Module, leaf_modules: Sequence[str | type], option: str = "leaf_modules") -> None:
    """Every name in ``leaf_modules`` must be a submodule of ``model``: a misspelt one would be
    silently ignored (issue #24). Raises :class:`InputError` naming the closest submodules."""
    names = [n for n in leaf_modules if isinstance(n, str)]
    if not names:
        return
    known = [n for n, _ in model.named_modules() if n]
    for name in names:
        if name not in known:
            raise InputError(
                f"{option} {name!r} is not a submodule of the model.",
                hint=did_you_mean(name, known)
                + "give a dotted submodule path as model.named_modules() lists it (e.g. layer1.0).",
            )


def _omitted_default_args(model: nn.Module, n_given: int) -> dict[str, Any]:
    """``forward`` parameters after the ``n_given`` example inputs whose default is ``None`` or a plain
    constant (bool, int, float, str): traced as that default. fx would make each a placeholder, so
    ``if mask is not None:`` would take the branch for a value that is ``None`` at run time and
    ``if is_causal:`` (timm's ViT, ``forward(x, attn_mask=None, is_causal=False)``) would be Python
    control flow on a Proxy. Passing a different value later fails fx's guard for that argument."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    plain = (type(None), bool, int, float, str)
    return {p.name: p.default for p in params[n_given:] if p.kind in kinds and type(p.default) in plain}


def _none_args(model: nn.Module, example_inputs: Sequence[Any]) -> dict[str, None]:
    """The positional parameters the example gives as ``None`` (``(ids, None, mask)``: a decoder's
    cache skipped): traced as ``None`` — as a placeholder, ``if cache is not None:`` would take the
    branch for a value that is None."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: None for p, x in zip((p for p in params if p.kind in kinds), example_inputs) if x is None}


def _bound_as(model: nn.Module, example_inputs: Sequence[Any]) -> str:
    """`` The example inputs were given to forward as input_ids=int64[2, 12], past_key_values=...``:
    where both captures fail, the one fact the user may not have in mind — example inputs are
    positional, and an HF decoder's second parameter is its cache, not the attention mask."""
    import inspect

    try:
        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return ""

    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        return type(x).__name__

    bound = [f"{name}={show(x)}" for name, x in zip(params, example_inputs)]
    if len(bound) < 2:  # one input: nothing to mistake
        return ""
    return f" The example inputs were given to forward positionally: {', '.join(bound)}."


def trace(
    model: nn.Module,
    *,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: dict[str, Any] | None = None,
    example_inputs: Sequence[Any] | None = None,
) -> fx.GraphModule:
    """Symbolically trace ``model``; raise :class:`TraceFailure` with a readable reason on failure.

    With ``example_inputs`` (and no ``concrete_args``) shape-only Python in ``forward`` is answered
    with the example's sizes (:class:`_ShapeTracer`); the graph is then specialised to those input
    shapes, says so in ``gm.meta[SPECIALIZED]``, and refuses other shapes (:class:`gml.nn.InputGuard`).
    """
    check_leaf_names(model, leaf_modules)
    types, names = _leaf_spec(leaf_modules)
    tracer = (
        _ShapeTracer(example_inputs, types, names)
        if example_inputs is not None and not concrete_args
        else _Tracer(types, names)
    )
    if example_inputs is not None and not concrete_args:
        concrete_args = {**_none_args(model, example_inputs), **_omitted_default_args(model, len(example_inputs))}
        concrete_args = concrete_args or None
    model_name = type(model).__name__
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        frame = _user_frame(exc)
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}()" if frame else ""
        code = f": `{frame.line.strip()}`" if frame and frame.line else ""
        inside = f" (inside submodule '{tracer.failed_in}')" if tracer.failed_in else ""
        if tracer.failed_in:
            leaf_hint = (
                f"mark '{tracer.failed_in}' as a leaf module (--leaf {tracer.failed_in} / "
                f"leaf_modules=['{tracer.failed_in}']) so it runs as one opaque node, "
            )
        elif children := child_names(model):
            # the top-level forward itself does not trace: a part of the model may
            leaf_hint = (
                f"optimize a traceable part on its own (--submodule NAME / gml.optimize(model.NAME, ...); "
                f"its children: {children}), "
            )
        else:
            leaf_hint = ""
        raise TraceFailure(
            f"Cannot capture {model_name} with torch.fx: {_explain(exc)}{where}{inside}{code}.",
            hint=(
                (
                    "if the branch only reads shapes, pass example inputs (gml.capture(model, (x,))) so it is "
                    "decided for their shape; "
                    if example_inputs is None and "control flow" in str(exc)
                    else ""
                )
                + f"{leaf_hint}fix the value with concrete_args (e.g. a flag argument), or rewrite the "
                "branch without Python control flow on tensors (torch.where, masking)."
            ),
        ) from None
    _name_inputs(graph, model)
    _own_none_guards(graph, model)
    if example_inputs is not None:
        _drop_omitted_inputs(graph, len(example_inputs))
    name = model_name if isinstance(model, nn.Module) else "GraphModule"
    gm = fx.GraphModule(tracer.root, graph, name)
    # not .train(): the leaves are the caller's own modules; fx's fresh containers start in training mode
    for m in (gm, *(m for m in gm.modules() if type(m) is nn.Module)):
        m.training = model.training
    _as_torch_layers(gm)
    if isinstance(tracer, _ShapeTracer) and (tracer.specialized or tracer.ranks_used):
        # before the dead shape arithmetic goes: the probe evaluates the read nodes again
        free = _batch_free_inputs(graph, tracer.root, example_inputs or (), tracer.reads) if tracer.reads else []
        _drop_dead_shape_arithmetic(gm)
        _guard_inputs(gm, example_inputs or (), tracer.specialized, free)
    return gm


def _name_inputs(graph: fx.Graph, model: Any) -> None:
    """Tag each placeholder with the ``forward`` parameter it stands for (:data:`INPUT_NAME`)."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    positional = [p.name for p in params if p.kind in kinds]
    if len(placeholders) <= len(positional):
        for node, param in zip(placeholders, positional):
            node.meta[INPUT_NAME] = param


def input_is_none(value: Any, name: str) -> None:
    """The guard of an input traced as None (``(ids, None, mask)``): it must stay None."""
    if value is not None:
        raise InputError(
            f"input {name!r} was None in the example the model was built for; got {type(value).__name__}.",
            hint="pass None there (the graph was traced with it), or build the model again with that input given.",
        )


torch.fx.wrap("input_is_none")  # a leaf call in any later trace, named plainly in generated code


def _drop_omitted_inputs(graph: fx.Graph, n_given: int) -> None:
    """Remove the inputs after the ``n_given`` the example gave — ``forward`` defaults traced as
    constants (:func:`_omitted_default_args`) — that nothing but their guards reads (fx's
    ``_assert(flag_1 == True, ...)``, :func:`input_is_none`): the graph takes what the example gave.
    Kept as inputs, the INT8 lowering dropped their metadata but not the guard that reads them, and
    the model could not be saved ("input 'flag_1' has no shape metadata")."""
    import operator

    guards = {operator.eq, torch._assert, input_is_none}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in reversed(placeholders[n_given:]):
        chain: list[fx.Node] = []
        todo = list(ph.users)
        while todo:
            node = todo.pop()
            if node in chain:
                continue
            if node.op != "call_function" or node.target not in guards:
                return  # read by the model itself: keep it (and every input before it)
            chain.append(node)
            todo.extend(node.users)
        for node in sorted(chain, key=lambda n: -list(graph.nodes).index(n)):
            graph.erase_node(node)
        graph.erase_node(ph)


def _own_none_guards(graph: fx.Graph, model: Any) -> None:
    """fx's ``_assert_is_none(input, msg)`` guards of the inputs traced as None, as GML's
    :func:`input_is_none`.

    ``_assert_is_none`` is a ``torch.fx.wrap``-ed torch function: traced again (torch.ao's
    ``prepare_fx`` re-traces the captured graph), its call is marked wrapped, and the generated code
    runs ``wrap("torch.fx._symbolic_trace._assert_is_none")`` in the module's own globals, where
    that dotted name is no key — every later ``symbolic_trace`` in the process then failed with a
    ``KeyError`` on it (the second ``gml.quantize`` of a model given a None input). GML's guard is
    wrapped under its plain name, and says which input in an :class:`InputError`."""
    from torch.fx._symbolic_trace import _assert_is_none

    for node in graph.nodes:
        if node.op == "call_function" and node.target is _assert_is_none and node.args:
            value = node.args[0]
            name = value.meta.get(INPUT_NAME, value.name) if isinstance(value, fx.Node) else "?"
            node.target, node.args, node.kwargs = input_is_none, (value, str(name)), {}
            node.meta["is_wrapped"] = True  # the generated code registers it: a re-trace keeps the call


def _batch_free_inputs(
    graph: fx.Graph, root: nn.Module, example_inputs: Sequence[Any], reads: list[tuple[fx.Node, Any]]
) -> list[int]:
    """The inputs whose batch (dim 0) the graph is *not* specialised to: every shape-only value
    Python read while tracing (``reads``) is the same whatever the batch. Empty when one of them
    depends on it (``B, C, H, W = x.shape; if B > 1``, a reshape to ``x.shape``) or cannot be told.

    How: the traced graph runs once more on fake tensors (``FakeTensorMode`` with a ``ShapeEnv``)
    whose dim 0 is a symbol ``b`` wherever an example input has the first input's batch; a read is
    batch-free when its value comes out as a plain number equal to the example's — one that holds
    ``b`` is not, whatever ``b`` is. A proof over the graph's own arithmetic, not a test at a few
    batches: ``if B > 16`` depends on ``b`` for every example. The symbol's hint is the example's
    batch + 1 (never 1: a size-1 hint makes torch's broadcasting checks specialise ``b`` to 1, which
    then reads as a plain number); a check that does specialise it (``b == k``) counts as a dependence.
    Nodes that fail on a symbolic batch (a reshape to a size read earlier) leave their readers unknown,
    hence pinned. timm's ``Conv2dSame`` padding, VGG's pre-logits size check and MobileViT's patch
    arithmetic read heights and widths only: such models keep a free batch.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    except ImportError:  # pragma: no cover - a torch without them: every read pins the batch
        return []
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        return []
    batch = tensors[0].shape[0]
    free = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch]
    env = ShapeEnv(specialize_zero_one=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)

    def fake_input(i: int, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if i not in free:
            return mode.from_tensor(x)
        wider = torch.empty((batch + 1, *x.shape[1:]), dtype=x.dtype)
        dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (x.dim() - 1)
        return mode.from_tensor(wider, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    values: dict[fx.Node, Any] = {}
    wanted = {node for node, _ in reads}
    try:
        n_placeholders = 0
        for node in graph.nodes:
            if not wanted - values.keys():
                break
            if node.op == "placeholder":
                i = n_placeholders
                n_placeholders += 1
                if i < len(example_inputs):
                    values[node] = fake_input(i, example_inputs[i])
                continue
            if node.op == "get_attr":
                values[node] = _attr_of(root, str(node.target))
                continue
            if node.op == "output" or any(a not in values for a in node.all_input_nodes):
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
            try:
                with mode, torch.no_grad():
                    if node.op == "call_function":
                        values[node] = _PROBE_SHAPE_FUNCS.get(node.target, node.target)(*args, **kwargs)
                    elif node.op == "call_method":
                        values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
                    elif _stateless_layer(module := root.get_submodule(str(node.target))):
                        values[node] = module(*args, **kwargs)
                    else:  # a leaf of the user's: its forward may keep what it sees (a fake tensor)
                        continue
            except Exception:  # unknown on a symbolic batch: its readers count as depending on it
                continue
        if env.replacements:  # a check specialised the batch symbol to a number
            return []
        for node, value in reads:
            if node not in values or not _plain_equal(values[node], value):
                return []
    except Exception:  # the probe itself failed: pin the batch as before
        return []
    return free


def _stateless_layer(module: nn.Module) -> bool:
    """A torch.nn layer in eval mode, which the batch probe may call on fake tensors: it keeps
    nothing of its input (a user's leaf module might cache one on ``self``)."""
    return type(module).__module__.startswith("torch.nn.") and not module.training


def _padded_like(x: torch.Tensor, pad: Sequence[Any], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.pad``'s result shape, for the batch probe: torch's fake ``constant_pad_nd`` runs the
    ATen kernel with ``guard_int`` on every size, which pins the batch symbol (timm's ``Conv2dSame``
    pads before each conv)."""
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] = shape[-1 - i] + pad[2 * i] + pad[2 * i + 1]
    return x.new_empty(shape)


#: functions the batch probe replaces by their output shape (values do not matter there)
_PROBE_SHAPE_FUNCS: dict[Any, Any] = {torch.nn.functional.pad: _padded_like}


def _plain_equal(probed: Any, value: Any) -> bool:
    """Whether a probed value (ints, bools, SymInts, tuples of them) holds no symbol and equals ``value``."""
    if isinstance(probed, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        if probed.node.expr.free_symbols:
            return False
        probed = probed.node.expr
        try:
            probed = type(value)(probed)
        except (TypeError, ValueError):
            return False
    if isinstance(probed, (tuple, list)):
        return (
            isinstance(value, (tuple, list))
            and len(probed) == len(value)
            and all(_plain_equal(p, v) for p, v in zip(probed, value))
        )
    if isinstance(probed, torch.Tensor):
        return False
    return type(probed) is type(value) and probed == value


def _drop_dead_shape_arithmetic(gm: fx.GraphModule) -> None:
    """Erase the shape queries and arithmetic that only fed a Python decision made at trace time."""
    work = [n for n in gm.graph.nodes if not n.users and n.op in ("call_function", "call_method") and _shape_only(n)]
    while work:
        n = work.pop()
        if n.users or n.graph is not gm.graph or n.op not in ("call_function", "call_method", "get_attr"):
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        work.extend(inputs)


def _user_frame_now() -> traceback.FrameSummary | None:
    """The innermost frame of the running stack outside torch and gml: the user's line being traced."""
    user = [f for f in traceback.extract_stack() if not f.filename.startswith((_TORCH_DIR, _GML_DIR))]
    return user[-1] if user else None


def _guard_inputs(
    gm: fx.GraphModule, example_inputs: Sequence[Any], why: list[str], free_batch: Sequence[int] = ()
) -> None:
    """Record the input shapes (or, when only ranks were read, ranks) ``gm`` is specialised to and
    put an :class:`InputGuard` first. Inputs in ``free_batch`` (:func:`_batch_free_inputs`) keep
    their dim 0 free (``None``)."""
    from gml.nn import InputGuard, install_input_guard

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return
    tensors = list(example_inputs)[: len(placeholders)]
    if why:
        shapes: list[Any] = [
            ((None, *x.shape[1:]) if i in free_batch else tuple(x.shape)) if isinstance(x, torch.Tensor) else None
            for i, x in enumerate(tensors)
        ]
        reason = first_few(why, 1)
    else:
        shapes = [x.dim() if isinstance(x, torch.Tensor) else None for x in tensors]
        reason = "it asserts or branches on tensor ranks (x.ndim / x.dim())"
    gm.meta[SPECIALIZED] = {"shapes": shapes, "why": list(why) or [reason]}
    install_input_guard(gm, InputGuard(shapes, reason))


#: ``node.meta`` key: the memory formats of a ``call_module`` node's inputs when it was captured
#: (:class:`gml.passes.leaf_format.LeafMemoryFormat` hands an opaque leaf the same again).
TRACED_FORMATS = "gml_traced_formats"

#: ``node.meta`` keys shape propagation sets on a node that overwrote some of its inputs: the names
#: of those input nodes, and the one the node returned (``x.add_(y)`` returns ``x``), if any.
#: (``MUTATES`` is defined in :mod:`gml.ir.alias`, with the analysis that reads it.)
RETURNS_MUTATED = "gml_returns_mutated"


def _thaw(value: Any) -> Any:
    """Plain ``list`` / ``dict`` copies of fx's immutable node-argument containers, recursively.

    Only plain and fx-immutable containers: a value a node produced that subclasses ``dict`` (HF's
    ``ModelOutput``, returned by a leaf) stays what it is (#15: its attributes were lost)."""
    if type(value) in (list, immutable_list):
        return [_thaw(v) for v in value]
    if type(value) is tuple:  # not torch.Size or a namedtuple: they stay what they are
        return tuple(_thaw(v) for v in value)
    if type(value) in (dict, immutable_dict):
        return {k: _thaw(v) for k, v in value.items()}
    return value


class MutableArgsInterpreter(fx.Interpreter):
    """An ``fx.Interpreter`` that hands calls fresh lists and dicts, as the generated code does.

    A node's constant arguments are stored as fx's ``immutable_list``; ``gm(x)`` rebuilds them as
    literals on every call, but ``Interpreter`` passes the stored ones, so a wrapped function that
    edits a list argument (torchvision's Swin3D ``_get_window_and_shift_size``) works when the
    model runs and fails when it is interpreted.
    """

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return _thaw(args), _thaw(kwargs)


class _RecordingShapeProp(ShapeProp, MutableArgsInterpreter):
    """ShapeProp that remembers the node it was running when something failed.

    ``ShapeProp.run_node`` prints the full torch traceback to stderr before re-raising; a CLI user
    must see only our one-paragraph error, so this runs the node itself (no fake mode is used here)
    and records the same ``tensor_meta`` / ``type`` metadata.
    """

    current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        # A tensor's version counter moves when it (or a view of it) is written in place: this is
        # how an opaque call that overwrites its input (torchvision's MViT `_add_shortcut`) shows.
        inputs = [(i, self.env[i]) for i in n.all_input_nodes if isinstance(self.env.get(i), torch.Tensor)]
        versions = [t._version for _, t in inputs]
        result = fx.Interpreter.run_node(self, n)
        mutated = [i for (i, t), v in zip(inputs, versions) if t._version != v]
        n.meta.pop(MUTATES, None)
        n.meta.pop(RETURNS_MUTATED, None)
        if mutated and n.op != "placeholder":
            n.meta[MUTATES] = tuple(i.name for i in mutated)
            same = [i for i, t in inputs if t is result and i in mutated]
            if same:
                n.meta[RETURNS_MUTATED] = same[0].name
        found = False

        def extract(obj: Any) -> Any:
            nonlocal found
            if isinstance(obj, torch.Tensor):
                found = True
                return _extract_tensor_metadata(obj)
            return obj

        meta = map_aggregate(result, extract)
        if found:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        return result


def _shape_str(args: Sequence[Any]) -> str:
    return ", ".join(
        f"{tuple(a.shape)}:{str(a.dtype).removeprefix('torch.')}" if isinstance(a, torch.Tensor) else repr(a)
        for a in args
    )


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Fill ``node.meta['tensor_meta']`` by running ``example_inputs``; return the outputs.

    A shape or dtype mismatch becomes an :class:`InputError` naming the node that rejected it.
    """
    prop = _RecordingShapeProp(gm)
    n_placeholders = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if len(example_inputs) > n_placeholders:
        raise InputError(
            f"{len(example_inputs)} example inputs given, but the model takes {n_placeholders}.",
            hint="pass one tensor per forward() argument (--input-shape takes a comma-separated list).",
        )
    try:
        with torch.no_grad():  # on copies: a model that writes its input must not write the caller's
            return prop.propagate(*(x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs))
    except Exception as exc:
        node = prop.current
        cause = exc.__cause__ or exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, StopIteration) and node is not None and node.op == "placeholder":
            n_in = sum(n.op == "placeholder" for n in gm.graph.nodes)  # fewer inputs than placeholders
            first = f"the model takes {n_in} input(s), {len(example_inputs)} given (none for '{node.name}')"
        at = f" at node '{node.name}' ({node.op} {node.target})" if node is not None else ""
        hint = "pass --input-shape (e.g. 1x3x224x224) / example_inputs matching what forward() expects."
        weights = {p.dtype for p in gm.parameters() if p.is_floating_point()}
        # an integer input of a model with embedding tables is normal (token ids): not the suspect
        ids_ok = any(isinstance(m, nn.Embedding | nn.EmbeddingBag) for m in gm.modules())
        odd = [
            (i, a.dtype)
            for i, a in enumerate(example_inputs)
            if isinstance(a, torch.Tensor)
            and len(weights) == 1
            and a.dtype not in weights
            and (a.is_floating_point() or not ids_ok)
        ]
        if odd:  # the shape may be fine: say that the dtype is what differs
            (w,) = weights
            i, dt = odd[0]
            hint = (
                f"input {i} is {str(dt).removeprefix('torch.')} but the model's weights are "
                f"{str(w).removeprefix('torch.')}: convert the input (x.to({w})) or the model (model.to(...))."
            )
        raise InputError(
            f"Example inputs [{_shape_str(example_inputs)}] do not fit the model{at}: {first}",
            hint=hint,
        ) from None


def check_eval_mode(model: nn.Module, *, what: str = "optimization") -> None:
    """Raise if ``model`` (or any submodule) is in training mode: inference rewrites assume eval."""
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        shown = ", ".join(training[:3]) + (" ..." if len(training) > 3 else "")
        raise UnsupportedError(
            f"The model is in training mode ({shown}); {what} is for inference (BatchNorm would use batch "
            "statistics, Dropout would drop).",
            hint="call model.eval() first.",
        )


def check_finite_parameters(model: nn.Module, *, what: str = "optimization") -> None:
    """Raise if a parameter holds NaN or Inf: every output is then NaN (or an Inf), and a rewrite
    checked against NaN outputs is not checked at all (issue #11: a NaN weight was reported as
    "max abs error 0" and an INT8 "top-1 agreement 100%"). Buffers are not checked: an attention
    mask of -inf is a legitimate buffer."""
    bad = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and not torch.isfinite(p).all():
            bad.append(f"{name} ({int(torch.isnan(p).sum())} NaN, {int(torch.isinf(p).sum())} Inf)")
    if bad:
        raise UnsupportedError(
            f"The model's parameters hold NaN/Inf values: {first_few(bad)}; its outputs are not numbers, "
            f"so {what} cannot check anything against them.",
            hint="load the intended weights (a diverged training run or a damaged checkpoint writes NaN); "
            "find them with [n for n, p in model.named_parameters() if not p.isfinite().all()].",
        )


def _kv_cache_in(outputs: Any) -> str | None:
    """The class name of a transformers KV cache among ``outputs`` (GPT-2's ``past_key_values`` is a
    ``DynamicCache`` when ``use_cache`` is on), or None."""
    from torch.utils._pytree import tree_flatten

    for leaf in tree_flatten(outputs)[0]:
        cls = type(leaf)
        if any(c.__module__.startswith("transformers.cache_utils") for c in cls.__mro__):
            return f"transformers {cls.__name__}"
    return None


def check_deterministic(model: nn.Module, example_inputs: Sequence[Any], *, what: str = "optimization") -> None:
    """Raise if two eval-mode runs of ``model`` on the same inputs differ.

    A model whose submodules are all in eval mode can still be random where it matters:
    ``F.dropout(x, p, training=True)`` hard-coded in ``forward``, ``torch.rand``/``bernoulli`` noise.
    Every rewrite is verified by comparing outputs, so a random model makes each check fail for a
    reason that has nothing to do with the pass (and an INT8 model calibrated on it is noise).
    If the model does not even run on ``example_inputs``, nothing is raised here: :func:`capture`
    reports that with the node that failed.
    """
    # On a copy of the model and of the inputs: a forward that updates a buffer (a running max, a
    # counter) or writes its input must not change the caller's objects, even when it is refused.
    # One copy runs twice, so state that forward() carries from call to call still shows.
    try:
        probe = copy.deepcopy(model)
        with torch.no_grad():
            first = probe(*cloned(example_inputs))
            second = probe(*cloned(example_inputs))
    except Exception:
        return
    cache = _kv_cache_in(first)
    if cache is not None:
        raise UnsupportedError(
            f"The model returns a {cache} (the key/value cache of step-by-step generation); GML optimizes "
            "one forward pass over the whole input and cannot return or take a cache object.",
            hint="build or load the model with use_cache=False (model.config.use_cache = False, or pass "
            "use_cache=False to from_pretrained); gml's hf: and model-folder loaders do this already.",
        )
    same, _ = same_outputs(first, second)
    if not same:
        raise UnsupportedError(
            # the difference itself is random, so the message does not quote it
            f"The model is random in eval mode: two runs on the same input differ; {what} checks every "
            "rewrite against the model's outputs, which needs a deterministic model.",
            hint="look for dropout called with training=True in forward() (pass training=self.training), "
            "random ops (torch.rand*, torch.bernoulli), or state forward() updates on every call "
            "(a counter buffer, a cache); make them depend on self.training.",
        )


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any] | None = None,
    *,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: dict[str, Any] | None = None,
    export: bool = True,
) -> fx.GraphModule:
    """Trace ``model`` and, given ``example_inputs``, propagate shapes into node metadata.

    With ``example_inputs``, a model ``torch.fx`` cannot trace, or whose fx graph hides torch.nn
    attention/transformer layers as opaque leaves, is captured with ``torch.export`` instead
    (:mod:`gml.capture_export`); ``gml.capture_export.capture_info(gm)`` says which path and why.
    ``export=False`` keeps to torch.fx (the INT8 frontend, whose torch.ao stage needs it).
    """
    # --- #15: automatic choice between torch.fx and torch.export (gml.capture_export) ---
    if isinstance(model, fx.GraphModule):
        gm = model
    else:
        from gml.capture_export import CAPTURE_META, CaptureInfo, choose_export, export_capture

        try:
            gm = trace(model, leaf_modules=leaf_modules, concrete_args=concrete_args, example_inputs=example_inputs)
        except TraceFailure as fx_error:
            if example_inputs is None or concrete_args or not export:
                raise
            try:
                gm = export_capture(model, example_inputs, reason=f"torch.fx failed: {fx_error.message}")
            except TraceFailure as export_error:
                raise TraceFailure(
                    f"{fx_error.message} {export_error.message}{_bound_as(model, example_inputs)}", hint=fx_error.hint
                ) from None
        else:
            why = (
                choose_export(gm, model, example_inputs)
                if example_inputs is not None and not leaf_modules and export
                else None
            )
            info = CaptureInfo("torch.fx", "symbolic_trace")
            if why is not None:
                try:
                    gm = export_capture(model, example_inputs, reason=why)
                except TraceFailure as export_error:  # the fx graph, leaves and all, still serves
                    info = CaptureInfo("torch.fx", f"symbolic_trace; {why}, but {export_error.message}")
            if CAPTURE_META not in gm.meta:  # fx's graph is the one returned
                gm.meta[CAPTURE_META] = info
                gm.train(model.training)  # a traced eval model is an eval graph
    # --- end #15 ---
    if example_inputs is not None:
        propagate_shapes(gm, example_inputs)
        for node in gm.graph.nodes:
            if node.op == "call_module":
                metas = [a.meta.get("tensor_meta") if isinstance(a, fx.Node) else None for a in node.args]
                node.meta.setdefault(TRACED_FORMATS, [getattr(m, "memory_format", None) for m in metas])
    return gm
