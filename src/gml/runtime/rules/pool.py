"""Translation rules: pooling — INT8 ``gml.qmax_pool`` / ``gml.qavg_pool2d`` /
``gml.qadaptive_avg_pool`` / ``gml.qmean`` (the spatial mean as the global average pool it is) and
torch.nn's fp32 / bf16 pool modules; each one oneDNN pooling primitive, a requantization as its
``linear`` post-op."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx

from gml.runtime.rules import base
from gml.runtime.rules.base import Builder, Call, Eltwise, TranslationRule, Unsupported, Val


def _int8_pool(b: Builder, x: Val, out: Val, **kw: Any) -> None:
    """An INT8 pool from and into channels-last (:func:`base.as_nhwc`; a plain NCHW destination is
    written NHWC first, then copied): oneDNN 3.2 runs INT8 pools of other layouts on ``ref:any``."""
    x = base.as_nhwc(b, x)
    if base.is_nhwc(out):
        b.pool(x, out, **kw)
        return
    t = b.temp(out.shape, base.nhwc_strides(out.shape), out.dtype_name)
    b.pool(x, t, **kw)
    b.reorder(t, out, src_q=None, dst_q=None)


def _check_maxpool(c: Call) -> str | None:
    n = len(c.a.kernel_size)
    return None if n in (1, 2, 3) else f"{n}-D max pool (the engine plans 1-D to 3-D pools)"


def _emit_maxpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, a = ins[0], c.a
    k, s, p, d = (tuple(v) for v in (a.kernel_size, a.stride, a.padding, a.dilation))
    if len(x.shape) != len(k) + 2:
        raise Unsupported(f"{len(k)}-D max pool of a rank-{len(x.shape)} input")
    pad_r = base.pads_right(x, out, k, s, d, p)
    # the output keeps x's qparams
    dil = tuple(v - 1 for v in d)
    _int8_pool(b, x, out, alg="max", kernel=k, stride=s, dilation=dil, pad_l=p, pad_r=pad_r, eltwise=[])


def _check_avgpool(c: Call) -> str | None:
    a = c.a
    if a.divisor_override is not None:
        return "avg pool with divisor_override"
    if a.ceil_mode:
        return "avg pool with ceil_mode"
    if a.count_include_pad and any(a.padding) and a.x_zero_point != 0:
        return "avg pool counting padding with a non-zero input zero point (padding is the zero point there)"
    return None


def _emit_avgpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, a = ins[0], c.a
    k, s, p = (tuple(v) for v in (a.kernel_size, a.stride, a.padding))
    pad_r = base.pads_right(x, out, k, s, (1, 1), p)
    alg = "avg_include" if a.count_include_pad else "avg_exclude"
    eltwise = base.requant_eltwise(base.x_qparams(a), base.out_qparams(a))
    _int8_pool(b, x, out, alg=alg, kernel=k, stride=s, dilation=(0, 0), pad_l=p, pad_r=pad_r, eltwise=eltwise)


def _emit_adaptive(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    _emit_adaptive_pool(b, ins[0], out, base.requant_eltwise(base.x_qparams(c.a), base.out_qparams(c.a)))


def _check_qmean(c: Call) -> str | None:
    dims = sorted(int(d) for d in c.a.dim)
    meta = c.inputs[0].meta.get("val", c.inputs[0].meta.get("tensor_meta")) if c.inputs else None
    rank = len(meta.shape) if getattr(meta, "shape", None) is not None else None
    if dims == [2, 3] or (dims == [-2, -1] and rank == 4):
        return None
    return f"qmean over dims {list(c.a.dim)} (the engine takes the spatial mean of an NCHW tensor)"


def _emit_qmean(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """The spatial mean (squeeze-excite's) as the global average pool it is (the Python kernel runs
    the same pool): one pooling primitive with the requantization as its post-op. In torch it split
    every mixnet / efficientnet INT8 block's engine segment in two (issue #16, tf_mixnet_s)."""
    x = ins[0]
    if len(x.shape) != 4:
        raise Unsupported(f"qmean of a rank-{len(x.shape)} tensor")
    if len(out.shape) == 2:  # keepdim=False: the pool writes [N, C, 1, 1] into out's bytes
        out = b.view(out, (*out.shape, 1, 1), (*out.stride, 1, 1))
    _emit_adaptive_pool(b, x, out, base.requant_eltwise(base.x_qparams(c.a), base.out_qparams(c.a)))


