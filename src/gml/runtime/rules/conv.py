"""Translation rules: convolutions (INT8 ``gml.qconv`` / ``gml.qconv_add``, the fp32 and bf16 fused
conv modules of ``gml.kernels.fp32`` / ``gml.kernels.bf16``), each one oneDNN convolution with its
post-ops; a residual add is oneDNN's ``sum`` post-op, accumulated in the skip value's memory. An fp32
eval ``nn.BatchNorm2d`` no conv took (DenseNet's pre-activation norm after a concat) is a per-channel
affine map: a depthwise 1 × 1 convolution."""

from __future__ import annotations

import torch

from gml.kernels import bf16, fp32
from gml.runtime.rules import base
from gml.runtime.rules.base import Builder, Call, Eltwise, TranslationRule, Unsupported, Val
from gml.runtime.rules.eltwise import float_binary


def _single_channel(weight: torch.Tensor) -> str | None:
    """Why a conv with one input and one output channel (ECA's channel attention: a Conv1d(1, 1, k)
    over the pooled channels) stays in torch: oneDNN 3.2 has only its reference kernel for it on every
    ISA (its jitted convs block channels by 8 or 16), fp32 and INT8 alike."""
    if weight.shape[0] == 1 and weight.shape[1] == 1:
        return "a conv with one input and one output channel (oneDNN has only its reference kernel for it)"
    return None


def _check_conv(c: Call) -> str | None:
    if c.a.weight.dim() not in (3, 4, 5):
        return f"INT8 conv with a {c.a.weight.dim()}-D weight (the engine plans 1-D, 2-D and 3-D convs)"
    return _single_channel(c.a.weight)


def _emit_conv(b: Builder, c: Call, ins: list[Val], out: Val, *, sum_with: Val | None = None) -> None:
    a, x = c.a, ins[0]
    if x.dtype_name != "u8" or len(x.shape) != a.weight.dim():
        raise Unsupported(f"conv input {x.dtype_name} rank {len(x.shape)} (expects uint8 of the weight's rank)")
    k = tuple(a.weight.shape[2:])
    stride, padding, dilation = tuple(a.stride), tuple(a.padding), tuple(a.dilation)
    x, padding, pad_r = _absorb_pad(b, x, out, k, stride, dilation, padding, float(base.x_qparams(a).zero_point))
    x = base.as_nhwc(b, x)
    dst = out
    if sum_with is None and not base.is_nhwc(out):  # compute channels-last, then copy into the layout wanted
        dst = b.temp(out.shape, base.nhwc_strides(out.shape), out.dtype_name)
    if sum_with is None:
        eltwise, out_q = base.eltwise_of(base.post_op_of(a)), base.out_qparams(a)
    else:  # qconv_add: post_op is none or relu, the output uint8
        eltwise, out_q = ([("relu", 0.0, 0.0)] if a.post_op == "relu" else []), base.out_qparams(a)
    b.conv(
        x,
        dst,
        weight=a.weight,
        w_scales=a.weight_scale,
        bias=a.bias,
        stride=stride,
        dilation=tuple(d - 1 for d in dilation),
        pad_l=padding,
        pad_r=pad_r,
        groups=a.groups,
        src_q=base.qp(base.x_qparams(a)),
        dst_q=base.qp(out_q),
        sum_q=None if sum_with is None else base.qp(base.qparams(a.other_scale, a.other_zero_point)),
        eltwise=eltwise,
    )
    if dst is not out:
        b.reorder(dst, out, src_q=None, dst_q=None)


def _emit_conv_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # post_op(conv(x) + other) with oneDNN's ``sum`` post-op, accumulated in place into the skip
    # buffer: the output shares other's memory (the builder copies other first only if it is still
    # read later or belongs to the caller).
    b.share(out, ins[1], also_read=ins[0])
    _emit_conv(b, c, ins[:1], out, sum_with=ins[1])


def _check_fconv(c: Call) -> str | None:
    mod = c.a
    if mod.weight.dim() not in (3, 4, 5):
        return f"fp32 conv with a {mod.weight.dim()}-D weight (the engine plans 1-D, 2-D and 3-D convs)"
    if not mod.fused:
        return "the fp32 kernels are unavailable (the module runs its ATen fallback)"
    return _single_channel(mod.weight)


