"""Normalize: one node kind per op, so later passes match ``call_module`` nodes by module type (ADR 001).

Before → after (``%m`` is a fresh submodule, placed in the scope the call came from, e.g.
``layer1.0.add``)::

    F.relu(x) / torch.relu(x) / x.relu() / x.relu_() / F.relu(x, inplace=True)  →  %m(x), m = nn.ReLU()
    F.relu6, F.hardtanh(x, lo, hi)                                  →  nn.ReLU6(), nn.Hardtanh(lo, hi)
    sigmoid, tanh, silu, hardswish, hardsigmoid (any spelling)      →  nn.Sigmoid(), nn.Tanh(), ...
    F.gelu(x, approximate=a), F.leaky_relu(x, s), F.elu(x, a)       →  nn.GELU(a), nn.LeakyReLU(s), nn.ELU(a)
    x + y, torch.add(x, y, alpha=a), x.add(y), x.add_(y), x += y    →  gml.nn.Add(a)(x, y)
    x + 2.0, 1 + x, torch.add(x, 2, alpha=a)                        →  gml.nn.AddScalar(2.0, a)(x)
    x * y, torch.mul, x.mul(y), x.mul_(y), x *= y / x * 0.5         →  gml.nn.Mul()(x, y) / gml.nn.MulScalar(0.5)(x)
    x - y, torch.sub(x, y, alpha=a), x -= y / x - 2.0               →  gml.nn.Add(-a)(x, y) / AddScalar(2.0, -1)(x)
        (ATen computes a - b as a + (-1)·b: the same kernel)            (2.0 - x keeps its call: no module form)
    -x, torch.neg(x), x.neg()                                       →  gml.nn.MulScalar(-1)(x) (a sign flip either way)
    x.to(dtype), x.type_as(y), x.float(), x.type(dtype) that return  →  removed (shape metadata shows the same dtype
        x itself (timm's RoPE: ``out.to(dtype=x.dtype)``)                and strides; torch returns the tensor itself)
    torch.flatten(x, s, e), x.flatten(s, e)                         →  nn.Flatten(s, e)
    F.adaptive_avg_pool{1,2,3}d(x, size)                            →  nn.AdaptiveAvgPool{1,2,3}d(size)
    x.mean((2, 3), keepdim=True), torch.mean (a 4-D x)              →  nn.AdaptiveAvgPool2d(1) (squeeze-excite's
        squeeze in timm; ATen computes that pool as this very mean)      rank from shape metadata)
    F.max_pool{1,2,3}d / torch.max_pool{1,2,3}d (all arguments)     →  nn.MaxPool{1,2,3}d(...)
    F.avg_pool{1,2,3}d (all arguments)                              →  nn.AvgPool{1,2,3}d(...)
    F.dropout(x, p, training=False), nn.Dropout in eval mode        →  removed (it is the identity)
    torchvision.ops.stochastic_depth(x, p, mode, training=False)    →  removed (likewise)
    nn.Identity()(x)                                                →  removed
    F.batch_norm(x, mean, var, w, b, training=False, m, eps)        →  nn.BatchNorm{1,2,3}d (mean, var, w, b stored
        (timm's BatchNormAct2d calls it on its own buffers)              get_attr tensors; rank from shape metadata)
    F.conv{1,2,3}d(x, weight, bias, ...) with a stored weight       →  nn.Conv{1,2,3}d(...) sharing that weight
    F.linear(x, weight, bias) with a stored weight                  →  nn.Linear(...) sharing that weight
    F.layer_norm(x, shape, weight, bias, eps), stored weight / bias  →  nn.LayerNorm(...) sharing them (timm's
        LayerNorm subclasses, whose own forward calls it)
    nn.ReLU(inplace=True) and other in-place activation modules     →  same module with inplace=False

Every replacement module runs the very op it replaces, so the rewrite is bit-exact (tolerance 0).

**In-place ops.** ``x.relu_()`` overwrites ``x``; a later reader of ``x`` sees the new value. The pass
turns the op out-of-place and points every *later* reader of ``x`` at the new result (the rewrite
``torch.func.functionalize`` does, restricted to the case it can prove). It declines, with a reason,
when the mutation is visible elsewhere: ``x`` is a model input, parameter or buffer (state the caller
or the next call would see), or ``x`` shares storage with a tensor read later (a view of it, or a
tensor it is a view of). In-place *modules* shared by several call sites (torchvision's BasicBlock
reuses ``self.relu``) are flipped only when every site is safe. Modules are never mutated: after
``symbolic_trace`` the leaf modules are the user's own objects, so the pass installs copies.

**Opaque calls that write.** A call with no module form can overwrite an input too: torchvision's
MViT calls ``_add_shortcut(x, q)``, which does ``x[..., 1:, :] += q[..., 1:, :]`` and whose result
nobody reads. Shape propagation sees the input's version counter move and records it
(``gml.capture.MUTATES``); the pass then points later readers of ``x`` at the call (when the call
returns ``x``) or at ``gml.nn.ReturnOverwritten(fn, i)`` (when it returns something nobody reads),
so a pass or torch.ao that takes ops to be pure can no longer drop the write. It declines when the
write is also seen through a view read later, and the INT8 frontend then refuses the model.

**Skipped, with a reason** (the PassResult's ``skips``): calls whose arguments are computed at run
time (``F.leaky_relu(x, slope_tensor)``), ``out=`` arguments, dropout that is active (``training=True``
or a module in training mode: it is random, not an op to keep), scalar operands computed at run time
(``x * x.size(1)``), ``F.batch_norm`` with batch statistics (``training=True``) or computed
statistics, ``F.conv`` whose weight is computed at run time, and every tensor op with no module
form here (``torch.cat``, ``.view()``,
``torch.cumsum``; "no module form for torch.cumsum"). Shape arithmetic (``x.size(0) * 2``) is not
a tensor op and is ignored. The notes give the coverage: rewritten / (rewritten + left).

Tensor-ness of an operand comes from ``node.meta['type']`` when shape propagation ran
(:func:`gml.capture`, the PassManager); otherwise it is inferred from the graph (``size()``,
``.shape`` and arithmetic on them are numbers; placeholders are tensors).
"""