def _check_fpool(c: Call) -> str | None:
    mod = c.a
    if isinstance(mod, torch.nn.MaxPool2d) and mod.return_indices:
        return "max pool returning indices"
    if isinstance(mod, torch.nn.AvgPool2d):
        if mod.divisor_override is not None:
            return "avg pool with divisor_override"
        if mod.ceil_mode and mod.count_include_pad and any(_pair(mod.padding)):
            # the last window may pass the padding: torch divides it by its clipped size (emit checks)
            return "avg pool with ceil_mode counting its padding"
    return None


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _emit_fpool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # nn.MaxPool2d / nn.AvgPool2d / nn.AdaptiveAvgPool2d of an fp32 or bf16 graph
    mod, x = c.a, ins[0]
    if x.dtype_name not in ("f32", "bf16") or len(x.shape) != 4:
        raise Unsupported(f"pool module on a {x.dtype_name} rank-{len(x.shape)} input")
    if isinstance(mod, torch.nn.AdaptiveAvgPool2d):
        _emit_adaptive_pool(b, x, out, [])
        return
    k, s = _pair(mod.kernel_size), _pair(mod.stride if mod.stride is not None else mod.kernel_size)
    p = _pair(mod.padding)
    d = _pair(getattr(mod, "dilation", 1))
    pad_r = base.pads_right(x, out, k, s, d, p)
    if isinstance(mod, torch.nn.MaxPool2d):
        alg = "max"
    elif mod.count_include_pad and any(p):
        # torch divides by the window clipped to the padded input: a ceil_mode window that passes the
        # padding (oneDNN's pad_r > the padding) counts fewer elements than oneDNN's whole kernel
        if any(r > left for r, left in zip(pad_r, p)):
            raise Unsupported("avg pool counting its padding whose ceil_mode window passes the padding")
        alg = "avg_include"
    else:
        # no padding to count (timm ResNet-D's AvgPool2d(2, 2, ceil_mode=True) shortcut, or
        # count_include_pad=False): torch divides by the input elements in the window, as oneDNN's
        # avg_exclude does, the ceil_mode window at the edge included
        alg = "avg_exclude"
    b.pool(x, out, alg=alg, kernel=k, stride=s, dilation=tuple(v - 1 for v in d), pad_l=p, pad_r=pad_r, eltwise=[])


