"""Translation rules: element-wise ops, binary ops and normalization — INT8 ``gml.qadd`` /
``gml.qmul`` / ``gml.qactivation``, ``gml.quantize`` / ``dequantize`` / ``requantize`` and the bf16
casts (reorders), float residual adds (``gml.nn.Add``), torch.nn activations and ``nn.LayerNorm``.

An INT8 activation is ``max(x, x)`` (the one oneDNN primitive that takes any rank and layout) with
the dequantize → function → quantize chain as post-ops; a float add or activation right after the
linear that made its operand becomes that linear's post-op (gml.runtime.rules.linear)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml import nn as gnn
from gml.ir.ops import modules_tagged
from gml.ir.values import PostOp, QParams
from gml.kernels import bf16
from gml.kernels import fp32 as k32
from gml.kernels.backend import clamp_bounds
from gml.runtime.rules import base
from gml.runtime.rules.base import Builder, Call, Eltwise, TranslationRule, Unsupported, Val
from gml.runtime.rules.linear import extend_linear, fuse_into_dynamic_linear, fuse_into_linear


def _check_add(c: Call) -> str | None:
    return None if c.a.post_op in ("none", "relu") else f"INT8 add with post-op {c.a.post_op}"


def _operand_qparams(c: Call) -> tuple[QParams, QParams, QParams | None]:
    """A binary INT8 op's operand ``a`` / ``b`` and output qparams."""
    a = c.a
    return base.qparams(a.a_scale, a.a_zero_point), base.qparams(a.b_scale, a.b_zero_point), base.out_qparams(a)


def _emit_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    qa, qb, o = _operand_qparams(c)
    if ins[0].shape != ins[1].shape:
        raise Unsupported("broadcasting INT8 add")
    # binary computes s_a*a + s_b*b; the zero points and the output quantization are a linear
    # post-op, relu the clip at the output zero point.
    shift = -(qa.scale * qa.zero_point + qb.scale * qb.zero_point)
    eltwise: Eltwise = [("linear", 1.0 / o.scale, shift / o.scale + o.zero_point)]
    if c.a.post_op == "relu":
        eltwise.append(("clip", float(o.zero_point), 255.0))
    b.binary(ins[0], ins[1], out, "add", scale0=qa.scale, scale1=qb.scale, eltwise=eltwise)


def _activation_post_op(c: Call) -> PostOp:
    return PostOp(c.a.op, tuple(c.a.scalars), "")


def _check_activation(c: Call) -> str | None:
    if c.a.op in ("relu", "hardtanh"):
        return None
    try:
        base.eltwise_of(_activation_post_op(c))
    except (Unsupported, ValueError) as e:
        return f"INT8 {c.a.op}: {e}"
    return None


