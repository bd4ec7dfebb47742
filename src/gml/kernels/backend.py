"""The INT8 kernel-backend interface the GML quantized modules call.

A backend turns dense INT8 weights into whatever its kernels want (``prepack_*``) and runs the
quantized ops on **plain uint8 activation tensors** whose scale / zero point travel separately as
:class:`QParams` (the modules keep them in buffers). That is exactly what oneDNN's
``qconv2d_pointwise`` takes, and it avoids the QTensor wrapper on the hot path; a backend whose
kernels want QTensors (PyTorch's ``quantized::*``) wraps and unwraps inside its methods.

Conventions every backend keeps, so modules and the lowering pass need no backend-specific code:

* activations: ``torch.uint8``, per-tensor affine ``real = (q - zero_point) * scale``; 4-D
  activations are channels-last (NHWC in memory), which both CPU backends compute in natively;
* weights: ``torch.int8`` symmetric (zero point 0), per output channel (``weight_scale`` has one
  entry per output channel) or per tensor (one entry); bias in fp32;
* ``conv2d`` post-ops: ``"none"``, ``"relu"``, ``"add"`` and ``"add_relu"`` (the residual case:
  ``relu(conv(x) + other)``, with ``other`` a uint8 tensor of the output's shape), or an element-wise
  :class:`~gml.kernels.fp32.PostOp` (the fp32 kernels' type: oneDNN attr name + scalars, e.g.
  ``PostOp("hardtanh", (0.0, 6.0))`` for ReLU6). Which element-wise post-ops a backend fuses is in
  :attr:`Int8Backend.conv_post_ops` / :attr:`Int8Backend.linear_post_ops`. A backend that computes
  the add *into* ``other``'s memory sets :attr:`Int8Backend.conv_add_writes_other`, and the caller
  must not read ``other`` afterwards (the lowering pass checks this);
* a clamp ``hardtanh(lo, hi)`` commutes with quantization (the quantizer is monotone), so on a
  uint8 tensor it is a clamp of the integers to ``[Q(lo), Q(hi)]`` (:func:`clamp_bounds`): exact,
  no arithmetic on the values. That is how standalone ReLU6 runs, and how a backend without a clamp
  post-op fuses one after its conv.

A GPU backend would implement the same methods on device tensors; nothing above this module needs
to change.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from gml.ir.values import NO_POST_OP, ConvSpec, Int8Weight, PostOp, QParams

ConvPostOp = Literal["none", "relu", "add", "add_relu"] | PostOp
Tensor = torch.Tensor
#: the residual operand of a fused conv + add: ``(other, other_qparams)``, or ``None``
Add = tuple[torch.Tensor, QParams] | None
POST_OPS: tuple[str, ...] = ("none", "relu", "add", "add_relu")


def has_padding_only_window(size: int, kernel: int, stride: int, padding: int, dilation: int) -> bool:
    """Whether some output of a 1-D conv over ``size`` inputs reads nothing but padding: all its
    taps ``o * stride - padding + j * dilation`` fall outside ``[0, size)``."""
    out = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return any(
        all(not 0 <= o * stride - padding + j * dilation < size for j in range(kernel)) for o in range(max(out, 0))
    )


@functools.lru_cache(maxsize=1024)
def clamp_bounds(qparams: QParams, min_val: float, max_val: float) -> tuple[int, int]:
    """The integer interval ``[Q(min_val), Q(max_val)]`` of ``hardtanh(min_val, max_val)`` on uint8.

    ``Q(v) = clamp(round(v / s) + z, 0, 255)`` is monotone, so ``Q(clamp(v, lo, hi)) =
    clamp(Q(v), Q(lo), Q(hi))``: clamping the integers equals quantizing the clamped value. The
    bounds are rounded by the same quantizer as the activations (half to even)."""
    q = torch.quantize_per_tensor(
        torch.tensor([min_val, max_val]), qparams.scale, qparams.zero_point, torch.quint8
    ).int_repr()
    return int(q[0]), int(q[1])


def split_post_op(post_op: ConvPostOp) -> tuple[PostOp, bool]:
    """``(element-wise post-op, residual add?)`` of a ``conv2d`` post-op argument."""
    if isinstance(post_op, PostOp):
        return post_op, False
    if post_op not in POST_OPS:
        raise ValueError(f"unknown conv post-op {post_op!r}; known: {', '.join(POST_OPS)} or a PostOp")
    eltwise = PostOp("relu") if post_op.endswith("relu") else NO_POST_OP
    return eltwise, post_op.startswith("add")


# ---------------------------------------------------------------- bridging to QTensor kernels
def silence_quantized_tensor_warnings() -> None:
    """PyTorch warns once per process that QTensor creation is deprecated; GML uses QTensors only
    as transient wrappers inside kernels, so trigger that one warning here, silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._make_per_tensor_quantized_tensor(torch.zeros(1, dtype=torch.uint8), 1.0, 0)
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)