def _absorb_pad(
    b: Builder,
    x: Val,
    out: Val,
    k: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    zero: float = 0.0,
) -> tuple[Val, tuple[int, ...], list[int]]:
    """``(source, pad_l, pad_r)`` of a conv: when ``x`` is a pad of the spatial dims with the conv's
    zero (0.0; an INT8 conv's source zero point) not written yet (:meth:`Builder.pending_pad`), its
    source with the pad's widths added to the conv's own: ``conv(pad(s, p), pad=q) = conv(s, pad=p +
    q)``, the same sums (both pad with the value that stands for 0). Kept only while every window
    still overlaps the source (padding within the window's extent, as oneDNN's jitted convs take
    it); else ``x`` as it is."""
    pad_r = base.pads_right(x, out, k, stride, dilation, padding)
    p = b.pending_pad(x)
    if p is None or p.value != zero or len(p.pads) != len(padding) + 2 or any(sum(d) for d in p.pads[:2]):
        return x, tuple(padding), pad_r
    pad_l = tuple(q + before for q, (before, _) in zip(padding, p.pads[2:], strict=True))
    new_r = base.pads_right(p.src, out, k, stride, dilation, pad_l)
    extent = [(kk - 1) * d for kk, d in zip(k, dilation, strict=True)]
    if any(v > e for v, e in zip((*pad_l, *new_r), extent * 2, strict=True)):
        return x, tuple(padding), pad_r
    return p.src, pad_l, new_r


def _emit_fconv(
    b: Builder,
    c: Call,
    ins: list[Val],
    out: Val,
    *,
    sum_with: Val | None = None,
    dtype: str = "f32",
    eltwise: Eltwise | None = None,
) -> None:
    """A float conv (fp32, or bf16 with fp32 accumulation): weights reordered once, bias fp32; a
    zero pad before it is its own padding (:func:`_absorb_pad`). ``eltwise``: the post-ops, when not
    the module's own."""
    mod, x = c.a, ins[0]
    if x.dtype_name != dtype or len(x.shape) != mod.weight.dim() or (dtype == "bf16" and len(x.shape) != 4):
        raise Unsupported(f"{dtype} conv input {x.dtype_name} rank {len(x.shape)}")
    k = tuple(mod.weight.shape[2:])
    x, padding, pad_r = _absorb_pad(b, x, out, k, tuple(mod.stride), tuple(mod.dilation), tuple(mod.padding))
    if eltwise is None:
        eltwise = base.eltwise_of(mod.post_op) if sum_with is None else _relu_of(mod)
    b.conv(
        x,
        out,
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        stride=mod.stride,
        dilation=tuple(d - 1 for d in mod.dilation),
        pad_l=padding,
        pad_r=pad_r,
        groups=mod.groups,
        src_q=None,
        dst_q=None,
        sum_q=None if sum_with is None else (1.0, 0),
        eltwise=eltwise,
    )


def _relu_of(mod: torch.nn.Module) -> Eltwise:
    """A conv + add module's activation after the sum (``relu=True``), as post-ops."""
    return [("relu", 0.0, 0.0)] if getattr(mod, "relu", False) else []


def _emit_fconv_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # conv(x) + other accumulated in other's memory (a copy if other lives on or is x itself)
    if ins[1].shape != out.shape:
        _conv_then_broadcast_add(b, c, ins[0], ins[1], out, "f32")
        return
    b.share(out, ins[1], also_read=ins[0])
    _emit_fconv(b, c, ins[:1], out, sum_with=ins[1])


