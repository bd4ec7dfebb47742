"""Plan values with weights: INT8 conv (1-D, 2-D, 3-D, with a residual add) and linear, and the
weight quantization they share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gml.ir.values import NO_POST_OP, ConvSpec, Int8Weight, PostOp, QParams
from gml.quant.modules.base import (
    BackendArg,
    BinaryOpsBase,
    OpCall,
    UnaryOpsBase,
    _out,
    _qp,
)


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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_packed"] = None  # backend handles are not picklable; rebuilt in __setstate__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._prepack()

    def _prepack(self) -> None:
        raise NotImplementedError

    @property
    def int8_weight(self) -> Int8Weight:
        """The weight buffers as the backends' ``prepack_*`` take them."""
        return Int8Weight(self.weight, self.weight_scale, self.bias)

    def _init_weight(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_shape: Sequence[int] | None,
        spec: ConvSpec | None = None,
    ) -> None:
        """Register the weight buffers, keep the geometry and the example input shape, prepack."""
        if weight.dtype != torch.int8:
            raise ValueError(f"weight must be int8, got {weight.dtype}")
        scale = weight_scale.detach().float().flatten().contiguous()
        if scale.numel() not in (1, weight.shape[0]):
            raise ValueError(f"{scale.numel()} weight scales for {weight.shape[0]} output channels")
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        if spec is not None:
            self.spec = spec
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self._prepack()

    def refresh(self) -> None:
        super().refresh()  # the qparams base class: buffers → cached qparams
        self._prepack()

    def _conv_args(self, x: Any) -> tuple[Any, ...]:
        """The leading arguments of ``gml.qconv`` / ``gml.qconv_add``: ``x``, its qparams, weight, geometry."""
        return (x, *_qp(self._in_qp), self.weight, self.weight_scale, self.bias, *self.spec.as_args())


class _WithPostOp(_Weighted, UnaryOpsBase):
    """``post_op(op(x))`` on uint8 → uint8, or → fp32 when ``output_qparams`` is None: the conv and
    linear kernels with an element-wise post-op. ``kind`` is the op as the backend's ``fuses`` names it."""

    kind: str

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        spec: ConvSpec | None,
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
        if not self.backend.fuses(self.kind, self.post_op):
            raise ValueError(f"the {self.backend.name} backend has no {self.kind} kernel with a {self.post_op} post-op")
        self._init_weight(weight, weight_scale, bias, input_shape, spec)

    @property
    def relu(self) -> bool:
        return self.post_op == PostOp("relu")

    def _post_op_args(self) -> tuple[Any, ...]:
        """The trailing arguments of ``gml.qconv`` / ``gml.qlinear``: output qparams, post-op, backend."""
        p = self.post_op
        return (*_out(self._out_qp), p.attr, list(p.scalars), p.algorithm, self.backend.name)


class QConv2d(_WithPostOp):
    """``post_op(conv2d(x))`` on uint8 → uint8, or → fp32 when ``output_qparams`` is None (oneDNN
    ``qconv2d_pointwise`` with an eltwise post-op: relu, hardtanh (ReLU6), hardswish, swish)."""

    kind = "conv2d"

    def _prepack(self) -> None:
        self._packed = self.backend.prepack_conv(self.int8_weight, self.spec, self._in_qp, self.input_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.conv2d(x, self._in_qp, self._packed, self._out_qp, self.post_op)

    def extra_repr(self) -> str:
        geo = _conv_geometry(self.weight, self.spec)
        return f"{geo}{_post_op_repr(self.post_op)}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall("qconv", (*self._conv_args(inputs[0]), *self._post_op_args()))


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


class QConv3d(_Weighted, UnaryOpsBase):
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
        self._init_weight(weight, weight_scale, bias, input_shape, spec)

    _prepack = QConv2d._prepack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.conv3d(x, self._in_qp, self._packed, self._out_qp)

    def extra_repr(self) -> str:
        geo = _conv_geometry(self.weight, self.spec)
        return f"{geo}{', relu' if self.relu else ''}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (*_out(self._out_qp), "relu" if self.relu else "none", [], "", self.backend.name)
        return OpCall("qconv", (*self._conv_args(inputs[0]), *args))


class QConv2dAdd(_Weighted, BinaryOpsBase):
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
        self.relu = relu
        self.clone_other = clone_other
        self._post_op = "add_relu" if relu else "add"
        self._init_weight(weight, weight_scale, bias, input_shape, spec)

    _prepack = QConv2d._prepack

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.clone_other and self.backend.conv_add_writes_other:
            other = other.clone(memory_format=torch.channels_last)
        return self.backend.conv2d(x, self._in_qp, self._packed, self._out_qp, self._post_op, other, self._other_qp)

    def extra_repr(self) -> str:
        geo = _conv_geometry(self.weight, self.spec)
        flags = " + other" + (", relu" if self.relu else "") + (", clone_other" if self.clone_other else "")
        return f"{geo}{flags}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        other = (inputs[1], *_qp(self._other_qp), *_qp(self._out_qp))
        return OpCall(
            "qconv_add", (*self._conv_args(inputs[0]), *other, "relu" if self.relu else "none", self.backend.name)
        )


class QLinear(_WithPostOp):
    """``post_op(x @ W.T + b)`` on uint8 → uint8, or → fp32 when ``output_qparams`` is None (oneDNN
    ``qlinear_pointwise``). Keyword arguments as :class:`QConv2d`'s."""

    kind = "linear"

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_qparams: QParams,
        output_qparams: QParams | None,
        **options: Any,
    ) -> None:
        super().__init__(weight, weight_scale, bias, None, input_qparams, output_qparams, **options)

    def _prepack(self) -> None:
        self._packed = self.backend.prepack_linear(self.int8_weight, self._in_qp, self.input_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self._in_qp, self._packed, self._out_qp, self.post_op)

    def extra_repr(self) -> str:
        o, i = self.weight.shape
        return f"{i}→{o}{_post_op_repr(self.post_op)}, {self._qp_repr()}, {self.backend.name}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (inputs[0], *_qp(self._in_qp), self.weight, self.weight_scale, self.bias)
        return OpCall("qlinear", (*args, *self._post_op_args()))