from __future__ import annotations

import builtins
import copy
import operator
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from gml import nn as gnn
from gml.capture import RETURNS_MUTATED
from gml.ir.alias import (
    INPLACE_CAPABLE_MODULES,
    MUTATES,
    returns_alias,
    writes_in_place,
)
from gml.ir.alias import inplace_spelling as _is_inplace_spelling
from gml.ir.layers import behaves_as
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.oplib import node_label, op_kind
from gml.passes.utils import modules_of, remove_unused_nodes

# Spellings oplib does not list yet (candidates to move there).
_EXTRA_KINDS: dict[Callable, str] = {
    torch.max_pool1d: "max_pool",
    torch.max_pool2d: "max_pool",
    torch.max_pool3d: "max_pool",
    torch.adaptive_avg_pool1d: "adaptive_avg_pool",
    torch.dropout: "dropout",
    F.dropout1d: "dropout",
    F.dropout3d: "dropout",
    F.alpha_dropout: "dropout",
    F.feature_alpha_dropout: "dropout",
    torch.sigmoid_: "sigmoid",
    torch.tanh_: "tanh",
    F.elu_: "elu",
}


def _know_stochastic_depth() -> None:
    """torchvision's stochastic depth (EfficientNet, ConvNeXt) is dropout of whole residual branches.
    Looked up where torchvision is already imported (a graph that calls it imported it), never
    imported here: loading a saved model (gml.io) runs this pass and must not need torchvision."""
    ops = sys.modules.get("torchvision.ops")
    fn = getattr(ops, "stochastic_depth", None)
    if fn is not None and fn not in _EXTRA_KINDS:
        _EXTRA_KINDS[fn] = "dropout"
        _SIG_BY_TARGET[fn] = _Sig(("input", "p", "mode", "training"), {"training": True})


@dataclass(frozen=True)
class _Sig:
    """Positional parameter names of one spelling (``input`` first; ``self`` for methods) and defaults."""

    params: tuple[str, ...]
    defaults: dict[str, Any] = field(default_factory=dict)


