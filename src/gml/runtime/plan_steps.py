"""The engine's step families as Python fills them: one function per family turns a recorded
:class:`gml.runtime.plan.Step` into that family's typed step description (``gml._engine.ConvStep``,
``MatmulStep``, ...: the structs of native/conv.h, native/linear.h, ...) and adds it to the native
plan (``plan.add(step)``, whose overload builds the primitives). :data:`EMITTERS` maps a step's
``method`` (what :class:`~gml.runtime.plan.Builder` recorded) to its function.

A description is filled by field name (:func:`describe`): a misspelt or missing field is an
``AttributeError`` here, not a shifted positional argument in C++. Tensors whose bytes the native
builder copies (weights, bias, LayerNorm's gamma / beta) stay referenced until ``plan.add`` returns;
an embedding table is read in place at run time, so the plan keeps it (``plan.keep``).

This module imports no other ``gml.runtime`` module (``plan`` imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class Unsupported(Exception):
    """The engine has no kernel for this node (or this shape of it); the message says why."""


#: torch.bool is u8 (the same bytes: 0 / 1), read only as an attention mask (gml.runtime.rules.attention)
# int64: token ids, read only by the embedding kernel (Builder.embedding)
_DTYPES = {
    torch.uint8: "u8",
    torch.int8: "s8",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.bool: "u8",
    torch.int64: "s64",
}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        raise Unsupported(f"{dtype} tensors")
    return name


@dataclass(frozen=True)
class EmitContext:
    """What every step function reads besides the step: the native module, the native value ids,
    and the plan-wide choices (made once per plan by ``Builder``, from its target CPU)."""

    native: Any  # gml._engine
    ids: dict[Any, int]  # Val -> native value id
    winograd: int  # EngineOptions.winograd_mode (gml.runtime.options)
    exact_gemm: bool  # gml.runtime.plan.exact_int8_gemm(target)
    native_bf16: bool  # target.native_bf16
    int8_winograd: bool  # target.int8_winograd


def describe(cls: Any, **fields: Any) -> Any:
    """A ``cls()`` step description with ``fields`` set by name."""
    desc = cls()
    for name, value in fields.items():
        setattr(desc, name, value)
    return desc


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _weights(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """A conv / inner product's weight fields (native ConvStep / InnerProductStep), and the tensors
    they point at (alive until ``plan.add`` has copied them)."""
    w, bias = kw["weight"].contiguous(), _f32(kw["bias"])
    fields = dict(
        weight=w.data_ptr(),
        wdims=list(w.shape),
        wdtype=dtype_name(w.dtype),
        w_scales=[float(x) for x in kw["w_scales"].flatten()],
        bias=_ptr(bias),
        src_q=kw["src_q"],
        dst_q=kw["dst_q"],
        eltwise=kw["eltwise"],
    )
    return w, bias, fields


def _window(kw: dict[str, Any]) -> dict[str, list[int]]:
    """A conv's or pool's window as its step's fields (native/conv.h, native/pool.h)."""
    return {
        k: list(kw[v])
        for k, v in (("strides", "stride"), ("dilation", "dilation"), ("pad_l", "pad_l"), ("pad_r", "pad_r"))
    }


