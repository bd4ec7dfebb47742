"""GML INT8 modules: the lowering rules' plan values for ``DQ → op → Q`` patterns.

Since ADR 005 a lowered graph holds no modules: a rule of :mod:`gml.quant.lower` builds one of
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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from gml.ir.qdq import DECOMPOSED_DQ, is_dequantize, is_quantize, quantize_args
from gml.ir.values import NO_POST_OP, ConvSpec, PostOp, QParams
from gml.kernels.backend import Int8Backend
from gml.kernels.registry import get_backend

BackendArg = str | Int8Backend | None


@dataclass(frozen=True)
class OpCall:
    """What the lowering emits for a module: a call of ``target`` (a ``torch.ops.gml`` op name, a
    torch function, or ``".method"``) on ``args`` (tensors among them become graph constants),
    then ``[item]`` and a ``gml.requantize`` when ``requantize=(in, out)`` qparams differ."""

    target: Any
    args: tuple[Any, ...]
    item: int | None = None
    requantize: tuple[QParams, QParams] | None = None


def _qp(qp: QParams) -> tuple[float, int]:
    return float(qp.scale), int(qp.zero_point)


def _out(qp: QParams | None) -> tuple[float, int, torch.dtype]:
    """``(out_scale, out_zero_point, out_dtype)``: an fp32 output is requested as (1.0, 0, float32)."""
    return (1.0, 0, torch.float32) if qp is None else (float(qp.scale), int(qp.zero_point), torch.uint8)


def _scalar_buffer(value: float | int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _register_qparams(module: nn.Module, prefix: str, qp: QParams) -> None:
    """``<prefix>_scale`` (float64) and ``<prefix>_zp`` (int64) buffers: the state_dict form of qparams."""
    module.register_buffer(f"{prefix}_scale", _scalar_buffer(qp.scale, torch.float64))
    module.register_buffer(f"{prefix}_zp", _scalar_buffer(qp.zero_point, torch.int64))


def _buffered_qparams(module: nn.Module, prefix: str) -> QParams:
    """The qparams the ``<prefix>_scale`` / ``<prefix>_zp`` buffers hold now."""
    return QParams(float(getattr(module, f"{prefix}_scale")), int(getattr(module, f"{prefix}_zp")))


def _refresh_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    # A named function, not a lambda: hooks are pickled with the module by torch.save.
    module.refresh()  # type: ignore[operator]


class GMLQuantModuleBase(nn.Module, ABC):
    """An INT8 op whose output is a uint8 tensor with the qparams in ``output_scale``/``output_zp``.

    Subclasses call ``super().__init__(output_qparams, backend)`` first, register their own
    buffers, and implement :meth:`forward`. Python-float copies of the buffers are cached for the hot
    path and refreshed by :meth:`refresh` (called after ``load_state_dict``); a subclass that derives
    state from buffers (a prepacked weight) extends :meth:`refresh`.

    ``output_qparams=None`` is allowed for the weighted ops only (:class:`QConv2d`,
    :class:`QLinear`): their kernels can write fp32 directly, which is how a model's last layer
    avoids rounding its logits. Such a module has ``output_dtype == torch.float32``, buffers
    (1.0, 0), and :attr:`output_qparams` is ``None``.
    """

    #: The output shares memory with the first input (a view): the lowering must not let a kernel
    #: write into it while the input is still read.
    is_view: bool = False

    def __init__(self, output_qparams: QParams | None, backend: BackendArg = None) -> None:
        super().__init__()
        self.backend = get_backend(backend)
        self.output_dtype = torch.uint8 if output_qparams is not None else torch.float32
        _register_qparams(self, "output", output_qparams or QParams(1.0, 0))
        self._out_qp = output_qparams
        self.register_load_state_dict_post_hook(_refresh_after_load)

    @property
    def output_qparams(self) -> QParams | None:
        """qparams of the uint8 output; ``None`` when the module writes fp32."""
        return self._out_qp

    def refresh(self) -> None:
        """Re-read cached values from the buffers (after they were loaded or edited)."""
        if self.output_dtype == torch.uint8:
            self._out_qp = _buffered_qparams(self, "output")

    @abstractmethod
    def forward(self, *args: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        """The ``torch.ops.gml`` call computing this module on ``inputs`` (what the lowering emits)."""

    def _qp_repr(self) -> str:
        qp = self._out_qp
        return "out=fp32" if qp is None else f"out=({qp.scale:.4g}, {qp.zero_point})"


class UnaryOpsBase(GMLQuantModuleBase):
    """One uint8 input with qparams ``input_scale``/``input_zp``."""

    def __init__(self, input_qparams: QParams, output_qparams: QParams, backend: BackendArg = None) -> None:
        super().__init__(output_qparams, backend)
        _register_qparams(self, "input", input_qparams)
        self._in_qp = input_qparams

    @property
    def input_qparams(self) -> QParams:
        return self._in_qp

    def refresh(self) -> None:
        super().refresh()
        self._in_qp = _buffered_qparams(self, "input")

    def _qp_repr(self) -> str:
        return f"in=({self._in_qp.scale:.4g}, {self._in_qp.zero_point}), " + super()._qp_repr()


class BinaryOpsBase(UnaryOpsBase):
    """Two uint8 inputs: ``input_*`` for the first, ``other_*`` for the second."""

    def __init__(
        self,
        input_qparams: QParams,
        other_qparams: QParams,
        output_qparams: QParams,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        _register_qparams(self, "other", other_qparams)
        self._other_qp = other_qparams

    @property
    def other_qparams(self) -> QParams:
        return self._other_qp

    def refresh(self) -> None:
        super().refresh()
        self._other_qp = _buffered_qparams(self, "other")

    def _qp_repr(self) -> str:
        other = f"other=({self._other_qp.scale:.4g}, {self._other_qp.zero_point}), "
        return other + super()._qp_repr()


# ---------------------------------------------------------------- weights
def quantize_weight(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of an fp32 weight (dim 0 = output channels): ``(int8, scales)``.

    Uses [-127, 127] so that the VNNI u8×s8 dot product cannot saturate its 16-bit pairs.
    """
    w = weight.detach().float()
    amax = w.abs().flatten(1).amax(1) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / 127.0).clamp_min(1e-12)
    shape = (-1,) + (1,) * (w.dim() - 1)
    q = torch.round(w / scale.reshape(shape if per_channel else ())).clamp(-127, 127).to(torch.int8)
    return q, scale


