"""One engine plan: the steps of a graph segment for one input shape, and its activation arena.

:class:`Builder` is what the translation table (:mod:`gml.runtime.rules`) writes to. It records
steps over :class:`Val` values whose shapes / strides / dtypes come from one run of the segment's
Python executor on the inputs (so they are, by construction, what that executor produces), then

1. places values in **storage groups**: a view (flatten) or an in-place accumulation (the residual
   ``sum``) joins the group of the value it aliases; a group holding a segment output lives in the
   caller's output tensor, one holding an input in the caller's input tensor;
2. gives every other group an offset in one arena from its lifetime (first step that touches it to
   the last): groups whose lifetimes overlap never overlap in memory; dead buffers are reused
   (greedy first fit, largest first);
3. creates the native plan (``gml._engine.Plan``): one oneDNN primitive per step.

**Free layouts.** A value marked ``free`` (fp32, 4-D, inside a segment, written by a conv / pool and
read only by convs, pools, residual sums or a flatten: :func:`gml.runtime.compile.free_values`)
takes the layout :data:`FP32_FREE_LAYOUT` names, whatever strides the executor gave it: dense NHWC
(the layout oneDNN's ``brgconv`` runs on, measured fastest on Zen 4), or ``"any"``: no strides
here, the primitive that writes it picks (``format_tag::any``; fp32 on AVX-512 gets ``nChw16c``).
Every later reader takes that layout as it is; only the steps at the segment's edges (a flatten,
an output) reorder back to the executor's plain strides, and a plain NCHW source of a step
writing an NHWC free value is reordered to NHWC first (no primitive mixes the two). A value in the same
memory as a free one (the residual ``sum``) is *tied* to it: same layout. Because a blocked layout's
size (channels padded to the block) is known only once its primitive exists, the arena is planned
after the native steps are created, from the sizes the plan reports (``Plan.value_bytes``).
INT8 values stay plain NHWC: oneDNN's INT8 kernels (``brgconv``) take NHWC directly (measured:
docs/adr/006-native-engine.md, "Layouts").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from gml.ir.target import Target
from gml.runtime.options import EngineOptions
from gml.runtime.plan_steps import EMITTERS, EmitContext, Unsupported, dtype_name

#: A uint8 value's (scale, zero point), or None for fp32.
QP = tuple[float, int] | None
#: Fused oneDNN eltwise post-ops: ``(algorithm, alpha, beta)`` each.
Eltwise = list[tuple[str, float, float]]
#: matmul post-ops: an eltwise ``(algorithm, alpha, beta, None)`` or a binary op with a value.
PostOps = Sequence[tuple[str, float, float, "Val | None"]]


_ITEMSIZE = {"f32": 4, "bf16": 2, "s64": 8}
ALIGN = 64


#: The layout of free fp32 values (see the module docstring): ``"nhwc"`` (dense channels-last, what
#: oneDNN's ``brgconv`` runs on) or ``"any"`` (the writer's pick: ``nChw16c`` for oneDNN 3.2's direct
#: ``jit`` kernels). Measured in one interleaved run on Zen 4 (ADR 006, "Layouts"): ResNet18 fp32 bs1
#: 2-5 % faster in NHWC (its 256- and 512-channel 3x3 convs 3 % / 9 % faster on ``brgconv``, equal
#: at 64 channels); OpenVINO runs its fp32 convs the same way (``brgconv_avx512_f32``, NHWC).
FP32_FREE_LAYOUT = "nhwc"


def exact_int8_gemm(target: Target) -> bool:
    """Whether ``gml::dynamic_linear`` runs its GEMM on GML's own exact AVX2 kernel on ``target``
    (native/int8_gemm_avx2.h): where int8 dot products are not VNNI-class (``target.exact_u8s8``:
    AVX2, AVX-512 without VNNI) oneDNN's int8 matmul multiplies with ``vpmaddubsw``, whose int16 pair
    sums saturate, in its slow ``gemm:jit`` (issue #23); with VNNI / AMX its brgemm is exact and faster."""
    return target.gml_int8_gemm


def nhwc_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Dense channels-last strides of an ``N, C, *spatial`` shape (NWC / NHWC / NDHWC)."""
    stride, inner = [1] * len(shape), shape[1]  # channels innermost
    for i in range(len(shape) - 1, 1, -1):
        stride[i] = inner
        inner *= shape[i]
    stride[0] = inner
    return tuple(stride)


def is_nhwc(v: Val) -> bool:
    """Dense channels-last (strides of size-1 dims do not matter)."""
    want = nhwc_strides(v.shape)
    return all(d == 1 or s == t for d, s, t in zip(v.shape, v.stride, want))


def _dense_in(v: Val, want: tuple[int, ...]) -> bool:
    """Whether ``v`` addresses its elements as strides ``want`` do (the strides of size-1 dims aside)."""
    return all(d == 1 or s == t for d, s, t in zip(v.shape, v.stride, want))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major dense strides of ``shape`` (in elements) (the translation rules: ``contiguous_strides``)."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _fixed_free_layout(v: Val) -> bool:
    """Whether free value ``v`` gets :data:`FP32_FREE_LAYOUT`'s fixed strides rather than ``any``."""
    return v.free and FP32_FREE_LAYOUT == "nhwc" and v.dtype_name == "f32" and len(v.shape) == 4


def _const_address(v: Val, written: set[Group]) -> int:
    """Where the bytes of plan constant ``v`` start: its own tensor, or, for a view of one (a
    matmul's transposed or broadcast view of botnet26t's relative-position table), the constant's
    tensor plus the view's offset. The native plan copies them (``Plan::add_constant``), so the view's
    span, as oneDNN counts it (:func:`_span`: what the copy reads), is checked against the
    constant's bytes first; a constant no step writes (an in-place sum copies its skip value first:
    :meth:`Builder.share`)."""
    g = v.group
    assert g is not None
    if g in written:
        raise Unsupported("a step writes a plan constant")
    root = g.members[0]  # the constant itself (Builder.constant); views are joined after it
    if root.ref is None or root.offset != 0:
        raise Unsupported("a plan constant without its tensor")
    end = v.offset + _span(tuple(v.shape), tuple(v.stride), root.ref.element_size())
    if v.offset < 0 or end > root.ref.numel() * root.ref.element_size():
        raise Unsupported("a view past the end of a plan constant")
    return root.ref.data_ptr() + v.offset


def _native_strides(v: Val) -> list[int]:
    """The strides a value is added to the native plan with; none (``format_tag::any``) for a free
    value whose writer picks its layout."""
    if _fixed_free_layout(v):
        return list(nhwc_strides(v.shape))
    return [] if v.free else list(v.stride)


def _span(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes a strided value spans, as oneDNN counts them (``max(dim * stride)`` for plain strided
    memory: a slice such as a split's last piece reaches past its last element, and the native
    plan checks that every arena value fits)."""
    if any(d == 0 for d in shape):
        return 0
    last = sum((d - 1) * s for d, s in zip(shape, stride)) + 1
    return max([last, *(d * s for d, s in zip(shape, stride))]) * itemsize  # a 0-d value: one element


def _extent(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a strided value's first element to its last, inclusive: what ``torch.empty_strided``
    allocates for it (less than :func:`_span` for a slice)."""
    if any(d == 0 for d in shape):
        return 0
    return (sum((d - 1) * s for d, s in zip(shape, stride)) + 1) * itemsize


@dataclass(eq=False)
class Group:
    """Bytes shared by aliasing values: in the arena, or an input / output tensor of the call."""

    where: str = "arena"  # "arena" | "input" | "output" | "const" (plan-owned: Builder.constant)
    index: int = -1
    members: list[Val] = field(default_factory=list)
    arena_offset: int = 0

    @property
    def nbytes(self) -> int:
        return max((m.offset + m.nbytes for m in self.members), default=0)


@dataclass(eq=False)
class Val:
    """A value of the plan: its layout, the node it stands for (None for temporaries), its group."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype_name: str
    node: fx.Node | None = None
    group: Group | None = None
    offset: int = 0  # bytes from the start of the group
    ref: torch.Tensor | None = None  # the Python executor's tensor for this value (compile time only)
    #: layout chosen by the primitive writing it (``stride`` is then the executor's, unused)
    free: bool = False
    #: the value whose layout this one takes (the residual sum's skip value)
    tie: Val | None = None
    #: bytes of a free value's layout, once the native plan knows it
    layout_bytes: int | None = None

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype_name, 1)

    @property
    def nbytes(self) -> int:
        if self.layout_bytes is not None:
            return self.layout_bytes
        return _span(self.shape, self.stride, self.itemsize)


@dataclass(eq=False)
class Step:
    method: str
    reads: list[Val]
    writes: list[Val]
    kwargs: dict[str, Any]
    name: str


@dataclass(eq=False)
class PendingPad:
    """A constant pad not written yet (:meth:`Builder.defer_pad`): ``out`` is ``src`` padded by
    ``pads`` (``(before, after)`` per dim of ``src``, first dim first) with ``value``; ``write``
    records its steps. A conv reading ``out`` may take the widths as its own padding instead
    (timm's "same" padding before a stride-2 conv), and then nothing writes ``out`` at all."""

    out: Val
    src: Val
    pads: tuple[tuple[int, int], ...]
    value: float
    write: Callable[[], None]
    name: str


class Builder:
    """Records the steps of one plan (see the module docstring). ``node_pos`` / ``last_use`` come
    from the segment graph: a value read by a later node or returned must not be overwritten."""

    def __init__(
        self, last_use: dict[fx.Node, float], target: Target | None = None, options: EngineOptions | None = None
    ) -> None:
        from gml.runtime.target import resolve

        #: the CPU this plan is for (gml.ir.target): the rules' ISA decisions read it, nothing else
        self.target = resolve(target)
        #: the engine's switches (gml.runtime.options: Winograd, the attention path), from the API
        self.options = options if options is not None else EngineOptions()
        self.vals: list[Val] = []
        self.steps: list[Step] = []
        self.last_use = last_use
        self.pos = 0  # position of the node being translated
        self.node_name = ""
        #: values a rule computes once per plan and reuses (an attention mask made additive)
        self.memo: dict[str, Any] = {}
        #: bytes of the caller's input / output tensors (first to last element), for the native plan's
        #: bounds check (Plan.external_bytes)
        self.extents: dict[tuple[int, int], int] = {}
        #: pads whose steps wait for their first reader (defer_pad)
        self.pending_pads: list[PendingPad] = []

    # ------------------------------------------------------------ values
    def _new(self, shape: Any, stride: Any, dtype: str, node: fx.Node | None = None) -> Val:
        v = Val(tuple(int(d) for d in shape), tuple(int(s) for s in stride), dtype, node)
        v.group = Group(members=[v])
        self.vals.append(v)
        return v

    def value_for(self, node: fx.Node | None, t: torch.Tensor, *, free: bool = False) -> Val:
        v = self._new(t.shape, t.stride(), dtype_name(t.dtype), node)
        v.ref, v.free = t, free
        return v

    def temp(self, shape: Any, stride: Any, dtype: str, *, like: Val | None = None) -> Val:
        """A new value; ``like`` a free value: the temp is free too, in that value's layout."""
        v = self._new(shape, stride, dtype)
        if like is not None and like.free:
            v.free, v.tie = True, like
        return v

    def constant(self, t: torch.Tensor) -> Val:
        """A value the plan owns (a copy of ``t``, dense): a causal or a constant attention mask."""
        t = t.detach().contiguous()
        v = self._new(t.shape, t.stride(), dtype_name(t.dtype))
        assert v.group is not None
        v.group.where = "const"
        v.ref = t
        return v

    def settle(self, v: Val) -> bool:
        """Make free value ``v`` plain when its fixed layout (:data:`FP32_FREE_LAYOUT` NHWC) is the
        executor's own strides for it: then a view of it (a flatten the executor returned as a
        view) can alias it, as it would a plain value. Returns whether ``v`` is plain now."""
        if not v.free:
            return True
        if _fixed_free_layout(v) and v.tie is None and v.stride == nhwc_strides(v.shape):
            v.free = False
            return True
        return False

    def is_view_of(self, out: Val, src: Val) -> bool:
        """Whether the Python executor returned ``out`` as a view of ``src``'s memory."""
        if out.ref is None or src.ref is None:
            return False
        return out.ref.untyped_storage().data_ptr() == src.ref.untyped_storage().data_ptr()

    def _join(self, v: Val, base: Val, offset: int) -> None:
        assert v.group is not None and base.group is not None
        if len(v.group.members) != 1:
            raise Unsupported("a value aliased twice")
        v.group = base.group
        v.offset = base.offset + offset
        base.group.members.append(v)

    def alias(self, out: Val, src: Val) -> None:
        """``out`` is a view of ``src`` (same bytes, as the executor's storage offsets say)."""
        assert out.ref is not None and src.ref is not None
        delta = (out.ref.storage_offset() - src.ref.storage_offset()) * out.ref.element_size()
        self._join(out, src, delta)

    def view(self, base: Val, shape: Any, stride: Any, *, offset: int = 0) -> Val:
        """A new value over ``base``'s bytes with another shape / strides (for copies in a new order),
        ``offset`` bytes in (a slice: one source's part of a concatenation)."""
        v = self._new(shape, stride, base.dtype_name)
        self._join(v, base, offset)
        return v

    def share(self, out: Val, other: Val, *, also_read: Val | None = None) -> None:
        """``out`` is computed in place into ``other``'s memory (the residual ``sum``). If ``other``
        (or a value aliasing it) is read after this node, is the caller's, or shares memory with
        ``also_read`` (the conv's own source: ``conv(x) + x`` would overwrite x while the conv
        reads it; fuzz seed 424242), copy it first. ``other`` must have ``out``'s shape: the sum
        adds the destination's own elements (a broadcast addend is a binary step's: the float conv
        rules' ``_conv_then_broadcast_add``)."""
        assert other.group is not None
        if tuple(other.shape) != tuple(out.shape):
            raise Unsupported(f"an in-place sum of a {tuple(other.shape)} addend into {tuple(out.shape)}")
        live = (
            other.group.where in ("input", "const")  # the caller's, or a plan constant: never written
            or (also_read is not None and also_read.group is other.group)
            or any(m.node is not None and self.last_use.get(m.node, 0) > self.pos for m in other.group.members)
        )
        if out.free:  # the sum's destination takes the skip value's layout, whatever it is
            if live:
                # a plain skip value's copy takes the layout the conv would have picked (fp32 4-D:
                # NHWC), not the skip value's own: brgconv writes no NCHW destination (a conv + a
                # constant NCHW position term ran 40x slower into a plain copy)
                plain = not other.free and _fixed_free_layout(out)
                stride = nhwc_strides(other.shape) if plain else other.stride
                t = self.temp(other.shape, stride, other.dtype_name, like=other)
                self.reorder(other, t, src_q=None, dst_q=None)
                other = t
            out.tie = other
            if not other.free:
                out.free, out.tie, out.stride = False, None, other.stride
        elif live or other.free or other.stride != out.stride or other.shape != out.shape:
            t = self.temp(out.shape, out.stride, other.dtype_name)
            self.reorder(other, t, src_q=None, dst_q=None)
            other = t
        self._join(out, other, 0)

    # ------------------------------------------------------------ deferred pads
    def defer_pad(self, pad: PendingPad) -> None:
        """Record ``pad``'s steps only when a step touches its output (or overwrites its source, or
        the output is returned): a conv that reads it through :meth:`pending_pad` takes the widths
        as its own zero padding and no step writes the padded copy."""
        self.pending_pads.append(pad)

    def pending_pad(self, v: Val) -> PendingPad | None:
        """The pad not written yet whose output is ``v`` itself (not a view of it), or None."""
        return next((p for p in self.pending_pads if p.out is v), None)

    def _write_pending(self, reads: Sequence[Val], writes: Sequence[Val]) -> None:
        """Record the pending pads a step reading ``reads`` and writing ``writes`` depends on, before
        it: those whose output it touches, and those whose source it overwrites (an in-place sum
        into the pad's source must come after the pad read it)."""
        due = [
            p
            for p in self.pending_pads
            if any(v.group is p.out.group for v in (*reads, *writes)) or any(v.group is p.src.group for v in writes)
        ]
        for p in due:
            if p in self.pending_pads:  # a pad written for an earlier one (a pad of a pad) is gone
                self.pending_pads.remove(p)
                name, self.node_name = self.node_name, p.name
                p.write()
                self.node_name = name

    # ------------------------------------------------------------ steps (native plan: gml.runtime.plan_steps)
    def _step(self, method: str, reads: list[Val], writes: list[Val], **kwargs: Any) -> None:
        self._write_pending(reads, writes)
        self.steps.append(Step(method, reads, writes, kwargs, self.node_name))

    def _free_edge(self, src: Val, dst: Val) -> Val:
        """Where a step reading a free value writes a plain one (the segment's edge): a free temp
        to write, reordered into ``dst`` afterwards (a primitive given a blocked source and a plain
        destination may find only oneDNN's reference kernel). Returns what the step writes."""
        if not src.free or dst.free:
            return dst
        if _fixed_free_layout(src) and len(dst.shape) == 4 and is_nhwc(dst):
            return dst  # a fixed NHWC free value is plain NHWC: nothing to convert (mixnet_s's split convs)
        t = self.temp(dst.shape, dst.stride, dst.dtype_name)
        t.free = True
        return t

    def _finish_edge(self, written: Val, dst: Val) -> None:
        if written is not dst:
            self.reorder(written, dst, src_q=None, dst_q=None)

    def _fixed_src(self, src: Val, dst: Val) -> Val:
        """A plain source (the caller's NCHW input, a segment input torch made NCHW) of a step
        writing NHWC (a free value, or a fixed NHWC one such as a segment output the executor keeps
        channels-last): reordered to NHWC first. A primitive mixing NCHW in and NHWC out finds only
        oneDNN's reference kernel (shufflenet_v2's conv5 after the channel shuffle: 1.5 s instead of
        ~0.2 ms); OpenVINO does the same reorder. Any rank with spatial dims: a Conv1d's NCW source
        with an NWC destination (Whisper's first conv, 39 s per call on ``ref:any`` under AVX2). The
        converse, an NHWC source with a plain NCHW destination, is reordered to NCHW."""
        rank = len(src.shape)
        if src.free or rank < 3 or len(dst.shape) != rank:
            return src
        writes_nhwc = _fixed_free_layout(dst) or (not dst.free and is_nhwc(dst))
        if writes_nhwc and not is_nhwc(src):
            t = self.temp(src.shape, nhwc_strides(src.shape), src.dtype_name)
            t.free = True
            self.reorder(src, t, src_q=None, dst_q=None)
            return t
        # the converse: an NHWC source (a squeeze-excite product torch strides channels-last) into a
        # plain NCHW destination (a residual sum into the caller's NCHW input) is reordered to NCHW
        writes_nchw = not dst.free and _dense_in(dst, _contiguous(dst.shape)) and not is_nhwc(dst)
        if writes_nchw and is_nhwc(src) and not _dense_in(src, _contiguous(src.shape)):
            t = self.temp(src.shape, _contiguous(src.shape), src.dtype_name)
            self.reorder(src, t, src_q=None, dst_q=None)
            return t
        return src

    def _one_order(self, src: Val, dst: Val) -> tuple[Val, Val]:
        """``src`` and ``dst`` described in one dimension order where their strides leave the order
        open. oneDNN takes the stride of a size-1 dim as given: ``(1, C, 1, 1)`` with strides
        ``(C, 1, 1, 1)`` reads as NCHW, with ``(C, 1, C, C)`` as NHWC — the same bytes — and a conv
        created with one of each finds only its reference kernel (``ref:any``; timm mixnet_s's
        squeeze-excite convs, fp32 and INT8, whose source torch made NCHW-strided and whose output
        NHWC-strided). Such a value becomes a view in the other's order (no copy): NHWC when the
        destination is (or may be) channels-last, else NCHW. Plain values with spatial dims (a
        Conv1d's NCW too: Wav2Vec2's first conv reads one channel of raw audio, ``(1, 1, 16000)``
        strided as NCW beside an NWC output, 57 ms per call on ``ref:any`` under AVX2 instead of
        0.5 ms); a free value fixed to NHWC counts as NHWC, one whose writer picks its layout is
        left alone."""
        rank = len(src.shape)
        if rank < 3 or len(dst.shape) != rank or (src.free and not _fixed_free_layout(src)):
            return src, dst
        if dst.free and not _fixed_free_layout(dst):
            return src, dst
        for order in (nhwc_strides, _contiguous):
            s_want, d_want = order(src.shape), order(dst.shape)
            s_ok = _fixed_free_layout(src) if src.free else _dense_in(src, s_want)
            d_ok = _fixed_free_layout(dst) if dst.free else _dense_in(dst, d_want)
            if order is _contiguous and (src.free or dst.free):
                break
            if s_ok and d_ok:
                if not src.free and src.stride != s_want:
                    src = self.view(src, src.shape, s_want)
                if not dst.free and dst.stride != d_want:
                    dst = self.view(dst, dst.shape, d_want)
                break
        return src, dst

    def _windowed(self, method: str, src: Val, dst: Val, *, accumulate: bool = False, **kw: Any) -> None:
        """A conv or pool step from ``src`` to ``dst``, the two laid out for it (:meth:`_fixed_src`,
        :meth:`_free_edge`, :meth:`_one_order`). ``accumulate``: the step also reads ``dst`` (a conv's
        ``sum`` post-op), which is then written where it is, never through a free edge."""
        src = self._fixed_src(src, dst)
        written = dst if accumulate else self._free_edge(src, dst)
        src, target = self._one_order(src, written)
        self._step(method, [src, target] if accumulate else [src], [target], **kw)
        self._finish_edge(written, dst)

    def conv(self, src: Val, dst: Val, *, sum_q: QP = None, **kw: Any) -> None:
        self._windowed("conv", src, dst, accumulate=sum_q is not None, sum_q=sum_q, **kw)

    def inner_product(self, src: Val, dst: Val, **kw: Any) -> None:
        self._step("inner_product", [src], [dst], **kw)

    def dynamic_linear(self, src: Val, dst: Val, *, residual: Val | None = None, **kw: Any) -> None:
        """``gml::dynamic_linear`` on 2-D fp32 ``[M, K]`` → ``[M, N]``: the engine's row quantization
        writes two arena temporaries (int8 rows, per-row abs-max) that its matmul reads.
        ``residual`` (2-D ``[M, N]`` fp32): added to the result as the matmul's last post-op."""
        m, k = src.shape
        n = dst.shape[1]
        q = self.temp((m, k), (k, 1), "s8")
        amax = self.temp((m, 1), (1, 1), "f32")
        # the native matmul is planned 3-D ([1, M, K] x [1, K, N]; native/dynamic_linear.h says why): views
        q3, amax3 = self.view(q, (1, m, k), (m * k, k, 1)), self.view(amax, (1, m, 1), (m, 1, 1))
        dst3 = self.view(dst, (1, m, n), (m * dst.stride[0], dst.stride[0], dst.stride[1]))
        reads = [src]
        if residual is not None:
            reads.append(self.view(residual, (1, m, n), (m * residual.stride[0], *residual.stride)))
        self._step("dynamic_linear", reads, [dst3, q3, amax3], rows=(src, dst), **kw)

    def reorder(self, src: Val, dst: Val, *, src_q: QP, dst_q: QP) -> None:
        self._step("reorder", [src], [dst], src_q=src_q, dst_q=dst_q)

    def pool(self, src: Val, dst: Val, **kw: Any) -> None:
        """One oneDNN pooling (native/pool.h): ``alg``, the window (``kernel``, ``stride``,
        ``dilation``, ``pad_l``, ``pad_r``) and the ``eltwise`` post-ops, as keywords."""
        self._windowed("pool", src, dst, **kw)

    def binary(
        self, a: Val, b: Val, dst: Val, alg: str, *, scale0: float | None, scale1: float | None, eltwise: Eltwise
    ) -> None:
        # oneDNN 3.2's binary primitive gives wrong values when a source's strides differ from the
        # destination's (found by the INT8 fuzzer: an NWC conv output plus an NCW input): bring such a
        # source into the destination's layout first.
        if a.free or b.free or dst.free:
            raise Unsupported("a binary op on a free-layout value")  # free_values() never marks these
        if a.stride != dst.stride and a.shape == dst.shape:
            a = self._relayout(a, dst)
        if b.stride != dst.stride and b.shape == dst.shape:
            b = self._relayout(b, dst)
        self._step("binary", [a, b], [dst], alg=alg, scale0=scale0, scale1=scale1, eltwise=eltwise)

    def _relayout(self, v: Val, like: Val) -> Val:
        t = self.temp(like.shape, like.stride, v.dtype_name)
        self.reorder(v, t, src_q=None, dst_q=None)
        return t

    def concat(self, srcs: list[Val], dst: Val, axis: int) -> None:
        self._step("concat", list(srcs), [dst], axis=axis)

    # transformer ops (native/linear.h: matmul; native/eltwise.h: softmax, layer_norm)
    def matmul(
        self,
        src: Val,
        wei: Val | None,
        dst: Val,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        post: PostOps = (),
    ) -> None:
        """``dst = post(src @ wei + bias)``: ``wei`` a value, or ``weight`` a constant ``[K, N]``
        tensor (any strides: a Linear's weight transposed). ``post`` entries: eltwise
        ``(alg, alpha, beta, None)`` or ``("binary_add" | "binary_mul", 0, 0, value)``."""
        if (wei is None) == (weight is None):
            raise ValueError("matmul takes a weight value or a constant weight")
        operands = [p[3] for p in post if p[3] is not None]
        reads = [src, *([wei] if wei is not None else []), *operands]
        self._step("matmul", reads, [dst], wei=wei, weight=weight, bias=bias, post=list(post))

    def embedding(self, ids: Val, dst: Val, *, weight: torch.Tensor) -> None:
        """``dst = weight[ids]`` (nn.Embedding): int64 ids of any rank and strides, a dense
        ``[..., dim]`` f32 / bf16 destination. The native step reads ``weight``'s rows in place (the
        plan keeps the tensor alive: ``Plan.keep``)."""
        self._step("embedding", [ids], [dst], weight=weight)

    def mask_op(
        self,
        op: str,
        srcs: list[Val],
        dst: Val,
        strides: list[tuple[int, ...]],
        index_dims: tuple[int, ...] = (),
        index_strides: tuple[int, ...] = (),
    ) -> None:
        """A padding mask's integer / bool arithmetic (native/shape.h ``MaskOpStep``): ``ne0``,
        ``and`` or ``index`` into the dense ``dst``, each source read through ``strides`` (dst's
        rank, in elements, 0 along a broadcast dim)."""
        self._step(
            "mask_op", list(srcs), [dst], op=op, strides=strides, index_dims=index_dims, index_strides=index_strides
        )

    def softmax(self, src: Val, dst: Val, axis: int) -> None:
        self._step("softmax", [src], [dst], axis=axis)

    def attention(
        self,
        q: Val,
        k: Val,
        v: Val,
        dst: Val,
        *,
        masks: list[Val],
        scale: float,
        kernel: str = "avx512",
        zero_masked_rows: bool = False,
    ) -> None:
        """``dst = softmax(scale * q @ kᵀ + sum(masks)) @ v`` in one fused step: q / k / v / dst of
        one rank, unit last-dim strides; masks additive f32. ``kernel``: ``avx512`` (bf16 / fp32,
        native/attention.h) or ``avx2`` (fp32, native/attention_avx2.h). ``zero_masked_rows``: a
        row whose every key is masked is zeros (a bool mask's rule in SDPA), else the values' mean."""
        self._step("attention", [q, k, v, *masks], [dst], scale=scale, kernel=kernel, zero_masked_rows=zero_masked_rows)

    def layer_norm(
        self, src: Val, dst: Val, *, gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float
    ) -> None:
        self._step("layer_norm", [src], [dst], gamma=gamma, beta=beta, eps=eps)

    def kernel(self, struct: str, reads: dict[str, Val], writes: dict[str, Val], **fields: Any) -> None:
        """A step whose native description ``struct`` (an op's own engine step, gml.runtime.rules.kernel)
        takes its values by field name: ``reads`` and ``writes`` name them, ``fields`` are set as they are."""
        self._step(
            "kernel", list(reads.values()), list(writes.values()), struct=struct, names=[*reads, *writes], fields=fields
        )

    # ------------------------------------------------------------ placement
    def place_inputs(self, inputs: list[Val]) -> None:
        for i, v in enumerate(inputs):
            assert v.group is not None
            v.group.where, v.group.index = "input", i
            self.extents[(1, i)] = _extent(v.shape, v.stride, _ITEMSIZE.get(v.dtype_name, 1))

    def place_outputs(self, outputs: list[Val], metas: list[torch.Tensor]) -> list[Val]:
        """Put each output's group in the caller's output tensor, or copy into it when the group is
        the caller's input, another output's, or larger than the output (a view of a bigger value).

        "Larger" counts the bytes the caller allocates (``torch.empty_strided`` of the output's
        shape and strides: first to last element), not oneDNN's span of the value (``max(dim *
        stride)``): a select of a LayerNorm's first token, ``(B, C)`` with strides ``(T*C, 1)``, spans
        the whole ``B*T*C`` LayerNorm in oneDNN's count but is allocated ``(B-1)*T*C + C`` elements;
        placing the LayerNorm in it wrote past the caller's tensor (HF Dinov2's pooler output, issue
        #24: heap corruption)."""
        self._write_pending(outputs, [])  # a returned pad is written, whoever else reads it
        placed: list[Val] = []
        for k, (v, t) in enumerate(zip(outputs, metas)):
            g = v.group
            assert g is not None
            allocated = _extent(tuple(t.shape), tuple(t.stride()), t.element_size())
            self.extents[(2, k)] = allocated
            fits = all(
                not m.free and m.offset + _extent(m.shape, m.stride, _ITEMSIZE.get(m.dtype_name, 1)) <= allocated
                for m in g.members
            )
            if g.where == "arena" and v.offset == 0 and v.nbytes >= g.nbytes and fits and not v.free:
                g.where, g.index = "output", k
                placed.append(v)
                continue
            o = self.value_for(None, t)
            assert o.group is not None
            o.group.where, o.group.index = "output", k
            self.node_name = "output"
            self.reorder(v, o, src_q=None, dst_q=None)
            placed.append(o)
        return placed

    def plan_arena(self) -> int:
        """Arena offsets from group lifetimes; returns the arena size in bytes."""
        life: dict[Group, list[int]] = {}
        for i, s in enumerate(self.steps):
            for v in (*s.reads, *s.writes):
                assert v.group is not None
                if v.group.where != "arena":
                    continue
                span = life.setdefault(v.group, [i, i])
                span[0], span[1] = min(span[0], i), max(span[1], i)
        placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
        size = 0
        for g, (first, last) in sorted(life.items(), key=lambda kv: -kv[0].nbytes):
            need = (g.nbytes + ALIGN - 1) // ALIGN * ALIGN
            busy = sorted((o, e) for o, e, f, la in placed if not (la < first or last < f))
            offset = 0
            for o, e in busy:
                if offset + need <= o:
                    break
                offset = max(offset, e)
            g.arena_offset = offset
            placed.append((offset, offset + need, first, last))
            size = max(size, offset + need)
        return size

    # ------------------------------------------------------------ native plan
    def build(self, native: Any) -> Any:
        """The native plan: values, then steps (which fix the free values' layouts), then the arena."""
        plan = native.Plan()
        plan.keep = []  # tensors the native steps read in place (embedding tables)
        ids: dict[Val, int] = {}
        where = {"arena": 0, "input": 1, "output": 2}
        used = {v for s in self.steps for v in (*s.reads, *s.writes)}
        written = {v.group for s in self.steps for v in s.writes}
        for v in self.vals:
            g = v.group
            assert g is not None
            if v not in used and not any(m.tie is v for m in self.vals if m in used):
                continue
            if v.free and (g.where != "arena" or (len(g.members) > 1 and v.offset)):
                raise Unsupported("a free-layout value outside the arena or at an offset")
            if g.where == "const":
                ids[v] = plan.add_constant(list(v.shape), list(v.stride), v.dtype_name, _const_address(v, written))
                continue
            ids[v] = plan.add_value(list(v.shape), _native_strides(v), v.dtype_name, where[g.where], g.index, 0)
        for v in ids:
            if v.tie is not None and not _fixed_free_layout(v):  # a fixed layout: the same strides
                plan.tie(ids[v], ids[v.tie])
        self._emit_steps(plan, ids, native)
        for v in ids:
            if v.free:
                v.layout_bytes = int(plan.value_bytes(ids[v]))
        arena = self.plan_arena()
        for v, i in ids.items():
            g = v.group
            assert g is not None
            if g.where != "const":
                plan.set_offset(i, (g.arena_offset if g.where == "arena" else 0) + v.offset)
        for (where_id, index), nbytes in self.extents.items():
            plan.external_bytes(where_id, index, nbytes)
        plan.finalize(arena)
        for v in self.vals:
            v.ref = None  # the executor's tensors were for layouts only
        return plan

    def _emit_steps(self, plan: Any, ids: dict[Val, int], native: Any) -> None:
        """Each step as its family's typed description (gml.runtime.plan_steps, native/*.h)."""
        cx = EmitContext(
            native,
            ids,
            self.options.winograd_mode,
            exact_int8_gemm(self.target),
            self.target.native_bf16,
            self.target.int8_winograd,
        )
        for s in self.steps:
            EMITTERS[s.method](plan, cx, s)
