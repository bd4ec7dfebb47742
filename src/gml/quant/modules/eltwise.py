"""Element-wise plan values: add, mul, ReLU, hardtanh (an integer clamp), the table-driven activations
and batch norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gml.ir.values import PostOp, QParams
from gml.quant.modules.base import (
    BackendArg,
    BinaryOpsBase,
    OpCall,
    UnaryOpsBase,
    _qp,
)


class QAdd(BinaryOpsBase):
    """``relu?(a + b)`` of two uint8 tensors, requantized to the output qparams."""

    def __init__(
        self,
        input_qparams: QParams,
        other_qparams: QParams,
        output_qparams: QParams,
        *,
        relu: bool = False,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, other_qparams, output_qparams, backend)
        self.relu = relu

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.backend.add(a, self._in_qp, b, self._other_qp, self._out_qp, self.relu)

    def extra_repr(self) -> str:
        return f"{'relu, ' if self.relu else ''}{self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall(
            "qadd",
            (
                inputs[0],
                *_qp(self._in_qp),
                inputs[1],
                *_qp(self._other_qp),
                *_qp(self._out_qp),
                "relu" if self.relu else "none",
                self.backend.name,
            ),
        )


class QReLU(UnaryOpsBase):
    """ReLU in the integer domain (``max(q, zero_point)``), requantized if the output qparams differ."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.requantize(self.backend.relu(x, self._in_qp), self._in_qp, self._out_qp)

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall("qactivation", (inputs[0], *_qp(self._in_qp), "relu", [], *_qp(self._out_qp), self.backend.name))


class QHardtanh(UnaryOpsBase):
    """``hardtanh(x, min_val, max_val)`` (ReLU6: ``0, 6``) as a clamp of the integers to
    ``[Q(min_val), Q(max_val)]`` (exact: quantization is monotone), requantized if the output
    qparams differ."""

    def __init__(
        self,
        min_val: float,
        max_val: float,
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        if not min_val <= max_val:
            raise ValueError(f"hardtanh needs min_val <= max_val, got {min_val} > {max_val}")
        self.min_val, self.max_val = float(min_val), float(max_val)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.backend.hardtanh(x, self._in_qp, self.min_val, self.max_val)
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val:g}, max_val={self.max_val:g}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (inputs[0], *_qp(self._in_qp), "hardtanh", [self.min_val, self.max_val], *_qp(self._out_qp))
        return OpCall("qactivation", (*args, self.backend.name))


class QActivation(UnaryOpsBase):
    """A standalone element-wise activation with an INT8 kernel (hardswish, sigmoid, hardsigmoid;
    see :meth:`~gml.kernels.backend.Int8Backend.activation`)."""

    def __init__(
        self, post_op: PostOp, input_qparams: QParams, output_qparams: QParams, *, backend: BackendArg = None
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        if post_op.attr not in self.backend.activations:
            raise ValueError(f"the {self.backend.name} backend has no INT8 {post_op} kernel")
        self.post_op = post_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.activation(x, self._in_qp, self.post_op, self._out_qp)

    def extra_repr(self) -> str:
        return f"{self.post_op}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        p = self.post_op
        args = (inputs[0], *_qp(self._in_qp), p.attr, list(p.scalars), *_qp(self._out_qp))
        return OpCall("qactivation", (*args, self.backend.name))


class QMul(BinaryOpsBase):
    """``a * b`` of two uint8 tensors (broadcasting, e.g. a squeeze-excitation gate ``[N, C, 1, 1]``
    times its feature map), requantized to the output qparams."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.backend.mul(a, self._in_qp, b, self._other_qp, self._out_qp)

    def extra_repr(self) -> str:
        return f"{self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall(
            "qmul",
            (inputs[0], *_qp(self._in_qp), inputs[1], *_qp(self._other_qp), *_qp(self._out_qp), self.backend.name),
        )


class QBatchNorm2d(UnaryOpsBase):
    """``[relu](batch_norm(x))`` in inference form on uint8: a BN that no conv before it absorbed
    (pre-activation blocks: BN → ReLU → conv, as in DenseNet). Statistics are buffers."""

    def __init__(
        self,
        bn: nn.BatchNorm2d,
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        relu: bool = False,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        if bn.running_mean is None or bn.running_var is None:
            raise ValueError("batch norm without running statistics has no inference form")
        channels = bn.num_features
        weight = bn.weight.detach() if bn.weight is not None else torch.ones(channels)
        bias = bn.bias.detach() if bn.bias is not None else torch.zeros(channels)
        self.register_buffer("weight", weight.float().clone())
        self.register_buffer("bias", bias.float().clone())
        self.register_buffer("running_mean", bn.running_mean.detach().float().clone())
        self.register_buffer("running_var", bn.running_var.detach().float().clone())
        self.eps = float(bn.eps)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.batch_norm2d(
            x,
            self._in_qp,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            self._out_qp,
            self.relu,
        )

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}{', relu' if self.relu else ''}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        stats = (self.weight, self.bias, self.running_mean, self.running_var, self.eps)
        args = (inputs[0], *_qp(self._in_qp), *stats, *_qp(self._out_qp), "relu" if self.relu else "none")
        return OpCall("qbatch_norm", (*args, self.backend.name))
