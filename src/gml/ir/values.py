"""Value types of the lowered graph: quantization parameters, convolution geometry, post-ops.

These are plain frozen values (hashable, comparable, printable). The op schemas in
:mod:`gml.ir.library` spell each of them out as scalar op arguments (``x_scale: float``,
``stride: int[]``, ``post_op: str`` + ``post_op_scalars: float[]``), so a graph carries no objects
of these types; passes and executors use them to read and write those arguments in one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: oneDNN attr names of the element-wise post-ops (aten/src/ATen/native/mkldnn/Utils.cpp,
#: ``fusion_unary_attr_map``); ``"none"`` is no post-op.
UNARY_ATTRS = ("relu", "sigmoid", "tanh", "swish", "hardswish", "hardsigmoid", "leaky_relu", "hardtanh", "gelu")
#: the post-ops that take no scalars, as ATen functions (:meth:`PostOp.apply`)
_NO_SCALARS = {
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "swish": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
}

#: a graph input's (placeholder's) meta key: the ``forward`` parameter it stands for — fx renames an
#: input traced as a constant (``bias`` -> ``bias_1``); set by gml.capture, read by the executors
#: that take inputs by name (gml.inference.inputs_by_name)
INPUT_NAME = "gml_input_name"


@dataclass(frozen=True)
class QParams:
    """Per-tensor affine quantization parameters of a uint8 activation: ``real = (q - zp) * scale``."""

    scale: float
    zero_point: int

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be positive, got {self.scale}")
        if not 0 <= self.zero_point <= 255:
            raise ValueError(f"uint8 zero point must be in [0, 255], got {self.zero_point}")

    def close_to(self, other: QParams, rtol: float = 1e-6) -> bool:
        """Same values (not the same object): what lets two quantized tensors share a kernel."""
        return self.zero_point == other.zero_point and abs(self.scale - other.scale) <= rtol * other.scale


@dataclass(frozen=True)
class ChannelQParams:
    """Per-channel (or per-tensor when one entry) symmetric int8 *weight* quantization parameters:
    ``real[c] = q[c] * scale[c]`` along ``axis`` (always the output-channel axis 0 in GML)."""

    scale: tuple[float, ...]
    axis: int = 0

    @classmethod
    def of(cls, scale: torch.Tensor | Sequence[float], axis: int = 0) -> ChannelQParams:
        values = scale.detach().flatten().tolist() if isinstance(scale, torch.Tensor) else list(scale)
        return cls(tuple(float(s) for s in values), axis)

    def tensor(self) -> torch.Tensor:
        """The scales as the op argument wants them: a contiguous 1-D float32 tensor."""
        return torch.tensor(self.scale, dtype=torch.float32)


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """A weighted op's dense weight as the IR passes it (the ``weight, weight_scale, bias`` arguments of
    ``gml.qconv`` / ``gml.qlinear``): symmetric int8 ``weight`` (output channels first, zero point 0),
    ``scale`` per output channel or one per tensor, fp32 ``bias`` or ``None``."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class ConvSpec:
    """Static geometry of an N-d convolution: one entry per spatial dimension (1, 2 or 3)."""

    stride: tuple[int, ...] = (1, 1)
    padding: tuple[int, ...] = (0, 0)
    dilation: tuple[int, ...] = (1, 1)
    groups: int = 1

    def __post_init__(self) -> None:
        if not len(self.stride) == len(self.padding) == len(self.dilation):
            raise ValueError(f"stride/padding/dilation of different ranks: {self}")
        # checked here, before any kernel sees it: a stride of 0 divides by zero in oneDNN's
        # prepack (SIGFPE; a crafted saved model, issue #24)
        if not (
            all(isinstance(s, int) and s >= 1 for s in self.stride)
            and all(isinstance(d, int) and d >= 1 for d in self.dilation)
            and all(isinstance(p, int) and p >= 0 for p in self.padding)
            and isinstance(self.groups, int)
            and self.groups >= 1
        ):
            raise ValueError(
                f"invalid convolution geometry {self}: stride, dilation and groups must be integers >= 1, "
                "padding integers >= 0"
            )

    @property
    def ndim(self) -> int:
        return len(self.stride)

    def as_args(self) -> tuple[list[int], list[int], list[int], int]:
        """``(stride, padding, dilation, groups)`` as the op schemas take them."""
        return list(self.stride), list(self.padding), list(self.dilation), int(self.groups)


