"""Default implementations of the INT8 ops both CPU backends share, on PyTorch's quantized kernels.

:class:`~gml.kernels.backend.Int8Backend` is the interface; :class:`QuantizedCPUBackend` implements
its non-weighted ops (add, mul, pools, batch norm, cat, activations, (re)quantize) once, over
PyTorch's ``quantized::*`` CPU kernels, and the oneDNN and FBGEMM backends inherit them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gml.ir.values import PostOp, QParams
from gml.kernels.backend import Int8Backend, as_qtensor, as_uint8, clamp_bounds


class QuantizedCPUBackend(Int8Backend):
    """The shared ops; subclasses add the weighted kernels (prepack / conv / linear)."""

    def add(
        self,
        a: torch.Tensor,
        a_qparams: QParams,
        b: torch.Tensor,
        b_qparams: QParams,
        out_qparams: QParams,
        relu: bool = False,
    ) -> torch.Tensor:
        """Elementwise ``[relu](a + b)`` of two same-shape tensors (``quantized::add[_relu]``)."""
        op = torch.ops.quantized.add_relu if relu else torch.ops.quantized.add
        out = op(as_qtensor(a, a_qparams), as_qtensor(b, b_qparams), out_qparams.scale, out_qparams.zero_point)
        return as_uint8(out)

    def max_pool2d(
        self,
        x: torch.Tensor,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        dilation: tuple[int, int],
        ceil_mode: bool,
    ) -> torch.Tensor:
        """Max pooling; the output keeps the input's qparams (max commutes with the affine map).
        ``quantized::max_pool2d`` takes plain uint8, channels-last in and out."""
        return torch.ops.quantized.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)

    def adaptive_avg_pool3d(
        self, x: torch.Tensor, x_qparams: QParams, output_size: tuple[int, int, int], out_qparams: QParams
    ) -> torch.Tensor:
        """:meth:`adaptive_avg_pool2d` over ``[N, C, D, H, W]``: the integers averaged in fp32 and
        rounded once onto the output grid (exact up to that one rounding)."""
        y = torch.nn.functional.adaptive_avg_pool3d(x.float(), output_size)
        return self.quantize(y.sub_(x_qparams.zero_point).mul_(x_qparams.scale), out_qparams)

    def max_pool3d(
        self,
        x: torch.Tensor,
        kernel_size: tuple[int, int, int],
        stride: tuple[int, int, int],
        padding: tuple[int, int, int],
        dilation: tuple[int, int, int],
        ceil_mode: bool,
    ) -> torch.Tensor:
        """:meth:`max_pool2d` over ``[N, C, D, H, W]`` (PyTorch's quantized max_pool3d; the maximum
        of the integers does not depend on the qparams, so any will do for the wrapper)."""
        q = as_qtensor(x, QParams(1.0, 0))
        return as_uint8(torch.nn.functional.max_pool3d(q, kernel_size, stride, padding, dilation, ceil_mode))

    def adaptive_avg_pool2d(
        self, x: torch.Tensor, x_qparams: QParams, output_size: tuple[int, int], out_qparams: QParams
    ) -> torch.Tensor:
        """Adaptive average pooling, requantized to ``out_qparams``."""
        # PyTorch's quantized kernel averages on the input's own grid. It mixes up the layout of a
        # channels-last 1x1 map it has to spread over a larger output ([a, 0, 0, a] for [a, a, a, a]),
        # so a 1x1 input takes the fp32 route below, which is exact there (the mean of one value).
        if x_qparams.close_to(out_qparams) and x.shape[-2] * x.shape[-1] > 1:
            return as_uint8(torch.nn.functional.adaptive_avg_pool2d(as_qtensor(x, x_qparams), output_size))
        # Otherwise average the integers in fp32 and round once onto the output grid (rounding the
        # mean to the input grid first would lose the finer output resolution).
        y = torch.nn.functional.adaptive_avg_pool2d(x.float(), output_size)
        return self.quantize(y.sub_(x_qparams.zero_point).mul_(x_qparams.scale), out_qparams)

    def avg_pool2d(
        self,
        x: torch.Tensor,
        x_qparams: QParams,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
        out_qparams: QParams,
    ) -> torch.Tensor:
        """Average pooling. An average lies within its inputs' range, so the output normally keeps
        the input's qparams and PyTorch's quantized kernel averages the integers (padding counts as
        real 0, the zero point); other output qparams go through fp32 and round once."""
        args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        # a channels-last 1x1 map is laid out like a contiguous one and the quantized kernel mixes
        # the two up (as in adaptive_avg_pool2d above; fuzz seed 424242): it takes the fp32 route
        if x_qparams.close_to(out_qparams) and x.shape[-2] * x.shape[-1] > 1:
            return as_uint8(torch.nn.functional.avg_pool2d(as_qtensor(x, x_qparams), *args))
        return self.quantize(torch.nn.functional.avg_pool2d(self.dequantize(x, x_qparams), *args), out_qparams)

    def batch_norm2d(
        self,
        x: torch.Tensor,
        x_qparams: QParams,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        var: torch.Tensor,
        eps: float,
        out_qparams: QParams,
        relu: bool = False,
    ) -> torch.Tensor:
        """Inference batch norm (a per-channel affine map) with an optional fused ReLU, on PyTorch's
        ``quantized::batch_norm2d[_relu]``: what is left of a BN no conv before it could absorb."""
        op = torch.ops.quantized.batch_norm2d_relu if relu else torch.ops.quantized.batch_norm2d
        q = as_qtensor(x, x_qparams)
        return as_uint8(op(q, weight, bias, mean, var, eps, out_qparams.scale, out_qparams.zero_point))

    def cat(
        self, xs: Sequence[torch.Tensor], qparams: Sequence[QParams], dim: int, out_qparams: QParams
    ) -> torch.Tensor:
        """Concatenate, requantizing each input to ``out_qparams``."""
        if all(qp.close_to(out_qparams) for qp in qparams):
            return torch.cat(list(xs), dim)  # same qparams: concatenating the integers is exact
        qs = [as_qtensor(x, qp) for x, qp in zip(xs, qparams)]
        return as_uint8(torch.ops.quantized.cat(qs, dim, out_qparams.scale, out_qparams.zero_point))

    # -------------------------------------------- ops with one obvious implementation
    def relu(self, x: torch.Tensor, x_qparams: QParams) -> torch.Tensor:
        """ReLU in the integer domain: real 0 is the zero point, so ``max(q, zp)``."""
        return torch.clamp_min(x, x_qparams.zero_point)

    def hardtanh(self, x: torch.Tensor, x_qparams: QParams, min_val: float, max_val: float) -> torch.Tensor:
        """``hardtanh`` (ReLU6 = ``hardtanh(0, 6)``) as a clamp of the integers, same qparams."""
        lo, hi = clamp_bounds(x_qparams, min_val, max_val)
        return torch.clamp(x, lo, hi)

    def activation(self, x: torch.Tensor, x_qparams: QParams, post_op: PostOp, out_qparams: QParams) -> torch.Tensor:
        """A standalone element-wise activation (one of :attr:`activations`) on uint8.

        Clamps (relu, hardtanh) work on the integers; the others go through PyTorch's quantized
        CPU kernels (``quantized::hardswish``; ``sigmoid`` / ``hardsigmoid`` on a QTensor, which
        write fixed qparams 1/256, 0 that are then requantized if ``out_qparams`` differ).
        """
        if post_op.attr not in self.activations:
            raise NotImplementedError(f"the {self.name} backend has no INT8 {post_op} kernel")
        if post_op.attr == "relu":
            y = self.relu(x, x_qparams)
        elif post_op.attr == "hardtanh":
            y = self.hardtanh(x, x_qparams, *post_op.scalars)
        else:
            q = as_qtensor(x, x_qparams)
            if post_op.attr == "hardswish":
                return as_uint8(torch.ops.quantized.hardswish(q, out_qparams.scale, out_qparams.zero_point))
            fn = torch.sigmoid if post_op.attr == "sigmoid" else torch.nn.functional.hardsigmoid
            r = fn(q)
            return self.requantize(as_uint8(r), QParams(r.q_scale(), r.q_zero_point()), out_qparams)
        return self.requantize(y, x_qparams, out_qparams)

    def mul(
        self, a: torch.Tensor, a_qparams: QParams, b: torch.Tensor, b_qparams: QParams, out_qparams: QParams
    ) -> torch.Tensor:
        """Elementwise ``a * b`` with broadcasting (PyTorch's ``quantized::mul``)."""
        out = torch.ops.quantized.mul(
            as_qtensor(a, a_qparams), as_qtensor(b, b_qparams), out_qparams.scale, out_qparams.zero_point
        )
        return as_uint8(out)

    def quantize(self, x: torch.Tensor, qparams: QParams) -> torch.Tensor:
        """fp32 → uint8 (round half to even, saturating), channels-last for 4-D inputs."""
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return as_uint8(torch.quantize_per_tensor(x, qparams.scale, qparams.zero_point, torch.quint8))

    def dequantize(self, x: torch.Tensor, qparams: QParams) -> torch.Tensor:
        """uint8 → fp32: ``(q - zero_point) * scale``."""
        return torch._make_per_tensor_quantized_tensor(x, qparams.scale, qparams.zero_point).dequantize()

    def requantize(self, x: torch.Tensor, x_qparams: QParams, out_qparams: QParams) -> torch.Tensor:
        """Change a uint8 tensor's qparams (identity if they are equal)."""
        if x_qparams.close_to(out_qparams):
            return x
        return self.quantize(self.dequantize(x, x_qparams), out_qparams)