def reference_weight(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight and its scales from a torch.ao reference module (the weight observer's choice),
    or from a float module by symmetric per-channel quantization."""
    get_q = getattr(mod, "get_quantized_weight", None)
    if get_q is None:
        return quantize_weight(mod.weight)
    qw = get_q()
    if qw.dtype != torch.qint8:
        raise ValueError(f"weight dtype {qw.dtype} (the INT8 kernels take qint8 weights)")
    if qw.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        if qw.q_per_channel_axis() != 0:
            raise ValueError("per-channel weight quantized along a non-output axis")
        scale, zp = qw.q_per_channel_scales(), qw.q_per_channel_zero_points()
    else:
        scale, zp = torch.tensor([qw.q_scale()]), torch.tensor([qw.q_zero_point()])
    if bool((zp != 0).any()):
        raise ValueError("asymmetric weight (non-zero weight zero point)")
    return qw.int_repr(), scale.float()


def _resolve_post_op(relu: bool, post_op: PostOp | None) -> PostOp:
    """``relu=True`` is shorthand for ``post_op=PostOp("relu")``; giving both is ambiguous."""
    if relu and post_op is not None and post_op != PostOp("relu"):
        raise ValueError(f"relu=True and post_op={post_op} disagree")
    if post_op is not None:
        return post_op
    return PostOp("relu") if relu else NO_POST_OP


class _Weighted(nn.Module):
    """Dense int8 ``weight`` + ``weight_scale`` + fp32 ``bias`` buffers, prepacked into ``_packed``."""

    _packed: Any

    def _register_weight(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype != torch.int8:
            raise ValueError(f"weight must be int8, got {weight.dtype}")
        scale = weight_scale.detach().float().flatten().contiguous()
        if scale.numel() not in (1, weight.shape[0]):
            raise ValueError(f"{scale.numel()} weight scales for {weight.shape[0]} output channels")
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_packed"] = None  # backend handles are not picklable; rebuilt in __setstate__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._prepack()

    def _prepack(self) -> None:
        raise NotImplementedError


class QConv2d(UnaryOpsBase, _Weighted):
    """``post_op(conv2d(x))`` on uint8 → uint8, or → fp32 when ``output_qparams`` is None (oneDNN
    ``qconv2d_pointwise`` with an eltwise post-op: relu, hardtanh (ReLU6), hardswish, swish)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        spec: ConvSpec,
        input_qparams: QParams,
        output_qparams: QParams | None,
        *,
        relu: bool = False,
        post_op: PostOp | None = None,
        input_shape: Sequence[int] | None = None,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.post_op = _resolve_post_op(relu, post_op)
        if not self.backend.fuses("conv2d", self.post_op):
            raise ValueError(f"the {self.backend.name} backend has no conv kernel with a {self.post_op} post-op")
        self._register_weight(weight, weight_scale, bias)
        self.spec = spec
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self._prepack()

    @property
    def relu(self) -> bool:
        return self.post_op == PostOp("relu")

    def _prepack(self) -> None:
        self._packed = self.backend.prepack_conv2d(
            self.weight, self.weight_scale, self.bias, self.spec, self._in_qp, self.input_shape
        )

    def refresh(self) -> None:
        super().refresh()
        self._prepack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.conv2d(x, self._in_qp, self._packed, self._out_qp, self.post_op)

    def extra_repr(self) -> str:
        geo = _conv_geometry(self.weight, self.spec)
        return f"{geo}{_post_op_repr(self.post_op)}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        stride, padding, dilation, groups = self.spec.as_args()
        p = self.post_op
        return OpCall(
            "qconv",
            (
                inputs[0],
                *_qp(self._in_qp),
                self.weight,
                self.weight_scale,
                self.bias,
                stride,
                padding,
                dilation,
                groups,
                *_out(self._out_qp),
                p.attr,
                list(p.scalars),
                p.algorithm,
                self.backend.name,
            ),
        )


def _conv_geometry(weight: torch.Tensor, spec: ConvSpec) -> str:
    """``"64→128, k=3x3, stride=(2, 2), pad=(1, 1)"`` for a conv weight of any dimension."""
    o, i, *k = weight.shape
    geo = f"{i * spec.groups}→{o}, k={'x'.join(str(d) for d in k)}, stride={spec.stride}, pad={spec.padding}"
    return geo + (f", groups={spec.groups}" if spec.groups != 1 else "")


def _post_op_repr(post_op: PostOp) -> str:
    return "" if post_op == NO_POST_OP else f", {post_op}"


class QConv1d(QConv2d):
    """``post_op(conv1d(x))`` on uint8 ``[N, C, L]``: the 2-D kernel on ``[N, C, 1, L]`` with an
    ``[O, I, 1, k]`` weight (a conv of height 1 is a 1-D conv), so every conv2d post-op fuses.

    Arguments as :class:`QConv2d`'s; the weight may be 1-D (``[O, I, k]``) and ``input_shape``
    ``[N, C, L]``; ``spec`` entries are ``(1, s)``, ``(0, p)``, ``(1, d)``.
    """

    def __init__(self, weight: torch.Tensor, *args: Any, input_shape: Sequence[int] | None = None, **kwargs: Any):
        if input_shape is not None and len(input_shape) == 3:
            input_shape = (input_shape[0], input_shape[1], 1, input_shape[2])
        super().__init__(weight.unsqueeze(2) if weight.dim() == 3 else weight, *args, input_shape=input_shape, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.unsqueeze(2)).squeeze(2)

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        # the op is N-d: a 1-D conv is called with its 3-D weight and 1-entry geometry
        call = super().op_call(inputs)
        args = list(call.args)
        args[3] = self.weight.squeeze(2)
        args[6], args[7], args[8] = args[6][1:], args[7][1:], args[8][1:]
        return OpCall(call.target, tuple(args))


class QConv3d(UnaryOpsBase, _Weighted):
    """``[relu](conv3d(x))`` on uint8 → uint8 (or → fp32 when ``output_qparams`` is None), for video
    models (``onednn::qconv_pointwise`` on 5-D, channels-last-3d).

    The 5-D kernel takes no eltwise post-op, so ``relu=True`` needs an output zero point of 0: the
    requantization then saturates every negative value at the integer 0, which *is* ``relu``
    (torch.ao's fused ``ConvReLU3d`` observer sees only values >= 0, so its zero point is 0).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        spec: ConvSpec,
        input_qparams: QParams,
        output_qparams: QParams | None,
        *,
        relu: bool = False,
        input_shape: Sequence[int] | None = None,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        if not self.backend.has_conv3d:
            raise ValueError(f"the {self.backend.name} backend has no INT8 conv3d kernel")
        if relu and (output_qparams is None or output_qparams.zero_point != 0):
            raise ValueError("a fused ReLU needs a uint8 output with zero point 0 (it is the saturation at 0)")
        if weight.dim() != 5:
            raise ValueError(f"conv3d weight must be 5-D, got {weight.dim()}-D")
        self.relu = relu
        self._register_weight(weight, weight_scale, bias)
        self.spec = spec
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self._prepack()

    def _prepack(self) -> None:
        self._packed = self.backend.prepack_conv3d(
            self.weight, self.weight_scale, self.bias, self.spec, self._in_qp, self.input_shape
        )

    def refresh(self) -> None:
        super().refresh()
        self._prepack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.conv3d(x, self._in_qp, self._packed, self._out_qp)

    def extra_repr(self) -> str:
        geo = _conv_geometry(self.weight, self.spec)
        return f"{geo}{', relu' if self.relu else ''}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        stride, padding, dilation, groups = self.spec.as_args()
        return OpCall(
            "qconv",
            (
                inputs[0],
                *_qp(self._in_qp),
                self.weight,
                self.weight_scale,
                self.bias,
                stride,
                padding,
                dilation,
                groups,
                *_out(self._out_qp),
                "relu" if self.relu else "none",
                [],
                "",
                self.backend.name,
            ),
        )


class QConv2dAdd(BinaryOpsBase, _Weighted):
    """``relu?(conv2d(x) + other)``: the residual join as one kernel (oneDNN ``sum`` post-op).

    ``other`` is the skip branch. oneDNN accumulates into ``other``'s memory; the lowering sets
    ``clone_other`` when anything reads ``other`` after this op (or ``other`` is a view of such a
    tensor), so the overwrite is never visible.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        spec: ConvSpec,
        input_qparams: QParams,
        other_qparams: QParams,
        output_qparams: QParams,
        *,
        relu: bool = False,
        clone_other: bool = False,
        input_shape: Sequence[int] | None = None,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, other_qparams, output_qparams, backend)
        if not self.backend.supports_conv_add:
            raise ValueError(f"the {self.backend.name} backend has no fused conv+add kernel")
        self._register_weight(weight, weight_scale, bias)
        self.spec = spec
        self.relu = relu
        self.clone_other = clone_other
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self._post_op = "add_relu" if relu else "add"
        self._prepack()

    _prepack = QConv2d._prepack

    def refresh(self) -> None:
        super().refresh()
        self._prepack()

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.clone_other and self.backend.conv_add_writes_other:
            other = other.clone(memory_format=torch.channels_last)
        return self.backend.conv2d(x, self._in_qp, self._packed, self._out_qp, self._post_op, other, self._other_qp)

    def extra_repr(self) -> str:
        geo = _conv_geometry(self.weight, self.spec)
        flags = " + other" + (", relu" if self.relu else "") + (", clone_other" if self.clone_other else "")
        return f"{geo}{flags}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        stride, padding, dilation, groups = self.spec.as_args()
        return OpCall(
            "qconv_add",
            (
                inputs[0],
                *_qp(self._in_qp),
                self.weight,
                self.weight_scale,
                self.bias,
                stride,
                padding,
                dilation,
                groups,
                inputs[1],
                *_qp(self._other_qp),
                *_qp(self._out_qp),
                "relu" if self.relu else "none",
                self.backend.name,
            ),
        )


class QLinear(UnaryOpsBase, _Weighted):
    """``post_op(x @ W.T + b)`` on uint8 → uint8, or → fp32 when ``output_qparams`` is None (oneDNN
    ``qlinear_pointwise``)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_qparams: QParams,
        output_qparams: QParams | None,
        *,
        relu: bool = False,
        post_op: PostOp | None = None,
        input_shape: Sequence[int] | None = None,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self.post_op = _resolve_post_op(relu, post_op)
        if not self.backend.fuses("linear", self.post_op):
            raise ValueError(f"the {self.backend.name} backend has no linear kernel with a {self.post_op} post-op")
        self._register_weight(weight, weight_scale, bias)
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self._prepack()

    @property
    def relu(self) -> bool:
        return self.post_op == PostOp("relu")

    def _prepack(self) -> None:
        self._packed = self.backend.prepack_linear(
            self.weight, self.weight_scale, self.bias, self._in_qp, self.input_shape
        )

    def refresh(self) -> None:
        super().refresh()
        self._prepack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self._in_qp, self._packed, self._out_qp, self.post_op)

    def extra_repr(self) -> str:
        o, i = self.weight.shape
        return f"{i}→{o}{_post_op_repr(self.post_op)}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        p = self.post_op
        return OpCall(
            "qlinear",
            (
                inputs[0],
                *_qp(self._in_qp),
                self.weight,
                self.weight_scale,
                self.bias,
                *_out(self._out_qp),
                p.attr,
                list(p.scalars),
                p.algorithm,
                self.backend.name,
            ),
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

    def extra_repr(self) -> str:
        return self._qp_repr()

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


class RuntimeArg:
    """Marks an argument of :class:`QMove` that is passed to ``forward`` (e.g. a size read at run
    time, as in ShuffleNet's ``x.view(n, groups, c // groups, h, w)``)."""

    def __repr__(self) -> str:
        return "?"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuntimeArg)

    def __hash__(self) -> int:
        return hash(RuntimeArg)


#: Tensor methods :class:`QMove` replays on uint8 (``view`` runs as ``reshape``, see there).
MOVE_METHODS = ("view", "reshape", "transpose", "permute", "contiguous", "squeeze", "unsqueeze", "chunk", "split")
#: the methods that return pieces: QMove takes one of them (``item``)
PIECE_METHODS = ("chunk", "split")


class QMove(UnaryOpsBase):
    """A data-movement op (``view``, ``reshape``, ``transpose``, ``permute``, ``contiguous``,
    ``squeeze``, ``unsqueeze``, or one piece of ``chunk`` / ``split``) applied to the integers.

    Moving values does not change them, so the op commutes with (de)quantization:
    ``Q(move(DQ(u))) = move(u)`` when the output shares the input's qparams (the BackendConfig
    shares them), else a requantize. ``view`` runs as ``reshape``: uint8 activations are
    channels-last, where a ``view`` valid for the contiguous fp32 tensor can fail; ``reshape``
    gives the same values and copies only then.
    """

    is_view = True  # may alias its input (the lowering's overwrite protection must know)

    def __init__(
        self,
        method: str,
        args: Sequence[Any],
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        item: int | None = None,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        if method not in MOVE_METHODS:
            raise ValueError(f"unknown data-movement method {method!r}; known: {', '.join(MOVE_METHODS)}")
        if (method in PIECE_METHODS) != (item is not None):
            raise ValueError("chunk / split need the index of the piece (item), other methods none")
        self.method, self.args, self.item = method, tuple(args), item
        self._call = "reshape" if method == "view" else method

    def forward(self, x: torch.Tensor, *runtime: Any) -> torch.Tensor:
        values = iter(runtime)
        args = [next(values) if isinstance(a, RuntimeArg) else a for a in self.args]
        y = getattr(x, self._call)(*args)
        if self.item is not None:
            y = y[self.item]
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        args = ", ".join(repr(a) for a in self.args)
        item = "" if self.item is None else f"[{self.item}]"
        return f"{self.method}({args}){item}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        values = iter(inputs[1:])
        args = [next(values) if isinstance(a, RuntimeArg) else a for a in self.args]
        return OpCall("." + self._call, (inputs[0], *args), item=self.item, requantize=(self._in_qp, self._out_qp))


class QPad(UnaryOpsBase):
    """A constant zero pad on the integers: ``Q(pad(DQ(u), 0)) = pad(u, zero_point)``.

    Real 0 is the integer ``zero_point`` (``(zp - zp) * s = 0``), always representable, so padding
    with it is exact; then a requantize where the output's qparams differ (as every move op).
    """

    is_view = False

    def __init__(
        self,
        pads: Sequence[int | RuntimeArg],
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        # sizes computed at run time (timm's "same" padding from x.shape) are RuntimeArg slots,
        # filled from the extra inputs in order
        self.pads = tuple(p if isinstance(p, RuntimeArg) else int(p) for p in pads)

    def _sizes(self, runtime: Sequence[Any]) -> list[Any]:
        values = iter(runtime)
        return [next(values) if isinstance(p, RuntimeArg) else p for p in self.pads]

    def forward(self, x: torch.Tensor, *runtime: int) -> torch.Tensor:
        y = torch.constant_pad_nd(x, [int(p) for p in self._sizes(runtime)], float(self._in_qp.zero_point))
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        return f"pads={list(self.pads)}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (inputs[0], self._sizes(inputs[1:]), float(self._in_qp.zero_point))
        return OpCall(torch.constant_pad_nd, args, requantize=(self._in_qp, self._out_qp))


class QCat(GMLQuantModuleBase):
    """``torch.cat`` of uint8 tensors, each requantized to the output qparams (exact when equal)."""

    def __init__(
        self, dim: int, input_qparams: Sequence[QParams], output_qparams: QParams, *, backend: BackendArg = None
    ) -> None:
        super().__init__(output_qparams, backend)
        if not input_qparams:
            raise ValueError("QCat needs at least one input")
        self.dim = dim
        self.register_buffer("input_scales", torch.tensor([q.scale for q in input_qparams], dtype=torch.float64))
        self.register_buffer("input_zps", torch.tensor([q.zero_point for q in input_qparams], dtype=torch.int64))
        self._in_qps = tuple(input_qparams)

    def refresh(self) -> None:
        super().refresh()
        self._in_qps = tuple(QParams(float(s), int(z)) for s, z in zip(self.input_scales, self.input_zps))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.backend.cat(xs, self._in_qps, self.dim, self._out_qp)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, inputs={len(self._in_qps)}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        scales = [q.scale for q in self._in_qps]
        zps = [q.zero_point for q in self._in_qps]
        return OpCall("qcat", (list(inputs), scales, zps, self.dim, *_qp(self._out_qp), self.backend.name))


class Quantize(GMLQuantModuleBase):
    """fp32 → uint8 where the INT8 region starts (model input, or after an op kept in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quantize(x, self._out_qp)

    def extra_repr(self) -> str:
        return self._qp_repr()

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall("quantize", (inputs[0], *_qp(self._out_qp)))


class Dequantize(nn.Module):
    """uint8 → fp32 where the INT8 region ends. Not a :class:`GMLQuantModuleBase`: its output
    carries no qparams, so :func:`extract_qparams` correctly finds none on it."""

    def __init__(self, input_qparams: QParams, *, backend: BackendArg = None) -> None:
        super().__init__()
        self.backend = get_backend(backend)
        _register_qparams(self, "input", input_qparams)
        self._in_qp = input_qparams
        self.register_load_state_dict_post_hook(_refresh_after_load)

    @property
    def input_qparams(self) -> QParams:
        return self._in_qp

    def refresh(self) -> None:
        self._in_qp = _buffered_qparams(self, "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.dequantize(x, self._in_qp)

    def extra_repr(self) -> str:
        return f"in=({self._in_qp.scale:.4g}, {self._in_qp.zero_point})"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall("dequantize", (inputs[0], *_qp(self._in_qp)))


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


# ---------------------------------------------------------------- reading qparams off the graph
def extract_qparams(node: fx.Node, gm: fx.GraphModule) -> QParams | None:
    """The qparams of the uint8 value ``node`` produces, or ``None`` if it produces no quantized value.

    Polymorphic over what the node is: a torch quantize op (read its scale/zero point arguments), a
    dequantize op (the qparams of the value it reads), or an already-lowered GML module (its
    ``output_scale``/``output_zp`` buffers). The last case is what lets a pattern whose operand was
    lowered earlier, such as a residual add, be lowered without knowing which module produced it.
    Unsupported quantize ops (per-channel activations, int8) raise ``ValueError`` with the reason.
    """
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return mod.output_qparams if isinstance(mod, GMLQuantModuleBase) else None
    if is_quantize(node):
        return quantize_args(node, gm)[0]
    if is_dequantize(node):
        if node.target in DECOMPOSED_DQ:
            return quantize_args(node, gm)[0]
        src = node.args[0]
        return extract_qparams(src, gm) if isinstance(src, fx.Node) else None
    return None