def _emit_activation(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # All as post-ops of max(x, x), the one primitive that takes any rank and layout.
    in_q, out_q = base.x_qparams(c.a), base.out_qparams(c.a)
    if c.a.op in ("relu", "hardtanh"):
        # a clamp of the integers (exact: quantization is monotone, see
        # gml.kernels.backend.clamp_bounds), then the requantization
        lo, hi = (in_q.zero_point, 255) if c.a.op == "relu" else clamp_bounds(in_q, *c.a.scalars)
        eltwise: Eltwise = [("clip", float(lo), float(hi)), *base.requant_eltwise(in_q, out_q)]
    else:
        # hardswish, sigmoid, hardsigmoid, ...: dequantize (s * (q - z)), the function on real
        # values, quantize (y / s_out + z_out; the u8 destination rounds to nearest and saturates)
        eltwise = [
            ("linear", in_q.scale, -in_q.scale * in_q.zero_point),
            *base.eltwise_of(_activation_post_op(c)),
            ("linear", 1.0 / out_q.scale, float(out_q.zero_point)),
        ]
    b.binary(ins[0], ins[0], out, "max", scale0=None, scale1=None, eltwise=eltwise)


def _emit_mul(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # s_a (a - z_a) * s_b (b - z_b) / s_out + z_out. The binary primitive scales its sources but
    # takes no zero points: an operand with one is dequantized to fp32 first (a zero-point-free
    # operand, e.g. a ReLU output or a sigmoid gate, is read as uint8 directly).
    a, bq, o = _operand_qparams(c)
    srcs: list[tuple[Val, float | None]] = []
    for v, q in zip(ins, (a, bq)):
        if q.zero_point:
            t = b.temp(v.shape, v.stride, "f32")
            b.reorder(v, t, src_q=base.qp(q), dst_q=None)
            srcs.append((t, None))
        else:
            srcs.append((v, q.scale))
    if srcs[0][0].shape != out.shape:  # oneDNN 3.2 broadcasts the second source only
        srcs.reverse()
    (x, sx), (y, sy) = srcs
    if x.shape != out.shape:
        raise Unsupported(f"INT8 mul with both inputs broadcast ({x.shape} * {y.shape})")
    if len(y.shape) < len(out.shape):  # numpy broadcasting: leading 1s
        pad = len(out.shape) - len(y.shape)
        outer = y.shape[0] * y.stride[0] if y.shape else 1
        y = b.view(y, (1,) * pad + y.shape, (outer,) * pad + y.stride)
    eltwise: Eltwise = [("linear", 1.0 / o.scale, float(o.zero_point))]
    b.binary(x, y, out, "mul", scale0=sx, scale1=sy, eltwise=eltwise)


def _emit_quantize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    if ins[0].dtype_name != "f32":
        raise Unsupported(f"quantize of a {ins[0].dtype_name} tensor")
    b.reorder(ins[0], out, src_q=None, dst_q=base.qp(base.out_qparams(c.a)))


def _emit_dequantize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=base.qp(base.x_qparams(c.a)), dst_q=None)


def _emit_requantize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=base.qp(base.x_qparams(c.a)), dst_q=base.qp(base.out_qparams(c.a)))


#: gml.kernels.bf16's dtype conversions (call_function nodes of a bf16 graph)
CASTS = (bf16.to_fp32, bf16.to_bf16)