def conv(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/conv.h ``ConvStep`` (Builder.conv)."""
    kw = s.kwargs
    w, bias, fields = _weights(kw)
    plan.add(
        describe(
            cx.native.ConvStep,
            src=cx.ids[s.reads[0]],
            dst=cx.ids[s.writes[0]],
            **_window(kw),
            groups=int(kw["groups"]),
            sum=kw["sum_q"],
            name=s.name,
            nthreads=torch.get_num_threads(),  # the team the Winograd choice is timed with
            winograd=cx.winograd,
            native_bf16=cx.native_bf16,
            int8_winograd=cx.int8_winograd,
            **fields,
        )
    )
    del w, bias


def inner_product(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/linear.h ``InnerProductStep`` (Builder.inner_product)."""
    w, bias, fields = _weights(s.kwargs)
    desc = describe(cx.native.InnerProductStep, src=cx.ids[s.reads[0]], dst=cx.ids[s.writes[0]], name=s.name, **fields)
    plan.add(desc)
    del w, bias


def dynamic_linear(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/dynamic_linear.h ``DynamicLinearStep`` (Builder.dynamic_linear: writes dst, q, amax)."""
    kw = s.kwargs
    w, bias = kw["weight"].contiguous(), kw["bias"]
    dst, q, amax = (cx.ids[v] for v in s.writes)
    desc = describe(
        cx.native.DynamicLinearStep,
        src=cx.ids[s.reads[0]],
        dst=dst,
        q=q,
        amax=amax,
        weight=w.data_ptr(),
        wdims=list(w.shape),
        w_scales=[float(x) for x in kw["w_scales"].flatten()],
        bias=_ptr(bias),
        smooth_inv=[] if kw["smooth_inv"] is None else [float(x) for x in kw["smooth_inv"].flatten()],
        eltwise=kw["eltwise"],
        name=s.name,
        sum_src=cx.ids[s.reads[1]] if len(s.reads) > 1 else -1,
        exact_gemm=cx.exact_gemm,
    )
    plan.add(desc)
    del w, bias


def matmul(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/linear.h ``MatmulStep`` (Builder.matmul): ``wei`` a value, or a constant ``weight``."""
    kw = s.kwargs
    w, bias = kw["weight"], _f32(kw["bias"])
    desc = describe(
        cx.native.MatmulStep,
        src=cx.ids[s.reads[0]],
        wei=-1 if kw["wei"] is None else cx.ids[kw["wei"]],
        dst=cx.ids[s.writes[0]],
        weight=_ptr(w),
        wdims=[] if w is None else list(w.shape),
        wstrides=[] if w is None else list(w.stride()),
        wdtype="f32" if w is None else dtype_name(w.dtype),
        bias=_ptr(bias),
        post=[(alg, float(a), float(b), -1 if v is None else cx.ids[v]) for alg, a, b, v in kw["post"]],
        name=s.name,
    )
    plan.add(desc)
    del bias


def pool(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/pool.h ``PoolStep`` (Builder.pool)."""
    kw = s.kwargs
    desc = describe(
        cx.native.PoolStep,
        src=cx.ids[s.reads[0]],
        dst=cx.ids[s.writes[0]],
        alg=kw["alg"],
        kernel=list(kw["kernel"]),
        **_window(kw),
        eltwise=kw["eltwise"],
        name=s.name,
    )
    plan.add(desc)


def binary(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/eltwise.h ``BinaryStep`` (Builder.binary)."""
    kw = s.kwargs
    src0, src1 = (cx.ids[v] for v in s.reads)
    desc = describe(
        cx.native.BinaryStep,
        src0=src0,
        src1=src1,
        dst=cx.ids[s.writes[0]],
        alg=kw["alg"],
        scale0=kw["scale0"],
        scale1=kw["scale1"],
        eltwise=kw["eltwise"],
        name=s.name,
    )
    plan.add(desc)


def softmax(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/eltwise.h ``SoftmaxStep`` (Builder.softmax)."""
    src, dst = cx.ids[s.reads[0]], cx.ids[s.writes[0]]
    plan.add(describe(cx.native.SoftmaxStep, src=src, dst=dst, axis=int(s.kwargs["axis"]), name=s.name))


def layer_norm(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/eltwise.h ``LayerNormStep`` (Builder.layer_norm)."""
    kw = s.kwargs
    gamma, beta = _f32(kw["gamma"]), _f32(kw["beta"])
    desc = describe(
        cx.native.LayerNormStep,
        src=cx.ids[s.reads[0]],
        dst=cx.ids[s.writes[0]],
        gamma=_ptr(gamma),
        beta=_ptr(beta),
        eps=float(kw["eps"]),
        name=s.name,
    )
    plan.add(desc)
    del gamma, beta


def attention(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/attention_step.h ``AttentionStep`` (Builder.attention: reads q, k, v, masks...)."""
    q, k, v = (cx.ids[x] for x in s.reads[:3])
    masks = [cx.ids[x] for x in s.reads[3:]]
    desc = describe(
        cx.native.AttentionStep,
        q=q,
        k=k,
        v=v,
        dst=cx.ids[s.writes[0]],
        masks=masks,
        scale=float(s.kwargs["scale"]),
        zero_masked_rows=bool(s.kwargs.get("zero_masked_rows", False)),
        kernel=str(s.kwargs.get("kernel", "avx512")),
        name=s.name,
    )
    plan.add(desc)


def reorder(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/shape.h ``ReorderStep`` (Builder.reorder)."""
    kw = s.kwargs
    src, dst = cx.ids[s.reads[0]], cx.ids[s.writes[0]]
    plan.add(describe(cx.native.ReorderStep, src=src, dst=dst, src_q=kw["src_q"], dst_q=kw["dst_q"], name=s.name))


def concat(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/shape.h ``ConcatStep`` (Builder.concat)."""
    srcs = [cx.ids[v] for v in s.reads]
    plan.add(describe(cx.native.ConcatStep, srcs=srcs, dst=cx.ids[s.writes[0]], axis=s.kwargs["axis"], name=s.name))


def embedding(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/shape.h ``EmbeddingStep`` (Builder.embedding)."""
    w = s.kwargs["weight"].detach()
    plan.keep.append(w)  # the native step reads its rows in place
    desc = describe(
        cx.native.EmbeddingStep,
        ids=cx.ids[s.reads[0]],
        dst=cx.ids[s.writes[0]],
        table=w.data_ptr(),
        num=w.shape[0],
        dim=w.shape[1],
        ld=w.stride(0),
        name=s.name,
    )
    plan.add(desc)


def mask_op(plan: Any, cx: EmitContext, s: Any) -> None:
    """native/shape.h ``MaskOpStep`` (Builder.mask_op)."""
    kw = s.kwargs
    desc = describe(
        cx.native.MaskOpStep,
        op=kw["op"],
        srcs=[cx.ids[v] for v in s.reads],
        dst=cx.ids[s.writes[0]],
        strides=[list(st) for st in kw["strides"]],
        index_dims=list(kw["index_dims"]),
        index_strides=list(kw["index_strides"]),
        name=s.name,
    )
    plan.add(desc)


def kernel(plan: Any, cx: EmitContext, s: Any) -> None:
    """An op's own engine step (Builder.kernel; gml.runtime.rules.kernel): its description's fields are
    the values by name, and the op's other arguments as they are."""
    kw = s.kwargs
    cls = getattr(cx.native, kw["struct"], None)
    if cls is None:  # an engine built before the op's header existed
        raise Unsupported(f"this build of the engine has no {kw['struct']} (rebuild it: pip install -e .)")
    values = {name: cx.ids[v] for name, v in zip(kw["names"], (*s.reads, *s.writes))}
    plan.add(describe(cls, **values, **kw["fields"], name=s.name))


#: Builder step method -> the function adding it to the native plan.
EMITTERS: dict[str, Callable[[Any, EmitContext, Any], None]] = {
    "conv": conv,
    "inner_product": inner_product,
    "dynamic_linear": dynamic_linear,
    "matmul": matmul,
    "pool": pool,
    "binary": binary,
    "softmax": softmax,
    "layer_norm": layer_norm,
    "attention": attention,
    "reorder": reorder,
    "concat": concat,
    "embedding": embedding,
    "mask_op": mask_op,
    "kernel": kernel,
}
