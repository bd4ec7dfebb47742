"""The transformer rows of the translation table (#15 / #14): LayerNorm, attention, float adds, split.

Each function here is a ``check`` or an ``emit`` of a :class:`~gml.runtime.translate.Rule` (the rows
are listed in :data:`gml.runtime.translate.RULES`); they write the engine's transformer steps
(``Builder.layer_norm`` / ``matmul`` / ``softmax``, native/eltwise.h and native/linear.h):

==========================  ========================================================================
node                        engine steps
==========================  ========================================================================
``nn.LayerNorm`` (last dim)  one oneDNN ``layer_normalization`` (statistics in fp32; f32 or bf16 in
                            and out, as the Python executor's values are) over the rows view
``gml.attention``           ``S = Q @ Kᵀ`` (matmul, fp32 accumulation and fp32 output; ``Kᵀ`` is K's
                            strides swapped, no copy) with the scale (eltwise ``linear``) and the
                            mask (binary ``add``, broadcast over heads / queries) as post-ops →
                            ``P = softmax(S)`` (fp32 math, written in Q's dtype) → ``O = P @ V``;
                            on an AVX512-BF16 CPU: the same math as one fused step
                            (``Builder.attention``, native/attention.h, ADR 009;
                            :func:`fused_attention_ok` says when)
``gml.nn.Add`` (float)      one binary ``add`` (oneDNN broadcasts the smaller operand); f32 / bf16,
                            mixed operands promote as torch does (the executor's output dtype)
``split`` + ``getitem``     views of the split tensor (no step): the QKV merge's ``q, k, v``
``nn.Embedding``            one gather step (int64 ids, rows read from the module's table in place)
==========================  ========================================================================

**Masks.** A float mask is added as it is. A bool mask (``True`` = attend, SDPA's convention) is
converted once per plan to an additive one, ``(m - 1) * FLT_MAX`` (one u8 → f32 reorder with a zero
point), not ``-inf``: ``0 * inf`` would be NaN. A masked score becomes ``-FLT_MAX`` and its softmax
weight exactly 0, as with ``-inf``; only a query row whose keys are *all* masked differs (SDPA gives
NaN there, the engine the uniform average) — padded batches never mask every key of a row.
Dimensions a mask has by broadcasting (``expand``: stride 0) are described with size 1, so the
``[B, 1, L, S]`` boolean masks transformers builds are read without materializing them.

A constant mask (a model's buffer, e.g. a causal mask) and ``is_causal`` (SDPA's top-left aligned
``j <= i``) are additive fp32 constants the plan owns, one more binary post-op each.

**Not covered** (the node stays in torch with this reason): masks of another dtype, a scale
computed at run time, LayerNorm over more than the last dim.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx, nn

from gml.ir.target import Target
from gml.runtime.plan import Builder, Unsupported, Val, dtype_name

#: a gml.runtime.translate.Call (not imported: translate imports this module; the functions here
#: import what they need from it when they run)
Call = Any

#: the additive mask value of a masked key: finite, so that ``(m - 1) * MASKED`` is never NaN
MASKED = float(torch.finfo(torch.float32).max)
_FLOATS = (torch.float32, torch.bfloat16)
#: a matmul post-op (gml.runtime.plan.PostOps)
PostOp = tuple[str, float, float, "Val | None"]
_SPLITS = (torch.split, torch.functional.split, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)


def meta_dtype(node: Any) -> torch.dtype | None:
    """The dtype shape propagation / export recorded for ``node`` (None when unknown: a segment's
    own placeholders; the emit functions check the values' actual dtypes again)."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta.get("val", node.meta.get("tensor_meta"))
    return getattr(meta, "dtype", None)


# ---------------------------------------------------------------- split / getitem (views)
def is_split(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "split"
    return node.op == "call_function" and node.target in _SPLITS


def read_split(node: fx.Node) -> Call | None:
    """A ``split`` or a ``getitem`` of one as a :class:`Call` (both read the split's source)."""
    from gml.runtime.translate import Call

    if is_split(node) and node.args and isinstance(node.args[0], fx.Node):
        return Call("split", SimpleNamespace(node=node), (node.args[0],))
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and is_split(node.args[0])
        and isinstance(node.args[1], int)
    ):
        return Call("split_item", SimpleNamespace(index=node.args[1]), (node.args[0],))
    return None


def check_split(c: Call) -> str | None:
    from gml.runtime.translate import check_move_source

    if not all(u.op == "call_function" and u.target is operator.getitem for u in c.a.node.users):
        return "a split whose pieces are not taken apart by getitem"
    return check_move_source(c.inputs[0], "split")


def check_split_item(c: Call) -> str | None:
    """A piece of a split runs in the engine only where its split does: the piece of a split that
    stays in torch (its source is a torch op's value) is a torch view, and a segment given the
    split's tuple of pieces as its input could not plan it (timm mixnet_s: every mixed 1x1 conv's
    segment recompiled on each call, then ran its Python executor)."""
    split = c.inputs[0]
    if split.op == "placeholder":  # a segment's own graph: the partition vetted the split
        return None
    whole = read_split(split)
    if whole is None:
        return "a piece of a value that is not a split"
    reason = check_split(whole)
    return None if reason is None else f"its split stays in torch ({reason})"


def emit_split_item(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if not b.is_view_of(out, x):
        raise Unsupported("a split piece that is not a view of its source")
    b.alias(out, x)


# ---------------------------------------------------------------- LayerNorm
def check_layer_norm(c: Call) -> str | None:
    mod = c.a
    if type(mod) is not nn.LayerNorm:
        return f"{type(mod).__module__}.{type(mod).__name__} (not torch.nn.LayerNorm)"
    if len(mod.normalized_shape) != 1:
        return f"LayerNorm over {len(mod.normalized_shape)} dims (the engine normalizes the last dim)"
    dtype = meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in _FLOATS:
        return f"LayerNorm of a {dtype} tensor"
    return None


def _dense_rows(b: Builder, v: Val) -> Val:
    """``v`` as ``[rows, features]`` with unit feature stride: a view, or a contiguous copy."""
    from gml.runtime.translate import _as_rows, _contiguous_strides

    if v.stride[-1] != 1 and v.shape[-1] != 1:
        t = b.temp(v.shape, _contiguous_strides(v.shape), v.dtype_name)
        b.reorder(v, t, src_q=None, dst_q=None)
        v = t
    return _as_rows(b, v) if len(v.shape) != 2 else v


def emit_layer_norm(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    from gml.runtime.translate import _as_rows

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
    out = _as_rows(b, out, output=True) if len(out.shape) != 2 else out
    b.layer_norm(x, out, gamma=mod.weight, beta=mod.bias, eps=float(mod.eps))


# ---------------------------------------------------------------- float add (residuals)
def check_float_add(c: Call) -> str | None:
    from gml import nn as gnn

    if type(c.a) is not gnn.Add or c.a.alpha != 1:
        return f"{type(c.a).__name__} with alpha {getattr(c.a, 'alpha', '?')}"
    if any(n.op == "get_attr" for n in c.inputs):
        return "add of a constant (the engine adds two computed values)"
    dtypes = [meta_dtype(n) for n in c.inputs]
    if len(dtypes) != 2 or any(d is not None and d not in _FLOATS for d in dtypes):
        return f"add of {', '.join(str(d) for d in dtypes)} tensors (the engine adds fp32 / bf16)"
    return None


def emit_float_add(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, y = ins
    if {x.dtype_name, y.dtype_name, out.dtype_name} - {"f32", "bf16"}:
        raise Unsupported(f"add of {x.dtype_name} and {y.dtype_name}")
    if _fuse_into_linear(b, x, y, out) or _fuse_into_linear(b, y, x, out):
        return
    if _fuse_into_dynamic_linear(b, x, y, out) or _fuse_into_dynamic_linear(b, y, x, out):
        return
    if x.shape != out.shape:  # oneDNN broadcasts the second source only
        x, y = y, x
    if x.shape != out.shape or len(y.shape) > len(out.shape):
        raise Unsupported(f"add of {x.shape} and {y.shape} broadcasting both operands")
    # oneDNN 3.2's binary has no jitted kernel for mixed bf16 / f32 sources (measured: ref:any,
    # 2-6 ms for a 128 x 384 add): such operands are converted to the output's dtype first
    if x.dtype_name != out.dtype_name:
        x = _converted(b, x, out.dtype_name)
    if y.dtype_name != out.dtype_name:
        y = _converted(b, y, out.dtype_name)
    y = broadcast_view(b, y, len(out.shape))
    b.binary(x, y, out, "add", scale0=None, scale1=None, eltwise=[])


def _converted(b: Builder, v: Val, dtype: str) -> Val:
    t = b.temp(v.shape, v.stride, dtype)
    b.reorder(v, t, src_q=None, dst_q=None)
    return t


def _fuse_into_linear(b: Builder, lin: Val, other: Val, out: Val) -> bool:
    """``linear(x) + other`` as one matmul with a binary ``add`` post-op (see :func:`_extend_linear`):
    ``out = post_op(x Wᵀ + b) + other`` in the fp32 accumulator (a bf16 linear's output is then not
    rounded to bf16 before the add: one rounding fewer than the Python executor)."""
    from gml.runtime.translate import _as_rows, _rows_strides

    if other.free or other.shape != out.shape or _rows_strides(other) is None:
        return False
    return _extend_linear(b, lin, out, lambda: [("binary_add", 0.0, 0.0, _as_rows(b, other))])


def _fuse_into_dynamic_linear(b: Builder, lin: Val, other: Val, out: Val) -> bool:
    """``dynamic_linear(x) + other`` (a transformer's residual after its INT8 GEMM) as one step: the
    add is the matmul's last post-op, in fp32 after the rescale / bias / activation, as the Python
    executor adds (the same fp32 operations in the same order). Only when the step just recorded is
    that linear node's own, nothing else reads its output, and all three are plain fp32 rows."""
    from gml.runtime.translate import _as_rows, _rows_strides

    if not b.steps or lin.node is None or b.steps[-1].method != "dynamic_linear":
        return False
    step = b.steps[-1]
    src, dst = step.kwargs["rows"]
    if len(step.reads) != 1 or step.name != lin.node.name or dst.group is not lin.group or dst.offset != lin.offset:
        return False
    if b.last_use.get(lin.node, 0) != b.pos or lin.shape != out.shape or other.shape != out.shape:
        return False
    if other.free or out.free or other.dtype_name != "f32" or out.dtype_name != "f32":
        return False
    # dense rows only: a strided binary post-op operand sends oneDNN 3.2's matmul to its reference kernel
    if any(_rows_strides(v) is None or _rows_strides(v)[1] != 1 for v in (other, out)):
        return False
    rows_out, rows_other = _as_rows(b, out, output=True), _as_rows(b, other)
    if rows_out.shape != dst.shape or rows_other.shape != dst.shape:
        return False
    b.steps.pop()
    kw = {k: v for k, v in step.kwargs.items() if k != "rows"}
    b.dynamic_linear(src, rows_out, residual=rows_other, **kw)
    b.steps[-1].name = f"{step.name}+{b.node_name}"
    return True


def _extend_linear(b: Builder, lin: Val, out: Val, extra: Callable[[], list[PostOp]]) -> bool:
    """Append post-ops to the float linear that just wrote ``lin`` and write ``out`` instead, when
    the step just recorded is that linear node's own (an inner product, or a matmul this function
    made) and nothing else reads ``lin``. The step is re-recorded as one matmul with constant
    weights (oneDNN's inner product takes no binary post-op)."""
    from gml.runtime.translate import _as_rows, _rows_strides

    if not b.steps or lin.node is None or lin.free or out.free or lin.shape != out.shape:
        return False
    step = b.steps[-1]
    if step.method == "inner_product":
        if step.kwargs.get("src_q") is not None or step.kwargs["weight"].dtype not in _FLOATS:
            return False
        weight = step.kwargs["weight"].detach().t()
        post: list[PostOp] = [(a, al, be, None) for a, al, be in step.kwargs["eltwise"]]
    elif step.method == "matmul" and step.kwargs["weight"] is not None:
        weight, post = step.kwargs["weight"], list(step.kwargs["post"])
    else:
        return False
    # the step is the linear node's own (not a view of its output in another order: a transpose)
    own = step.name.split("+")[-1] == lin.node.name and step.writes[0].group is lin.group
    if not own or b.last_use.get(lin.node, 0) != b.pos or _rows_strides(out) is None:
        return False
    b.steps.pop()
    post += extra()
    b.matmul(step.reads[0], None, _as_rows(b, out, output=True), weight=weight, bias=step.kwargs["bias"], post=post)
    b.steps[-1].name = f"{step.name}+{b.node_name}"
    return True


# ---------------------------------------------------------------- element-wise activations
#: float activation modules → oneDNN eltwise (algorithm, alpha, beta)
_ELTWISE: dict[type[nn.Module], Callable[[Any], tuple[str, float, float]]] = {
    nn.GELU: lambda m: ("gelu_tanh" if m.approximate == "tanh" else "gelu_erf", 0.0, 0.0),
    nn.ReLU: lambda m: ("relu", 0.0, 0.0),
    nn.Tanh: lambda m: ("tanh", 0.0, 0.0),
    nn.Sigmoid: lambda m: ("logistic", 0.0, 0.0),
    nn.SiLU: lambda m: ("swish", 1.0, 0.0),
}


def check_eltwise(c: Call) -> str | None:
    if type(c.a) not in _ELTWISE:
        return f"{type(c.a).__module__}.{type(c.a).__name__} (not a torch.nn activation the engine has)"
    dtype = meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in _FLOATS:
        return f"{type(c.a).__name__} of a {dtype} tensor"
    return None


def emit_eltwise(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """A post-op of the linear before it when nothing else reads that linear's output; else one
    ``max(x, x)`` binary with the activation as its post-op (the primitive that takes any rank)."""
    x = ins[0]
    if x.dtype_name not in ("f32", "bf16") or out.dtype_name != x.dtype_name or x.shape != out.shape:
        raise Unsupported(f"{type(c.a).__name__} of {x.dtype_name} {x.shape} -> {out.dtype_name} {out.shape}")
    alg, alpha, beta = _ELTWISE[type(c.a)](c.a)
    if _extend_linear(b, x, out, lambda: [(alg, alpha, beta, None)]):
        return
    b.binary(x, x, out, "max", scale0=None, scale1=None, eltwise=[(alg, alpha, beta)])


# ---------------------------------------------------------------- embedding lookups
def check_embedding(c: Call) -> str | None:
    mod = c.a
    if type(mod) is not nn.Embedding:
        return f"{type(mod).__module__}.{type(mod).__name__} (not torch.nn.Embedding)"
    if mod.max_norm is not None:
        return "Embedding with max_norm (it renormalizes the table in place on every lookup)"
    if mod.weight.dim() != 2 or mod.weight.dtype not in _FLOATS:
        return f"Embedding of a {mod.weight.dtype} table"
    dtype = meta_dtype(c.inputs[0])
    if dtype is not None and dtype != torch.int64:
        return f"Embedding of {dtype} ids (the engine reads int64 ids)"
    return None


def emit_embedding(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """One gather step (native/shape.h ``EmbeddingStep``): the word-embedding lookup of a token-id
    model in the same plan as the encoder (it was a torch call between engine segments)."""
    from gml.runtime.translate import _contiguous_strides

    ids, w = ins[0], c.a.weight
    if ids.dtype_name != "s64":
        raise Unsupported(f"Embedding of {ids.dtype_name} ids")
    want = (*ids.shape, w.shape[1])
    if out.dtype_name != dtype_name(w.dtype) or out.shape != want or out.stride != _contiguous_strides(want):
        raise Unsupported(f"Embedding output {out.dtype_name} {out.shape} / {out.stride} for ids {ids.shape}")
    if w.stride(1) != 1:
        raise Unsupported(f"an Embedding table with strides {w.stride()}")
    b.embedding(ids, out, weight=w)


# ---------------------------------------------------------------- a padding mask's arithmetic
# transformers' mask builder turns ``attention_mask`` ([B, S] int64) into SDPA's bool mask with
# ``to(bool)``, ``index`` by arange tensors (size-only values: gml.runtime.shape_values), ``&`` and
# ``expand``; as engine steps the whole model is one plan (#15: short sentences).
_aten = torch.ops.aten
_TO_OPS = (_aten.to.device, _aten.to.dtype, _aten.to.dtype_layout)
_AND_OPS = (_aten.__and__.Tensor, _aten.bitwise_and.Tensor)  # tensor-only schemas (not operator.and_ on ints)
_EXPAND_OPS = (_aten.expand.default,)


def read_mask_op(node: fx.Node) -> Call | None:
    """``to(bool)``, ``index``, ``&`` of two tensors and ``expand`` as a :class:`Call`, else None."""
    from gml.runtime.translate import Call

    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    t, args = node.target, node.args
    if node.op == "call_function" and t in _TO_OPS:
        named = {a.name: a.default_value if a.has_default_value() else None for a in t._schema.arguments}
        named.update({a.name: v for a, v in zip(t._schema.arguments, args)}, **node.kwargs)
        keep = ("dtype", "device", "memory_format", "copy")
        return Call("to_bool", SimpleNamespace(**{k: named.get(k) for k in keep}), (args[0],))
    if node.op == "call_function" and t is _aten.index.Tensor and len(args) == 2:
        idx = list(args[1])
        if all(isinstance(i, fx.Node) for i in idx):
            return Call("index", SimpleNamespace(), (args[0], *idx))
        return Call("index", SimpleNamespace(has_none=True), (args[0],))
    if node.op == "call_function" and t in _AND_OPS and len(args) == 2 and isinstance(args[1], fx.Node):
        return Call("and", SimpleNamespace(), (args[0], args[1]))
    if (node.op == "call_function" and t in _EXPAND_OPS) or (node.op == "call_method" and t == "expand"):
        return Call("expand_mask", SimpleNamespace(node=node), (args[0],))
    return None


def check_to_bool(c: Call) -> str | None:
    a = c.a
    if a.dtype is not torch.bool:
        return f"a conversion to {a.dtype} (the engine converts masks to bool only)"
    if a.device is not None and torch.device(a.device).type != "cpu":
        return f"a conversion to {a.device}"
    if a.memory_format not in (None, torch.preserve_format):
        return f"a conversion to {a.memory_format}"
    if a.copy:
        return "a conversion with copy=True"
    src = meta_dtype(c.inputs[0])
    if src is not None and src not in (torch.int64, torch.bool):
        return f"a conversion of a {src} tensor to bool (the engine converts int64 masks)"
    return None


def emit_to_bool(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if x.dtype_name == "u8" and b.is_view_of(out, x):  # bool -> bool: torch returns the tensor itself
        b.alias(out, x)
        return
    if x.dtype_name != "s64" or not _is_bool(out) or out.shape != x.shape:
        raise Unsupported(f"{x.dtype_name} -> bool")
    b.mask_op("ne0", [x], _dense_out(out), [_broadcast_strides(x, out.shape)])


def check_index(c: Call) -> str | None:
    if getattr(c.a, "has_none", False):
        return "index with None entries (the engine indexes leading dims by int64 tensors)"
    idx = [meta_dtype(n) for n in c.inputs[1:]]
    if any(d is not None and d != torch.int64 for d in idx):
        return f"index by {', '.join(str(d) for d in idx)} tensors (the engine takes int64 indices)"
    return None


def emit_index(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``out = x[i0, .., ik-1]`` (aten.index with int64 index tensors on x's leading dims)."""
    x, idx = ins[0], ins[1:]
    k = len(idx)
    if any(i.dtype_name != "s64" for i in idx) or k == 0 or k > len(x.shape):
        raise Unsupported(f"index of a rank-{len(x.shape)} tensor by {k} tensors")
    bshape = tuple(torch.broadcast_shapes(*(i.shape for i in idx)))
    rest = tuple(x.shape[k:])
    if out.shape != bshape + rest or out.dtype_name != x.dtype_name:
        raise Unsupported(f"index output {out.shape} for {x.shape} by {[i.shape for i in idx]}")
    pad = (0,) * len(rest)
    strides = [(0,) * len(bshape) + tuple(x.stride[k:])]
    strides += [_broadcast_strides(i, bshape) + pad for i in idx]
    b.mask_op("index", [x, *idx], _dense_out(out), strides, tuple(x.shape[:k]), tuple(x.stride[:k]))


def check_mask_and(c: Call) -> str | None:
    dtypes = [meta_dtype(n) for n in c.inputs]
    if any(d is not None and d is not torch.bool for d in dtypes):
        return f"& of {', '.join(str(d) for d in dtypes)} tensors (the engine ands bool masks)"
    return None


def emit_mask_and(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x, y = ins
    if not (_is_bool(x) and _is_bool(y) and _is_bool(out)):  # uint8 & uint8 is bitwise: not this kernel
        raise Unsupported(f"& of {x.dtype_name} and {y.dtype_name}")
    shape = tuple(out.shape)
    if tuple(torch.broadcast_shapes(x.shape, y.shape)) != shape:
        raise Unsupported(f"& of {x.shape} and {y.shape} into {shape}")
    b.mask_op("and", [x, y], _dense_out(out), [_broadcast_strides(x, shape), _broadcast_strides(y, shape)])


def check_expand_mask(c: Call) -> str | None:
    from gml.ir.attention import is_attention

    def reads_as_mask(u: fx.Node) -> bool:
        mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
        return is_attention(u) and mask is c.a.node and c.a.node not in u.args[:3]

    users = list(c.a.node.users)
    if not users or not all(reads_as_mask(u) for u in users):
        return "expand of a value that is not an attention mask (the engine reads expanded masks only)"
    return None


def emit_expand_mask(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    if not b.is_view_of(out, ins[0]):
        raise Unsupported("an expand that copied")
    b.alias(out, ins[0])  # stride-0 dims: the attention reads them as size 1 (broadcast_view)


def _is_bool(v: Val) -> bool:
    """A torch.bool value (the engine's ``u8`` is uint8 or bool: the executor's tensor tells which)."""
    return v.dtype_name == "u8" and v.ref is not None and v.ref.dtype == torch.bool


def _broadcast_strides(v: Val, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``v``'s strides (elements) read as ``shape`` by broadcasting: 0 along a dim ``v`` has as 1."""
    lead = len(shape) - len(v.shape)
    return tuple(
        0 if i < lead or v.shape[i - lead] == 1 else v.stride[i - lead] for i in range(len(shape))
    )


def _dense_out(v: Val) -> Val:
    from gml.runtime.translate import _contiguous_strides

    if v.stride != _contiguous_strides(v.shape) and 0 not in v.shape:
        raise Unsupported(f"a mask op writing layout {v.stride}")
    return v


# ---------------------------------------------------------------- attention
def check_attention(c: Call) -> str | None:
    a = c.a
    if not (a.scale is None or isinstance(a.scale, int | float)):
        return "attention scale computed at run time"
    if isinstance(a.attn_mask, torch.Tensor) and a.attn_mask.dtype not in (torch.bool, *_FLOATS):
        return f"a constant {a.attn_mask.dtype} attention mask"
    dtypes = [meta_dtype(n) for n in c.inputs[:3]]
    if None in dtypes:
        return None
    if len(set(dtypes)) != 1 or dtypes[0] not in _FLOATS:
        return f"attention on {', '.join(str(d) for d in dtypes)} q / k / v"
    if a.attn_mask is not None:
        m = meta_dtype(a.attn_mask)
        if m is not None and m not in (torch.bool, dtypes[0]):
            return f"a {m} attention mask with {dtypes[0]} q / k / v"
    return None


def broadcast_view(b: Builder, v: Val, rank: int) -> Val:
    """``v`` with leading 1s up to ``rank`` and every stride-0 (expanded) dim seen as size 1."""
    shape = (1,) * (rank - len(v.shape)) + tuple(v.shape)
    stride = (0,) * (rank - len(v.shape)) + tuple(v.stride)
    if shape == v.shape and 0 not in stride:
        return v
    shape = tuple(1 if s == 0 else d for d, s in zip(shape, stride))
    dense, acc = [], 1  # strides of size-1 dims are free: give them plain values oneDNN accepts
    for d, s in reversed(list(zip(shape, stride))):
        dense.append(s if d != 1 else acc)
        acc = max(acc, (s if d != 1 else acc) * d)
    return b.view(v, shape, tuple(reversed(dense)))


def _additive_mask(b: Builder, m: Val, rank: int, keys: int) -> Val:
    """The float mask to add to the scores (see the module docstring), once per plan.

    A mask that varies along the queries but not along the ``keys`` (``[..., L, 1]`` after
    :func:`broadcast_view`; HF ViT's all-true ``[B, 1, L, L]`` expand) is written out ``[..., L, keys]``
    (one reorder reading it with stride 0 along the keys): oneDNN's matmul has no jitted kernel for a
    binary post-op broadcast that way, on any ISA (``ref:any``, 0.8 s per ViT attention under AVX2)."""
    from gml.runtime.translate import _contiguous_strides

    memo = b.memo.setdefault("attention_masks", {})
    key = id(m)
    if key in memo:
        return memo[key]
    out = broadcast_view(b, m, rank)
    if m.dtype_name == "u8":  # a bool mask (torch.bool is the engine's u8)
        t = b.temp(out.shape, _contiguous_strides(out.shape), "f32")
        b.reorder(out, t, src_q=(MASKED, 1), dst_q=None)  # (m - 1) * FLT_MAX
        out = t
    if rank >= 2 and out.shape[-2] > 1 and out.shape[-1] == 1 and keys > 1:  # per query: written out
        # a plain fp32 copy reads the stride 0 (oneDNN 3.2's jitted reorder from a stride-0 u8 source
        # with a zero point writes wrong values: 37,824 of 197 x 197, so the bool conversion stays above)
        wide = b.view(out, (*out.shape[:-1], keys), (*out.stride[:-1], 0))
        t = b.temp(wide.shape, _contiguous_strides(wide.shape), "f32")
        b.reorder(wide, t, src_q=None, dst_q=None)
        out = t
    memo[key] = out
    return out


def _additive_constant(m: torch.Tensor, rank: int) -> torch.Tensor:
    """A constant mask as the fp32 tensor added to the scores, with leading 1s up to ``rank``."""
    m = m.detach()
    add = torch.zeros(m.shape).masked_fill(~m, -MASKED) if m.dtype == torch.bool else m.float()
    return add.reshape((1,) * (rank - add.dim()) + tuple(add.shape)).contiguous()


def emit_attention(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    from gml.runtime.translate import _contiguous_strides

    q, k, v = ins[:3]
    a = c.a
    if len(ins) > 3 and ins[3].dtype_name not in ("u8", q.dtype_name):
        raise Unsupported(f"a {ins[3].dtype_name} attention mask with {q.dtype_name} q / k / v")
    if len({q.dtype_name, k.dtype_name, v.dtype_name}) != 1 or q.dtype_name not in ("f32", "bf16"):
        raise Unsupported(f"attention on {q.dtype_name} / {k.dtype_name} / {v.dtype_name}")
    rank = len(q.shape)
    if rank < 2 or len(k.shape) != rank or len(v.shape) != rank or 0 in q.shape or 0 in k.shape:
        raise Unsupported(f"attention of shapes {q.shape}, {k.shape}, {v.shape}")
    L, E, S = q.shape[-2], q.shape[-1], k.shape[-2]
    batch = tuple(max(x, y, z) for x, y, z in zip(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    dims_ok = all(t.shape[i] in (1, d) for t in (q, k, v) for i, d in enumerate(batch))
    if not dims_ok or k.shape[-1] != E or v.shape[-2] != S or out.shape != (*batch, L, v.shape[-1]):
        raise Unsupported(f"attention output {out.shape} for q {q.shape}, v {v.shape}")
    scale = float(a.scale) if a.scale is not None else 1.0 / math.sqrt(E)
    masks: list[Val] = []
    if isinstance(a.attn_mask, torch.Tensor):  # a constant (a model's buffer): made additive here
        masks.append(b.constant(_additive_constant(a.attn_mask, rank)))
    elif len(ins) > 3:
        masks.append(_additive_mask(b, ins[3], rank, k.shape[-2]))
    if a.is_causal:  # SDPA's: query i sees keys j <= i (top-left aligned)
        keep = torch.ones(L, S, dtype=torch.bool).tril()
        masks.append(b.constant(_additive_constant(keep, rank)))
    if fused_attention_ok(q, k, v, out, b.target):
        b.attention(q, k, v, out, masks=[_f32(b, m) for m in masks], scale=scale)
        return
    # dense copies of strided heads (pieces of the merged QKV output): oneDNN's brgemm matmul
    # takes dense operands only, else its gemm:jit fallback (measured on MiniLM bf16: Q.K^T
    # 0.31 -> 0.15 ms, P.V 0.11 -> 0.07 ms for three 10 us reorders)
    q, k, v = (_dense(b, t) for t in (q, k, v))
    kt = b.view(k, (*k.shape[:-2], E, S), (*k.stride[:-2], k.stride[-1], k.stride[-2]))
    post: list[tuple[str, float, float, Val | None]] = [("linear", scale, 0.0, None)]
    post += [("binary_add", 0.0, 0.0, m) for m in masks]
    scores_shape = (*batch, L, S)
    scores = b.temp(scores_shape, _contiguous_strides(scores_shape), "f32")
    b.matmul(q, kt, scores, post=post)
    probs = b.temp(scores_shape, _contiguous_strides(scores_shape), q.dtype_name)
    b.softmax(scores, probs, rank - 1)
    b.matmul(probs, v, out)


#: ``GML_ATTENTION``: ``auto`` (default), ``fused`` or ``primitives`` — which bf16 attention path the
#: engine plans (docs/adr/009-fused-bf16-attention.md).
ATTENTION_ENV = "GML_ATTENTION"


def fused_attention_cpu(target: Target) -> bool:
    """Whether ``target`` runs the fused attention kernel (native/attention.h): AVX-512 with native
    bf16 on the target (``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16 says no) and on the CPU (the
    engine checks the instructions exist)."""
    from gml.runtime import native

    return target.avx512 and target.native_bf16 and bool(native.load().fused_attention_available())


def fused_attention_ok(q: Val, k: Val, v: Val, out: Val, target: Target) -> bool:
    """Whether ``gml.attention`` runs as the engine's one fused step (native/attention.h) instead of
    matmul → softmax → matmul: operands of one dtype with unit last-dim strides, an even head size, a
    ``target`` with AVX-512 and native bf16 (and a CPU that has the instructions, which the engine
    checks: ``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16 turns it off). ``auto``: bf16 only, and not
    on an AMX target (oneDNN's AMX matmuls; the fused
    kernel is not measured there yet). fp32 runs fused only when forced (``fused``): on Zen 4 it is
    level with the primitives (MiniLM fp32 and INT8, ADR 009), both bound by fp32 FMA throughput.
    """
    import os


    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower()
    if choice not in ("auto", "fused", "primitives"):
        from gml.errors import InputError

        raise InputError(f"{ATTENTION_ENV}={choice!r} is not an attention path.", hint="use auto, fused or primitives.")
    if choice == "primitives":
        return False
    if not fused_attention_cpu(target):
        return False
    tensors = (q, k, v, out)
    dtype = q.dtype_name
    if dtype not in ("bf16", "f32") or any(t.dtype_name != dtype for t in tensors):
        return False
    if choice == "auto" and (dtype != "bf16" or target.amx):
        return False
    if any(t.shape[-1] > 1 and t.stride[-1] != 1 for t in tensors):
        return False
    return q.shape[-1] % 2 == 0 and out.shape[-1] == v.shape[-1]


def _f32(b: Builder, m: Val) -> Val:
    """An additive mask as fp32 (the fused step adds fp32 masks; a bf16 model's float mask is bf16)."""
    from gml.runtime.translate import _contiguous_strides

    if m.dtype_name == "f32":
        return m
    t = b.temp(m.shape, _contiguous_strides(m.shape), "f32")
    b.reorder(m, t, src_q=None, dst_q=None)
    return t


def _dense(b: Builder, v: Val) -> Val:
    from gml.runtime.translate import _contiguous_strides

    if v.stride == _contiguous_strides(v.shape):
        return v
    t = b.temp(v.shape, _contiguous_strides(v.shape), v.dtype_name)
    b.reorder(v, t, src_q=None, dst_q=None)
    return t
