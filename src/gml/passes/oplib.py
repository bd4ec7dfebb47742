"""One vocabulary for the ops GML-Lab reasons about.

The same mathematical op reaches an FX graph in up to three spellings: a module call
(``self.relu(x)``), a function call (``F.relu(x)``, ``torch.relu(x)``, ``operator.add``) or a
method call (``x.relu()``, ``x.add_(y)``). :func:`op_kind` maps every spelling to one canonical
name so that inspection, pattern catalogs and the normalize pass share a single table.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.capture import behaves_as


@dataclass(frozen=True)
class OpSpec:
    """The spellings of one canonical op."""

    name: str
    modules: tuple[type[nn.Module], ...] = ()
    functions: tuple[Callable, ...] = ()
    methods: tuple[str, ...] = ()
    tags: frozenset[str] = field(default_factory=frozenset)


_ACT = frozenset({"activation", "elementwise"})
_EW = frozenset({"elementwise"})

OPS: tuple[OpSpec, ...] = (
    OpSpec("conv", (nn.Conv1d, nn.Conv2d, nn.Conv3d), (F.conv1d, F.conv2d, F.conv3d)),
    OpSpec(
        "conv_transpose",
        (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
        (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
    ),
    OpSpec("batchnorm", (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), (F.batch_norm,), frozenset()),
    OpSpec("layernorm", (nn.LayerNorm,), (F.layer_norm,)),
    OpSpec("linear", (nn.Linear,), (F.linear,)),
    OpSpec("matmul", (), (torch.matmul, torch.mm, torch.bmm, operator.matmul), ("matmul", "mm", "bmm")),
    OpSpec("relu", (nn.ReLU,), (F.relu, torch.relu, F.relu_, torch.relu_), ("relu", "relu_"), _ACT),
    OpSpec("relu6", (nn.ReLU6,), (F.relu6,), (), _ACT),
    OpSpec("hardtanh", (nn.Hardtanh,), (F.hardtanh, F.hardtanh_), (), _ACT),
    OpSpec("sigmoid", (nn.Sigmoid,), (torch.sigmoid, F.sigmoid), ("sigmoid", "sigmoid_"), _ACT),
    OpSpec("tanh", (nn.Tanh,), (torch.tanh, F.tanh), ("tanh", "tanh_"), _ACT),
    OpSpec("gelu", (nn.GELU,), (F.gelu,), (), _ACT),
    OpSpec("silu", (nn.SiLU,), (F.silu,), (), _ACT),
    OpSpec("hardswish", (nn.Hardswish,), (F.hardswish,), (), _ACT),
    OpSpec("hardsigmoid", (nn.Hardsigmoid,), (F.hardsigmoid,), (), _ACT),
    OpSpec("leaky_relu", (nn.LeakyReLU,), (F.leaky_relu, F.leaky_relu_), (), _ACT),
    OpSpec("elu", (nn.ELU,), (F.elu,), (), _ACT),
    OpSpec(
        "add",
        (),
        (operator.add, operator.iadd, torch.add),
        ("add", "add_"),
        _EW,
    ),
    OpSpec("mul", (), (operator.mul, operator.imul, torch.mul), ("mul", "mul_"), _EW),
    OpSpec("sub", (), (operator.sub, operator.isub, torch.sub), ("sub", "sub_"), _EW),
    OpSpec("cat", (), (torch.cat, torch.concat), ()),
    OpSpec("flatten", (nn.Flatten,), (torch.flatten,), ("flatten",)),
    OpSpec(
        "view",
        (),
        (torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze),
        ("view", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "contiguous"),
    ),
    OpSpec(
        "adaptive_avg_pool",
        (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
        (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d),
    ),
    OpSpec(
        "max_pool",
        (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
        (F.max_pool1d, F.max_pool2d, F.max_pool3d),
    ),
    OpSpec("avg_pool", (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)),
    OpSpec("dropout", (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), (F.dropout, F.dropout2d)),
    OpSpec("softmax", (nn.Softmax,), (F.softmax, torch.softmax), ("softmax",)),
    OpSpec("identity", (nn.Identity,), ()),
)

_BY_MODULE: dict[type, str] = {m: spec.name for spec in OPS for m in spec.modules}
_BY_FUNCTION: dict[Callable, str] = {f: spec.name for spec in OPS for f in spec.functions}
_BY_METHOD: dict[str, str] = {m: spec.name for spec in OPS for m in spec.methods}
SPECS: dict[str, OpSpec] = {spec.name: spec for spec in OPS}


def op_kind(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """Canonical op name of ``node`` in any spelling, or ``None`` if the op is not in :data:`OPS`.

    Module calls are classified by the module's exact type first, then by
    :func:`~gml.capture.behaves_as`: torch's own subclasses and subclasses that override nothing
    are recognised; a subclass with its own ``forward`` (timm's ``Conv2dSame``) is not its base op.
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
