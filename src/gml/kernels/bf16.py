"""BF16 fused kernels: oneDNN convolution / inner product with bf16 weights and activations.

The bf16 twins of :mod:`gml.kernels.fp32`'s modules (same constructor arguments, same post-ops,
same module path in the graph), made by :class:`gml.passes.bf16.LowerToBf16`:

=====================  ================================================  =================================
module                 kernel                                            math
=====================  ================================================  =================================
:class:`Bf16Conv`      ``mkldnn._convolution_pointwise`` on bf16         ``bf16(act(conv(x, W) + b))``
:class:`Bf16ConvAdd`   ``mkldnn._convolution_pointwise[_].binary``       ``bf16([relu](conv(x, W) + b
                                                                         + other))``
:class:`Bf16Linear`    ``mkldnn._linear_pointwise`` on bf16              ``bf16(act(x W^T + b))``
=====================  ================================================  =================================

**Numerics.** ``x`` and ``W`` are bf16 (8 significant bits: one rounding costs at most
``u = 2^-8`` relative, :data:`BF16_UNIT_ROUNDOFF`); products are exact in fp32 and oneDNN
accumulates them in fp32 (AVX512-BF16 ``vdpbf16ps`` / AMX ``tdpbf16ps``); the bias is added in fp32
and the post-op runs on the fp32 accumulator; the result is rounded to bf16 once. So one layer's
output differs from the fp32 layer on the *rounded* inputs by at most ``u * |y|`` plus the fp32
summation error, and from the fp32 layer on the exact inputs by about ``|W||x| * 2u`` (both
operands rounded). :func:`bf16_dot_bound` is that bound, the one the tests use.

**Weights** are stored as bf16 parameters (half the bytes of fp32) plus a copy reordered once into
the blocked layout the primitive wants (``_reorder_convolution_weight`` / ``_reorder_linear_weight``
on the bf16 tensor), rebuilt lazily after ``load_state_dict``/``.to()``/deepcopy (see
:class:`gml.kernels.fp32._Prepacked`). The bias is bf16-rounded (``u * |b|``, below the output's own
rounding) and added in fp32.

**Activations** enter as bf16 (an fp32 input is converted once, at the first kernel) and leave as
bf16 in channels-last, so consecutive kernels never convert.

**Availability.** :func:`bf16_unavailable_reason` is the one capability query, on the
:class:`~gml.ir.target.Target` (``Target.native_bf16``): oneDNN must dispatch to an ISA with native
bf16 dot products (AVX512-BF16, AMX-BF16, AVX-NE-CONVERT + AVX-VNNI-INT8's ``avx2_vnni_2``). On
other CPUs oneDNN would emulate bf16 by converting to fp32 around every instruction, slower than
fp32: GML then refuses bf16 and keeps the fp32 model, with a warning.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gml.ir.library import channels_last_format
from gml.ir.target import Target
from gml.kernels import fp32 as k32

#: bf16's unit roundoff 2^(1-p)/2 = 2^-8 for p = 8 significant bits (7 stored + the implicit one),
#: round-to-nearest-even (2^-9 until 2026-11-24: half the true value).
BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_dot_bound(abs_dot: torch.Tensor | float, k: int = 1) -> torch.Tensor | float:
    """Error bound of one bf16 kernel vs the same fp32 op: ``(2u + u + k*2^-24) * sum|w||x|``.

    Both operands are rounded to bf16 (``2u``), the output once more (``u``), and the fp32
    accumulation of ``k`` products adds ``k * 2^-24`` (fp32's unit roundoff) at most; ``abs_dot``
    is ``|W| @ |x|`` (+ ``|b|``), the magnitude the rounding errors scale with.
    """
    return (3 * BF16_UNIT_ROUNDOFF + k * 2.0**-24) * abs_dot


@functools.cache
def bf16_unavailable_reason(target: Target | None = None) -> str | None:
    """Why bf16 kernels cannot run *natively* on ``target`` (default: this process's, detected
    once), or ``None`` when they can. ``Target.native_bf16`` is the one ISA fact used.

    The one function tests monkeypatch to simulate a CPU without bf16 (``functools.cache``d: patch
    the module attribute, or call ``bf16_unavailable_reason.cache_clear()``).
    """
    why = k32.kernel_unavailable_reason()
    if why is not None:
        return why
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN in this torch build has no bf16 support on this CPU"
    from gml.runtime.target import resolve

    target = resolve(target)
    if not target.native_bf16:
        return (
            f"this CPU has no native bf16 instructions (oneDNN dispatches to {target.isa}; bf16 needs "
            "AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT): bf16 would be emulated, slower than fp32"
        )
    return None


def bf16_available(target: Target | None = None) -> bool:
    return bf16_unavailable_reason(target) is None


def cpu_description(target: Target | None = None) -> str:
    """One line naming what bf16 runs on here, for reports."""
    from gml.runtime.target import resolve

    return f"oneDNN ISA {resolve(target).isa}"


def to_bf16(x: Any) -> Any:
    """``x`` as bf16 if it is an fp32 tensor; anything else unchanged."""
    return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x


def to_fp32(x: Any) -> Any:
    """``x`` as fp32 if it is a bf16 tensor; anything else (fp32, integers, non-tensors) unchanged.

    Inserted by :class:`~gml.passes.bf16.LowerToBf16` before ops that compute in fp32 (LayerNorm,
    softmax, reductions, ops without a bf16 kernel) and on the model's outputs."""
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


torch.fx.wrap("to_fp32")


def _bf16_weight(module: k32._Prepacked) -> None:
    module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    if module.bias is not None:  # torch's oneDNN binding takes the bias in the input's dtype
        module.bias = nn.Parameter(module.bias.detach().to(torch.bfloat16), requires_grad=False)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def conv_refusal(m: nn.Module, input_shape: Sequence[int] | None) -> str | None:
    """Why the bf16 twin of the fused conv ``m`` would compute wrong numbers on ``input_shape``, or
    ``None``. oneDNN's bf16 Conv3d (torch's build, prepacked or not) is wrong on a one-frame clip
    with depth padding: relative error 0.4-1.2 for 1, 3 or 5 input channels, 2+ frames or no depth
    padding exact (measured 2026-11-27 on AMX and under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; found
    by the bf16 fuzz property, seed 20261128) — the INT8 kernel has the same one-frame fault
    (docs/fuzzing.md). Declined for any channel count: cheap, a one-frame Conv3d is rare."""
    weight = getattr(m, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 4:
        return _conv2d_refusal(m, input_shape)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 5:  # not a Conv3d
        return None
    shape = tuple(input_shape) if input_shape is not None else getattr(m, "input_size", None)
    if shape is None or len(shape) != 5:
        return "a Conv3d's input depth is unknown (oneDNN's bf16 Conv3d is wrong on one frame with depth padding)"
    if shape[2] == 1 and m.padding[0] > 0:
        return "one-frame Conv3d with depth padding: oneDNN's bf16 kernel computes it wrong (kept fp32)"
    return None


def _conv2d_refusal(m: nn.Module, input_shape: Sequence[int] | None) -> str | None:
    """Two Conv2d shapes oneDNN's AMX bf16 kernel (torch's build too) computes wrong, both with a width
    stride > 1; exact under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, with width stride 1, and for the
    same shapes transposed (height). Declined on every CPU: one rule everywhere, and such convs are rare.

    * a one-column input (width 1) with width padding: relative errors 0.7-1.8 once the input has 8+
      rows, and with a dilated 1-wide kernel a segmentation fault (`make fuzz` of 2026-11-28, ``(1, 5,
      8, 1)``, k=2, stride 2, pad 1);
    * a one-column output (width 1): relative errors 0.65-3.4, or 2e36 (`make fuzz` of 2026-11-28 s8,
      ``(1, 3, 9, 2)``, k=2, stride 2, pad 1, dilation 2; 47 of 405 width configurations mapped, every
      failure one of the two).

    Measured on Sapphire Rapids."""
    if input_shape is None or len(input_shape) != 4:
        return None
    stride, padding = getattr(m, "stride", (1, 1)), getattr(m, "padding", (0, 0))
    if isinstance(padding, str) or stride[1] <= 1:
        return None
    width, kernel, dilation = input_shape[3], m.weight.shape[-1], getattr(m, "dilation", (1, 1))[1]
    if width == 1 and padding[1] > 0:
        what = "a one-column input with width stride and padding"
    elif (width + 2 * padding[1] - dilation * (kernel - 1) - 1) // stride[1] + 1 == 1:
        what = "a one-column output with width stride"
    else:
        return None
    return f"Conv2d over {what}: oneDNN's AMX bf16 kernel computes it wrong (kept fp32)"


class _Bf16Twin:
    """What the three bf16 twins add to their fp32 kernel: bf16 weights (built through the fp32
    constructor, then cast) and ``bf16`` in the repr. ``_forced`` overrides constructor arguments."""

    _forced: ClassVar[dict[str, Any]] = {}

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, **kwargs: Any) -> None:
        super().__init__(weight.float(), _f32(bias), **{**kwargs, **self._forced})  # type: ignore[call-arg]
        _bf16_weight(self)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", bf16"  # type: ignore[misc]


class Bf16Conv(_Bf16Twin, k32.FusedConv):
    """``bf16(post_op(conv(x, W) + b))``: bf16 weights/activations, fp32 accumulate and bias."""

    @classmethod
    def from_fused(cls, m: k32.FusedConv) -> Bf16Conv:
        return cls(m.weight, m.bias, post_op=m.post_op, **m.window())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(to_bf16(x))

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        y = self._conv(x.float(), self.weight.float(), _f32(self.bias))
        return self.post_op.apply(y).to(torch.bfloat16)


class Bf16ConvAdd(_Bf16Twin, k32.FusedConvAdd):
    """``bf16([relu](conv(x, W) + b + other))``; ``other`` is read as bf16 (oneDNN's sum post-op)."""

    @classmethod
    def from_fused(cls, m: k32.FusedConvAdd) -> Bf16ConvAdd:
        return cls(m.weight, m.bias, relu=m.relu, inplace=m.inplace, **m.window())

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        x = to_bf16(x)
        if other.dtype != torch.bfloat16:  # a fresh copy: accumulating into it in place is safe
            other = other.to(torch.bfloat16, memory_format=channels_last_format(other))
        return super().forward(x, other)

    def _reference(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        y = self._conv(x.float(), self.weight.float(), _f32(self.bias)) + other.float()
        return (torch.relu(y) if self.relu else y).to(torch.bfloat16)


class Bf16Linear(_Bf16Twin, k32.FusedLinear):
    """``bf16(post_op(x W^T + b))`` on oneDNN's bf16 inner product (any leading dims); arguments as
    :class:`~gml.kernels.fp32.FusedLinear`'s but ``backend``: MKL's packed GEMM is fp32-only, so bf16
    always runs oneDNN's inner product."""

    _forced: ClassVar[dict[str, Any]] = {"backend": "onednn"}

    @classmethod
    def from_fused(cls, m: k32.FusedLinear) -> Bf16Linear:
        return cls(m.weight, m.bias, post_op=m.post_op, rows=m.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_bf16(x)
        if self.backend == "aten":
            return self._reference(x)
        if torch.compiler.is_compiling():
            # export / compile trace, before the NaN / Inf check: that check reads the data (a
            # data-dependent branch torch.export refuses: a bf16 ConvNeXt, GELU MLPs, did not save)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, *self._attr)
        if self.post_op.attr in k32.NONFINITE_UNSAFE_POST_OPS and not k32.all_finite(x):
            return self._reference(x)
        w = self._packed if self._packed is not None else self.packed()
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, *self._attr)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_op.apply(F.linear(x.float(), self.weight.float(), _f32(self.bias))).to(torch.bfloat16)


#: fp32 fused module type → its bf16 twin.
BF16_TWINS: dict[type[nn.Module], Any] = {
    k32.FusedConv: Bf16Conv,
    k32.FusedConvAdd: Bf16ConvAdd,
    k32.FusedLinear: Bf16Linear,
}


def bf16_kernel_modules() -> tuple[type[nn.Module], ...]:
    return (Bf16Conv, Bf16ConvAdd, Bf16Linear)


def weight_bytes(modules: Sequence[nn.Module]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in modules if isinstance(m, k32._Prepacked))


__all__ = [
    "BF16_TWINS",
    "BF16_UNIT_ROUNDOFF",
    "Bf16Conv",
    "Bf16ConvAdd",
    "Bf16Linear",
    "bf16_available",
    "bf16_dot_bound",
    "bf16_kernel_modules",
    "bf16_unavailable_reason",
    "cpu_description",
    "to_bf16",
    "to_fp32",
]
