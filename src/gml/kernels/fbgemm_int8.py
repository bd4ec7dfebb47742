"""Fallback INT8 backend on PyTorch's ``quantized::*`` CPU kernels (FBGEMM).

Used when oneDNN is missing from the PyTorch build, or on request (``--backend fbgemm``). These
kernels take and return QTensors, so activations cross the interface as uint8 tensors and are
wrapped (``_make_per_tensor_quantized_tensor``, one memcpy) and results are read back through a
zero-copy uint8 view (:func:`~gml.kernels.backend.as_uint8`).

Ops: ``quantized::conv2d_prepack`` / ``conv2d`` / ``conv2d_relu``, ``quantized::linear_prepack`` /
``linear`` / ``linear_relu``, ``quantized::add`` / ``add_relu``, ``quantized::max_pool2d``,
``quantized::cat``. FBGEMM has no conv kernel with a residual-add post-op, so
:attr:`FbgemmBackend.supports_conv_add` is False: the lowering keeps conv and add as two modules
(each with its calibrated output qparams) instead of fusing them.

Element-wise post-ops: ``relu`` is FBGEMM's own (``conv2d_relu``); ``hardtanh(lo, hi)`` (ReLU6) is
the plain kernel followed by a clamp of the uint8 result to ``[Q(lo), Q(hi)]``
(:func:`~gml.kernels.backend.clamp_bounds`), which equals quantizing the clamped real value because
the quantizer is monotone. It costs one extra pass over the output, not a round trip through fp32.
There is no hardswish / SiLU epilogue: the frontend leaves those unfused for fbgemm and the
activation runs as its own INT8 op (hardswish) or in fp32 (SiLU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from gml.ir.values import ConvSpec, Int8Weight, PostOp, QParams
from gml.kernels.backend import (
    Add,
    Int8Backend,
    Tensor,
    as_qtensor,
    as_uint8,
    clamp_bounds,
    fp32_or_none,
    silence_quantized_tensor_warnings,
)


@contextlib.contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """Temporarily select the engine ``quantized::*_prepack`` packs for (it is a process global)."""
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def _qweight(w: Int8Weight) -> torch.Tensor:
    scale = w.scale.double().flatten()
    if scale.numel() == 1:
        return torch._make_per_tensor_quantized_tensor(w.weight, float(scale[0]), 0)
    zp = torch.zeros(scale.numel(), dtype=torch.int64)
    return torch._make_per_channel_quantized_tensor(w.weight, scale, zp, 0)


class FbgemmBackend(Int8Backend):
    """PyTorch ``quantized::*`` kernels (FBGEMM engine)."""

    name = "fbgemm"
    supports_conv_add: ClassVar[bool] = False
    engine: ClassVar[str] = "fbgemm"
    conv_post_ops = frozenset({"relu", "hardtanh"})
    linear_post_ops = frozenset({"relu", "hardtanh"})
    activations = frozenset({"relu", "hardtanh", "hardswish", "sigmoid", "hardsigmoid"})

    def __init__(self) -> None:
        silence_quantized_tensor_warnings()

    @classmethod
    def is_available(cls) -> bool:
        return cls.engine in torch.backends.quantized.supported_engines

    def prepack_conv(
        self, w: Int8Weight, spec: ConvSpec, input_qparams: QParams, input_shape: Sequence[int] | None = None
    ) -> Any:
        if w.weight.dim() != 4:
            raise NotImplementedError(f"the {self.name} backend has no INT8 conv{w.weight.dim() - 2}d")
        with quantized_engine(self.engine):
            return torch.ops.quantized.conv2d_prepack(
                _qweight(w),
                fp32_or_none(w.bias),
                list(spec.stride),
                list(spec.padding),
                list(spec.dilation),
                spec.groups,
            )

    def prepack_linear(self, w: Int8Weight, input_qparams: QParams, input_shape: Sequence[int] | None = None) -> Any:
        with quantized_engine(self.engine):
            return torch.ops.quantized.linear_prepack(_qweight(w), fp32_or_none(w.bias))

    def _conv2d(
        self, x: Tensor, x_qparams: QParams, packed: Any, out_qparams: QParams | None, eltwise: PostOp, add: Add
    ) -> Tensor:
        self._check_post_op("conv2d", eltwise)
        if out_qparams is None:  # no fp32-output kernel: dequantized weights, fp32 conv
            w, b = packed.unpack()
            y = torch.nn.functional.conv2d(
                self.dequantize(x, x_qparams),
                w.dequantize(),
                b,
                packed.stride(),
                packed.padding(),
                packed.dilation(),
                packed.groups(),
            )
            return eltwise.apply(y)
        op = torch.ops.quantized.conv2d_relu.new if eltwise.attr == "relu" else torch.ops.quantized.conv2d.new
        y = as_uint8(op(as_qtensor(x, x_qparams), packed, out_qparams.scale, out_qparams.zero_point))
        return self._clamp(y, out_qparams, eltwise)

    def _linear(
        self, x: Tensor, x_qparams: QParams, packed: Any, out_qparams: QParams | None, eltwise: PostOp
    ) -> Tensor:
        self._check_post_op("linear", eltwise)
        if out_qparams is None:  # no fp32-output kernel: dequantized weights, fp32 linear
            w, b = torch.ops.quantized.linear_unpack(packed)
            return eltwise.apply(torch.nn.functional.linear(self.dequantize(x, x_qparams), w.dequantize(), b))
        op = torch.ops.quantized.linear_relu if eltwise.attr == "relu" else torch.ops.quantized.linear
        y = as_uint8(op(as_qtensor(x, x_qparams), packed, out_qparams.scale, out_qparams.zero_point))
        return self._clamp(y, out_qparams, eltwise)

    def _check_post_op(self, op: str, post_op: PostOp) -> None:
        if not self.fuses(op, post_op):
            raise NotImplementedError(f"the fbgemm backend has no {op} kernel with a {post_op} post-op")

    @staticmethod
    def _clamp(y: torch.Tensor, out_qparams: QParams, post_op: PostOp) -> torch.Tensor:
        """The hardtanh epilogue on the uint8 result, in place (``y`` is the kernel's fresh output)."""
        if post_op.attr != "hardtanh":
            return y
        lo, hi = clamp_bounds(out_qparams, *post_op.scalars)
        return y.clamp_(lo, hi)