def _emit_cast(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    b.reorder(ins[0], out, src_q=None, dst_q=None)  # f32 <-> bf16 (round to nearest even), any layout


def check_float_add(c: Call) -> str | None:
    if c.a.alpha not in (1, -1):  # -1: ``x - y`` (Normalize spells a sub as ATen computes it)
        return f"{type(c.a).__name__} with alpha {c.a.alpha}"
    return _check_float_binary(c, "add" if c.a.alpha == 1 else "sub")


def _check_float_binary(c: Call, op: str) -> str | None:
    consts = [n for n in c.inputs if n.op == "get_attr"]
    if len(consts) > 1:
        return f"{op} of two constants"
    dtypes = [base.meta_dtype(n) for n in c.inputs]
    if len(dtypes) != 2 or any(d is not None and d not in base.FLOATS for d in dtypes):
        verb = "adds" if op == "add" else "multiplies"
        return f"{op} of {', '.join(str(d) for d in dtypes)} tensors (the engine {verb} fp32 / bf16)"
    return None


def check_float_mul(c: Call) -> str | None:
    return _check_float_binary(c, "mul")


def emit_float_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, y = ins
    if {x.dtype_name, y.dtype_name, out.dtype_name} - {"f32", "bf16"}:
        raise Unsupported(f"add of {x.dtype_name} and {y.dtype_name}")
    if c.a.alpha == -1:
        float_binary(b, x, y, out, "sub")
        return
    if fuse_into_linear(b, x, y, out) or fuse_into_linear(b, y, x, out):
        return
    if fuse_into_dynamic_linear(b, x, y, out) or fuse_into_dynamic_linear(b, y, x, out):
        return
    float_binary(b, x, y, out, "add")


def emit_float_mul(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    float_binary(b, ins[0], ins[1], out, "mul")


def check_add_relu(c: Call) -> str | None:
    return _check_float_binary(c, "add")


def emit_add_relu(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    # kernels.fp32.AddReLU: relu(a + b) (a residual sum no conv took: SE-ResNeXt's gated branch)
    float_binary(b, ins[0], ins[1], out, "add", eltwise=[("relu", 0.0, 0.0)])


def float_binary(b: Builder, x: Val, y: Val, out: Val, alg: str, *, eltwise: Eltwise | None = None) -> None:
    """One oneDNN binary ``x <alg> y`` (add, mul, sub); the operand that broadcasts (a constant
    vector: MobileBERT's NoNorm ``x * w + b``; a squeeze-excite gate ``x * g`` with ``g`` of shape
    N×C×1×1) is the second source (add and mul commute; a sub's first operand must be the full one).
    Layouts oneDNN has only its reference binary for run as GML's strided loop (native/strided.h)."""
    if {x.dtype_name, y.dtype_name, out.dtype_name} - {"f32", "bf16"}:
        raise Unsupported(f"{alg} of {x.dtype_name} and {y.dtype_name}")
    if x.shape != out.shape and alg != "sub":  # oneDNN broadcasts the second source only
        x, y = y, x
    if len(x.shape) > len(out.shape) or len(y.shape) > len(out.shape):
        raise Unsupported(f"{alg} of {x.shape} and {y.shape} into {out.shape}")
    if x.shape != out.shape:  # both operands broadcast (HF FocalNet's (1, 1, H, W) gate times (1, C, 1, 1)):
        # x spread over a plan-owned zero tensor of out's shape first (one binary add), then the op
        dtype = torch.float32 if out.dtype_name == "f32" else torch.bfloat16
        zeros = b.constant(torch.zeros(out.shape, dtype=dtype))
        full = b.temp(out.shape, base.contiguous_strides(out.shape), out.dtype_name)
        xs = base.converted(b, x, out.dtype_name) if x.dtype_name != out.dtype_name else x
        b.binary(zeros, _broadcast_source(b, xs, len(out.shape)), full, "add", scale0=None, scale1=None, eltwise=[])
        x = full
    # oneDNN 3.2's binary has no jitted kernel for mixed bf16 / f32 sources (measured: ref:any,
    # 2-6 ms for a 128 x 384 add): such operands are converted to the output's dtype first
    if x.dtype_name != out.dtype_name:
        x = base.converted(b, x, out.dtype_name)
    if y.dtype_name != out.dtype_name:
        y = base.converted(b, y, out.dtype_name)
    b.binary(x, _broadcast_source(b, y, len(out.shape)), out, alg, scale0=None, scale1=None, eltwise=eltwise or [])


def _broadcast_source(b: Builder, v: Val, rank: int) -> Val:
    """``v`` as a binary's broadcast source of ``rank`` dims: a constant operand as a plan-owned copy
    of that rank (a view of a plan constant cannot be planned: visformer's and botnet26t's position
    terms), anything else as a view (:func:`base.broadcast_view`)."""
    if v.group is not None and v.group.where == "const" and v.ref is not None:
        return b.constant(v.ref.reshape((1,) * (rank - v.ref.dim()) + tuple(v.ref.shape)))
    return base.broadcast_view(b, v, rank)


#: float activation modules: every one the op vocabulary tags an activation; those with a oneDNN
#: eltwise form (kernels.fp32.post_op_of_module, the fusions' own table) run, the rest keep the reason
_ACTIVATIONS = modules_tagged("activation")


def _activation_eltwise(mod: nn.Module) -> Eltwise | str:
    post_op = k32.post_op_of_module(mod)
    return post_op if isinstance(post_op, str) else base.eltwise_of(post_op)


def check_eltwise(c: Call) -> str | None:
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"{type(c.a).__name__} of a {dtype} tensor"
    eltwise = _activation_eltwise(c.a)
    return eltwise if isinstance(eltwise, str) else None


def emit_eltwise(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    eltwise = _activation_eltwise(c.a)
    if isinstance(eltwise, str):
        raise Unsupported(eltwise)
    _unary(b, c, ins[0], out, eltwise)


def _unary(b: Builder, c: Call, x: Val, out: Val, eltwise: Eltwise) -> None:
    """A post-op of the linear before it when nothing else reads that linear's output; else one
    ``max(x, x)`` binary with ``eltwise`` as its post-ops (the primitive that takes any rank)."""
    if x.dtype_name not in ("f32", "bf16") or out.dtype_name != x.dtype_name or x.shape != out.shape:
        raise Unsupported(f"{type(c.a).__name__} of {x.dtype_name} {x.shape} -> {out.dtype_name} {out.shape}")
    if extend_linear(b, x, out, lambda: [(alg, alpha, beta, None) for alg, alpha, beta in eltwise]):
        return
    b.binary(x, x, out, "max", scale0=None, scale1=None, eltwise=eltwise)


def _scalar_eltwise(mod: gnn.MulScalar | gnn.AddScalar) -> Eltwise:
    """``x * s`` is ``linear(s, 0)``; ``x + alpha * s`` is ``linear(1, alpha * s)`` (one rounding,
    as torch's: the scalar product is exact for the alpha of 1 and -1 Normalize writes)."""
    if isinstance(mod, gnn.MulScalar):
        return [("linear", float(mod.other), 0.0)]
    return [("linear", 1.0, float(mod.alpha * mod.other))]


def check_scalar(c: Call) -> str | None:
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"{type(c.a).__name__} of a {dtype} tensor"
    numbers = [c.a.other, getattr(c.a, "alpha", 1)]
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in numbers):
        return f"{type(c.a).__name__} by {c.a.other!r}"
    return None


def emit_scalar(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``x * 0.5``, ``x + 1``, ``-x``: one eltwise ``linear`` (a post-op of the linear before it)."""
    _unary(b, c, ins[0], out, _scalar_eltwise(c.a))


#: the function spellings of softmax (``x.softmax(dim)`` is the method; ``nn.Softmax`` the module)
SOFTMAXES = (F.softmax, torch.softmax, torch.ops.aten.softmax.int)


def read_softmax(node: fx.Node) -> Call | None:
    """``F.softmax(x, dim)``, ``torch.softmax(x, dim)`` or ``x.softmax(dim)`` as a ``"softmax"``
    :class:`Call` (the ``nn.Softmax`` module's rule). Attention written out by hand (EfficientViT,
    SHViT, LeViT, GCNet, ResNeSt's split attention) calls it so; each one ended an engine segment."""
    method = node.op == "call_method" and node.target == "softmax"
    if not (method or (node.op == "call_function" and node.target in SOFTMAXES)):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dtype = node.kwargs.get("dtype")
    if node.target is not F.softmax and len(node.args) > 2:  # F.softmax's third is _stacklevel
        dtype = node.args[2]
    return Call("softmax", SimpleNamespace(dim=dim, dtype=dtype), (node.args[0],))


def check_softmax(c: Call) -> str | None:
    if getattr(c.a, "dtype", None) is not None:
        return f"Softmax to {c.a.dtype} (the engine keeps its input's dtype)"
    if not isinstance(c.a.dim, int) or isinstance(c.a.dim, bool):
        return f"Softmax over dim={c.a.dim!r} (the engine takes one given dim)"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"Softmax of a {dtype} tensor"
    return None


def emit_softmax(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """One oneDNN softmax (``softmax_accurate``: the max subtracted, fp32 math) on a dense copy of a
    strided source: attention written out (``attn.softmax(dim=-1)``) beside its matmuls."""
    x = ins[0]
    if x.dtype_name not in ("f32", "bf16") or out.dtype_name != x.dtype_name or x.shape != out.shape or not x.shape:
        raise Unsupported(f"Softmax of {x.dtype_name} {x.shape} into {out.dtype_name} {out.shape}")
    axis = c.a.dim % len(x.shape)
    if any(d != 1 for d in x.shape[axis + 1 :]):
        _softmax_not_last(b, x, out, axis)
        return
    if out.stride != base.contiguous_strides(out.shape):
        raise Unsupported(f"Softmax into a strided {out.shape}")
    b.softmax(base.dense(b, x), out, axis)


def _softmax_not_last(b: Builder, x: Val, out: Val, axis: int) -> None:
    """A softmax over another dim than the last (SKNet's and ResNeSt's split attention over the
    radix dim): oneDNN 3.2 runs it on its reference kernel (``ref:any``, on AVX2 and AVX-512 alike)
    unless the axis is innermost in memory. So the source is copied into the dense layout with
    ``axis`` innermost, the softmax runs there (jitted), and its result is copied into ``out``."""
    order = [d for d in range(len(x.shape)) if d != axis] + [axis]  # outermost first
    strides = [0] * len(x.shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= x.shape[d]
    t = b.temp(x.shape, tuple(strides), x.dtype_name)
    b.reorder(x, t, src_q=None, dst_q=None)
    y = b.temp(out.shape, tuple(strides), out.dtype_name)
    b.softmax(t, y, axis)
    b.reorder(y, out, src_q=None, dst_q=None)


def read_addcmul(node: fx.Node) -> Call | None:
    """``torch.addcmul(input, t1, t2, value=v)`` / ``input.addcmul(t1, t2)`` (``input + v · t1 · t2``) as an
    ``"addcmul"`` :class:`Call`: timm's ResMLP ``Affine`` (``addcmul(beta, alpha, x)``) and ConvNeXt-V2's
    global response norm (``addcmul(bias, weight, x * nx)``). In torch they cut the engine's plan at every
    block (ResMLP-12: 26 segments)."""
    function = node.op == "call_function" and node.target is torch.addcmul
    if not (function or (node.op == "call_method" and node.target == "addcmul")):
        return None
    args = list(node.args)
    kwargs = dict(node.kwargs)
    names = ("input", "tensor1", "tensor2", "value")
    got = dict(zip(names, args, strict=False))
    if len(args) > len(names) or any(k not in names or k in got for k in kwargs):
        return None  # (``out=``, or arguments given twice: torch's own error)
    got.update(kwargs)
    tensors = [got.get(k) for k in names[:3]]
    if not all(isinstance(t, fx.Node) for t in tensors):
        return None
    return Call("addcmul", SimpleNamespace(value=got.get("value", 1)), tuple(tensors))


def check_addcmul(c: Call) -> str | None:
    value = c.a.value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"addcmul with value={value!r} (the engine takes a finite number)"
    if all(n.op == "get_attr" for n in c.inputs):
        return "addcmul of three constants"
    dtypes = [base.meta_dtype(n) for n in c.inputs]
    if any(d is not None and d not in base.FLOATS for d in dtypes):
        return f"addcmul of {', '.join(str(d) for d in dtypes)} tensors (the engine multiplies fp32 / bf16)"
    return None


def emit_addcmul(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``input + value · (t1 · t2)``: one binary mul into a temporary of the product's broadcast shape
    (``value`` as its linear post-op unless 1), then one binary add into ``out``. torch computes
    ``(value · t1) · t2``: equal for ``value`` 1 (and any power of two), else a rounding apart."""
    x, t1, t2 = ins
    shape = tuple(torch.broadcast_shapes(t1.shape, t2.shape))
    if torch.broadcast_shapes(shape, x.shape) != torch.Size(out.shape):
        raise Unsupported(f"addcmul of {x.shape}, {t1.shape} and {t2.shape} into {out.shape}")
    product = b.temp(shape, base.contiguous_strides(shape), out.dtype_name)
    value = float(c.a.value)
    float_binary(b, t1, t2, product, "mul", eltwise=None if value == 1.0 else [("linear", value, 0.0)])
    float_binary(b, x, product, out, "add")


def read_normalize(node: fx.Node) -> Call | None:
    """``F.normalize(x, p, dim, eps)`` as a ``"normalize"`` :class:`Call` (XCiT's and EdgeNeXt's q / k)."""
    if node.op != "call_function" or node.target is not F.normalize:
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    names = ("input", "p", "dim", "eps", "out")
    got: dict[str, Any] = {"p": 2.0, "dim": 1, "eps": 1e-12, "out": None}
    got.update(zip(names[1:], node.args[1:], strict=False))
    got.update(node.kwargs)
    return Call(
        "normalize", SimpleNamespace(p=got["p"], dim=got["dim"], eps=got["eps"], out=got["out"]), (node.args[0],)
    )


def check_normalize(c: Call) -> str | None:
    a = c.a
    if a.p != 2 or a.out is not None:
        return f"F.normalize with p={a.p!r} (the engine divides by the Euclidean norm)"
    if not isinstance(a.dim, int) or isinstance(a.dim, bool):
        return f"F.normalize over dim={a.dim!r}"
    if not isinstance(a.eps, int | float) or not 0 <= a.eps < float("inf"):
        return f"F.normalize with eps={a.eps!r}"
    meta = c.inputs[0].meta.get("val", c.inputs[0].meta.get("tensor_meta"))
    shape = getattr(meta, "shape", None)
    if shape is not None and a.dim % max(len(shape), 1) != len(shape) - 1:
        return f"F.normalize over dim {a.dim} of a rank-{len(shape)} value (the engine normalizes the last dim)"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype not in (None, torch.float32):
        return f"F.normalize of a {dtype} tensor (the engine step takes fp32)"
    return None


def emit_normalize(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``x / max(‖x‖₂, eps)`` over the last dim as one ``L2NormStep`` (native/l2_norm.h) on dense rows
    (a strided source, XCiT's transposed q, is copied first)."""
    x = ins[0]
    if x.dtype_name != "f32" or out.dtype_name != "f32" or not x.shape or c.a.dim % len(x.shape) != len(x.shape) - 1:
        raise Unsupported(f"F.normalize over dim {c.a.dim} of a {x.dtype_name} rank-{len(x.shape)} value")
    x = base.dense(b, x)
    dst = (
        out
        if out.stride == base.contiguous_strides(out.shape)
        else b.temp(out.shape, base.contiguous_strides(out.shape), "f32")
    )
    b.kernel("L2NormStep", {"x": x}, {"dst": dst}, eps=float(c.a.eps))
    if dst is not out:
        b.reorder(dst, out, src_q=None, dst_q=None)


def check_layer_norm(c: Call) -> str | None:
    mod = c.a
    if len(mod.normalized_shape) != 1:
        return f"LayerNorm over {len(mod.normalized_shape)} dims (the engine normalizes the last dim)"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"LayerNorm of a {dtype} tensor"
    return None


def _dense_rows(b: Builder, v: Val) -> Val:
    """``v`` as ``[rows, features]`` with unit feature stride: a view, or a contiguous copy."""
    if v.stride[-1] != 1 and v.shape[-1] != 1:
        t = b.temp(v.shape, base.contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        v = t
    return base.as_rows(b, v) if len(v.shape) != 2 else v


def emit_layer_norm(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    mod, x = c.a, ins[0]
    if x.dtype_name not in ("f32", "bf16") or out.dtype_name not in ("f32", "bf16") or len(x.shape) < 1:
        raise Unsupported(f"LayerNorm {x.dtype_name} -> {out.dtype_name}")
    if len(x.shape) == 1:
        x, out = (
            b.view(x, (1, x.shape[0]), (x.shape[0], x.stride[0])),
            b.view(out, (1, out.shape[0]), (out.shape[0], 1)),
        )
    x = _dense_rows(b, x)
    if out.stride[-1] != 1 and out.shape[-1] != 1:
        raise Unsupported(f"LayerNorm output layout {out.stride}")
    out = base.as_rows(b, out, output=True) if len(out.shape) != 2 else out
    b.layer_norm(x, out, gamma=mod.weight, beta=mod.bias, eps=float(mod.eps))


def check_group_norm(c: Call) -> str | None:
    dtype = base.meta_dtype(c.inputs[0])
    if dtype not in (None, torch.float32):
        return f"group_norm of a {dtype} tensor (the engine step takes fp32)"
    for name in ("weight", "bias"):
        t = getattr(c.a, name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32):
            return f"group_norm's {name} is not a stored fp32 tensor"
    return None


def emit_group_norm(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``gml.group_norm`` as one ``GroupNormStep`` (native/group_norm.h) in the layout it is given: the
    channels-last one of the convs around it (a copy to plain rows and back cost as much as the
    norm itself in BiT: 96 reorders, 4.6 ms of 51, AMD EPYC Zen 4), or plain; another is copied."""
    x = ins[0]
    if x.dtype_name != "f32" or out.dtype_name != "f32":
        raise Unsupported(f"group_norm {x.dtype_name} -> {out.dtype_name} (the engine step takes fp32)")
    if not base.plain_or_channels_last(x):
        x = base.dense(b, x)
    dst = out if base.plain_or_channels_last(out) else b.temp(out.shape, base.contiguous_strides(out.shape), "f32")
    reads = {"x": x}
    for name in ("weight", "bias"):
        t = getattr(c.a, name)
        if t is not None:
            reads[name] = b.constant(t.detach().float())
    b.kernel("GroupNormStep", reads, {"dst": dst}, num_groups=int(c.a.num_groups), eps=float(c.a.eps))
    if dst is not out:
        b.reorder(dst, out, src_q=None, dst_q=None)


RULES: dict[object, TranslationRule] = {
    "qadd": TranslationRule(_check_add, _emit_add, 2),
    "qactivation": TranslationRule(_check_activation, _emit_activation),
    "qmul": TranslationRule(base.always, _emit_mul, 2),
    "quantize": TranslationRule(base.always, _emit_quantize),
    "dequantize": TranslationRule(base.always, _emit_dequantize),
    "requantize": TranslationRule(base.always, _emit_requantize),
    **{cast: TranslationRule(base.always, _emit_cast) for cast in CASTS},
    gnn.Add: TranslationRule(check_float_add, emit_float_add, 2),
    gnn.Mul: TranslationRule(check_float_mul, emit_float_mul, 2),
    gnn.MulScalar: TranslationRule(check_scalar, emit_scalar),
    gnn.AddScalar: TranslationRule(check_scalar, emit_scalar),
    k32.AddReLU: TranslationRule(check_add_relu, emit_add_relu, 2),
    **{kind: TranslationRule(check_eltwise, emit_eltwise) for kind in _ACTIVATIONS},
    nn.LayerNorm: TranslationRule(check_layer_norm, emit_layer_norm),
    nn.Softmax: TranslationRule(check_softmax, emit_softmax),
    "softmax": TranslationRule(check_softmax, emit_softmax),  # F.softmax / x.softmax (read_softmax)
    "normalize": TranslationRule(check_normalize, emit_normalize),  # F.normalize (read_normalize)
    "addcmul": TranslationRule(check_addcmul, emit_addcmul, 3),  # torch.addcmul (read_addcmul)
    "group_norm": TranslationRule(check_group_norm, emit_group_norm, writes_free=True, reads_free=True),
}