def _emit_adaptive_pool(b: Builder, x: Val, out: Val, eltwise: Eltwise) -> None:
    size, osize = base.spatial(x), base.spatial(out)
    if not 1 <= len(size) <= 3 or len(osize) != len(size):
        raise Unsupported(f"adaptive pool {tuple(size)} -> {tuple(osize)}")
    if any(i % o for i, o in zip(size, osize)):
        if eltwise or x.dtype_name != "f32" or out.dtype_name != "f32":
            raise Unsupported(f"adaptive pool {tuple(size)} -> {tuple(osize)} is not a regular pooling window")
        _emit_pool_as_matmul(b, x, out)
        return
    k = tuple(i // o for i, o in zip(size, osize))
    zero = (0,) * len(k)
    b.pool(x, out, alg="avg_exclude", kernel=k, stride=k, dilation=zero, pad_l=zero, pad_r=zero, eltwise=eltwise)


#: the largest ``prod(in) * prod(out)`` averaging matrix an irregular adaptive pool is planned with
#: (16 MiB of fp32); beyond it the matmul does far more work than the pool it replaces
MAX_POOL_MATRIX = 1 << 22


def adaptive_pool_matrix(size: tuple[int, ...], osize: tuple[int, ...]) -> torch.Tensor:
    """``[prod(size), prod(osize)]``: column ``o`` averages output element ``o``'s window. torch's
    adaptive window for output ``i`` of ``n`` from ``m`` is ``[floor(i m / n), ceil((i + 1) m / n))``;
    over several spatial dims the window is the product of each dim's, so the matrix is the
    Kronecker product of the per-dim averaging matrices (row-major flattening on both sides)."""
    mats = []
    for m, n in zip(size, osize, strict=True):
        a = torch.zeros(n, m, dtype=torch.float64)
        for i in range(n):
            lo, hi = (i * m) // n, -((-(i + 1) * m) // n)
            a[i, lo:hi] = 1.0 / (hi - lo)
        mats.append(a)
    k = mats[0]
    for a in mats[1:]:
        k = torch.kron(k, a)
    return k.t().contiguous().float()


def _emit_pool_as_matmul(b: Builder, x: Val, out: Val) -> None:
    """An adaptive average pool whose windows differ in size (VGG's ``AdaptiveAvgPool2d(7)`` of a
    5 x 5 map, AlexNet's 6 of anything but 6 x k): no oneDNN pooling has such windows, but the pool is
    linear in each channel's map, ``out[n, c] = x[n, c] @ K`` over the flattened spatial dims
    (:func:`adaptive_pool_matrix`): one matmul with a constant weight, on NCHW rows. Before, the whole
    segment ran in torch for such input sizes."""
    size, osize = base.spatial(x), base.spatial(out)
    n, c, p, q = x.shape[0], x.shape[1], math.prod(size), math.prod(osize)
    if p * q > MAX_POOL_MATRIX:
        raise Unsupported(f"adaptive pool {tuple(size)} -> {tuple(osize)} with uneven windows over {p} positions")
    if x.free or x.stride != base.contiguous_strides(x.shape):
        t = b.temp(x.shape, base.contiguous_strides(x.shape), x.dtype_name)
        b.reorder(x, t, src_q=None, dst_q=None)
        x = t
    dst = out
    if out.free or out.stride != base.contiguous_strides(out.shape):
        dst = b.temp(out.shape, base.contiguous_strides(out.shape), out.dtype_name)
    rows, cols = b.view(x, (n * c, p), (p, 1)), b.view(dst, (n * c, q), (q, 1))  # oneDNN: weight's rank
    b.matmul(rows, None, cols, weight=adaptive_pool_matrix(tuple(size), tuple(osize)))
    if dst is not out:
        b.reorder(dst, out, src_q=None, dst_q=None)


#: ``torch.mean``'s function spellings (``x.mean(...)`` is the method)
MEANS = (torch.mean, torch.ops.aten.mean.dim)


def read_mean(node: fx.Node) -> Call | None:
    """``x.mean(dims, keepdim=True)`` of a float value as a ``"mean"`` :class:`Call`. Normalize makes
    the spatial mean over ``(2, 3)`` a global pool; HF FocalNet's ``ctx.mean(2, keepdim=True).mean(3,
    keepdim=True)`` (two means of one dim each) stayed in torch and cut its plan into 7 segments."""
    method = node.op == "call_method" and node.target == "mean"
    if not (method or (node.op == "call_function" and node.target in MEANS)):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node) or node.kwargs.get("dtype") is not None:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return Call("mean", SimpleNamespace(dim=dim, keepdim=keepdim), (node.args[0],))


def _mean_dims(dim: Any, rank: int) -> tuple[int, ...] | None:
    """The spatial dims (2, 3) a mean over ``dim`` averages of a rank-``rank`` value, or None."""
    dims = dim if isinstance(dim, list | tuple) else [dim]
    if rank != 4 or not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    norm = tuple(sorted({d % 4 for d in dims}))
    return norm if set(norm) <= {2, 3} else None


def _check_mean(c: Call) -> str | None:
    if c.a.keepdim is not True:
        return "a mean without keepdim (the engine's pool keeps the dims)"
    meta = c.inputs[0].meta.get("val", c.inputs[0].meta.get("tensor_meta"))
    shape = getattr(meta, "shape", None)
    if shape is not None and _mean_dims(c.a.dim, len(shape)) is None:
        return f"a mean over dims {c.a.dim} of a rank-{len(shape)} value (the engine averages H and W of a 4-D one)"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"a mean of a {dtype} value"
    return None


