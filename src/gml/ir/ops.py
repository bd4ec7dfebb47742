"""The op vocabulary: every op GML reasons about, defined once.

The same mathematical op reaches an FX graph in up to three spellings: a module call
(``self.relu(x)``), a function call (``F.relu(x)``, ``torch.relu(x)``, ``operator.add``) or a
method call (``x.relu()``, ``x.add_(y)``). :data:`OPS` lists each op once with its spellings and
its tags; :func:`op_kind` maps any spelling to the canonical name. Every other fact about ops
(which ones are views, activations, oneDNN post-ops, have an INT8 lowering) is a tag or a field
here, and the sets other modules use are *derived* from this table (:func:`methods_tagged`, ...).

Tags:

``view``        the result may share storage with the first argument (a view, or the argument
                itself: ``detach``, ``contiguous``, ``nn.Identity``, dropout in eval mode).
``activation``  an element-wise activation (the fusions put these into a kernel's epilogue).
``elementwise`` element-wise arithmetic.
``int8``        :mod:`gml.quant.lower` has a rule lowering it onto a ``torch.ops.gml`` op.

In-place spellings (``x.relu_()``, ``x += y``, ``inplace=True``) are recognised by
:func:`gml.ir.alias.writes_in_place` from the spelling, not listed per op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.ir.layers import behaves_as


@dataclass(frozen=True)
class OpSpec:
    """The spellings of one canonical op, its tags, and the oneDNN post-op computing it (if any)."""

    name: str
    modules: tuple[type[nn.Module], ...] = ()
    functions: tuple[Callable, ...] = ()
    methods: tuple[str, ...] = ()
    tags: frozenset[str] = field(default_factory=frozenset)
    #: oneDNN eltwise attr name when the op is one fused post-op with no arguments to read
    post_op: str | None = None


def _t(*tags: str) -> frozenset[str]:
    return frozenset(tags)


_ACT = _t("activation", "elementwise")
_ACT8 = _t("activation", "elementwise", "int8")
_VIEW = _t("view")
_VIEW8 = _t("view", "int8")

OPS: tuple[OpSpec, ...] = (
    OpSpec("conv", (nn.Conv1d, nn.Conv2d, nn.Conv3d), (F.conv1d, F.conv2d, F.conv3d), tags=_t("int8")),
    OpSpec(
        "conv_transpose",
        (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
        (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
    ),
    OpSpec("batchnorm", (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), (F.batch_norm,), tags=_t("int8")),
    OpSpec("layernorm", (nn.LayerNorm,), (F.layer_norm,)),
    OpSpec("linear", (nn.Linear,), (F.linear,), tags=_t("int8")),
    OpSpec("matmul", (), (torch.matmul, torch.mm, torch.bmm, operator.matmul), ("matmul", "mm", "bmm")),
    OpSpec("relu", (nn.ReLU,), (F.relu, torch.relu, F.relu_, torch.relu_), ("relu", "relu_"), _ACT8, "relu"),
    OpSpec("relu6", (nn.ReLU6,), (F.relu6,), (), _ACT8),
    OpSpec("hardtanh", (nn.Hardtanh,), (F.hardtanh, F.hardtanh_), (), _ACT8),
    OpSpec("sigmoid", (nn.Sigmoid,), (torch.sigmoid, F.sigmoid), ("sigmoid", "sigmoid_"), _ACT8, "sigmoid"),
    OpSpec("tanh", (nn.Tanh,), (torch.tanh, F.tanh), ("tanh", "tanh_"), _ACT, "tanh"),
    OpSpec("gelu", (nn.GELU,), (F.gelu,), (), _ACT),
    OpSpec("silu", (nn.SiLU,), (F.silu,), (), _ACT8, "swish"),  # INT8: as a fused conv/linear post-op
    OpSpec("hardswish", (nn.Hardswish,), (F.hardswish,), (), _ACT8, "hardswish"),
    OpSpec("hardsigmoid", (nn.Hardsigmoid,), (F.hardsigmoid,), (), _ACT8, "hardsigmoid"),
    OpSpec("leaky_relu", (nn.LeakyReLU,), (F.leaky_relu, F.leaky_relu_), (), _ACT),
    OpSpec("elu", (nn.ELU,), (F.elu, F.elu_), (), _ACT),
    OpSpec("celu", (nn.CELU,), (F.celu,), (), _ACT),
    OpSpec("selu", (nn.SELU,), (F.selu,), (), _ACT),
    OpSpec("mish", (nn.Mish,), (F.mish,), (), _ACT),
    OpSpec("threshold", (nn.Threshold,), (F.threshold,), (), _ACT),
    OpSpec("rrelu", (nn.RReLU,), (F.rrelu,), (), _ACT),
    OpSpec("add", (), (operator.add, operator.iadd, torch.add), ("add", "add_"), _t("elementwise", "int8")),
    OpSpec("mul", (), (operator.mul, operator.imul, torch.mul), ("mul", "mul_"), _t("elementwise", "int8")),
    OpSpec("sub", (), (operator.sub, operator.isub, torch.sub), ("sub", "sub_"), _t("elementwise")),
    OpSpec(
        "neg",
        (),
        (operator.neg, torch.neg, torch.negative),
        ("neg", "neg_", "negative", "negative_"),
        _t("elementwise"),
    ),
    # a dtype conversion: the tensor itself when it has the dtype already (``x.to(x.dtype)``)
    OpSpec("cast", (), (), ("to", "type_as", "float", "type")),
    OpSpec("cat", (), (torch.cat, torch.concat), (), _t("int8")),
    OpSpec("flatten", (nn.Flatten,), (torch.flatten,), ("flatten",), _VIEW8),
    OpSpec(
        "view",
        (),
        (torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze),
        ("view", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "contiguous"),
        _VIEW8,
    ),
    # Ops returning a view of (or the very) first argument that no rewrite treats as data movement
    # of its own; listed so that alias analysis sees through them (`other.detach()`).
    OpSpec(
        "alias",
        (nn.Unflatten,),
        (
            operator.getitem,
            torch.narrow,
            torch.select,
            torch.split,
            torch.chunk,
            torch.unbind,
            torch.t,
            torch.movedim,
            torch.swapaxes,
            torch.as_strided,
            torch.detach,
            torch.diagonal,
        ),
        (
            "view_as",
            "reshape_as",
            "t",
            "unflatten",
            "expand",
            "expand_as",
            "narrow",
            "select",
            "split",
            "chunk",
            "unbind",
            "as_strided",
            "detach",
            "movedim",
            "swapaxes",
            "diagonal",
            "__getitem__",
            "unfold",
        ),
        _VIEW,
    ),
    OpSpec(
        "adaptive_avg_pool",
        (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
        (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d),
        tags=_t("int8"),
    ),
    OpSpec(
        "max_pool",
        (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
        (F.max_pool1d, F.max_pool2d, F.max_pool3d),
        tags=_t("int8"),
    ),
    OpSpec(
        "avg_pool",
        (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d),
        (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d),
        tags=_t("int8"),
    ),
    OpSpec("mean", (), (torch.mean,), ("mean",), _t("int8")),
    # in eval mode a dropout returns its input itself
    OpSpec("dropout", (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), (F.dropout, F.dropout2d), (), _VIEW),
    OpSpec("softmax", (nn.Softmax,), (F.softmax, torch.softmax), ("softmax",)),
    OpSpec("identity", (nn.Identity,), (), (), _VIEW),
)

SPECS: dict[str, OpSpec] = {spec.name: spec for spec in OPS}
_BY_MODULE: dict[type, str] = {m: spec.name for spec in OPS for m in spec.modules}
_BY_FUNCTION: dict[Callable, str] = {f: spec.name for spec in OPS for f in spec.functions}
_BY_METHOD: dict[str, str] = {m: spec.name for spec in OPS for m in spec.methods}


def kinds_tagged(tag: str) -> frozenset[str]:
    """Canonical names of the ops carrying ``tag``."""
    return frozenset(spec.name for spec in OPS if tag in spec.tags)


def methods_tagged(tag: str) -> frozenset[str]:
    return frozenset(m for spec in OPS if tag in spec.tags for m in spec.methods)


def functions_tagged(tag: str) -> frozenset[Callable]:
    return frozenset(f for spec in OPS if tag in spec.tags for f in spec.functions)


def modules_tagged(tag: str) -> tuple[type[nn.Module], ...]:
    return tuple(m for spec in OPS if tag in spec.tags for m in spec.modules)


ACTIVATION_KINDS = kinds_tagged("activation")
VIEW_KINDS = kinds_tagged("view")
INT8_KINDS = kinds_tagged("int8")


def op_kind(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """Canonical op name of ``node`` in any spelling, or ``None`` if the op is not in :data:`OPS`.

    Module calls are classified by the module's exact type first, then by
    :func:`~gml.ir.layers.behaves_as`: torch's own subclasses (fused modules that inherit from
    ``nn.Conv2d``) and subclasses that override nothing are recognised; a subclass with its own
    ``forward`` (timm's ``Conv2dSame``) is not its base op.
    """
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if mod is None:
            return None
        kind = _BY_MODULE.get(type(mod))
        if kind is not None:
            return kind
        for cls, name in _BY_MODULE.items():
            if behaves_as(mod, cls):
                return name
        return None
    if node.op == "call_function":
        try:
            return _BY_FUNCTION.get(node.target)  # type: ignore[arg-type]
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _BY_METHOD.get(str(node.target))
    return None


#: ``torch.constant_pad_nd``'s spellings (what ``F.pad`` calls; the lowered INT8 pad)
CONSTANT_PADS = (torch.constant_pad_nd, torch.ops.aten.constant_pad_nd.default)


def pad_of(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[list[Any], str, Any] | None:
    """``(pads, mode, value)`` of a pad node (``F.pad``, ``torch.constant_pad_nd`` — the lowered INT8
    graph's pad of the integers with the zero point — or a constant / zero pad module), else None.
    ``pads`` lists the last dim first, as ``F.pad`` does; an entry may be a graph value (a size
    computed at run time: Swin's pad to whole windows)."""
    if node.op == "call_function" and node.target is F.pad:
        args = list(node.args) + [None] * 4
        pads = node.kwargs.get("pad", args[1])
        mode = node.kwargs.get("mode", args[2] if len(node.args) > 2 else "constant")
        value = node.kwargs.get("value", args[3] if len(node.args) > 3 else None)
        return list(pads) if isinstance(pads, list | tuple) else [pads], mode, value
    if node.op == "call_function" and node.target in CONSTANT_PADS:
        args = list(node.args) + [None] * 3
        pads = node.kwargs.get("pad", args[1])
        value = node.kwargs.get("value", args[2] if len(node.args) > 2 else 0)
        return list(pads) if isinstance(pads, list | tuple) else [pads], "constant", value
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if type(mod) in (nn.ConstantPad2d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ZeroPad1d):
            return list(mod.padding), "constant", float(mod.value)
    return None


def has_tag(node: fx.Node, modules: dict[str, nn.Module], tag: str) -> bool:
    kind = op_kind(node, modules)
    return kind is not None and tag in SPECS[kind].tags


def node_label(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    """Short human label of what a node computes: module type, function or method name."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        return type(mod).__name__ if mod is not None else str(node.target)
    if node.op == "call_function":
        target = node.target
        mod_name = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", str(target))
        if mod_name in ("_operator", "operator"):
            return f"operator.{name}"
        if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return str(target)
        if mod_name.startswith("torch.nn.functional"):
            return f"F.{name}"
        if mod_name.startswith("torch") or mod_name == "":
            return f"torch.{name}"
        return f"{mod_name}.{name}"
    if node.op == "call_method":
        return f".{node.target}()"
    return str(node.target)