def _conv_then_broadcast_add(b: Builder, c: Call, x: Val, other: Val, out: Val, dtype: str) -> None:
    """``conv(x) + other`` where ``other`` broadcasts over the output (visformer's position
    embedding, batch 1, added to its patch embedding's conv at a batch above 1). oneDNN's ``sum``
    post-op adds a tensor of the destination's own shape in place: the plan had read the bytes past a
    batch-1 addend for the other images (wrong numbers, different on every run). The conv writes a
    temp in the output's layout, then one binary add broadcasts ``other``, with the module's ReLU."""
    if out.free:  # the binary writes a fixed layout: the conv's own for a 4-D fp32 value (NHWC)
        rank4 = len(out.shape) == 4
        out.free, out.tie = False, None
        out.stride = base.nhwc_strides(out.shape) if rank4 else base.contiguous_strides(out.shape)
    t = b.temp(out.shape, out.stride, dtype)
    _emit_fconv(b, c, [x], t, dtype=dtype, eltwise=[])
    float_binary(b, t, other, out, "add", eltwise=_relu_of(c.a))


def _emit_bconv(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    _emit_fconv(b, c, [base.bf16_src(b, ins[0])], out, dtype="bf16")


def _emit_bconv_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    if ins[1].dtype_name != "bf16":
        raise Unsupported(f"bf16 conv + add of a {ins[1].dtype_name} tensor")
    x = base.bf16_src(b, ins[0])
    if ins[1].shape != out.shape:
        _conv_then_broadcast_add(b, c, x, ins[1], out, "bf16")
        return
    b.share(out, ins[1], also_read=x)
    _emit_fconv(b, c, [x], out, sum_with=ins[1], dtype="bf16")


def _check_batch_norm(c: Call) -> str | None:
    mod = c.a
    if mod.training or mod.running_mean is None or mod.running_var is None:
        return "BatchNorm with batch statistics (training mode or no running statistics)"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype != torch.float32:
        return f"BatchNorm of a {dtype} tensor (the engine's BatchNorm is fp32)"
    return None


def _emit_batch_norm(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``y = (x - mean) / sqrt(var + eps) * w + b = x * s + t`` per channel, with ``s = w / sqrt(var +
    eps)`` and ``t = b - mean * s``: a depthwise 1 × 1 conv of weight ``s`` and bias ``t`` (a jitted
    oneDNN kernel on every ISA, in the free layout of the convs around it)."""
    mod, x = c.a, ins[0]
    if x.dtype_name != "f32" or len(x.shape) != 4:
        raise Unsupported(f"BatchNorm of a rank-{len(x.shape)} {x.dtype_name} value")
    var, mean = mod.running_var.detach().double(), mod.running_mean.detach().double()
    scale = torch.rsqrt(var + mod.eps)
    shift = -mean * scale
    if mod.weight is not None:
        scale, shift = scale * mod.weight.detach().double(), shift * mod.weight.detach().double()
    if mod.bias is not None:
        shift = shift + mod.bias.detach().double()
    channels = x.shape[1]
    b.conv(
        x,
        out,
        weight=scale.float().reshape(channels, 1, 1, 1),
        w_scales=torch.ones(1),
        bias=shift.float(),
        stride=(1, 1),
        dilation=(0, 0),
        pad_l=(0, 0),
        pad_r=(0, 0),
        groups=channels,
        src_q=None,
        dst_q=None,
        sum_q=None,
        eltwise=[],
    )


#: fp32 convs write (and read) free layouts: oneDNN's fp32 conv kernels run fastest in the layout
#: they pick; bf16 convs do not (they take NHWC bf16, :func:`bf16_src`)
RULES: dict[object, TranslationRule] = {
    "qconv": TranslationRule(_check_conv, _emit_conv),
    "qconv_add": TranslationRule(_check_conv, _emit_conv_add, 2),
    fp32.FusedConv: TranslationRule(_check_fconv, _emit_fconv, writes_free=True, reads_free=True),
    fp32.FusedConvAdd: TranslationRule(_check_fconv, _emit_fconv_add, 2, writes_free=True, reads_free=True),
    bf16.Bf16Conv: TranslationRule(_check_fconv, _emit_bconv),
    bf16.Bf16ConvAdd: TranslationRule(_check_fconv, _emit_bconv_add, 2),
    torch.nn.BatchNorm2d: TranslationRule(_check_batch_norm, _emit_batch_norm, writes_free=True, reads_free=True),
}
