"""Translation rules: shapes, views and gathers — the view ops (``reshape``, ``permute``, ...:
Tensor methods, their torch functions and aten overloads), ``flatten``, ``contiguous``, ``split``
and its pieces, INT8 ``gml.qcat``, and ``nn.Embedding`` (one gather step). A view the executor made
is an alias (no step at all); one that copied is a reorder."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from gml.ir.library import gml_op_name
from gml.ir.ops import pad_of
from gml.runtime.plan import PendingPad, dtype_name
from gml.runtime.rules import base
from gml.runtime.rules.base import Builder, Call, TranslationRule, Unsupported, Val

FLATTENS = (torch.flatten, torch.ops.aten.flatten.using_ints)


#: shape-only ops (Tensor methods, their torch functions and aten overloads) the engine runs as views
MOVES = frozenset(
    {
        "reshape",
        "view",
        "_unsafe_view",
        "squeeze",
        "unsqueeze",
        "permute",
        "transpose",
        "contiguous",
        "select",
        "slice",
        "getitem",  # x[:, :c] in a traced graph (basic indexing: a view; ghostnet, rexnet)
        # always views, with int arguments only: nn.MultiheadAttention's packed in-projection is
        # ``proj.unflatten(-1, (3, E))`` (in torch, it left every attention of nn.TransformerEncoder
        # and the views after it in torch)
        "unflatten",
        "narrow",
        "movedim",
        "swapaxes",
        "t",
        "detach",
    }
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _basic_index(node: fx.Node) -> bool:
    """Whether ``node`` is ``x[idx]`` of a tensor with slices, ints, ``None`` and ``...`` only (a
    view of ``x``; an index tensor or a bool gathers, and a tuple's item is a split piece)."""
    if len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return False
    src = node.args[0]
    meta = src.meta.get("val", src.meta.get("tensor_meta"))
    # a segment's own placeholder has no metadata: the partition vetted it (a tensor, never a tuple)
    if not isinstance(meta, torch.Tensor | TensorMetadata) and not (meta is None and src.op == "placeholder"):
        return False
    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)

    def basic(i: object) -> bool:
        if isinstance(i, slice):  # a bound may be a size computed at run time (Swin's x[:, :H, :W])
            bounds = (i.start, i.stop, i.step)
            return all(v is None or isinstance(v, fx.Node) or _is_int(v) for v in bounds)
        return i is None or i is Ellipsis or _is_int(i)

    return all(basic(i) for i in items)