def _emit_mean(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """The mean over H and / or W as one average pool whose window is those dims: ``avg_exclude``
    without padding divides by the window's element count, as the mean does."""
    x = ins[0]
    dims = _mean_dims(c.a.dim, len(x.shape))
    if dims is None or x.dtype_name not in ("f32", "bf16") or out.dtype_name != x.dtype_name:
        raise Unsupported(f"mean over dims {c.a.dim} of a {x.dtype_name} rank-{len(x.shape)} value")
    k = tuple(x.shape[d] if d in dims else 1 for d in (2, 3))
    b.pool(x, out, alg="avg_exclude", kernel=k, stride=k, dilation=(0, 0), pad_l=(0, 0), pad_r=(0, 0), eltwise=[])


#: the most slices a sum over one dim adds (the radix of split attention is 2 to 4)
MAX_SUM_SLICES = 8


def read_sum(node: fx.Node) -> Call | None:
    """``x.sum(dim)`` / ``torch.sum(x, dim)`` of one dim as a ``"sum"`` :class:`Call` (SKNet's and
    ResNeSt's sum of the radix paths, ``x.sum(dim=1)`` of ``[B, radix, C, H, W]``)."""
    method = node.op == "call_method" and node.target == "sum"
    if not (method or (node.op == "call_function" and node.target is torch.sum)):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return Call("sum", SimpleNamespace(dim=dim, keepdim=keepdim, dtype=node.kwargs.get("dtype")), (node.args[0],))


def _sum_dim(dim: Any) -> int | None:
    if isinstance(dim, list | tuple) and len(dim) == 1:
        dim = dim[0]
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


def _check_sum(c: Call) -> str | None:
    if c.a.dtype is not None:
        return f"a sum to {c.a.dtype}"
    if _sum_dim(c.a.dim) is None:
        return f"a sum over dims {c.a.dim!r} (the engine adds the slices of one dim)"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"a sum of a {dtype} value"
    return None


def _emit_sum(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """A sum over one dim of up to :data:`MAX_SUM_SLICES` values as binary adds of its slices (views
    of ``x``), into ``out``: ``out = x[:, 0] + x[:, 1]``, then ``out += x[:, i]``, in index order as
    torch's sum of so few does. A slice's size-1 dims take the output's strides (they address
    nothing), so a batch-1 slice is as dense as the output and needs no copy before the add."""
    x = ins[0]
    d = _sum_dim(c.a.dim)
    if d is None or x.dtype_name not in ("f32", "bf16") or out.dtype_name != x.dtype_name or not x.shape:
        raise Unsupported(f"sum over {c.a.dim!r} of a {x.dtype_name} rank-{len(x.shape)} value")
    d %= len(x.shape)
    r = x.shape[d]
    if r > MAX_SUM_SLICES:
        raise Unsupported(f"a sum over {r} values (the engine adds up to {MAX_SUM_SLICES} slices)")
    shape = x.shape[:d] + x.shape[d + 1 :]
    if len(shape) == 0:
        raise Unsupported("a sum to a 0-d value")
    o_stride = out.stride[:d] + out.stride[d + 1 :] if c.a.keepdim else out.stride
    acc = b.view(out, shape, o_stride) if c.a.keepdim else out
    x_stride = x.stride[:d] + x.stride[d + 1 :]
    item = 2 if x.dtype_name == "bf16" else 4
    slices = [
        b.view(
            x,
            shape,
            tuple(o if n == 1 else s for n, s, o in zip(shape, x_stride, o_stride)),
            offset=i * x.stride[d] * item,
        )
        for i in range(r)
    ]
    if r == 1:
        b.reorder(slices[0], acc, src_q=None, dst_q=None)
        return
    b.binary(slices[0], slices[1], acc, "add", scale0=None, scale1=None, eltwise=[])
    for v in slices[2:]:
        b.binary(acc, v, acc, "add", scale0=None, scale1=None, eltwise=[])


#: fp32 pools write and read free layouts, as fp32 convs do (gml.runtime.rules.conv)
RULES: dict[object, TranslationRule] = {
    "qmax_pool": TranslationRule(_check_maxpool, _emit_maxpool),
    "qavg_pool2d": TranslationRule(_check_avgpool, _emit_avgpool),
    "qadaptive_avg_pool": TranslationRule(base.always, _emit_adaptive),
    "qmean": TranslationRule(_check_qmean, _emit_qmean),
    "mean": TranslationRule(_check_mean, _emit_mean),  # a float spatial mean of one or both dims
    "sum": TranslationRule(_check_sum, _emit_sum),  # a float sum over one short dim
    torch.nn.MaxPool2d: TranslationRule(_check_fpool, _emit_fpool, writes_free=True, reads_free=True),
    torch.nn.AvgPool2d: TranslationRule(_check_fpool, _emit_fpool, writes_free=True, reads_free=True),
    torch.nn.AdaptiveAvgPool2d: TranslationRule(_check_fpool, _emit_fpool, writes_free=True, reads_free=True),
}