def as_qtensor(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """A quint8 QTensor holding ``x``'s integers (same strides; one memcpy, no arithmetic)."""
    return torch._make_per_tensor_quantized_tensor(x, qp.scale, qp.zero_point)


def eltwise_of(post_op: PostOp | bool) -> PostOp:
    """The element-wise post-op of a ``linear`` call (``True`` / ``False``: the older relu / none)."""
    if isinstance(post_op, PostOp):
        return post_op
    return PostOp("relu") if post_op else PostOp()


def fp32_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the kernels take it: detached contiguous fp32, or ``None``."""
    return None if t is None else t.detach().float().contiguous()


def as_uint8(q: torch.Tensor) -> torch.Tensor:
    """The integers of a quint8 QTensor as a uint8 tensor *sharing its memory*.

    ``q.int_repr()`` copies element by element (about 60 µs for a 64×56×56 map here); pointing a
    uint8 tensor at the same storage costs about 2 µs. The storage stays alive through the view.
    """
    return torch.empty((0,), dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.size(), q.stride())


class Int8Backend(ABC):
    """INT8 kernels over uint8 activations; one stateless instance per backend is enough.

    ``prepack_*`` return an opaque handle owned by the calling module; the module keeps the dense
    weight in its ``state_dict`` and prepacks again after loading, so handles are never saved.
    """

    name: ClassVar[str] = ""
    #: ``conv2d`` accepts the ``"add"`` / ``"add_relu"`` post-ops (one fused residual kernel).
    supports_conv_add: ClassVar[bool] = True
    #: ``conv2d(..., post_op="add*", other=t)`` overwrites ``t``.
    conv_add_writes_other: ClassVar[bool] = False
    #: ``conv2d`` is right where an output's whole window lies in the zero padding (the output is
    #: then just the bias). PyTorch's oneDNN INT8 conv returns uninitialised memory there.
    conv_handles_padding_only_windows: ClassVar[bool] = True
    #: Element-wise post-ops (:class:`PostOp` attr names) ``conv2d`` / ``linear`` fuse.
    conv_post_ops: ClassVar[frozenset[str]] = frozenset({"relu"})
    linear_post_ops: ClassVar[frozenset[str]] = frozenset({"relu"})
    #: Standalone element-wise activations :meth:`activation` computes on uint8 (besides clamps).
    activations: ClassVar[frozenset[str]] = frozenset({"relu", "hardtanh"})

    def fuses(self, op: str, post_op: PostOp) -> bool:
        """Whether ``op`` (``"conv2d"`` or ``"linear"``) has a kernel with ``post_op`` fused."""
        if post_op == NO_POST_OP:
            return True
        return post_op.attr in (self.conv_post_ops if op == "conv2d" else self.linear_post_ops)

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this PyTorch build has the backend's kernels."""

    # ------------------------------------------------------------------ weights
    @abstractmethod
    def prepack_conv(
        self, w: Int8Weight, spec: ConvSpec, input_qparams: QParams, input_shape: Sequence[int] | None = None
    ) -> Any:
        """Pack an int8 ``[O, I/groups, kH, kW]`` weight for :meth:`conv2d` (``[O, I/groups, kD, kH, kW]``
        for :meth:`conv3d`, where :attr:`has_conv3d`); ``input_shape`` lets the kernel pick a layout."""

    @abstractmethod
    def prepack_linear(self, w: Int8Weight, input_qparams: QParams, input_shape: Sequence[int] | None = None) -> Any:
        """Pack an int8 ``[O, I]`` weight."""

    # ------------------------------------------------------------------ compute
    def conv2d(
        self,
        x: torch.Tensor,
        x_qparams: QParams,
        packed: Any,
        out_qparams: QParams | None,
        post_op: ConvPostOp = "none",
        other: torch.Tensor | None = None,
        other_qparams: QParams | None = None,
    ) -> torch.Tensor:
        """``post_op(conv(x) [+ other])`` requantized to ``out_qparams`` (``None``: fp32 output,
        element-wise post-ops only): the post-op argument checked here, the kernel :meth:`_conv2d`."""
        eltwise, add = split_post_op(post_op)
        if not add:
            return self._conv2d(x, x_qparams, packed, out_qparams, eltwise, None)
        if not self.supports_conv_add:
            raise NotImplementedError(f"the {self.name} backend has no conv kernel with an add post-op")
        if other is None or other_qparams is None or out_qparams is None:
            raise ValueError(f"post-op {post_op!r} needs `other`, `other_qparams` and a uint8 output")
        return self._conv2d(x, x_qparams, packed, out_qparams, eltwise, (other, other_qparams))

    @abstractmethod
    def _conv2d(
        self, x: Tensor, x_qparams: QParams, packed: Any, out_qparams: QParams | None, eltwise: PostOp, add: Add
    ) -> Tensor:
        """:meth:`conv2d` with its post-op split: ``eltwise`` and, for the residual forms,
        ``add = (other, other_qparams)`` (``out_qparams`` then is not ``None``)."""

    #: :meth:`conv3d` exists (video models' ``Conv3d``).
    has_conv3d: ClassVar[bool] = False

    def conv3d(self, x: torch.Tensor, x_qparams: QParams, packed: Any, out_qparams: QParams | None) -> torch.Tensor:
        """``conv3d(x)`` requantized to ``out_qparams`` (``None``: fp32), no post-op."""
        raise NotImplementedError(f"the {self.name} backend has no INT8 conv3d")

    def linear(
        self,
        x: torch.Tensor,
        x_qparams: QParams,
        packed: Any,
        out_qparams: QParams | None,
        post_op: PostOp | bool = False,
    ) -> torch.Tensor:
        """``post_op(x @ W.T + b)`` over the last dimension (``out_qparams=None``: fp32 output);
        ``True`` / ``False`` mean relu / none. The kernel: :meth:`_linear`."""
        return self._linear(x, x_qparams, packed, out_qparams, eltwise_of(post_op))

    @abstractmethod
    def _linear(
        self, x: Tensor, x_qparams: QParams, packed: Any, out_qparams: QParams | None, eltwise: PostOp
    ) -> Tensor:
        """:meth:`linear` with its post-op as a :class:`PostOp`."""

    # ---------------------------- the other INT8 ops: one implementation both CPU backends share,
    # on PyTorch's ``quantized::*`` CPU kernels (a backend with its own kernels overrides them)
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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # Backends are stateless: every instance of a class is interchangeable (and cheap to copy).
    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the class on unpickling/deepcopy: op handles inside are not picklable.
        return (type(self), ())
