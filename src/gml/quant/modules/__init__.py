"""GML INT8 modules: the lowering rules' plan values for ``DQ → op → Q`` patterns.

Since ADR 005 a lowered graph holds no modules: a rule of :mod:`gml.quant.lower_rules` builds one of
these (its constructor validates what the backend can run), and :class:`~gml.quant.lower.LowerToGML`
emits it as the ``torch.ops.gml`` call its :meth:`~GMLQuantModuleBase.op_call` names. The modules
still run eagerly (``forward``), which the kernel tests use.

Hierarchy (ADR 002)::

    GMLQuantModuleBase            output_scale / output_zp buffers; forward returns uint8
    ├── UnaryOpsBase              + input_scale / input_zp:  QConv1d, QConv2d, QConv3d, QLinear, QReLU,
    │                               QHardtanh,
    │                               QActivation, QMaxPool2d, QMaxPool3d, QAvgPool2d, QAdaptiveAvgPool2d,
    │                               QBatchNorm2d, QMean, QFlatten,
    │                               QMove (view / reshape / transpose / permute / chunk piece)
    ├── BinaryOpsBase             + other_scale / other_zp:  QAdd, QMul, QConv2dAdd (residual)
    ├── QCat                      one (scale, zp) per input, as 1-D buffers
    └── Quantize                  fp32 → uint8 at the edge of the INT8 region
    Dequantize (plain Module)     uint8 → fp32; its output is not quantized, so no output qparams

Between GML modules activations are **plain uint8 tensors** (channels-last when 4-D); each module
knows the qparams of its inputs and output from its buffers, so no QTensor and no per-op
quantize/dequantize runs. Because every module stores its *output* qparams the same way,
:func:`extract_qparams` reads a lowered node exactly like a torch quantize node: a residual add whose
operand was lowered earlier needs no special case.

Saving: qparams, the dense int8 weight, its per-channel scales and the fp32 bias are buffers, so
``state_dict`` / ``load_state_dict`` round-trip them; the backend's prepacked weight is derived state,
rebuilt after ``load_state_dict``, deepcopy and unpickling (it is never serialized).
Each module takes its kernel backend in the constructor (name or instance; default oneDNN).

One file per family — ``base`` (the bases, the region edges :class:`Quantize` /
:class:`Dequantize`, :func:`extract_qparams`), ``weighted`` (conv, linear), ``eltwise``, ``pool``,
``shape`` (data movement, pad, cat) —; this package re-exports them.
"""

from __future__ import annotations

from torch import nn

from gml.quant.modules.base import (
    BackendArg,
    BinaryOpsBase,
    Dequantize,
    GMLQuantModuleBase,
    OpCall,
    Quantize,
    UnaryOpsBase,
    extract_qparams,
)
from gml.quant.modules.eltwise import (
    QActivation,
    QAdd,
    QBatchNorm2d,
    QHardtanh,
    QMul,
    QReLU,
)
from gml.quant.modules.pool import (
    QAdaptiveAvgPool2d,
    QAdaptiveAvgPool3d,
    QAvgPool2d,
    QFlatten,
    QMaxPool2d,
    QMaxPool3d,
    QMean,
)
from gml.quant.modules.shape import (
    MOVE_METHODS,
    PIECE_METHODS,
    QCat,
    QMove,
    QPad,
    RuntimeArg,
)
from gml.quant.modules.weighted import (
    QConv1d,
    QConv2d,
    QConv2dAdd,
    QConv3d,
    QLinear,
    quantize_weight,
    reference_weight,
)

GML_MODULES: tuple[type[nn.Module], ...] = (
    QConv2d,
    QConv1d,
    QConv3d,
    QConv2dAdd,
    QLinear,
    QAdd,
    QMul,
    QReLU,
    QHardtanh,
    QActivation,
    QMaxPool2d,
    QMaxPool3d,
    QAvgPool2d,
    QBatchNorm2d,
    QAdaptiveAvgPool2d,
    QAdaptiveAvgPool3d,
    QMean,
    QFlatten,
    QMove,
    QCat,
    Quantize,
    Dequantize,
)

__all__ = [
    "GML_MODULES",
    "MOVE_METHODS",
    "PIECE_METHODS",
    "BackendArg",
    "BinaryOpsBase",
    "Dequantize",
    "GMLQuantModuleBase",
    "OpCall",
    "QActivation",
    "QAdaptiveAvgPool2d",
    "QAdaptiveAvgPool3d",
    "QAdd",
    "QAvgPool2d",
    "QBatchNorm2d",
    "QCat",
    "QConv1d",
    "QConv2d",
    "QConv2dAdd",
    "QConv3d",
    "QFlatten",
    "QHardtanh",
    "QLinear",
    "QMaxPool2d",
    "QMaxPool3d",
    "QMean",
    "QMove",
    "QMul",
    "QPad",
    "QReLU",
    "Quantize",
    "RuntimeArg",
    "UnaryOpsBase",
    "extract_qparams",
    "quantize_weight",
    "reference_weight",
]
