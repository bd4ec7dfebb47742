"""oneDNN INT8 kernels, as PyTorch exposes them to Inductor (``torch.ops.onednn.*``).

Ops used (signatures as registered by torch 2.14, ``op._schema``)::

    onednn::qconv_prepack(Tensor weight, Tensor w_scales, float x_scale, int x_zp, int[] stride,
                          int[] padding, int[] dilation, int groups, int[]? x_shape=None) -> Tensor
    onednn::qconv2d_pointwise(Tensor qx, float x_scale, int x_zero_point, Tensor qw, Tensor w_scale,
                              Tensor w_zero_point, Tensor? bias, int[] stride, int[] padding,
                              int[] dilation, int groups, float output_scale, int output_zero_point,
                              ScalarType? output_dtype, str attr, Scalar?[] scalars, str? algorithm)
    onednn::qconv2d_pointwise.binary(..., Tensor(a!) qaccum, Tensor? bias, ..., float output_scale,
                              int output_zero_point, ScalarType? output_dtype, float accum_scale,
                              int accum_zero_point, str binary_attr, Scalar? alpha, str? unary_attr,
                              Scalar?[] unary_scalars, str? unary_algorithm)
    onednn::qlinear_prepack(Tensor weight, int[]? x_shape) -> Tensor
    onednn::qlinear_pointwise(Tensor qx, float x_scale, int x_zero_point, Tensor qw, Tensor w_scale,
                              Tensor w_zero_point, Tensor? bias, float output_scale,
                              int output_zero_point, ScalarType? output_dtype, str post_op_name,
                              Scalar?[] post_op_args, str post_op_algorithm)

Facts checked on this build (tests/kernels/test_onednn_int8.py pins them):

* activations are plain ``uint8`` tensors, weights plain ``int8`` prepacked into an opaque
  ``torch._mkldnn`` tensor; ``output_scale`` is the scale itself (not its reciprocal);
* the residual add is the oneDNN ``sum`` post-op: the kernel accumulates *into* ``qaccum``
  (which must be channels-last and is overwritten) and returns a copy; the ``add`` binary post-op
  is rejected for quantized conv on CPU, so ``sum`` is the only fused residual form;
* ``qconv_prepack`` picks the weight layout for ``x_shape``; a call with another input shape still
  works but reorders the weight on every call, so the handle keeps one packing per input shape
  (at most :data:`MAX_PACKINGS`, oldest dropped first);
* the eltwise post-op (``attr``/``scalars``) of ``qconv2d_pointwise`` takes ``relu``, ``hardtanh``
  ``[min, max]`` (ReLU6 is ``[0, 6]``, as Inductor's fp32 mkldnn fusion spells clamps),
  ``hardswish`` and ``swish`` (SiLU); ``sigmoid``, ``hardsigmoid``, ``gelu``, ``tanh`` and
  ``leaky_relu`` are rejected ("Unsupported post op"). ``qlinear_pointwise`` takes all but
  ``sigmoid``/``hardsigmoid``/``silu``; GML uses the four the conv has, plus ``gelu`` (algorithm
  ``none`` or ``tanh``) for the Linear → GELU of transformer MLPs;
* ``onednn::qadd.tensor`` returns wrong values on this build (all zero point on a plain 1+1 test), so
  the standalone add and the pools use PyTorch's ``quantized::*`` CPU kernels instead (inputs
  wrapped as QTensors, results read back through a zero-copy uint8 view, see ``as_uint8``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gml.ir.values import ConvSpec, Int8Weight, PostOp, QParams
from gml.kernels.backend import (
    Add,
    Int8Backend,
    Tensor,
    fp32_or_none,
    has_padding_only_window,
    silence_quantized_tensor_warnings,
)

_CL = torch.channels_last
_CL3 = torch.channels_last_3d
#: Packings kept per weight (one per input shape seen); the oldest goes first beyond this.
MAX_PACKINGS = 4


class OneDNNPackedConv:
    """Prepacked conv weight plus everything ``qconv2d_pointwise`` needs besides the activation.

    Packings are made per input batch size on first use (see the module docstring)."""

    __slots__ = ("bias", "explicit_padding", "input_qparams", "packs", "spec", "w_scale", "w_zp", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None,
        spec: ConvSpec,
        input_qparams: QParams,
    ) -> None:
        self.weight = weight
        self.w_scale = w_scale
        self.w_zp = torch.zeros(w_scale.numel(), dtype=torch.int64)
        self.bias = bias
        self.spec = spec
        self.input_qparams = input_qparams
        self.packs: dict[tuple[int, ...], torch.Tensor] = {}
        #: input shape -> whether its padding is applied explicitly (see :meth:`needs_explicit_padding`)
        self.explicit_padding: dict[tuple[int, ...], bool] = {}

    def pack_for(self, shape: Sequence[int], padding: tuple[int, ...] | None = None) -> torch.Tensor:
        """The weight packed for input ``shape`` (and ``padding``, default the conv's own)."""
        s, qp = self.spec, self.input_qparams
        padding = s.padding if padding is None else padding
        key = tuple(shape) if padding == s.padding else (*shape, *padding)
        packed = self.packs.get(key)
        if packed is None:
            _make_room(self.packs)
            packed = torch.ops.onednn.qconv_prepack(
                self.weight,
                self.w_scale,
                qp.scale,
                qp.zero_point,
                list(s.stride),
                list(padding),
                list(s.dilation),
                s.groups,
                list(shape),
            )
            self.packs[key] = packed
        return packed

    def needs_explicit_padding(self, shape: Sequence[int]) -> bool:
        """Whether the kernel must not see this conv's padding for an input of ``shape``.

        Two oneDNN INT8 defects, both avoided by padding the input ourselves (with the zero point, the
        integer of 0.0: the same math) and convolving without padding:

        * some output window lies entirely in the padding: oneDNN returns uninitialised memory
          there (fp32 gives the bias);
        * a 3-D conv over a one-frame clip (input depth 1) with depth padding: the kernel oneDNN
          picks for it is wrong (grouped convs with several outputs per group, e.g. ``Conv3d(6, 12,
          3, padding=1, groups=6)`` on ``(1, 6, 1, 4, 4)``: error 1.5 against outputs of 0.5; with
          the padding explicit, or with two frames, the result is exact). Fuzz seeds 9001 and 424242.
        """
        key = tuple(shape)
        flag = self.explicit_padding.get(key)
        if flag is None:
            s = self.spec
            k = self.weight.shape[2:]
            flag = any(
                has_padding_only_window(key[2 + i], k[i], s.stride[i], s.padding[i], s.dilation[i])
                for i in range(len(k))
            ) or (len(k) == 3 and key[2] == 1 and s.padding[0] > 0)
            _make_room(self.explicit_padding)
            self.explicit_padding[key] = flag
        return flag


class OneDNNPackedLinear:
    __slots__ = ("bias", "packs", "w_scale", "w_zp", "weight")

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.w_scale = w_scale
        self.w_zp = torch.zeros(w_scale.numel(), dtype=torch.int64)
        self.bias = bias
        self.packs: dict[tuple[int, ...], torch.Tensor] = {}

    def pack_for(self, shape: Sequence[int]) -> torch.Tensor:
        key = tuple(shape)
        packed = self.packs.get(key)
        if packed is None:
            _make_room(self.packs)
            packed = torch.ops.onednn.qlinear_prepack(self.weight, list(key))
            self.packs[key] = packed
        return packed


class OneDNNBackend(Int8Backend):
    """oneDNN (x86, VNNI/AMX) INT8 kernels: fused conv+post-ops, linear, and the residual sum."""

    name = "onednn"
    conv_add_writes_other = True
    conv_handles_padding_only_windows = False
    conv_post_ops = frozenset({"relu", "hardtanh", "hardswish", "swish"})
    linear_post_ops = frozenset({"relu", "hardtanh", "hardswish", "swish", "gelu"})
    activations = frozenset({"relu", "hardtanh", "hardswish", "sigmoid", "hardsigmoid"})

    def __init__(self) -> None:
        silence_quantized_tensor_warnings()
        self._qconv = torch.ops.onednn.qconv2d_pointwise.default
        self._qconv_sum = torch.ops.onednn.qconv2d_pointwise.binary
        self.has_conv3d = hasattr(torch.ops.onednn, "qconv_pointwise")  # type: ignore[misc]
        self._qconv_nd = torch.ops.onednn.qconv_pointwise.default if self.has_conv3d else None
        self._qlinear = torch.ops.onednn.qlinear_pointwise.default

    @classmethod
    def is_available(cls) -> bool:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.onednn, "qconv2d_pointwise")
            and "onednn" in torch.backends.quantized.supported_engines
        )

    # ------------------------------------------------------------------ weights
    def prepack_conv(
        self, w: Int8Weight, spec: ConvSpec, input_qparams: QParams, input_shape: Sequence[int] | None = None
    ) -> OneDNNPackedConv:
        # one handle for 2-D and 3-D: qconv_prepack takes 5-D weights and 3-entry geometry as they are
        packed = OneDNNPackedConv(
            w.weight.contiguous(), w.scale.float().contiguous(), fp32_or_none(w.bias), spec, input_qparams
        )
        if input_shape is not None:
            packed.pack_for(input_shape)
        return packed

    def conv3d(
        self, x: torch.Tensor, x_qparams: QParams, packed: OneDNNPackedConv, out_qparams: QParams | None
    ) -> torch.Tensor:
        # ``qconv_pointwise`` on 5-D takes no eltwise post-op on this build ("Unsupported post op
        # relu for quantized pointwise conv3d"): QConv3d gets its ReLU from the output's saturation.
        if not x.is_contiguous(memory_format=_CL3):
            x = x.contiguous(memory_format=_CL3)
        src, geometry = _conv_operands(x, x_qparams, packed, _CL3)
        return self._qconv_nd(*src, packed.bias, *geometry, *_out_args(out_qparams), "none", [], "")  # type: ignore[misc]

    def prepack_linear(
        self, w: Int8Weight, input_qparams: QParams, input_shape: Sequence[int] | None = None
    ) -> OneDNNPackedLinear:
        packed = OneDNNPackedLinear(w.weight.contiguous(), w.scale.float().contiguous(), fp32_or_none(w.bias))
        if input_shape is not None:
            packed.pack_for(_linear_key(input_shape))
        return packed

    # ------------------------------------------------------------------ compute
    def _conv2d(
        self,
        x: Tensor,
        x_qparams: QParams,
        packed: OneDNNPackedConv,
        out_qparams: QParams | None,
        eltwise: PostOp,
        add: Add,
    ) -> Tensor:
        src, geometry = _conv_operands(x, x_qparams, packed, _CL)
        unary = (eltwise.attr, list(eltwise.scalars), eltwise.algorithm)
        if add is None:
            return self._qconv(*src, packed.bias, *geometry, *_out_args(out_qparams), *unary)
        other, other_qparams = add
        assert out_qparams is not None  # Int8Backend.conv2d checked it
        if not other.is_contiguous(memory_format=_CL):
            other = other.contiguous(memory_format=_CL)
        accum = (other_qparams.scale, other_qparams.zero_point, "sum", 1.0)
        out = (out_qparams.scale, out_qparams.zero_point, None)
        return self._qconv_sum(*src, other, packed.bias, *geometry, *out, *accum, *unary)

    def _linear(
        self, x: Tensor, x_qparams: QParams, packed: OneDNNPackedLinear, out_qparams: QParams | None, eltwise: PostOp
    ) -> Tensor:
        out_scale, out_zp, out_dtype = _out_args(out_qparams)
        return self._qlinear(
            x,
            x_qparams.scale,
            x_qparams.zero_point,
            packed.pack_for(_linear_key(x.shape)),
            packed.w_scale,
            packed.w_zp,
            packed.bias,
            out_scale,
            out_zp,
            out_dtype,
            eltwise.attr,
            list(eltwise.scalars),
            eltwise.algorithm,
        )


