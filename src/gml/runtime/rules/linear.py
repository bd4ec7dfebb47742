"""Translation rules: linear layers and the matmuls they become — INT8 ``gml.qlinear`` (oneDNN inner
product, the source zero point folded into the bias), ``gml.dynamic_linear`` (per-row INT8 inside,
ADR 008), the fp32 / bf16 fused linears and a plain fp32 ``nn.Linear``. bf16 runs bf16 source,
weights and destination with fp32 accumulation inside oneDNN; the bias goes in as fp32.

A later node may fold into the linear just recorded (:func:`extend_linear`,
:func:`fuse_into_linear`, :func:`fuse_into_dynamic_linear`): a residual add or an activation
becomes a post-op of its matmul (the element-wise rules call these)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import fx, nn

from gml.kernels import bf16, exact_int8, fp32
from gml.kernels.dynamic_int8 import POST_OPS, QMAX
from gml.runtime.rules import base
from gml.runtime.rules.base import Builder, Call, TranslationRule, Unsupported, Val


def _emit_exact_linear(b: Builder, c: Call, x: Val, out: Val) -> None:
    """``gml.qlinear(..., backend="gml")``: 8-bit weights on GML's exact AVX2 GEMM, one kernel step
    (native/qlinear_exact.h) with the epilogue constants of the Python kernel (gml.kernels.exact_int8)."""
    a = c.a
    if "avx2" not in b.target.features:
        raise Unsupported(f"GML's exact INT8 linear needs AVX2 ({b.target.isa})")
    w = a.weight.detach()
    if w.dtype != torch.int8 or w.dim() != 2 or not w.is_contiguous():
        raise Unsupported(f"exact INT8 linear with a {w.dtype} {w.dim()}-D weight that is not dense")
    in_q, out_q = base.x_qparams(a), base.out_qparams(a)
    scale, bias = exact_int8.epilogue(in_q.scale, in_q.zero_point, w, a.weight_scale, a.bias)
    inv = 1.0 if out_q is None else exact_int8.out_inverse(out_q.scale)
    b.kernel(
        "ExactQLinearStep",
        {"src": x},
        {"dst": out},
        weight=w.data_ptr(),  # the graph's own tensor: alive while the plan is built (the step packs it)
        wdims=list(w.shape),
        scale=scale.tolist(),
        bias=bias.tolist(),
        relu=a.post_op == "relu",
        out_inv=inv,
        out_zp=0 if out_q is None else int(out_q.zero_point),
    )


def _emit_linear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    a = c.a
    if len(ins[0].shape) < 2:
        raise Unsupported(f"INT8 linear on a rank-{len(ins[0].shape)} input")
    # rank > 2 ([batch, tokens, features]): the same inner product over the rows
    x, out = base.as_rows(b, ins[0]), base.as_rows(b, out, output=True)
    if getattr(a, "backend", "onednn") == "gml":
        _emit_exact_linear(b, c, x, out)
        return
    # oneDNN 3.2's inner product takes no source zero point: fold it into the bias,
    # s_x * s_w[o] * sum_i (x_i - z) w[o, i] = s_x * s_w[o] * sum_i x_i w[o, i] - s_x * s_w[o] * z * sum_i w[o, i].
    in_q, out_q = base.x_qparams(a), base.out_qparams(a)
    eltwise = base.eltwise_of(base.post_op_of(a))
    if out_q is not None and out_q.zero_point:  # nor a destination one: add z * s_out before the division
        eltwise.append(("linear", 1.0, out_q.zero_point * out_q.scale))
    bias = a.bias.double() if a.bias is not None else torch.zeros(a.weight.shape[0], dtype=torch.float64)
    if in_q.zero_point:
        w_sum = a.weight.double().sum(1)
        bias = bias - in_q.scale * a.weight_scale.double() * in_q.zero_point * w_sum
    b.inner_product(
        x,
        out,
        weight=a.weight,
        w_scales=a.weight_scale,
        bias=bias.float(),
        src_q=(float(in_q.scale), 0),
        dst_q=None if out_q is None else (float(out_q.scale), 0),
        eltwise=eltwise,
    )


def _check_dynamic_linear(c: Call) -> str | None:
    if c.a.post_op not in POST_OPS:
        return f"dynamic INT8 linear with post-op {c.a.post_op}"
    if c.a.weight.dtype != torch.int8 or c.a.weight.dim() != 2:
        return f"dynamic INT8 linear with a {c.a.weight.dtype} {c.a.weight.dim()}-D weight"
    return None


def _emit_dynamic_linear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``gml.dynamic_linear`` (fp32 → fp32; per-row INT8 inside: ADR 008): the rows of ``x``
    (leading dims collapsed, a view where they collapse), the engine's row quantization, then one
    oneDNN matmul with the per-row scale and bias as post-ops."""
    a, x = c.a, ins[0]
    if len(x.shape) < 2 or x.dtype_name != "f32":
        raise Unsupported(f"dynamic INT8 linear on a rank-{len(x.shape)} {x.dtype_name} input")
    x, out = base.as_rows(b, x), base.as_rows(b, out, output=True)
    if x.stride[1] != 1 and x.shape[1] > 1:  # the row quantization reads dense rows
        t = b.temp(x.shape, base.contiguous_strides(x.shape), "f32")
        b.reorder(x, t, src_q=None, dst_q=None)
        x = t
    b.dynamic_linear(
        x,
        out,
        weight=a.weight,
        w_scales=(a.weight_scale.float() / QMAX).contiguous(),  # exactly the Python kernel's s_w / 127
        bias=None if a.bias is None else a.bias.detach().float().contiguous(),
        smooth_inv=None if a.smooth_inv is None else a.smooth_inv.detach().float(),
        eltwise=base.eltwise_of(base.post_op_of(a)),
    )