def move_name(node: fx.Node) -> str | None:
    """``"permute"`` for ``x.permute(...)`` / ``torch.permute`` / ``aten.permute.default``, else None."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__ if node.target.namespace == "aten" else ""
    elif node.op == "call_function" and node.target is operator.getitem:
        name = "getitem" if _basic_index(node) else ""
    elif node.op == "call_function":  # torch.reshape, torch.permute, ...
        fn = str(getattr(node.target, "__name__", ""))
        name = fn if fn and getattr(torch, fn, None) is node.target else ""
    else:
        return None
    return name if name in MOVES and node.args and isinstance(node.args[0], fx.Node) else None


#: ops returning a tuple of views of their source, taken apart by getitem: torch.split, and
#: unbind / chunk (a ViT's ``q, k, v = qkv.unbind(0)``)
_SPLITS = (
    torch.split,
    torch.functional.split,
    torch.unbind,
    torch.chunk,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.unbind.int,
    torch.ops.aten.chunk.default,
)


def is_split(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("split", "unbind", "chunk")
    return node.op == "call_function" and node.target in _SPLITS


def read_split(node: fx.Node) -> Call | None:
    """A ``split`` or a ``getitem`` of one as a :class:`Call` (both read the split's source)."""
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
    if not all(u.op == "call_function" and u.target is operator.getitem for u in c.a.node.users):
        return "a split whose pieces are not taken apart by getitem"
    return check_move_source(c.inputs[0], "split", c.engine_runs)


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
    reason = check_split(replace(whole, engine_runs=c.engine_runs))
    return None if reason is None else f"its split stays in torch ({reason})"


def emit_split_item(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if not b.is_view_of(out, x):
        raise Unsupported("a split piece that is not a view of its source")
    b.alias(out, x)


#: arithmetic on sizes (``C // self.num_heads``, ``N - 1``; timm's "same" padding
#: ``(math.ceil(ih / s) - 1) * s + k - ih``): numbers fixed per plan like the sizes themselves
_SIZE_ARITHMETIC = (
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
    math.ceil,
    math.floor,
    # comparisons of sizes: the condition of a shape check (timm's patch embeds' ``H == 112``)
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.not_,
)


#: meta key of a node whose value is a size made by a :func:`read_size` node elsewhere: a segment's
#: input, or the item of a segment's outputs that returns one (gml.runtime.compile)
SIZE_INPUT = "gml_size_input"


def is_size(node: fx.Node) -> bool:
    """Whether ``node``'s value is a size: a :func:`read_size` node, or a value one made."""
    return read_size(node) is not None or bool(node.meta.get(SIZE_INPUT))


def read_size(node: fx.Node) -> Call | None:
    """A size of a tensor (``x.shape``, ``x.size()``, ``x.size(d)``, ``x.dim()``, aten's
    ``sym_size``), an item or slice of one, or arithmetic on such sizes (``_SIZE_ARITHMETIC``), as a
    ``"size"`` :class:`Call` reading the tensors whose sizes it takes.

    Every size inside a segment is fixed by the shapes its plan is made for (a plan is per input
    shape), so it needs no step; but as a torch node (timm's ``B, N, C = x.shape`` in every
    attention block) it made the tensor a segment output, cut the segment there, and a ``Size``
    entering the next segment made that segment run in torch."""
    if node.op == "call_method" and node.target in ("size", "dim") and node.args:
        src, rest = node.args[0], [*node.args[1:], *node.kwargs.values()]
        ok = isinstance(src, fx.Node) and all(isinstance(d, int) for d in rest)
        return Call("size", SimpleNamespace(), (src,)) if ok else None
    if node.op != "call_function":
        return None
    if node.target is getattr and node.args[1:] == ("shape",) and isinstance(node.args[0], fx.Node):
        return Call("size", SimpleNamespace(), (node.args[0],))
    if node.target is torch.ops.aten.sym_size.int and isinstance(node.args[0], fx.Node):
        return Call("size", SimpleNamespace(), (node.args[0],))
    if node.target is operator.getitem and len(node.args) == 2 and isinstance(node.args[0], fx.Node):
        index = node.args[1]
        if isinstance(index, int | slice) and is_size(node.args[0]):
            return Call("size", SimpleNamespace(), (node.args[0],))
        return None
    if node.target is torch._assert and node.args and isinstance(node.args[0], fx.Node) and is_size(node.args[0]):
        # a check of sizes (visformer's stages: ``_assert(H == self.img_size[0], ...)``): it held when
        # the plan was made (the segment's reference ran it on these shapes), so it holds for every
        # input the plan runs; as a torch node it cut the plan in two at each stage
        return Call("size", SimpleNamespace(), (node.args[0],))
    if node.target in _SIZE_ARITHMETIC and not node.kwargs:
        operands = [a for a in node.args if isinstance(a, fx.Node)]
        numbers = all(isinstance(a, int | float) for a in node.args if not isinstance(a, fx.Node))
        if operands and numbers and all(is_size(a) for a in operands):
            return Call("size", SimpleNamespace(), tuple(operands))
    return None


def check_size(c: Call) -> str | None:
    src = c.inputs[0]
    meta = src.meta.get("val", src.meta.get("tensor_meta"))
    if not is_size(src) and meta is not None and not isinstance(meta, torch.Tensor | TensorMetadata):
        return "a size of a value that is not a tensor"
    return None


def check_move(c: Call) -> str | None:
    # sizes computed at run time (sym_size of a dynamic dim) are ints the segment takes as inputs
    return check_move_source(c.inputs[0], c.name, c.engine_runs)


def check_move_source(src: fx.Node, op: str, engine_runs: Callable[[fx.Node], bool] | None) -> str | None:
    """Why a move (or split) of ``src`` stays in torch, or None: the value must come from a node the
    engine runs (through other moves / split pieces: ``engine_runs`` answers for that node; None:
    no node does) or be an input of a dtype the engine takes."""
    while src.op in ("call_method", "call_function") and (
        move_name(src) or src.target in FLATTENS or read_split(src) is not None
    ):
        src = src.args[0]  # type: ignore[assignment]
    if src.op == "placeholder":
        # a model input (or, in a segment's own graph, a value the partition already vetted): the
        # engine takes uint8, fp32 and bf16 tensors
        meta = src.meta.get("val", src.meta.get("tensor_meta"))
        dtype = getattr(meta, "dtype", None)
        if dtype is not None and dtype not in (torch.uint8, torch.float32, torch.bfloat16):
            return f"{op} of a {dtype} input"
        return None
    if gml_op_name(src) is None and not (engine_runs is not None and engine_runs(src)):
        return f"{op} of a value no lowered GML op made (an fp32 torch op's output: runs in torch)"
    return None


def _check_contiguous(c: Call) -> str | None:
    """``.contiguous()`` of an engine module's output (fp32 / bf16 convs), else as any move."""
    return None if c.inputs[0].op == "call_module" else check_move(c)


def _emit_move(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    if b.is_view_of(out, x):
        b.alias(out, x)  # the executor made a view (permute, squeeze, ...): no step at all
    elif out.shape == x.shape:  # contiguous(): the same elements in another layout
        b.reorder(x, out, src_q=None, dst_q=None)
    elif c.op != "permute" and c.op != "transpose" and out.stride == base.contiguous_strides(out.shape):
        # a reshape that copied: x's elements in their logical order into out's contiguous memory
        b.reorder(x, b.view(out, x.shape, base.contiguous_strides(x.shape)), src_q=None, dst_q=None)
    else:
        raise Unsupported(f"{c.op} copying into layout {out.stride}")


def emit_flatten(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    x = ins[0]
    # a view: no step at all (a conv's NHWC output flattened to [N, C, H*W], then transposed into
    # tokens: timm pvt_v2's MLP, which fell back to the Python executor for the whole segment)
    if b.is_view_of(out, x) and b.settle(x):
        b.alias(out, x)
        return
    if out.stride != base.contiguous_strides(out.shape):
        raise Unsupported(f"flatten to a non-contiguous {out.shape} (strides {out.stride})")
    # a copy in the flattened order: reorder x into out's memory seen with x's dims
    b.reorder(x, b.view(out, x.shape, base.contiguous_strides(x.shape)), src_q=None, dst_q=None)


def _emit_cat(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``gml.qcat``: sources off the output's grid are requantized into a temp first; then one
    oneDNN concat where every source is laid out in the output's dim order, else a plain reorder of
    each source straight into its slice of ``out``.

    oneDNN 3.2 has a fast concat (``simple:any``: one parallel copy) only when the sources and the
    destination share one layout; a mix (ShuffleNetV2: the channel shuffle's NCHW half beside the
    branch conv's NHWC output) found its reference concat (``ref:any``, reorders through a scratchpad),
    which the runtime reports as a bug. A reorder into a view of the slice is a jit reorder for any
    pair of plain / blocked layouts. The requantization stays a separate step into a dense temp:
    oneDNN 3.2's jit reorder drops the zero points when it writes a strided slice (``tests/runtime/
    test_ops.py::test_cat``: every element 104 off)."""
    o = base.out_qparams(c.a)
    srcs = []
    for v, s, z in zip(ins, c.a.x_scales, c.a.x_zero_points):
        q = base.qparams(s, z)
        if not q.close_to(o):  # requantize onto the output grid first
            t = b.temp(v.shape, v.stride, v.dtype_name)
            b.reorder(v, t, src_q=base.qp(q), dst_q=base.qp(o))
            v = t
        srcs.append(v)
    _concat(b, srcs, out, c.a.dim % len(out.shape))


#: torch.cat's spellings in a traced graph and in a torch.export program; torch.stack's
CATS = (torch.cat, torch.concat, torch.ops.aten.cat.default)
STACKS = (torch.stack, torch.ops.aten.stack.default)


def read_cat(node: fx.Node) -> Call | None:
    """``torch.cat(tensors, dim)`` / ``torch.stack(tensors, dim)`` of float values (an fp32 / bf16
    graph) as a :class:`Call` (``"cat"`` / ``"stack"``)."""
    if node.op != "call_function" or node.target not in (*CATS, *STACKS):
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    parts = list(tensors) if isinstance(tensors, list | tuple) else [tensors]
    op = "cat" if node.target in CATS else "stack"
    return Call(op, SimpleNamespace(dim=dim, parts=parts), tuple(t for t in parts if isinstance(t, fx.Node)))


def check_float_cat(c: Call) -> str | None:
    if not isinstance(c.a.dim, int):
        return f"{c.op} along a dim computed at run time"
    if not c.a.parts or len(c.inputs) != len(c.a.parts):
        return f"{c.op} of an operand that is not a tensor value"
    if any(n.op == "get_attr" for n in c.inputs):
        return f"{c.op} of a constant"
    dtypes = {base.meta_dtype(n) for n in c.inputs}
    if None not in dtypes and (len(dtypes) != 1 or not dtypes <= set(base.FLOATS)):
        kinds = ", ".join(sorted(map(str, dtypes)))
        return f"{c.op} of {kinds} tensors (the engine concatenates fp32 / bf16 of one dtype)"
    return None


def emit_float_cat(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``torch.cat``; ``torch.stack`` is the cat of its sources each seen with a size-1 dim at
    ``dim`` (a view: ``rot(x) = stack([-x[..., 1::2], x[..., ::2]], -1)`` interleaves the halves)."""
    if not {v.dtype_name for v in ins} | {out.dtype_name} <= {"f32", "bf16"}:
        raise Unsupported(f"{c.op} of {sorted({v.dtype_name for v in ins})} into {out.dtype_name}")
    rank = len(out.shape) - (c.op == "stack")
    if any(0 in v.shape or len(v.shape) != rank for v in ins):
        raise Unsupported(f"{c.op} of an empty tensor")
    axis = c.a.dim % len(out.shape)
    if c.op == "stack":
        if any(v.free and not b.settle(v) for v in ins):  # a view needs the source's strides
            raise Unsupported("stack of a value whose layout its writer picks")
        ins = [b.view(v, (*v.shape[:axis], 1, *v.shape[axis:]), _inserted_stride(v, axis)) for v in ins]
    # torch.cat promotes to the widest dtype (a ViT's fp32 class token before bf16 patches): exact
    srcs = [v if v.dtype_name == out.dtype_name else base.converted(b, v, out.dtype_name) for v in ins]
    _concat(b, srcs, out, axis)


def _inserted_stride(v: Val, axis: int) -> tuple[int, ...]:
    """``v``'s strides with a size-1 dim inserted at ``axis`` (its stride: the span of the dims after)."""
    inner = v.stride[axis] * v.shape[axis] if axis < len(v.shape) else 1
    return (*v.stride[:axis], inner, *v.stride[axis:])


def _concat(b: Builder, srcs: list[Val], out: Val, axis: int) -> None:
    """``out = cat(srcs, axis)``: one oneDNN concat where every source is laid out in the output's dim
    order (its fast ``simple:any`` copy), else a reorder of each source into its slice of ``out``."""
    if out.free or all(_same_order(v, out) for v in srcs):
        b.concat(srcs, out, axis)
        return
    start = 0
    for v in srcs:
        piece = b.view(out, v.shape, out.stride, offset=start * out.stride[axis] * out.itemsize)
        b.reorder(v, piece, src_q=None, dst_q=None)
        start += v.shape[axis]


def _same_order(v: Val, out: Val) -> bool:
    """Whether ``v`` lays its dims out in ``out``'s order (size-1 dims aside); a free value (its
    writer picks the layout) counts as the same: oneDNN's concat sees it first."""
    if v.free:
        return True

    def order(x: Val) -> list[int]:
        return sorted((d for d in range(len(x.shape)) if x.shape[d] != 1), key=lambda d: -x.stride[d])

    return order(v) == order(out)


def read_pad(node: fx.Node, module: nn.Module | None = None) -> Call | None:
    """``F.pad(x, pads, mode, value)`` (or a constant / zero pad ``module``: BiT's stem pad before its
    max pool) as a ``"pad"`` :class:`Call` reading ``x`` and the pads that are sizes computed at run
    time (Swin pads its tokens to whole windows: ``(ws - H % ws) % ws``)."""
    spec = pad_of(node, {} if module is None else {str(node.target): module})
    if spec is None or not isinstance(node.args[0], fx.Node):
        return None
    pads, mode, value = spec
    widths = tuple(p for p in pads if isinstance(p, fx.Node))
    return Call("pad", SimpleNamespace(pads=pads, mode=mode, value=value), (node.args[0], *widths))


#: ``F.interpolate``'s nearest modes, the ones a gather computes (``ResizeStep``, native/resize.h)
NEAREST_MODES = ("nearest", "nearest-exact")
_UPSAMPLE_MODULES = (nn.Upsample, nn.UpsamplingNearest2d)


def read_interpolate(node: fx.Node, module: nn.Module | None = None) -> Call | None:
    """``F.interpolate(x, size, scale_factor, mode, ...)`` or an ``nn.Upsample`` module as an
    ``"interpolate"`` :class:`Call` reading ``x`` and the sizes computed at run time (GhostNetV2's
    ``F.interpolate(gate, size=(H, W))``: ``x.shape`` items)."""
    if module is not None:
        if not isinstance(module, _UPSAMPLE_MODULES) or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        a = SimpleNamespace(
            size=module.size,
            scale_factor=module.scale_factor,
            mode=module.mode,
            align_corners=module.align_corners,
            recompute_scale_factor=getattr(module, "recompute_scale_factor", None),
            antialias=False,
        )
        return Call("interpolate", a, (node.args[0],))
    if node.op != "call_function" or node.target is not F.interpolate:
        return None
    names = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
    defaults = {"size": None, "scale_factor": None, "mode": "nearest", "align_corners": None}
    got = {**defaults, "recompute_scale_factor": None, "antialias": False}
    got.update(zip(names, node.args, strict=False))
    got.update(node.kwargs)
    x = got.pop("input", None)
    if not isinstance(x, fx.Node):
        return None
    sizes = tuple(v for v in _flat_args(got["size"]) if isinstance(v, fx.Node))
    return Call("interpolate", SimpleNamespace(**got), (x, *sizes))


def _flat_args(v: Any) -> list[Any]:
    return [w for item in v for w in _flat_args(item)] if isinstance(v, list | tuple) else [v]


def check_interpolate(c: Call) -> str | None:
    a = c.a
    if a.mode not in NEAREST_MODES:
        return f"interpolate mode {a.mode!r} (the engine resizes by nearest neighbour)"
    if a.antialias or a.align_corners:
        return "interpolate with antialias / align_corners"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype not in (None, torch.float32):
        return f"interpolate of a {dtype} tensor (the engine step takes fp32)"
    return None


def nearest_index(n_in: int, n_out: int, scale_factor: float | None, mode: str) -> list[int]:
    """The source position of each of ``n_out`` output positions along one dim, as torch computes it:
    torch's own 1-D interpolation of the positions ``0 .. n_in - 1`` (exact in float64), so the
    engine gathers what eager reads, rounding and clamping included, for every factor."""
    pos = torch.arange(n_in, dtype=torch.float64).view(1, 1, n_in)
    if scale_factor is None:
        out = F.interpolate(pos, size=n_out, mode=mode)
    else:
        out = F.interpolate(pos, scale_factor=scale_factor, mode=mode)
    if out.shape[-1] != n_out:
        raise Unsupported(f"interpolate by {scale_factor} gives {out.shape[-1]} positions, not {n_out}")
    return [int(v) for v in out.flatten().tolist()]


def emit_interpolate(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """A nearest-neighbour resize as one gather step (``ResizeStep``, native/resize.h) in the layout it
    is given (the convs' channels-last one, or plain; another is copied first). Each spatial dim's
    source positions come from :func:`nearest_index`."""
    x, a = ins[0], c.a
    rank = len(x.shape)
    if x.dtype_name != "f32" or out.dtype_name != "f32" or rank not in (3, 4, 5) or len(out.shape) != rank:
        raise Unsupported(f"interpolate {x.dtype_name} rank {rank} -> {out.dtype_name}")
    factors = a.scale_factor if isinstance(a.scale_factor, list | tuple) else [a.scale_factor] * (rank - 2)
    if len(factors) != rank - 2:
        raise Unsupported(f"interpolate with {len(factors)} scale factors for {rank - 2} spatial dims")
    by_size = a.size is not None or a.recompute_scale_factor
    index = [
        nearest_index(i, o, None if by_size else float(f), a.mode)
        for i, o, f in zip(x.shape[2:], out.shape[2:], factors, strict=True)
    ]
    if not base.plain_or_channels_last(x):
        x = base.dense(b, x)
    dst = out if base.plain_or_channels_last(out) else b.temp(out.shape, base.contiguous_strides(out.shape), "f32")
    b.kernel("ResizeStep", {"src": x}, {"dst": dst}, index=index)
    if dst is not out:
        b.reorder(dst, out, src_q=None, dst_q=None)


def check_pad(c: Call) -> str | None:
    if c.a.mode != "constant":
        return f"a {c.a.mode} pad (the engine pads with a constant)"
    if c.a.value is not None and (isinstance(c.a.value, bool) or not isinstance(c.a.value, int | float)):
        return f"a pad with value {c.a.value!r}"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype == torch.uint8:  # the lowered INT8 pad: the integers with the zero point
        if c.a.value is not None and (c.a.value != int(c.a.value) or not 0 <= c.a.value <= 255):
            return f"a pad of a uint8 tensor with value {c.a.value!r}"
    elif dtype is not None and dtype not in base.FLOATS:
        return f"a pad of a {dtype} tensor"
    return check_move_source(c.inputs[0], "pad", c.engine_runs)


def emit_pad(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """The constant into ``out`` (a plan-owned tensor of ``out``'s shape) unless the pads are all
    zero, then ``x`` into its window of ``out`` (a view: one reorder) — deferred to ``out``'s first
    reader (:meth:`Builder.defer_pad`): a conv reading it takes zero widths as its own padding
    (gml.runtime.rules.conv), and then neither step exists (tf_efficientnet_lite0's eight "same"
    pads were 20% of its fp32 plan, AMD EPYC Zen 4)."""
    x, known = ins[0], dict(zip(c.inputs[1:], ins[1:]))
    pads = [known[p] if isinstance(p, fx.Node) else p for p in c.a.pads]
    if len(pads) % 2 or len(pads) // 2 > len(x.shape) or any(not isinstance(p, int) or p < 0 for p in pads):
        raise Unsupported(f"pad widths {pads}")
    if out.dtype_name not in ("f32", "bf16", "u8") or out.dtype_name != x.dtype_name or out.free:
        raise Unsupported(f"pad of {x.dtype_name} into {out.dtype_name}")
    n = len(pads) // 2
    value = float(c.a.value or 0.0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "u8": torch.uint8}[out.dtype_name]

    def write() -> None:
        offset = 0
        for i in range(n):  # F.pad lists the last dim first
            offset += pads[2 * i] * out.stride[len(out.shape) - 1 - i]
        if any(pads):
            b.reorder(b.constant(torch.full(out.shape, value, dtype=dtype)), out, src_q=None, dst_q=None)
        if 0 not in x.shape:
            b.reorder(x, b.view(out, x.shape, out.stride, offset=offset * out.itemsize), src_q=None, dst_q=None)

    per_dim = [(0, 0)] * (len(x.shape) - n) + [(pads[2 * i], pads[2 * i + 1]) for i in reversed(range(n))]
    b.defer_pad(PendingPad(out, x, tuple(per_dim), value, write, b.node_name))


#: torch.roll's spellings (``x.roll(...)`` is the method)
ROLLS = (torch.roll, torch.ops.aten.roll.default)


def read_roll(node: fx.Node) -> Call | None:
    method = node.op == "call_method" and node.target == "roll"
    if not (method or (node.op == "call_function" and node.target in ROLLS)):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    shifts = node.args[1] if len(node.args) > 1 else node.kwargs.get("shifts")
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", ())
    return Call("roll", SimpleNamespace(shifts=shifts, dims=dims), (node.args[0],))


def check_roll(c: Call) -> str | None:
    shifts = c.a.shifts if isinstance(c.a.shifts, list | tuple) else [c.a.shifts]
    dims = c.a.dims if isinstance(c.a.dims, list | tuple) else [c.a.dims]
    if not dims or len(dims) != len(shifts):
        return "a roll of the flattened tensor (no dims)"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*shifts, *dims)):
        return "a roll by shifts computed at run time"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype not in base.FLOATS:
        return f"a roll of a {dtype} tensor"
    return check_move_source(c.inputs[0], "roll", c.engine_runs)


def emit_roll(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``torch.roll``: along each rolled dim the tensor is two blocks that trade places, so
    ``2^dims`` block copies (reorders between views of ``x`` and ``out``); Swin's shifted windows."""
    x = ins[0]
    if out.free or x.shape != out.shape or out.dtype_name != x.dtype_name:
        raise Unsupported(f"roll of {x.shape} into {out.shape}")
    shifts = c.a.shifts if isinstance(c.a.shifts, list | tuple) else [c.a.shifts]
    dims = c.a.dims if isinstance(c.a.dims, list | tuple) else [c.a.dims]
    shift = [0] * len(x.shape)
    for s, d in zip(shifts, dims):
        shift[d % len(x.shape)] += s
    # blocks: (source start, destination start, size) per dim; a rolled dim has two
    per_dim: list[list[tuple[int, int, int]]] = []
    for n, s in zip(x.shape, shift):
        k = s % n if n else 0
        per_dim.append([(0, 0, n)] if k == 0 else [(0, k, n - k), (n - k, 0, k)])
    for blocks in itertools.product(*per_dim):
        shape = tuple(size for _, _, size in blocks)
        if 0 in shape:
            continue
        src = sum(start * st for (start, _, _), st in zip(blocks, x.stride))
        dst = sum(start * st for (_, start, _), st in zip(blocks, out.stride))
        b.reorder(
            b.view(x, shape, x.stride, offset=src * x.itemsize),
            b.view(out, shape, out.stride, offset=dst * out.itemsize),
            src_q=None,
            dst_q=None,
        )


def check_embedding(c: Call) -> str | None:
    mod = c.a
    if mod.max_norm is not None:
        return "Embedding with max_norm (it renormalizes the table in place on every lookup)"
    if mod.weight.dim() != 2 or mod.weight.dtype not in base.FLOATS:
        return f"Embedding of a {mod.weight.dtype} table"
    dtype = base.meta_dtype(c.inputs[0])
    if dtype is not None and dtype != torch.int64:
        return f"Embedding of {dtype} ids (the engine reads int64 ids)"
    return None


def emit_embedding(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """One gather step (native/shape.h ``EmbeddingStep``): the word-embedding lookup of a token-id
    model in the same plan as the encoder (it was a torch call between engine segments)."""
    ids, w = ins[0], c.a.weight
    if ids.dtype_name != "s64":
        raise Unsupported(f"Embedding of {ids.dtype_name} ids")
    want = (*ids.shape, w.shape[1])
    if out.dtype_name != dtype_name(w.dtype) or out.shape != want or out.stride != base.contiguous_strides(want):
        raise Unsupported(f"Embedding output {out.dtype_name} {out.shape} / {out.stride} for ids {ids.shape}")
    if w.stride(1) != 1:
        raise Unsupported(f"an Embedding table with strides {w.stride()}")
    b.embedding(ids, out, weight=w)


RULES: dict[object, TranslationRule] = {
    **{name: TranslationRule(check_move, _emit_move) for name in sorted(MOVES - {"contiguous"})},
    # a fused conv module's output made contiguous (a view, or one reordered copy), else as any move
    "contiguous": TranslationRule(_check_contiguous, emit_flatten, reads_free=True),
    "flatten": TranslationRule(base.always, emit_flatten, reads_free=True),  # torch.flatten of an INT8 value
    nn.Flatten: TranslationRule(base.always, emit_flatten, reads_free=True),
    "split": TranslationRule(check_split, base.always, tuple_out=True),
    "size": TranslationRule(check_size, base.always, None, size_out=True),
    "split_item": TranslationRule(check_split_item, emit_split_item),
    "qcat": TranslationRule(base.always, _emit_cat, None),
    "cat": TranslationRule(check_float_cat, emit_float_cat, None),  # torch.cat of an fp32 / bf16 graph
    "stack": TranslationRule(check_float_cat, emit_float_cat, None),
    # F.pad of a float value (Swin's whole windows, timm's "same" padding), a lowered INT8 pad
    "pad": TranslationRule(check_pad, emit_pad, None),
    "interpolate": TranslationRule(check_interpolate, emit_interpolate, None, writes_free=True, reads_free=True),
    "roll": TranslationRule(check_roll, emit_roll),  # torch.roll (Swin's shifted windows)
    nn.Embedding: TranslationRule(check_embedding, emit_embedding),
}
