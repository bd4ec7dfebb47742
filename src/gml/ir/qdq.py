"""Recognising quantize / dequantize ops, in every spelling, and reading their parameters.

Spellings: torch's ``quantize_per_tensor`` / ``quantize_per_channel`` / ``dequantize`` (function
and method), ``quantized_decomposed`` ops, torch.ao's ``Quantize`` / ``DeQuantize`` modules, and
GML's own ``torch.ops.gml.quantize`` / ``dequantize`` (:mod:`gml.ir.library`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.ao.nn.quantized import DeQuantize as _AoDeQuantize
from torch.ao.nn.quantized import Quantize as _AoQuantize

from gml.ir.values import QParams

_QUANTIZE_FUNCS: set[Any] = {torch.quantize_per_tensor}
_QUANTIZE_ANY_FUNCS: set[Any] = {torch.quantize_per_tensor, torch.quantize_per_channel}
_DEQUANTIZE_FUNCS: set[Any] = {torch.dequantize}
DECOMPOSED_Q: set[Any] = set()
DECOMPOSED_DQ: set[Any] = set()
try:  # the decomposed ops are registered on import of torch.ao's quantize_fx machinery
    import torch.ao.quantization.fx._decomposed

    _qd = torch.ops.quantized_decomposed
    DECOMPOSED_Q = {_qd.quantize_per_tensor.default, _qd.quantize_per_tensor.tensor}
    DECOMPOSED_DQ = {_qd.dequantize_per_tensor.default, _qd.dequantize_per_tensor.tensor}
except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
    pass


def _gml_op(name: str) -> Any:
    from gml.ir import library

    return getattr(library.ops(), name).default


def is_quantize(node: fx.Node) -> bool:
    """A per-tensor quantize op of a reference graph (torch or ``quantized_decomposed`` spelling)."""
    return node.op == "call_function" and (node.target in _QUANTIZE_FUNCS or node.target in DECOMPOSED_Q)


def is_quantize_any(node: fx.Node, modules: dict[str, nn.Module] | None = None) -> bool:
    """Any quantize op: per-tensor or per-channel function, torch.ao ``Quantize`` module, ``gml.quantize``."""
    if node.op == "call_module":
        return modules is not None and isinstance(modules.get(str(node.target)), _AoQuantize)
    return node.op == "call_function" and (
        node.target in _QUANTIZE_ANY_FUNCS or node.target in DECOMPOSED_Q or node.target is _gml_op("quantize")
    )


def is_dequantize(node: fx.Node, modules: dict[str, nn.Module] | None = None) -> bool:
    """``x.dequantize()``, ``torch.dequantize(x)``, ``quantized_decomposed.dequantize_per_tensor``,
    ``gml.dequantize``, or (given ``modules``) a torch.ao ``DeQuantize`` module call."""
    if node.op == "call_method":
        return node.target == "dequantize"
    if node.op == "call_module":
        return modules is not None and isinstance(modules.get(str(node.target)), _AoDeQuantize)
    return node.op == "call_function" and (
        node.target in _DEQUANTIZE_FUNCS or node.target in DECOMPOSED_DQ or node.target is _gml_op("dequantize")
    )


def constant(arg: Any, gm: fx.GraphModule) -> Any:
    """The value of a literal or ``get_attr`` argument (a tensor scalar becomes a Python number)."""
    if isinstance(arg, fx.Node):
        if arg.op != "get_attr":
            raise ValueError(f"{arg.name} is computed at run time")
        value: Any = gm
        for part in str(arg.target).split("."):
            value = getattr(value, part)
        arg = value
    if isinstance(arg, torch.Tensor):
        if arg.numel() != 1:
            raise ValueError("per-channel activation qparams")
        return arg.item()
    return arg


def quantize_args(node: fx.Node, gm: fx.GraphModule) -> tuple[QParams, torch.dtype]:
    """``(qparams, dtype)`` of a quantize (or decomposed dequantize) node; raises ValueError with a
    human reason if the values are not static per-tensor numbers or the dtype is not 8-bit unsigned."""
    if node.target in DECOMPOSED_Q or node.target in DECOMPOSED_DQ:
        scale, zp, dtype = node.args[1], node.args[2], node.args[5]
    else:
        scale = node.args[1] if len(node.args) > 1 else node.kwargs.get("scale")
        zp = node.args[2] if len(node.args) > 2 else node.kwargs.get("zero_point")
        dtype = node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")
    s, z = float(constant(scale, gm)), int(constant(zp, gm))
    if dtype not in (torch.quint8, torch.uint8):
        raise ValueError(f"activation dtype {dtype} (the INT8 kernels take unsigned 8-bit activations)")
    return QParams(s, z), dtype
