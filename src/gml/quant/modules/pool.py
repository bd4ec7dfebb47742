"""Pooling and reduction plan values: max / average / adaptive average pools, mean, flatten.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gml.ir.values import QParams
from gml.quant.modules.base import (
    BackendArg,
    OpCall,
    UnaryOpsBase,
    _qp,
)


class QMaxPool2d(UnaryOpsBase):
    """Max pooling on uint8 (max commutes with the affine map, so no arithmetic on qparams)."""

    def __init__(
        self,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        dilation: tuple[int, int],
        ceil_mode: bool,
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.ceil_mode = ceil_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.backend.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        return f"k={self.kernel_size}, stride={self.stride}, pad={self.padding}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        geo = [list(self.kernel_size), list(self.stride), list(self.padding), list(self.dilation)]
        args = (inputs[0], *_qp(self._in_qp), *geo, bool(self.ceil_mode), self.backend.name)
        return OpCall("qmax_pool", args, requantize=(self._in_qp, self._out_qp))


class QMaxPool3d(QMaxPool2d):
    """:class:`QMaxPool2d` over ``[N, C, D, H, W]`` (video models); 3-entry geometry."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.backend.max_pool3d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return self.backend.requantize(y, self._in_qp, self._out_qp)


class QAvgPool2d(UnaryOpsBase):
    """Average pooling on uint8 (normally on the input's own grid, see ``Int8Backend.avg_pool2d``)."""

    def __init__(
        self,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.ceil_mode, self.count_include_pad, self.divisor_override = ceil_mode, count_include_pad, divisor_override

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.avg_pool2d(
            x,
            self._in_qp,
            self.kernel_size,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override,
            self._out_qp,
        )

    def extra_repr(self) -> str:
        return f"k={self.kernel_size}, stride={self.stride}, pad={self.padding}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        geo = [list(self.kernel_size), list(self.stride), list(self.padding)]
        flags = (bool(self.ceil_mode), bool(self.count_include_pad), self.divisor_override)
        args = (inputs[0], *_qp(self._in_qp), *geo, *flags, *_qp(self._out_qp), self.backend.name)
        return OpCall("qavg_pool2d", args)


class QAdaptiveAvgPool2d(UnaryOpsBase):
    """Adaptive average pooling on uint8, requantized to the output qparams."""

    def __init__(
        self,
        output_size: tuple[int, int],
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.output_size = output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.adaptive_avg_pool2d(x, self._in_qp, self.output_size, self._out_qp)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (inputs[0], *_qp(self._in_qp), list(self.output_size), *_qp(self._out_qp), self.backend.name)
        return OpCall("qadaptive_avg_pool", args)


class QAdaptiveAvgPool3d(QAdaptiveAvgPool2d):
    """:class:`QAdaptiveAvgPool2d` over ``[N, C, D, H, W]`` (the head of the video ResNets)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.adaptive_avg_pool3d(x, self._in_qp, self.output_size, self._out_qp)


class QMean(UnaryOpsBase):
    """``x.mean(dims, keepdim)`` on uint8, requantized to the output qparams.

    The spatial mean of a 4-D map (dims 2 and 3, the global pooling of ShuffleNet-style heads)
    runs as a global average pool; other dims average the integers (exact in fp32 for any size
    that fits a model) and round once onto the output grid."""

    def __init__(
        self,
        dims: Sequence[int],
        keepdim: bool,
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.dims = tuple(int(d) for d in dims)
        self.keepdim = keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and sorted(d % 4 for d in self.dims) == [2, 3]:
            y = self.backend.adaptive_avg_pool2d(x, self._in_qp, (1, 1), self._out_qp)
            return y if self.keepdim else y.flatten(2).squeeze(2)
        qp = self._in_qp
        y = x.float().mean(self.dims, self.keepdim).sub_(qp.zero_point).mul_(qp.scale)
        return self.backend.quantize(y, self._out_qp)

    def extra_repr(self) -> str:
        return f"dim={self.dims}, keepdim={self.keepdim}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (inputs[0], *_qp(self._in_qp), list(self.dims), bool(self.keepdim), *_qp(self._out_qp))
        return OpCall("qmean", (*args, self.backend.name))


class QFlatten(UnaryOpsBase):
    """``torch.flatten`` of the integers (a view when the layout allows)."""

    is_view = True

    def __init__(
        self,
        start_dim: int,
        end_dim: int,
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.flatten(x, self.start_dim, self.end_dim)
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall(torch.flatten, (inputs[0], self.start_dim, self.end_dim), requantize=(self._in_qp, self._out_qp))