def _emit_flinear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    mod = c.a
    if len(ins[0].shape) < 2 or ins[0].dtype_name != "f32":
        raise Unsupported(f"fp32 linear on a rank-{len(ins[0].shape)} {ins[0].dtype_name} input")
    x, out = base.as_rows(b, ins[0]), base.as_rows(b, out, output=True)
    b.inner_product(
        x,
        out,
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        src_q=None,
        dst_q=None,
        eltwise=base.eltwise_of(mod.post_op) if hasattr(mod, "post_op") else [],  # a plain nn.Linear: none
    )


def _check_blinear(c: Call) -> str | None:
    return None if c.a.backend == "onednn" else f"bf16 linear on the {c.a.backend} path"


def _emit_blinear(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    mod = c.a
    # any layout: a view where the leading dims collapse, else a dense copy (ViT's MHA out_proj
    # reads a permuted value)
    x = base.as_rows(b, base.bf16_src(b, ins[0]))
    b.inner_product(
        x,
        base.as_rows(b, out, output=True),
        weight=mod.weight.detach(),
        w_scales=torch.ones(1),
        bias=mod.bias,
        src_q=None,
        dst_q=None,
        eltwise=base.eltwise_of(mod.post_op),
    )


#: a matmul post-op (gml.runtime.plan.PostOps)
MatmulPostOp = tuple[str, float, float, "Val | None"]


def _reads_itself(lin: Val, other: Val) -> bool:
    """Whether the add's other operand is the linear's own output (``y + y``) or a view of it: fused, the
    post-op would read the buffer the re-recorded matmul no longer writes (uninitialized memory: a
    fuzzed ``linear(x) + linear(x)`` was off by 0.77, on some runs only)."""
    return other is lin or (lin.group is not None and other.group is lin.group)


def fuse_into_linear(b: Builder, lin: Val, other: Val, out: Val) -> bool:
    """``linear(x) + other`` as one matmul with a binary ``add`` post-op (see :func:`extend_linear`):
    ``out = post_op(x Wᵀ + b) + other`` in the fp32 accumulator (a bf16 linear's output is then not
    rounded to bf16 before the add: one rounding fewer than the Python executor)."""
    if other.free or other.shape != out.shape or base.rows_strides(other) is None or _reads_itself(lin, other):
        return False
    if not b.target.f32_matmul_brgemm:  # the add needs a matmul, which has no brgemm kernel here
        return False
    return extend_linear(b, lin, out, lambda: [("binary_add", 0.0, 0.0, base.as_rows(b, other))])


def fuse_into_dynamic_linear(b: Builder, lin: Val, other: Val, out: Val) -> bool:
    """``dynamic_linear(x) + other`` (a transformer's residual after its INT8 GEMM) as one step: the
    add is the matmul's last post-op, in fp32 after the rescale / bias / activation, as the Python
    executor adds (the same fp32 operations in the same order). Only when the step just recorded is
    that linear node's own, nothing else reads its output, and all three are plain fp32 rows."""
    if not b.steps or lin.node is None or b.steps[-1].method != "dynamic_linear":
        return False
    step = b.steps[-1]
    src, dst = step.kwargs["rows"]
    if len(step.reads) != 1 or step.name != lin.node.name or dst.group is not lin.group or dst.offset != lin.offset:
        return False
    if b.last_use.get(lin.node, 0) != b.pos or lin.shape != out.shape or other.shape != out.shape:
        return False
    if other.free or out.free or other.dtype_name != "f32" or out.dtype_name != "f32" or _reads_itself(lin, other):
        return False
    # dense rows only: a strided binary post-op operand sends oneDNN 3.2's matmul to its reference kernel
    if any(base.rows_strides(v) is None or base.rows_strides(v)[1] != 1 for v in (other, out)):
        return False
    rows_out, rows_other = base.as_rows(b, out, output=True), base.as_rows(b, other)
    if rows_out.shape != dst.shape or rows_other.shape != dst.shape:
        return False
    b.steps.pop()
    kw = {k: v for k, v in step.kwargs.items() if k != "rows"}
    b.dynamic_linear(src, rows_out, residual=rows_other, **kw)
    b.steps[-1].name = f"{step.name}+{b.node_name}"
    return True


def extend_linear(b: Builder, lin: Val, out: Val, extra: Callable[[], list[MatmulPostOp]]) -> bool:
    """Append post-ops to the float linear that just wrote ``lin`` and write ``out`` instead, when
    the step just recorded is that linear node's own (an inner product, or a matmul this function
    made) and nothing else reads ``lin``. The step is re-recorded as one matmul with constant
    weights (oneDNN's inner product takes no binary post-op) — or, on a target whose f32 matmul has
    no brgemm kernel (AVX2), as the inner product with the element-wise post-ops appended."""
    if not b.steps or lin.node is None or lin.free or out.free or lin.shape != out.shape:
        return False
    step = b.steps[-1]
    if step.method == "inner_product":
        if step.kwargs.get("src_q") is not None or step.kwargs["weight"].dtype not in base.FLOATS:
            return False
        weight = step.kwargs["weight"].detach().t()
        post: list[MatmulPostOp] = [(a, al, be, None) for a, al, be in step.kwargs["eltwise"]]
    elif step.method == "matmul" and step.kwargs["weight"] is not None:
        weight, post = step.kwargs["weight"], list(step.kwargs["post"])
    else:
        return False
    # the step is the linear node's own (not a view of its output in another order: a transpose)
    own = step.name.split("+")[-1] == lin.node.name and step.writes[0].group is lin.group
    if not own or b.last_use.get(lin.node, 0) != b.pos or base.rows_strides(out) is None:
        return False
    if step.method == "inner_product" and not b.target.f32_matmul_brgemm:
        # no brgemm matmul on this ISA (Target.f32_matmul_brgemm): element-wise post-ops join the
        # inner product's own; a binary operand cannot (oneDNN's inner product takes none)
        more = extra()
        if any(operand is not None for *_, operand in more):
            return False
        b.steps.pop()
        eltwise = [*step.kwargs["eltwise"], *((a, al, be) for a, al, be, _ in more)]
        kwargs = {**step.kwargs, "eltwise": eltwise}
        b.inner_product(step.reads[0], base.as_rows(b, out, output=True), **kwargs)
        b.steps[-1].name = f"{step.name}+{b.node_name}"
        return True
    b.steps.pop()
    post += extra()
    b.matmul(step.reads[0], None, base.as_rows(b, out, output=True), weight=weight, bias=step.kwargs["bias"], post=post)
    b.steps[-1].name = f"{step.name}+{b.node_name}"
    return True


#: a product of two computed float tensors in any spelling (attention written out: ``q @ k.transpose(-2, -1)``)
MATMULS = (torch.matmul, operator.matmul, torch.bmm, torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)


def read_matmul(node: fx.Node) -> Call | None:
    method = node.op == "call_method" and node.target in ("matmul", "bmm", "__matmul__")
    if not (method or (node.op == "call_function" and node.target in MATMULS)):
        return None
    if len(node.args) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    return Call("matmul", SimpleNamespace(), tuple(node.args))


def check_matmul(c: Call) -> str | None:
    dtypes = [base.meta_dtype(n) for n in c.inputs]
    if any(d is not None and d not in base.FLOATS for d in dtypes) or (None not in dtypes and len(set(dtypes)) != 1):
        return f"matmul of {', '.join(map(str, dtypes))} tensors (the engine multiplies fp32 / bf16 of one dtype)"
    shapes = [base.meta_shape(n) for n in c.inputs]
    if any(s is not None and len(s) < 2 for s in shapes):
        return "matmul of a vector (the engine multiplies matrices and batches of them)"
    return None


def emit_matmul(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    """``out = x @ w`` of two computed values (batch dims broadcast as torch's): one oneDNN matmul
    on dense copies where they are strided (its brgemm kernel takes dense operands only)."""
    x, w = ins
    if {x.dtype_name, w.dtype_name, out.dtype_name} - {"f32", "bf16"} or x.dtype_name != w.dtype_name:
        raise Unsupported(f"matmul of {x.dtype_name} and {w.dtype_name} into {out.dtype_name}")
    rank = len(out.shape)
    if min(len(x.shape), len(w.shape)) < 2 or rank < 2 or out.free:
        raise Unsupported(f"matmul of {x.shape} and {w.shape}")
    if out.stride != base.contiguous_strides(out.shape):
        raise Unsupported(f"matmul into a strided {out.shape} (strides {out.stride})")
    x, w = (base.broadcast_view(b, base.dense(b, v), rank) for v in (x, w))
    b.matmul(x, w, out)


RULES: dict[object, TranslationRule] = {
    # backend "gml": GML's exact arithmetic (8-bit weights without VNNI), its own step (_emit_exact_linear)
    "qlinear": TranslationRule(base.always, _emit_linear, other_backends=("gml",)),
    "dynamic_linear": TranslationRule(_check_dynamic_linear, _emit_dynamic_linear),
    # MKL's / ATen's GEMM for the same fp32 math: the engine runs it on oneDNN, equal up to rounding
    fp32.FusedLinear: TranslationRule(base.always, _emit_flinear, other_backends=("mkl", "aten")),
    nn.Linear: TranslationRule(base.always, _emit_flinear),  # an fp32 nn.Linear the fusion left as it was
    bf16.Bf16Linear: TranslationRule(_check_blinear, _emit_blinear),
    "matmul": TranslationRule(check_matmul, emit_matmul, 2),
}