@dataclass(frozen=True)
class PostOp:
    """A fused element-wise epilogue: oneDNN ``attr`` name, its scalars and algorithm."""

    attr: str = "none"
    scalars: tuple[float, ...] = ()
    algorithm: str = ""

    def __post_init__(self) -> None:
        if self.attr != "none" and self.attr not in UNARY_ATTRS:
            raise ValueError(f"unknown oneDNN post-op {self.attr!r}; known: {', '.join(UNARY_ATTRS)}")

    @property
    def op_scalars(self) -> list[float | None]:
        # ``[None]`` rather than ``[]``: torch.export cannot serialize an empty Scalar?[] list.
        return list(self.scalars) if self.scalars else [None]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The same math with ATen ops (fallback path and test reference)."""
        F = torch.nn.functional
        a = self.attr
        if a == "none":
            return x
        if a in _NO_SCALARS:
            return _NO_SCALARS[a](x)
        if a == "leaky_relu":
            return F.leaky_relu(x, self.scalars[0])
        if a == "hardtanh":
            return F.hardtanh(x, self.scalars[0], self.scalars[1])
        return F.gelu(x, approximate=self.algorithm or "none")

    def __str__(self) -> str:
        if self.attr == "hardtanh":
            return f"hardtanh({self.scalars[0]:g}, {self.scalars[1]:g})"
        if self.attr == "leaky_relu":
            return f"leaky_relu({self.scalars[0]:g})"
        if self.attr == "gelu":
            return f"gelu({self.algorithm})" if self.algorithm == "tanh" else "gelu"
        return self.attr


NO_POST_OP = PostOp()


@dataclass(frozen=True)
class TensorQParams:
    """The parameters any quantize op carries, resolved to tensors: per-tensor (``axis`` None) or
    per-channel, any 8-bit dtype. (:class:`QParams` is the uint8 per-tensor activation form the
    kernels take; this is the general form passes compare quantize ops by.)"""

    scale: torch.Tensor  # float64, 1-D
    zero_point: torch.Tensor  # int64, 1-D
    dtype: torch.dtype
    axis: int | None = None

    def equals(self, other: TensorQParams) -> bool:
        return (
            self.dtype == other.dtype
            and self.axis == other.axis
            and torch.equal(self.scale, other.scale)
            and torch.equal(self.zero_point, other.zero_point)
        )

    def difference(self, other: TensorQParams) -> str:
        """Human reason why two parameter sets differ, e.g. ``scale 0.02 vs 0.03``."""
        if self.dtype != other.dtype:
            return f"dtype {str(self.dtype).removeprefix('torch.')} vs {str(other.dtype).removeprefix('torch.')}"
        if self.axis != other.axis:
            return f"axis {self.axis} vs {other.axis}"
        if self.scale.shape != other.scale.shape:
            return f"{self.scale.numel()} vs {other.scale.numel()} scales"
        parts = []
        if not torch.equal(self.scale, other.scale):
            a, b = _fmt(self.scale), _fmt(other.scale)
            if a == b:  # differ only beyond 6 digits (e.g. a float32 vs a float64 scale)
                a, b = _fmt(self.scale, 17), _fmt(other.scale, 17)
            parts.append(f"scale {a} vs {b}")
        if not torch.equal(self.zero_point, other.zero_point):
            parts.append(f"zero_point {_fmt(self.zero_point)} vs {_fmt(other.zero_point)}")
        return ", ".join(parts)


def _fmt(t: torch.Tensor, digits: int = 6) -> str:
    if t.numel() == 1:
        v = t.item()
        return f"{v:.{digits}g}" if isinstance(v, float) else str(v)
    return f"[{t.numel()} values]"


def cloned(values: Sequence[object]) -> list[object]:
    """``values`` with every tensor cloned (a run that may write its inputs in place gets copies)."""
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in values]
