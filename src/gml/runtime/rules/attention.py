"""Translation rules: attention (``gml.attention``) and the padding-mask arithmetic that feeds it
(#15 / #14). With the transformer rows of the other families (LayerNorm and float adds:
gml.runtime.rules.eltwise; split and Embedding: gml.runtime.rules.shape) they write the engine's
transformer steps (``Builder.layer_norm`` / ``matmul`` / ``softmax``, native/eltwise.h, native/linear.h):

==========================  ========================================================================
node                        engine steps
==========================  ========================================================================
``nn.LayerNorm`` (last dim)  one oneDNN ``layer_normalization`` (statistics in fp32; f32 or bf16 in
                            and out, as the Python executor's values are) over the rows view
``gml.attention``           ``S = Q @ Kᵀ`` (matmul, fp32 accumulation and fp32 output; ``Kᵀ`` is K's
                            strides swapped, no copy) with the scale (eltwise ``linear``) and the
                            mask (binary ``add``, broadcast over heads / queries) as post-ops →
                            ``P = softmax(S)`` (fp32 math, written in Q's dtype) → ``O = P @ V``;
                            or the same math as one fused step (``Builder.attention``: bf16 /
                            fp32 on AVX512-BF16, native/attention.h; fp32 on AVX2,
                            native/attention_avx2.h; ADR 009; :func:`fused_attention_kernel`
                            says when)
``gml.nn.Add`` (float)      one binary ``add`` (oneDNN broadcasts the smaller operand); f32 / bf16,
                            mixed operands promote as torch does (the executor's output dtype)
``split`` + ``getitem``     views of the split tensor (no step): the QKV merge's ``q, k, v``
``nn.Embedding``            one gather step (int64 ids, rows read from the module's table in place)
==========================  ========================================================================

**Masks.** A float mask is added as it is. A bool mask (``True`` = attend, SDPA's convention) is
converted once per plan to an additive one, ``(m - 1) * FLT_MAX`` (one u8 → f32 reorder with a zero
point), not ``-inf``: ``0 * inf`` would be NaN. A masked score becomes ``-FLT_MAX`` and its softmax
weight exactly 0, as with ``-inf``. A query row whose keys are *all* masked is what SDPA (torch >= 2.5)
gives: zeros for a bool mask or an all ``-inf`` row, the values' mean for a finite float mask
(``torch.finfo.min``: softmax of equal scores). The fused kernels scale such a row's P·V by 0
(native/attention_problem.h, ``zero_row``: a row whose largest score is ``-inf``, or any fully
masked row where the step is told the mask was bool). The primitive path (oneDNN's softmax, NaN for
a row that is ``-inf`` everywhere) clips the scores to ``-FLT_MAX`` after a float mask computed at
run time is added and multiplies P·V by a per-row factor computed once per plan: "attends to a key"
of a bool mask, "has a key above ``-inf``" of a float mask; a constant float mask's ``-inf`` is
``-FLT_MAX`` and its all ``-inf`` rows a constant factor. A mask that is a segment's input may hold
``-inf`` (``nn.MultiheadAttention``'s padding masks do): the segment checks it for NaN only
(:func:`mask_only_inputs`). A padded batch masks every key of a row for a sequence that is all padding (an
all-zero attention mask).
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
from types import SimpleNamespace

import torch
from torch import fx

from gml.ir.attention import is_attention
from gml.ir.target import Target
from gml.kernels import bf16
from gml.nn import Add as GmlAdd
from gml.runtime import native
from gml.runtime.rules import base, shape
from gml.runtime.rules.base import Builder, Call, TranslationRule, Unsupported, Val


def check_attention(c: Call) -> str | None:
    a = c.a
    if not (a.scale is None or isinstance(a.scale, int | float)):
        return "attention scale computed at run time"
    if isinstance(a.attn_mask, torch.Tensor) and a.attn_mask.dtype not in (torch.bool, *base.FLOATS):
        return f"a constant {a.attn_mask.dtype} attention mask"
    dtypes = [base.meta_dtype(n) for n in c.inputs[:3]]
    if None in dtypes:
        return None
    if len(set(dtypes)) != 1 or dtypes[0] not in base.FLOATS:
        return f"attention on {', '.join(str(d) for d in dtypes)} q / k / v"
    if a.attn_mask is not None:
        m = base.meta_dtype(a.attn_mask)
        if m is not None and m not in (torch.bool, dtypes[0]):
            return f"a {m} attention mask with {dtypes[0]} q / k / v"
    return None


def _additive_mask(b: Builder, m: Val, rank: int, keys: int) -> Val:
    """The float mask to add to the scores (see the module docstring), once per plan.

    A mask that varies along the queries but not along the ``keys`` (``[..., L, 1]`` after
    :func:`broadcast_view`; HF ViT's all-true ``[B, 1, L, L]`` expand) is written out ``[..., L, keys]``
    (one reorder reading it with stride 0 along the keys): oneDNN's matmul has no jitted kernel for a
    binary post-op broadcast that way, on any ISA (``ref:any``, 0.8 s per ViT attention under AVX2)."""
    memo = b.memo.setdefault("attention_masks", {})
    key = id(m)
    if key in memo:
        return memo[key]
    out = base.broadcast_view(b, m, rank)
    if m.dtype_name == "u8":  # a bool mask (torch.bool is the engine's u8)
        t = b.temp(out.shape, base.contiguous_strides(out.shape), "f32")
        b.reorder(out, t, src_q=(MASKED, 1), dst_q=None)  # (m - 1) * FLT_MAX
        out = t
    if rank >= 2 and out.shape[-2] > 1 and out.shape[-1] == 1 and keys > 1:  # per query: written out
        # a plain fp32 copy reads the stride 0 (oneDNN 3.2's jitted reorder from a stride-0 u8 source
        # with a zero point writes wrong values: 37,824 of 197 x 197, so the bool conversion stays above)
        wide = b.view(out, (*out.shape[:-1], keys), (*out.stride[:-1], 0))
        t = b.temp(wide.shape, base.contiguous_strides(wide.shape), "f32")
        b.reorder(wide, t, src_q=None, dst_q=None)
        out = t
    memo[key] = out
    return out


def _additive_constant(m: torch.Tensor, rank: int) -> torch.Tensor:
    """A constant mask as the fp32 tensor added to the scores, with leading 1s up to ``rank``: a bool
    mask's False and a float mask's -inf as ``-FLT_MAX`` (the same softmax weight, 0, and no NaN from
    a row that is -inf everywhere: that row's zeros come from :func:`_inf_rows_kept`)."""
    m = m.detach()
    add = torch.zeros(m.shape).masked_fill(~m, -MASKED) if m.dtype == torch.bool else m.float().clamp_min(-MASKED)
    return add.reshape((1,) * (rank - add.dim()) + tuple(add.shape)).contiguous()


def emit_attention(b: Builder, c: Call, ins: list[Val], out: Val) -> None:
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
    # SDPA's answer for a query row whose every key a bool mask masks is zeros (torch >= 2.5), and
    # for a row a float mask sets to -inf everywhere; a finite float mask gives the values' mean
    # (softmax of equal scores): the module docstring
    bool_mask: Val | torch.Tensor | None = None
    float_mask: Val | None = None  # a float mask known only at run time: it may hold such rows
    if isinstance(a.attn_mask, torch.Tensor):
        bool_mask = a.attn_mask if a.attn_mask.dtype == torch.bool else _inf_rows_kept(a.attn_mask)
    elif len(ins) > 3:
        bool_mask, float_mask = (ins[3], None) if ins[3].dtype_name == "u8" else (None, ins[3])
    kernel = fused_attention_kernel(q, k, v, out, b.target, b.options.attention)
    if kernel is not None:
        masks32 = [_f32(b, m) for m in masks]
        # (the fused kernels zero an all -inf row themselves: attention_problem.h, zero_row)
        b.attention(q, k, v, out, masks=masks32, scale=scale, kernel=kernel, zero_masked_rows=bool_mask is not None)
        return
    # dense copies of strided heads (pieces of the merged QKV output): oneDNN's brgemm matmul
    # takes dense operands only, else its gemm:jit fallback (measured on MiniLM bf16: Q.K^T
    # 0.31 -> 0.15 ms, P.V 0.11 -> 0.07 ms for three 10 us reorders)
    q, k, v = (base.dense(b, t) for t in (q, k, v))
    kt = b.view(k, (*k.shape[:-2], E, S), (*k.stride[:-2], k.stride[-1], k.stride[-2]))
    post: list[tuple[str, float, float, Val | None]] = [("linear", scale, 0.0, None)]
    scores_shape = (*batch, L, S)
    scores = b.temp(scores_shape, base.contiguous_strides(scores_shape), "f32")
    # a mask is the matmul's binary post-op where oneDNN has a jitted kernel for its broadcast, else
    # a binary add step after it (a post-op it has none for made the whole matmul ref:any: MaxViT's
    # relative-position bias, 100 ms per attention under the AVX2 cap)
    fused = [m for m in masks if _mask_post_op_ok(m.shape, scores_shape, b.target)]
    # oneDNN's softmax of a row that is -inf everywhere is NaN: a float mask's -inf becomes -FLT_MAX
    # (its softmax weight is still exactly 0), after the last mask is added
    clip = [("clip", -MASKED, MASKED, None)] if float_mask is not None else []
    unfused = [m for m in masks if not any(m is f for f in fused)]
    b.matmul(q, kt, scores, post=[*post, *(("binary_add", 0.0, 0.0, m) for m in fused), *([] if unfused else clip)])
    for i, m in enumerate(unfused):
        summed = b.temp(scores_shape, base.contiguous_strides(scores_shape), "f32")
        last = clip if i == len(unfused) - 1 else []
        b.binary(scores, m, summed, "add", scale0=None, scale1=None, eltwise=[e[:3] for e in last])
        scores = summed
    probs = b.temp(scores_shape, base.contiguous_strides(scores_shape), q.dtype_name)
    b.softmax(scores, probs, rank - 1)
    if bool_mask is None and float_mask is None:
        b.matmul(probs, v, out)
        return
    # P·V times 1 where the row attends to a key, 0 where the mask masks every key (softmax gave it
    # uniform weights), the factor once per plan. A binary step in fp32 (GML's strided loop:
    # oneDNN 3.2 has only its reference binary for this broadcast; its matmul has no binary post-op
    # broadcast along the heads and values, [B, 1, L, 1], and only ref:any for [B, 1, 1, 1]), then
    # bf16 by a reorder where the output is bf16. Measured: real MiniLM bf16, 128 tokens, 1 thread,
    # AMX (primitives): 6.73 -> 6.94 ms (1.03x) for the two steps per layer.
    dense = base.contiguous_strides(out.shape)
    pv = b.temp(out.shape, dense, "f32")
    b.matmul(probs, v, pv)
    zeroed = out if out.dtype_name == "f32" else b.temp(out.shape, dense, "f32")
    rows = _attended_rows(b, bool_mask, rank) if bool_mask is not None else _finite_rows(b, float_mask, rank)
    b.binary(pv, rows, zeroed, "mul", scale0=None, scale1=None, eltwise=[])
    if zeroed is not out:
        b.reorder(zeroed, out, src_q=None, dst_q=None)


def _inf_rows_kept(m: torch.Tensor) -> torch.Tensor | None:
    """For a constant float mask with a row that is -inf everywhere: which keys it keeps (bool,
    ``m > -inf``), so that such a row comes out zeros as SDPA gives it; None for any other."""
    keep = m.detach() > float("-inf")
    return keep if bool((~keep.any(-1)).any()) else None


def _attended_rows(b: Builder, m: Val | torch.Tensor, rank: int) -> Val:
    """f32 ``[..., L or 1, 1]``: 1 where bool mask ``m``'s row keeps a key, 0 where it masks every key.
    A constant mask's is a constant; an input mask's is computed once per plan: its 0 / 1 values as
    f32 (one reorder), summed over the keys by a matmul with a ones column, clipped to [0, 1]."""
    if isinstance(m, torch.Tensor):
        keep = m.detach().any(-1, keepdim=True).float()
        return b.constant(keep.reshape((1,) * (rank - keep.dim()) + tuple(keep.shape)).contiguous())
    return _row_factor(b, m, rank, "attended_rows", [], [("clip", 0.0, 1.0, None)])


def _finite_rows(b: Builder, m: Val, rank: int) -> Val:
    """f32 ``[..., L or 1, 1]``: 1 where float mask ``m``'s row has a key above -inf, 0 where the row is
    -inf everywhere, once per plan. ``sigmoid(m / FLT_MAX)`` is 0 for -inf and at least
    ``sigmoid(-1) = 0.27`` for any finite value, so the row's sum times 4, clipped to [0, 1], is the
    factor (a NaN stays NaN: the segment checks mask inputs for NaN, ``EngineSegment._finite``)."""
    to_unit = [("linear", 1.0 / MASKED, 0.0), ("logistic", 0.0, 0.0)]
    return _row_factor(b, m, rank, "finite_rows", to_unit, [("linear", 4.0, 0.0, None), ("clip", 0.0, 1.0, None)])


def _row_factor(b: Builder, m: Val, rank: int, memo_key: str, per_key: list, per_row: list) -> Val:
    """``per_row(sum over the keys of per_key(m))`` as f32 ``[..., L or 1, 1]``, once per plan and mask:
    ``m`` as f32 (one reorder; ``per_key`` as the eltwise of a binary add of 0 where given), then a
    matmul with a ones column whose post-ops are ``per_row``."""
    memo = b.memo.setdefault(memo_key, {})
    if id(m) not in memo:
        view = base.broadcast_view(b, m, rank)
        dense = base.contiguous_strides(view.shape)
        as_f32 = b.temp(view.shape, dense, "f32")
        b.reorder(view, as_f32, src_q=None, dst_q=None)
        if per_key:
            mapped = b.temp(view.shape, dense, "f32")
            zero = b.constant(torch.zeros((1,) * len(view.shape)))
            b.binary(as_f32, zero, mapped, "add", scale0=None, scale1=None, eltwise=per_key)
            as_f32 = mapped
        rows = (*view.shape[:-1], 1)
        factor = b.temp(rows, base.contiguous_strides(rows), "f32")
        n, keys = math.prod(rows), view.shape[-1]  # as 2-D rows: the constant-weight matmul's operands
        src, dst = b.view(as_f32, (n, keys), (keys, 1)), b.view(factor, (n, 1), (1, 1))
        b.matmul(src, None, dst, weight=torch.ones(keys, 1), post=per_row)
        memo[id(m)] = factor
    return memo[id(m)]


def mask_only_inputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Positions of ``gm``'s placeholders read only as attention masks: through views (reshape,
    unsqueeze, expand, ...), dtype casts and float adds of masks into ``gml.attention``'s ``attn_mask``. Such an
    input may hold ``-inf`` (``nn.MultiheadAttention`` turns a bool padding mask into ``-inf`` before
    its attention): every attention path adds it and gives SDPA's answer, so its segment checks it
    for NaN only (the module docstring), instead of running an infinite mask on the Python executor
    on every call (``nn.TransformerEncoder`` with ``src_key_padding_mask``: 1.5-2.5x slower than eager)."""
    modules = dict(gm.named_modules())
    only_mask: dict[fx.Node, bool] = {}

    def mask_use(u: fx.Node, n: fx.Node) -> bool:
        if u.op == "call_module" and u.target == "_guards_fn":  # torch.export's input guards: sizes only
            return True
        if is_attention(u):
            mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
            return mask is n and n not in u.args[:3]
        through = (
            shape.move_name(u) is not None
            or u.target in shape.FLATTENS
            or u.target in _EXPAND_OPS
            or (u.op == "call_method" and u.target == "expand")
            or u.target in (bf16.to_bf16, bf16.to_fp32)  # a bf16 model's mask cast (-inf stays -inf)
        )
        if through:
            return u.args[0] is n and only_mask.get(u, False)
        is_add = u.target in _FLOAT_ADDS or (u.op == "call_module" and isinstance(modules.get(str(u.target)), GmlAdd))
        return is_add and only_mask.get(u, False)

    # readers come after what they read: from the last node back, each node's readers are settled
    # (a loop, not a recursion: a long chain of views in a loaded file cannot exhaust the stack)
    for n in reversed(gm.graph.nodes):
        only_mask[n] = bool(n.users) and all(mask_use(u, n) for u in n.users)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, n in enumerate(placeholders) if only_mask[n])


#: float additions of two masks (an attention mask and a padding mask: nn.MultiheadAttention)
_FLOAT_ADDS = (operator.add, torch.add, torch.ops.aten.add.Tensor)


def _mask_post_op_ok(mask: tuple[int, ...], scores: tuple[int, ...], target: Target) -> bool:
    """Whether oneDNN 3.2's f32 matmul adds an additive ``mask`` (its rank, leading 1s) to
    ``scores`` ``[*batch, L, S]`` as a binary post-op with a jitted kernel. Measured
    (``brg:avx512_core``): the full shape, a per-column mask ``[1, .., 1, S]`` and masks per batch
    item ``[B, 1, .., 1, L or 1, S]`` (a padding mask, transformers' expanded masks) are jitted;
    a mask shared by the batch ``[1, H, L, S]`` / ``[L, S]`` (a relative-position bias, a causal
    mask) or per head ``[B, H, 1, S]`` is ``ref:any``. Below AVX-512 the matmul is ``gemm:jit``,
    which takes none (``Target.f32_matmul_brgemm``)."""
    if not target.f32_matmul_brgemm or len(mask) != len(scores) or mask[-1] != scores[-1]:
        return False
    if mask == scores or all(d == 1 for d in mask[:-1]):
        return True
    return len(scores) > 2 and mask[0] == scores[0] and all(d == 1 for d in mask[1:-2]) and mask[-2] in (1, scores[-2])


def fused_attention_kernels(target: Target) -> dict[str, str]:
    """The fused attention kernel ``target`` runs per dtype (``{"bf16": "avx512", "f32": "avx2"}``):
    ``avx512`` (native/attention.h, bf16 or fp32) with AVX-512 and native bf16, ``avx2``
    (native/attention_avx2.h, fp32) on any other target with AVX2. The target says what oneDNN may
    use (``ONEDNN_MAX_CPU_ISA`` honoured: under the AVX2 cap the AVX2 kernel runs); the engine says
    which kernels the CPU has the instructions for."""
    have = set(native.load().fused_attention_kernels())
    if target.avx512 and target.native_bf16 and "avx512" in have:
        return {"bf16": "avx512", "f32": "avx512"}
    if "avx2" in target.features and "avx2" in have:
        return {"f32": "avx2"}
    return {}


def fused_attention_cpu(target: Target) -> bool:
    """Whether ``target`` runs the fused bf16 attention kernel (native/attention.h)."""
    return "bf16" in fused_attention_kernels(target)


def fused_attention_kernel(q: Val, k: Val, v: Val, out: Val, target: Target, choice: str = "auto") -> str | None:
    """Which fused kernel runs ``gml.attention`` as the engine's one step (``avx512`` / ``avx2``), or
    None for matmul → softmax → matmul: operands of one dtype with unit last-dim strides, a kernel for
    that dtype on ``target`` (:func:`fused_attention_kernels`), an even head size for bf16 (pairs).
    ``choice``: the plan's ``EngineOptions.attention`` (``auto``, ``fused`` or ``primitives``).
    ``auto`` takes every kernel there is (ADR 009, session-22 amendment), except

    - bf16 on an AMX target: oneDNN's AMX matmuls (measured: fused 1.06× at 128 tokens);
    - the AVX2 kernel on an AVX-512 target without native bf16 (Skylake / Cascade Lake class): there
      oneDNN's f32 matmul is brgemm with the scale and mask as post-ops, and the AVX2 kernel measured
      0.99–1.05× of it (MiniLM INT8 under the ``AVX512_CORE_VNNI`` cap).

    Where it is taken it was never slower: on AVX2 the primitive path is five or more steps per layer
    (``gemm:jit`` takes no post-ops); the AVX-512 fp32 kernel on an Intel Xeon with AMX (family 6
    model 167): MiniLM INT8 0.92–0.99×, fp32 0.97–1.00×, ViT 1.00× (session 9's Zen 4 "level" was
    measured with GML's own loops built at ``-Os``).
    """
    if choice == "primitives":
        return None
    tensors = (q, k, v, out)
    dtype = q.dtype_name
    kernel = fused_attention_kernels(target).get(dtype)
    if kernel is None or any(t.dtype_name != dtype for t in tensors):
        return None
    if choice == "auto" and ((dtype == "bf16" and target.amx) or (kernel == "avx2" and target.f32_matmul_brgemm)):
        return None
    if any(t.shape[-1] > 1 and t.stride[-1] != 1 for t in tensors):
        return None
    if out.shape[-1] != v.shape[-1] or (dtype == "bf16" and q.shape[-1] % 2):  # bf16 is read in pairs
        return None
    return kernel


def _f32(b: Builder, m: Val) -> Val:
    """An additive mask as fp32 (the fused step adds fp32 masks; a bf16 model's float mask is bf16)."""
    if m.dtype_name == "f32":
        return m
    t = b.temp(m.shape, base.contiguous_strides(m.shape), "f32")
    b.reorder(m, t, src_q=None, dst_q=None)
    return t


#: the additive mask value of a masked key: finite, so that ``(m - 1) * MASKED`` is never NaN
MASKED = float(torch.finfo(torch.float32).max)


_aten = torch.ops.aten


_TO_OPS = (_aten.to.device, _aten.to.dtype, _aten.to.dtype_layout)


_AND_OPS = (_aten.__and__.Tensor, _aten.bitwise_and.Tensor)  # tensor-only schemas (not operator.and_ on ints)


_EXPAND_OPS = (_aten.expand.default,)


def read_mask_op(node: fx.Node) -> Call | None:
    """``to(bool)``, ``index``, ``&`` of two tensors and ``expand`` as a :class:`Call`, else None."""
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
    src = base.meta_dtype(c.inputs[0])
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
    idx = [base.meta_dtype(n) for n in c.inputs[1:]]
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
    dtypes = [base.meta_dtype(n) for n in c.inputs]
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


#: readers that copy an expanded value dense (``repeat_kv``: Llama / Qwen2 / Mistral / Gemma's grouped
#: K / V heads, ``x[:, :, None].expand(...).reshape(...)``): the copy is one reorder of the stride-0
#: view (shape.py's move rule), a plain fp32 / bf16 copy that reads stride 0 right
_COPYING_READERS = frozenset({"reshape", "contiguous"})


def check_expand_mask(c: Call) -> str | None:
    def reads_as_mask(u: fx.Node) -> bool:
        mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
        return is_attention(u) and mask is c.a.node and c.a.node not in u.args[:3]

    def copies(u: fx.Node) -> bool:
        name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
        return str(name).split(".")[0] in _COPYING_READERS and u.args[0] is c.a.node

    users = list(c.a.node.users)
    if not users or not all(reads_as_mask(u) or copies(u) for u in users):
        return "expand of a value read by other than an attention (as its mask) or a reshape (a dense copy)"
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
    return tuple(0 if i < lead or v.shape[i - lead] == 1 else v.stride[i - lead] for i in range(len(shape)))


def _dense_out(v: Val) -> Val:
    if v.stride != base.contiguous_strides(v.shape) and 0 not in v.shape:
        raise Unsupported(f"a mask op writing layout {v.stride}")
    return v


RULES: dict[object, TranslationRule] = {
    "attention": TranslationRule(check_attention, emit_attention, None),
    # the padding mask's arithmetic (read_mask_op): the whole model one plan
    "to_bool": TranslationRule(check_to_bool, emit_to_bool),
    "index": TranslationRule(check_index, emit_index, None),
    "and": TranslationRule(check_mask_and, emit_mask_and, 2),
    "expand_mask": TranslationRule(check_expand_mask, emit_expand_mask),
}