_ACT_INPLACE = _Sig(("input", "inplace"), {"inplace": False})
_UNARY = _Sig(("input",))
_DROPOUT = _Sig(("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False})
_BINARY = _Sig(("input", "other"))

_SIG_BY_KIND: dict[str, _Sig] = {
    "relu": _ACT_INPLACE,
    "relu6": _ACT_INPLACE,
    "silu": _ACT_INPLACE,
    "hardswish": _ACT_INPLACE,
    "hardsigmoid": _ACT_INPLACE,
    "sigmoid": _UNARY,
    "tanh": _UNARY,
    "hardtanh": _Sig(("input", "min_val", "max_val", "inplace"), {"min_val": -1.0, "max_val": 1.0, "inplace": False}),
    "gelu": _Sig(("input", "approximate"), {"approximate": "none"}),
    "leaky_relu": _Sig(("input", "negative_slope", "inplace"), {"negative_slope": 0.01, "inplace": False}),
    "elu": _Sig(("input", "alpha", "inplace"), {"alpha": 1.0, "inplace": False}),
    "add": _Sig(("input", "other", "alpha"), {"alpha": 1}),
    "mul": _BINARY,
    "sub": _Sig(("input", "other", "alpha"), {"alpha": 1}),
    "neg": _UNARY,
    "flatten": _Sig(("input", "start_dim", "end_dim"), {"start_dim": 0, "end_dim": -1}),
    "adaptive_avg_pool": _Sig(("input", "output_size")),
    "mean": _Sig(("input", "dim", "keepdim", "dtype"), {"dim": None, "keepdim": False, "dtype": None}),
    "max_pool": _Sig(
        ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
        {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False},
    ),
    "avg_pool": _Sig(
        ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
        {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True, "divisor_override": None},
    ),
    "dropout": _DROPOUT,
    "batchnorm": _Sig(
        ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
        {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
    ),
    "linear": _Sig(("input", "weight", "bias"), {"bias": None}),
    "layernorm": _Sig(
        ("input", "normalized_shape", "weight", "bias", "eps"), {"weight": None, "bias": None, "eps": 1e-5}
    ),
    "conv": _Sig(
        ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    ),
}

_ATEN_POOL = _Sig(
    ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    {"stride": (), "padding": 0, "dilation": 1, "ceil_mode": False},
)
# Spellings whose parameters differ from their kind's default signature.
_SIG_BY_TARGET: dict[Any, _Sig] = {
    operator.add: _BINARY,
    operator.iadd: _BINARY,
    operator.mul: _BINARY,
    operator.imul: _BINARY,
    operator.sub: _BINARY,
    operator.isub: _BINARY,
    torch.dropout: _Sig(("input", "p", "training")),  # aten spells it `train`; renamed in _bind
    F.alpha_dropout: _Sig(("input", "p", "training", "inplace"), {"p": 0.5, "training": False, "inplace": False}),
    F.feature_alpha_dropout: _Sig(
        ("input", "p", "training", "inplace"), {"p": 0.5, "training": False, "inplace": False}
    ),
    torch.max_pool1d: _ATEN_POOL,
    torch.max_pool2d: _ATEN_POOL,
    torch.max_pool3d: _ATEN_POOL,
    F.hardtanh_: _Sig(("input", "min_val", "max_val"), {"min_val": -1.0, "max_val": 1.0}),
    F.leaky_relu_: _Sig(("input", "negative_slope"), {"negative_slope": 0.01}),
    F.elu_: _Sig(("input", "alpha"), {"alpha": 1.0}),
}
_KWARG_ALIASES = {"train": "training", "self": "input"}

# Activation modules whose ``inplace=True`` overwrites their input (the op table's activations).
_INPLACE_MODULES = INPLACE_CAPABLE_MODULES
_DROPOUT_MODULES = (nn.modules.dropout._DropoutNd,)

# Methods / attributes that yield Python numbers, shapes or dtypes rather than tensors.
_NON_TENSOR_METHODS = frozenset(
    ["size", "dim", "numel", "item", "tolist", "element_size", "stride", "nelement", "__len__"]
)
_NON_TENSOR_ATTRS = frozenset(["shape", "ndim", "dtype", "device", "layout", "is_cuda", "requires_grad", "names"])


class _Decline(Exception):
    """A candidate this pass will not rewrite; the message is the user-facing reason."""


#: Start of the skip reason for an opaque call whose in-place write stays invisible to data flow.
OPAQUE_WRITE_KEPT = "opaque call overwrites"


def _bind(node: fx.Node, sig: _Sig) -> dict[str, Any]:
    """Map the node's args/kwargs onto ``sig``'s parameter names (method ``self`` is ``input``)."""
    if len(node.args) > len(sig.params):
        raise _Decline(f"{len(node.args)} positional arguments; expected at most {len(sig.params)}")
    bound = dict(zip(sig.params, node.args))
    for key, value in node.kwargs.items():
        key = _KWARG_ALIASES.get(key, key)
        if key == "out":
            raise _Decline("writes into an `out=` tensor")
        if key not in sig.params or key in bound:
            raise _Decline(f"unsupported argument {key}=")
        bound[key] = value
    for key in sig.params:
        if key not in bound:
            if key not in sig.defaults:
                raise _Decline(f"missing argument {key}")
            bound[key] = sig.defaults[key]
    return bound


def _constant(bound: dict[str, Any], key: str) -> Any:
    """A non-tensor argument, which must be fixed at trace time to be stored on a module."""
    value = bound[key]
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    if found:
        raise _Decline(f"argument {key} is computed at run time ({found[0].name}), so it cannot be stored on a module")
    return value


def _spatial_mean_module(bound: dict[str, Any]) -> nn.Module:
    """``x.mean((2, 3), keepdim=True)`` of a 4-D ``x`` → ``nn.AdaptiveAvgPool2d(1)``: ATen computes an
    adaptive average pool to 1 × 1 as exactly this mean (bit-exact), and the pool has an engine step
    and an INT8 lowering. Other means keep their call (no module computes them as they are)."""
    dim, keepdim, dtype = _constant(bound, "dim"), _constant(bound, "keepdim"), _constant(bound, "dtype")
    meta = bound["input"].meta.get("tensor_meta") if isinstance(bound["input"], fx.Node) else None
    rank = len(meta.shape) if isinstance(meta, TensorMetadata) else None
    if rank != 4:
        raise _Decline(f"mean of a {rank}-D tensor (only a 4-D tensor's spatial mean has a module form)")
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    if dtype is not None or not keepdim or not all(isinstance(d, int) for d in dims) or {d % 4 for d in dims} != {2, 3}:
        raise _Decline(
            f"mean over dim={dim!r} keepdim={keepdim!r} dtype={dtype!r} "
            "(only mean((2, 3), keepdim=True) of a 4-D tensor is nn.AdaptiveAvgPool2d(1))"
        )
    return nn.AdaptiveAvgPool2d(1)


def _dims(target: Any) -> int:
    name = getattr(target, "__name__", "")
    for d in (1, 2, 3):
        if f"{d}d" in name:
            return d
    raise _Decline(f"cannot tell the dimensionality of {name}")


class Normalize(GraphPass):
    """Rewrite function and method calls of common ops into ``call_module`` nodes (see module doc)."""

    name = "normalize"
    tolerance = Tolerance(atol=0.0, rtol=0.0)  # same kernels, same order: bit-exact

    def __init__(self, *, remove_dropout: bool = True) -> None:
        self.remove_dropout = remove_dropout

    def call(self, gm: fx.GraphModule) -> PassResult:
        _know_stochastic_depth()
        return _NormalizeRun(gm, remove_dropout=self.remove_dropout).run()


class _NormalizeRun:
    """One run of :class:`Normalize` over one graph: the per-run state (modules, node order, the
    tensor-ness cache, skips and counts) lives here, never on the pass."""

    def __init__(self, gm: fx.GraphModule, *, remove_dropout: bool) -> None:
        self.remove_dropout = remove_dropout
        self._gm = gm
        self._modules = modules_of(gm)
        self._order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self._tensor_cache: dict[fx.Node, bool] = {}
        self._skips: list[Skip] = []
        self._declined: set[fx.Node] = set()
        self._rewritten: Counter[str] = Counter()
        self._exposed: Counter[str] = Counter()

    # ------------------------------------------------------------------ driver
    def run(self) -> PassResult:
        gm = self._gm
        self._expose_opaque_mutations()  # first: it finds nodes by the names shape propagation saw
        self._uninplace_modules()
        for node in list(gm.graph.nodes):
            if node.op == "call_module":
                self._maybe_drop_identity_module(node)
            elif node.op in ("call_function", "call_method"):
                try:
                    self._rewrite(node)
                except _Decline as d:
                    self._decline(node, str(d))

        notes = self._coverage()
        changes = sum(self._rewritten.values()) + sum(self._exposed.values())
        modified = changes > 0
        if modified:
            gm.delete_all_unused_submodules()
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified, changes, self._skips, notes)

    def _decline(self, node: fx.Node, reason: str) -> None:
        self._declined.add(node)
        self._skips.append(Skip(node.name, reason, f"normalize {node_label(node, self._modules)}"))

    # ------------------------------------------------------------------ tensor-ness
    def _is_tensor(self, value: Any) -> bool:
        if not isinstance(value, fx.Node):
            return isinstance(value, torch.Tensor)
        if value not in self._tensor_cache:
            self._tensor_cache[value] = self._infer_tensor(value)
        return self._tensor_cache[value]

    def _infer_tensor(self, n: fx.Node) -> bool:
        t = n.meta.get("type")
        if isinstance(t, type):
            return issubclass(t, torch.Tensor)
        if isinstance(n.meta.get("tensor_meta"), TensorMetadata):
            return True
        if n.op == "placeholder":
            return n.type not in (int, float, bool)
        if n.op == "get_attr":
            obj: Any = self._gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part, None)
            return isinstance(obj, torch.Tensor)
        if n.op == "call_method":
            return n.target not in _NON_TENSOR_METHODS
        if n.op == "call_function":
            if n.target is builtins.getattr:
                return n.args[1] not in _NON_TENSOR_ATTRS
            if n.target is builtins.len:
                return False
            if n.target is operator.getitem:
                return self._is_tensor(n.args[0])
            if getattr(n.target, "__module__", None) in ("_operator", "operator", "builtins"):
                return any(self._is_tensor(a) for a in n.all_input_nodes)
        return True

    def _is_tensor_op(self, n: fx.Node) -> bool:
        """Produces a tensor, or a tuple/list of them (``torch.split``), from tensor inputs."""
        if self._is_tensor(n):
            return True
        return n.meta.get("type") in (tuple, list) and any(self._is_tensor(a) for a in n.all_input_nodes)

    # ------------------------------------------------------------------ aliasing and in-place ops
    def _returns_alias(self, n: fx.Node) -> bool:
        return returns_alias(n, self._modules)

    def _alias_root(self, n: fx.Node) -> fx.Node:
        """The value ``n`` is a view (or in-place result) of, following the chain to its start."""
        while self._returns_alias(n) and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        return n

    def _is_same_tensor_alias(self, n: fx.Node) -> bool:
        """Whether ``n`` returns its first argument object itself (an in-place op), not a view."""
        return writes_in_place(n, self._modules)

    def _same_tensor(self, site: fx.Node, mutated: fx.Node) -> set[fx.Node]:
        """The graph values that are ``mutated``'s tensor object when ``site`` runs.

        In-place ops return their operand, so ``b = a.add_(x)`` makes ``a`` and ``b`` one tensor; an
        overwrite of either is seen through both. Only such same-object aliases made before ``site``
        count (later ones read the overwritten value and are redirected like any later reader).
        """
        pos = self._order[site]
        root = mutated
        while self._is_same_tensor_alias(root) and root.args and isinstance(root.args[0], fx.Node):
            root = root.args[0]
        group, work = {root}, [root]
        while work:
            current = work.pop()
            for user in current.users:
                if (
                    user not in group
                    and user is not site
                    and self._order.get(user, pos) < pos
                    and self._is_same_tensor_alias(user)
                    and user.args[0] is current
                ):
                    group.add(user)
                    work.append(user)
        return group

    def _mutation_hazard(self, site: fx.Node, mutated: Any) -> str | None:
        """Why overwriting ``mutated`` at ``site`` cannot be turned out-of-place, or ``None`` if it can."""
        if not isinstance(mutated, fx.Node):
            return "the overwritten operand is not a graph value"
        root = self._alias_root(mutated)
        if root.op == "placeholder":
            return f"it overwrites model input {root.name} in place, which the caller can observe"
        if root.op == "get_attr":
            return f"it overwrites parameter/buffer {root.target} in place, which persists across calls"
        return self._late_alias_reader(site, mutated)

    def _late_alias_reader(self, site: fx.Node, mutated: fx.Node) -> str | None:
        """Why a write to ``mutated`` at ``site`` is seen through another tensor (a view of it, or
        one it is a view of) read after ``site``; ``None`` if it is not."""
        root = self._alias_root(mutated)
        pos = self._order[site]
        same = self._same_tensor(site, mutated)
        aliases, work = {root}, [root]
        while work:
            current = work.pop()
            for user in current.users:
                if current in same and self._order[user] > pos:
                    continue  # later readers of the overwritten tensor get redirected to the new result
                if user not in aliases and user is not site and self._returns_alias(user) and user.args[0] is current:
                    aliases.add(user)
                    work.append(user)
        for alias in aliases - same:
            late = [u for u in alias.users if u is not site and self._order[u] > pos]
            if late:
                return (
                    f"{alias.name} shares storage with the overwritten {mutated.name} and is read later "
                    f"by {late[0].name}"
                )
        return None

    def _redirect_later_readers(self, site: fx.Node, mutated: fx.Node, result: fx.Node) -> None:
        """After an in-place op became out-of-place, later readers of the old tensor (under any of its
        same-object names) read the result."""
        pos = self._order[site]
        for alias in self._same_tensor(site, mutated):
            for user in list(alias.users):
                if user is not site and user is not result and self._order[user] > pos:
                    user.replace_input_with(alias, result)

    def _uninplace_modules(self) -> None:
        sites: dict[str, list[fx.Node]] = {}
        for node in self._gm.graph.nodes:
            mod = self._modules.get(str(node.target)) if node.op == "call_module" else None
            # behaves_as: a subclass with its own forward may not honour ``inplace=False``
            if behaves_as(mod, _INPLACE_MODULES) and getattr(mod, "inplace", False):
                sites.setdefault(str(node.target), []).append(node)
        for target, nodes in sites.items():
            hazards = [(n, self._mutation_hazard(n, n.args[0] if n.args else None)) for n in nodes]
            bad = [(n, h) for n, h in hazards if h is not None]
            if bad:
                for n, h in bad:
                    self._decline(n, f"cannot make {target} out-of-place: {h}")
                for n, _ in hazards:
                    if all(n is not b for b, _ in bad):
                        self._decline(n, f"{target} is also called in place at {bad[0][0].name}, which must stay")
                continue
            # Install a copy: the module object may be the user's own (symbolic_trace shares leaves).
            clone = copy.deepcopy(self._modules[target])
            clone.inplace = False
            parent, _, attr = target.rpartition(".")
            setattr(self._gm.get_submodule(parent) if parent else self._gm, attr, clone)
            self._modules[target] = clone
            for n in nodes:
                n.meta.pop(MUTATES, None)  # shape propagation saw the write; there is none now
                self._redirect_later_readers(n, n.args[0], n)
                self._rewritten[f"{type(clone).__name__}(inplace=True)"] += 1

    # ------------------------------------------------------------------ opaque calls that write
    def _expose_opaque_mutations(self) -> None:
        """Make the in-place writes of calls Normalize has no module form for visible in the graph.

        Shape propagation records which inputs a call overwrote (:data:`gml.capture.MUTATES`).
        torchvision's MViT calls ``_add_shortcut(x, q)``, which does ``x[..., 1:, :] += q[...]``;
        its result is unused and ``x`` is read afterwards, so a pass or torch.ao that takes ops to
        be pure drops the call and the residual with it. The write stays in place (the call is
        opaque), but later readers of ``x`` read the call's node instead:

        * the call returns ``x`` itself (``_add_shortcut`` does): later readers read the call;
        * it returns something else that nobody reads (``operator.setitem``): the call becomes
          ``gml.nn.ReturnOverwritten(fn, i)``, which returns ``x``, and later readers read that.
        """
        by_name = {n.name: n for n in self._gm.graph.nodes}
        for node in list(self._gm.graph.nodes):
            names = node.meta.get(MUTATES)
            if not names or node in self._declined or writes_in_place(node, self._modules):
                continue  # in-place spellings Normalize knows were handled (or declined) above
            if len(names) != 1:
                self._decline(node, f"{OPAQUE_WRITE_KEPT} {len(names)} of its inputs in place")
                continue
            if names[0] not in by_name:
                self._decline(node, f"{OPAQUE_WRITE_KEPT} {names[0]}, which is no longer in the graph")
                continue
            mutated = by_name[names[0]]
            pos = self._order[node]
            later = [
                u for a in self._same_tensor(node, mutated) for u in a.users if u is not node and self._order[u] > pos
            ]
            hazard = self._late_alias_reader(node, mutated)
            if hazard is not None:
                self._decline(node, f"{OPAQUE_WRITE_KEPT} {mutated.name} in place: {hazard}")
                continue
            if not later:
                continue  # nothing reads the overwritten tensor afterwards: nothing to expose
            if node.meta.get(RETURNS_MUTATED) == mutated.name:
                result = node
            elif not node.users and node.op == "call_function" and mutated in node.args and not node.kwargs:
                result = self._insert_module(
                    node, "overwrite", gnn.ReturnOverwritten(node.target, node.args.index(mutated)), node.args
                )
            else:
                self._decline(
                    node,
                    f"{OPAQUE_WRITE_KEPT} {mutated.name} in place and returns another value that is read",
                )
                continue
            self._redirect_later_readers(node, mutated, result)
            self._exposed[node_label(node, self._modules)] += 1

    # ------------------------------------------------------------------ identities: nn.Identity, eval dropout
    def _maybe_drop_identity_module(self, node: fx.Node) -> None:
        mod = self._modules.get(str(node.target))
        if type(mod) is nn.Identity and len(node.args) == 1 and not node.kwargs:
            # a placeholder layer (torchvision uses it for optional norms and heads): dropping it
            # lets conv -> bn -> Identity -> add match as conv -> add
            node.replace_all_uses_with(node.args[0])
            self._gm.graph.erase_node(node)
            self._rewritten["nn.Identity"] += 1
            return
        if not behaves_as(mod, _DROPOUT_MODULES) or not self.remove_dropout:
            return
        if mod.training and mod.p > 0:
            self._decline(node, "dropout module is in training mode (random); call model.eval() first")
            return
        node.replace_all_uses_with(node.args[0])
        self._gm.graph.erase_node(node)
        self._rewritten["dropout"] += 1

    # ------------------------------------------------------------------ functions and methods
    def _kind(self, node: fx.Node) -> str | None:
        kind = op_kind(node, self._modules)
        if kind is None and node.op == "call_function":
            try:
                kind = _EXTRA_KINDS.get(node.target)  # type: ignore[arg-type]
            except TypeError:
                kind = None
        return kind

    def _rewrite(self, node: fx.Node) -> None:
        kind = self._kind(node)
        if kind == "cast":
            self._maybe_drop_identity_cast(node)
            return
        if kind not in _SIG_BY_KIND:
            return  # no module form; counted in _coverage
        sig = _SIG_BY_TARGET.get(node.target, _SIG_BY_KIND[kind]) if node.op == "call_function" else _SIG_BY_KIND[kind]
        bound = _bind(node, sig)
        if kind == "dropout":
            self._drop_dropout_call(node, bound)
            return
        if kind in ("add", "mul", "sub"):
            built = self._binary(kind, bound)
            if built is None:
                return  # arithmetic on Python numbers, not a tensor op
            module, inputs = built
        else:
            if not self._is_tensor(bound["input"]):
                raise _Decline("the input is not a tensor")
            module, inputs = self._build(kind, node, bound), (bound["input"],)
            stored = [a for a in node.all_input_nodes if a.op == "get_attr"]  # now held by the module
        inplace = _is_inplace_spelling(node) or bound.get("inplace") is True
        mutated = bound["input"]
        if inplace:
            hazard = self._mutation_hazard(node, mutated)
            if hazard is not None:
                raise _Decline(f"in-place op kept: {hazard}")
        new = self._insert_module(node, kind, module, inputs)
        if kind in ("batchnorm", "conv", "linear", "layernorm"):
            remove_unused_nodes(self._gm.graph, stored)
        if inplace:
            self._redirect_later_readers(node, mutated, new)
        self._rewritten[node_label(node, self._modules)] += 1

    def _insert_module(self, node: fx.Node, base: str, module: nn.Module, inputs: tuple[Any, ...]) -> fx.Node:
        target = self._fresh_name(node, base)
        self._gm.add_submodule(target, module)
        self._modules[target] = module
        with self._gm.graph.inserting_before(node):
            new = self._gm.graph.call_module(target, tuple(inputs))
        new.meta = dict(node.meta)
        new.meta.pop(MUTATES, None)  # the module runs out of place (an in-place spelling's readers move below)
        self._order[new] = self._order[node]
        node.replace_all_uses_with(new)
        self._gm.graph.erase_node(node)
        return new

    def _fresh_name(self, node: fx.Node, base: str) -> str:
        """``<scope>.<base>[_k]``: the new module lives in the submodule whose forward made the call."""
        stack = node.meta.get("nn_module_stack") or {}
        scope = next(reversed(stack.values()))[0] if stack else ""
        prefix = f"{scope}." if scope else ""
        candidate, k = f"{prefix}{base}", 0
        while self._name_taken(candidate):
            k += 1
            candidate = f"{prefix}{base}_{k}"
        return candidate

    def _name_taken(self, path: str) -> bool:
        obj: Any = self._gm
        for part in path.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    def _drop_dropout_call(self, node: fx.Node, bound: dict[str, Any]) -> None:
        if not self.remove_dropout:
            return
        training, p = _constant(bound, "training"), _constant(bound, "p")
        if training and p > 0:
            raise _Decline(
                "dropout called with training=True is random; call model.eval() and pass "
                "training=self.training to F.dropout"
            )
        node.replace_all_uses_with(bound["input"])
        self._gm.graph.erase_node(node)
        self._rewritten["dropout"] += 1

    def _binary(self, kind: str, bound: dict[str, Any]) -> tuple[nn.Module, tuple[Any, ...]] | None:
        a, b = bound["input"], bound["other"]
        alpha = _constant(bound, "alpha") if "alpha" in bound else 1
        ta, tb = self._is_tensor(a), self._is_tensor(b)
        number = (int, float, bool)
        if kind == "sub":
            if not ta:  # 2.0 - x (rsub): no module computes it as torch does
                if tb:
                    raise _Decline("a number minus a tensor has no module form")
                return None
            if isinstance(alpha, bool) or not isinstance(alpha, int | float):
                raise _Decline(f"sub with alpha={alpha!r}")
            # ATen's sub is its add kernel with -alpha: a - alpha·b, bit for bit
            kind, alpha = "add", -alpha
        if ta and tb:
            return (gnn.Add(alpha) if kind == "add" else gnn.Mul()), (a, b)
        if ta and isinstance(b, number):
            return (gnn.AddScalar(b, alpha) if kind == "add" else gnn.MulScalar(b)), (a,)
        if tb and isinstance(a, number) and alpha == 1:
            # a + x == x + a and a * x == x * a exactly (IEEE add and multiply commute).
            return (gnn.AddScalar(a) if kind == "add" else gnn.MulScalar(a)), (b,)
        if not ta and not tb:
            return None
        other = b if ta else a
        if isinstance(other, fx.Node):
            raise _Decline(f"operand {other.name} is a Python number computed at run time")
        raise _Decline(f"unsupported operand {other!r} (alpha={alpha})")

    def _build(self, kind: str, node: fx.Node, bound: dict[str, Any]) -> nn.Module:
        c = lambda key: _constant(bound, key)  # noqa: E731
        if kind == "batchnorm":
            return self._batch_norm_module(node, bound)
        if kind == "conv":
            return self._conv_module(node, bound)
        if kind == "linear":
            return self._linear_module(bound)
        if kind == "layernorm":
            return self._layer_norm_module(bound)
        if kind == "neg":
            return gnn.MulScalar(-1)  # x * -1 flips the sign bit as -x does (zeros and infinities too)
        if kind == "relu":
            return nn.ReLU()
        if kind == "relu6":
            return nn.ReLU6()
        if kind == "hardtanh":
            return nn.Hardtanh(c("min_val"), c("max_val"))
        if kind == "gelu":
            return nn.GELU(approximate=c("approximate"))
        if kind == "leaky_relu":
            return nn.LeakyReLU(c("negative_slope"))
        if kind == "elu":
            return nn.ELU(c("alpha"))
        simple = {"sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "silu": nn.SiLU, "hardswish": nn.Hardswish}
        simple["hardsigmoid"] = nn.Hardsigmoid
        if kind in simple:
            return simple[kind]()
        if kind == "flatten":
            start, end = c("start_dim"), c("end_dim")
            if not (isinstance(start, int) and isinstance(end, int)):
                raise _Decline("flatten over named dimensions has no module form")
            return nn.Flatten(start, end)
        if kind == "mean":
            return _spatial_mean_module(bound)
        if kind == "adaptive_avg_pool":
            cls = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}[_dims(node.target)]
            return cls(c("output_size"))
        if kind == "max_pool":
            cls = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}[_dims(node.target)]
            stride = c("stride")
            return cls(
                c("kernel_size"),
                stride=None if stride in ((), []) else stride,
                padding=c("padding"),
                dilation=c("dilation"),
                return_indices=bool(bound.get("return_indices", False)),
                ceil_mode=c("ceil_mode"),
            )
        if kind == "avg_pool":
            dims = _dims(node.target)
            cls = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}[dims]
            stride = c("stride")
            kwargs = {"divisor_override": c("divisor_override")} if dims > 1 else {}
            if dims == 1 and bound.get("divisor_override") is not None:
                raise _Decline("avg_pool1d takes no divisor_override")
            return cls(
                c("kernel_size"),
                stride=None if stride in ((), []) else stride,
                padding=c("padding"),
                ceil_mode=c("ceil_mode"),
                count_include_pad=c("count_include_pad"),
                **kwargs,
            )
        raise _Decline(f"no module builder for {kind}")  # pragma: no cover - table and builders agree

    # ------------------------------------------------------------------ casts that change nothing
    def _maybe_drop_identity_cast(self, node: fx.Node) -> None:
        """``x.to(dtype)`` / ``x.type_as(y)`` / ``x.float()`` / ``x.type(dtype)`` whose result has
        ``x``'s dtype and strides (shape propagation's metadata): torch returns ``x`` itself then, so
        readers read ``x``. ``copy=True`` and a device other than the CPU keep the call."""
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node):
            return
        before, after = src.meta.get("tensor_meta"), node.meta.get("tensor_meta")
        if not (isinstance(before, TensorMetadata) and isinstance(after, TensorMetadata)):
            return  # no metadata: the call stays (reported as having no module form)
        if (before.dtype, before.shape, before.stride) != (after.dtype, after.shape, after.stride):
            return  # a real conversion
        if node.kwargs.get("copy") is True or any(a is True for a in node.args[1:]):
            return  # x.to(dtype, copy=True) (or its positional non_blocking / copy flags) copies
        devices = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, str | torch.device)]
        if any(str(d).split(":")[0] != "cpu" for d in devices):
            return
        label, reads = node_label(node, self._modules), [a for a in node.all_input_nodes if a is not src]
        node.replace_all_uses_with(src)
        self._gm.graph.erase_node(node)
        remove_unused_nodes(self._gm.graph, reads)  # the getattr(x, "dtype") it read
        self._rewritten[f"{label} (no change)"] += 1

    def _stored_tensor(self, bound: dict[str, Any], key: str) -> torch.Tensor | None:
        """A tensor argument that is a parameter/buffer of the model (a ``get_attr``), or None."""
        value = bound[key]
        if value is None:
            return None
        if not (isinstance(value, fx.Node) and value.op == "get_attr"):
            raise _Decline(f"{key} is computed at run time, not a stored parameter or buffer")
        obj: Any = self._gm
        for part in str(value.target).split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            raise _Decline(f"{key} is not a tensor")
        return obj

    def _batch_norm_module(self, node: fx.Node, bound: dict[str, Any]) -> nn.Module:
        """``F.batch_norm`` in eval form (``training=False``, stored running statistics; timm's
        ``BatchNormAct2d`` calls it on its own buffers) → the ``nn.BatchNorm{1,2,3}d`` whose eval
        forward makes this very call, so FoldBatchNorm and the INT8 lowering see a module."""
        training = _constant(bound, "training")
        mean, var = self._stored_tensor(bound, "running_mean"), self._stored_tensor(bound, "running_var")
        if training is not False or mean is None or var is None:
            raise _Decline("batch_norm with batch statistics (training=True or no running statistics)")
        weight, bias = self._stored_tensor(bound, "weight"), self._stored_tensor(bound, "bias")
        if (weight is None) != (bias is None):
            raise _Decline("batch_norm with only one of weight/bias has no module form")
        meta = bound["input"].meta.get("tensor_meta") if isinstance(bound["input"], fx.Node) else None
        rank = len(meta.shape) if isinstance(meta, TensorMetadata) else None
        cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(rank or 0)
        if cls is None:
            raise _Decline(f"batch_norm on a {rank}-D input (unknown without shape propagation) has no module form")
        momentum, eps = _constant(bound, "momentum"), _constant(bound, "eps")
        affine = weight is not None
        bn = cls(mean.numel(), eps=eps, momentum=momentum, affine=affine, device=mean.device, dtype=mean.dtype)
        bn.running_mean, bn.running_var = mean.detach(), var.detach()  # shared, as the caller's were
        if weight is not None and bias is not None:
            bn.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(), False)
            bn.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), False)
        return bn.eval()

    def _conv_module(self, node: fx.Node, bound: dict[str, Any]) -> nn.Module:
        """``F.conv{1,2,3}d`` with a stored weight (timm's ``StdConv2d`` after FoldConstants, a
        ``Conv2dSame`` traced through) → the ``nn.Conv{1,2,3}d`` whose forward makes this very call."""
        weight, bias = self._stored_tensor(bound, "weight"), self._stored_tensor(bound, "bias")
        assert weight is not None
        dims = _dims(node.target)
        if weight.dim() != dims + 2:
            raise _Decline(f"conv{dims}d weight of rank {weight.dim()}")
        groups = _constant(bound, "groups")
        cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        conv = cls(
            weight.shape[1] * groups,
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=_constant(bound, "stride"),
            padding=_constant(bound, "padding"),
            dilation=_constant(bound, "dilation"),
            groups=groups,
            bias=bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        conv.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(), False)
        if bias is not None:
            conv.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), False)
        return conv.eval()

    def _linear_module(self, bound: dict[str, Any]) -> nn.Module:
        """``F.linear`` with a stored weight → the ``nn.Linear`` whose forward makes this very call."""
        weight, bias = self._stored_tensor(bound, "weight"), self._stored_tensor(bound, "bias")
        assert weight is not None
        if weight.dim() != 2:
            raise _Decline(f"linear weight of rank {weight.dim()}")
        lin = nn.Linear(
            weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
        )
        lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(), False)
        if bias is not None:
            lin.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), False)
        return lin.eval()

    def _layer_norm_module(self, bound: dict[str, Any]) -> nn.Module:
        """``F.layer_norm`` with stored weight / bias (timm's ``LayerNorm`` subclasses call it from
        their own forward) → the ``nn.LayerNorm`` whose forward makes this very call."""
        shape, eps = _constant(bound, "normalized_shape"), _constant(bound, "eps")
        weight, bias = self._stored_tensor(bound, "weight"), self._stored_tensor(bound, "bias")
        if weight is None and bias is not None:
            raise _Decline("layer_norm with a bias but no weight has no module form")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        ln = nn.LayerNorm(
            shape,
            eps=float(eps),
            elementwise_affine=weight is not None,
            bias=bias is not None,
            device=None if weight is None else weight.device,
            dtype=None if weight is None else weight.dtype,
        )
        if weight is not None:
            if tuple(weight.shape) != shape or (bias is not None and tuple(bias.shape) != shape):
                raise _Decline(f"layer_norm weight / bias of shape {tuple(weight.shape)} for normalized_shape {shape}")
            ln.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(), False)
            if bias is not None:
                ln.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), False)
        return ln.eval()

    # ------------------------------------------------------------------ report
    def _coverage(self) -> list[str]:
        no_form: Counter[str] = Counter()
        ignored = 0
        for node in self._gm.graph.nodes:
            if node.op not in ("call_function", "call_method") or node in self._declined:
                continue
            if not self._is_tensor_op(node):
                ignored += 1  # shape arithmetic / metadata: not a tensor op
                continue
            label = node_label(node, self._modules)
            no_form[label] += 1
            self._skips.append(Skip(node.name, f"no module form for {label}", f"normalize {label}"))
        done = sum(self._rewritten.values())
        left = len(self._declined) + sum(no_form.values())
        total = done + left
        pct = 100.0 * done / total if total else 100.0
        notes = [f"coverage: {done}/{total} op call sites normalized ({pct:.1f}%)"]
        if self._rewritten:
            notes.append("rewritten: " + ", ".join(f"{k} ×{v}" for k, v in self._rewritten.most_common()))
        if self._exposed:
            notes.append(
                "in-place writes of opaque calls made visible to later readers: "
                + ", ".join(f"{k} ×{v}" for k, v in self._exposed.most_common())
            )
        if self._declined:
            notes.append(f"declined: {len(self._declined)} (see skips)")
        if no_form:
            notes.append("no module form: " + ", ".join(f"{k} ×{v}" for k, v in no_form.most_common()))
        if ignored:
            notes.append(f"ignored {ignored} shape/scalar nodes (not tensor ops)")
        return notes


__all__ = ["Normalize"]