# ---------------------------------------------------------------- helpers
def _make_room(packs: dict[tuple[int, ...], torch.Tensor]) -> None:
    # Each packing is a full copy of the weight: a model served at many batch sizes must not grow
    # without bound.
    while len(packs) >= MAX_PACKINGS:
        packs.pop(next(iter(packs)))


def _padded_if_needed(
    x: torch.Tensor, packed: OneDNNPackedConv, x_qparams: QParams, memory_format: torch.memory_format
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(x, padding)`` for the kernel call: as they are, or, where some output window lies wholly in
    the padding (:meth:`OneDNNPackedConv.needs_explicit_padding`), ``x`` padded with the integer of
    0.0 (the zero point) and no padding left for the kernel: the same math."""
    padding = packed.spec.padding
    if not packed.needs_explicit_padding(x.shape):
        return x, padding
    pads = [p for pad in reversed(padding) for p in (pad, pad)]  # F.pad lists the last dim first
    x = torch.nn.functional.pad(x, pads, value=x_qparams.zero_point).contiguous(memory_format=memory_format)
    return x, (0,) * len(padding)


def _conv_operands(
    x: torch.Tensor, x_qparams: QParams, packed: OneDNNPackedConv, memory_format: torch.memory_format
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What every oneDNN conv call takes besides bias, output and post-ops: ``(x, x_scale, x_zp,
    packed weight, w_scale, w_zp)`` and ``(stride, padding, dilation, groups)``, with ``x`` padded
    explicitly where the kernel must not see the padding (:func:`_padded_if_needed`)."""
    s = packed.spec
    x, padding = _padded_if_needed(x, packed, x_qparams, memory_format)
    w = packed.pack_for(x.shape, padding)
    src = (x, x_qparams.scale, x_qparams.zero_point, w, packed.w_scale, packed.w_zp)
    return src, (list(s.stride), list(padding), list(s.dilation), s.groups)


def _out_args(qp: QParams | None) -> tuple[float, int, torch.dtype | None]:
    # oneDNN's convention: fp32 output is requested with scale 1.0, zero point 0.
    return (1.0, 0, torch.float32) if qp is None else (qp.scale, qp.zero_point, None)


def _linear_key(shape: Sequence[int]) -> tuple[int, ...]:
    # qlinear flattens leading dims: the packing depends on (rows, in_features) only.
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return (rows, int(shape[-1]))
