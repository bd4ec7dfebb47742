"""The Python executor of the lowered ops: a CPU implementation of every ``torch.ops.gml`` op.

Each implementation turns the op's explicit arguments back into the kernel backends' calls
(:mod:`gml.kernels.registry`: oneDNN or FBGEMM, named by the op's ``backend`` argument). Prepacked
weights are *derived state*: :func:`_packed` caches them per weight tensor (weakly, so they die
with the weight; invalidated when the weight is written, ``Tensor._version``), never in the graph
and never on disk. Small value objects (:class:`~gml.ir.values.QParams`, post-ops) are memoized so
the hot path builds none.

:func:`register` installs the implementations once; importing :mod:`gml` does it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gml.ir import library
from gml.ir.values import ConvSpec, Int8Weight, PostOp, QParams
from gml.kernels import dynamic_int8, exact_int8
from gml.kernels.backend import Int8Backend
from gml.kernels.registry import get_backend

#: packings kept per weight tensor (one per input qparams / geometry / backend seen)
MAX_PACKS_PER_WEIGHT = 4
_PACKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@functools.lru_cache(maxsize=4096)
def _qp(scale: float, zero_point: int) -> QParams:
    return QParams(scale, zero_point)


@functools.lru_cache(maxsize=256)
def _post(attr: str, scalars: tuple[float, ...], algorithm: str) -> PostOp:
    return PostOp(attr, scalars, algorithm)


@functools.lru_cache(maxsize=8)
def _backend(name: str) -> Int8Backend:
    return get_backend(name)


def _out(scale: float, zero_point: int, dtype: torch.dtype) -> QParams | None:
    return None if dtype == torch.float32 else _qp(scale, zero_point)


def _packed(weight: torch.Tensor, key: tuple[Any, ...], deps: tuple[Any, ...], make: Any) -> Any:
    """The packing of ``weight`` for ``key``, made by ``make()`` once. ``deps`` (weight scales,
    bias) are compared by identity and version, so a handle never outlives the tensors it read."""
    per = _PACKS.get(weight)
    if per is None:
        per = _PACKS[weight] = {}
    stamp = (weight._version, *((None, None) if d is None else (id(d), d._version) for d in deps))
    hit = per.get(key)
    if hit is not None and hit[0] == stamp and all(a is b for a, b in zip(hit[1], deps)):
        return hit[2]
    while len(per) >= MAX_PACKS_PER_WEIGHT:
        per.pop(next(iter(per)))
    handle = make()
    per[key] = (stamp, deps, handle)
    return handle


def clear_packs() -> None:
    """Drop every cached packing (tests; memory pressure)."""
    _PACKS.clear()


def drop_packs(weights: Sequence[torch.Tensor]) -> int:
    """Drop the packings of ``weights`` (:func:`gml.kernels.packs.drop_packed`); how many."""
    dropped = 0
    for w in weights:
        per = _PACKS.pop(w, None)
        dropped += len(per) if per else 0
    return dropped


# ---------------------------------------------------------------- implementations
@functools.cache
def _backend_available(name: str) -> bool:
    try:
        get_backend(name)
    except Exception:
        return False
    return True


def _any_backend() -> Int8Backend:
    return _backend("onednn" if _backend_available("onednn") else "fbgemm")


def quantize(x: torch.Tensor, out_scale: float, out_zero_point: int) -> torch.Tensor:
    return _any_backend().quantize(x, _qp(out_scale, out_zero_point))


def dequantize(x: torch.Tensor, x_scale: float, x_zero_point: int) -> torch.Tensor:
    return _any_backend().dequantize(x, _qp(x_scale, x_zero_point))


def requantize(
    x: torch.Tensor, x_scale: float, x_zero_point: int, out_scale: float, out_zero_point: int
) -> torch.Tensor:
    return _any_backend().requantize(x, _qp(x_scale, x_zero_point), _qp(out_scale, out_zero_point))


def _conv_spec(
    weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int
):
    return _spec(weight.dim() == 3, tuple(stride), tuple(padding), tuple(dilation), groups)


@functools.lru_cache(maxsize=1024)
def _spec(one_d: bool, stride: tuple, padding: tuple, dilation: tuple, groups: int) -> ConvSpec:
    if one_d:  # 1-D conv: the 2-D kernel at height 1
        return ConvSpec((1, *stride), (0, *padding), (1, *dilation), groups)
    return ConvSpec(stride, padding, dilation, groups)


def _check_conv(x: torch.Tensor, weight: torch.Tensor, spec: ConvSpec) -> None:
    """The source, weight and geometry of a ``gml.qconv`` agree (ranks, channels, groups, a kernel no
    larger than the padded input) before a backend prepacks anything: oneDNN divides by what it is
    given (a stride of 0: SIGFPE, issue #24). :class:`ConvSpec` checks the geometry's own ranges."""
    nsp = weight.dim() - 2
    if x.dim() != weight.dim() or nsp < 1:
        raise ValueError(f"gml.qconv: a {x.dim()}-D input for a {weight.dim()}-D weight")
    if weight.shape[0] % spec.groups or x.shape[1] != weight.shape[1] * spec.groups:
        raise ValueError(
            f"gml.qconv: input channels {x.shape[1]}, weight {tuple(weight.shape)} and groups {spec.groups} "
            "do not agree"
        )
    tail = spec.ndim - nsp  # a 1-D conv's spec is 2-D (height 1)
    for i in range(nsp):
        span = (weight.shape[2 + i] - 1) * spec.dilation[tail + i] + 1
        if x.shape[2 + i] + 2 * spec.padding[tail + i] < span:
            raise ValueError(
                f"gml.qconv: input size {tuple(x.shape[2:])} (padding {spec.padding}) is smaller than the kernel"
            )


def _conv_call(
    backend: str, x: torch.Tensor, x_scale: float, x_zero_point: int, weight, weight_scale, bias, geometry: tuple
) -> tuple[Int8Backend, QParams, Any]:
    """What ``gml.qconv`` and ``gml.qconv_add`` share: ``(backend, x's qparams, prepacked weight)``
    after checking the source, weight and ``geometry`` (stride, padding, dilation, groups) agree."""
    be = _backend(backend)
    x_qp = _qp(x_scale, x_zero_point)
    spec = _conv_spec(weight, *geometry)
    _check_conv(x, weight, spec)
    return be, x_qp, _conv_handle(be, x, x_qp, weight, weight_scale, bias, spec)


def _conv_handle(be: Int8Backend, x: torch.Tensor, x_qp: QParams, weight, weight_scale, bias, spec: ConvSpec) -> Any:
    def make() -> Any:
        w = weight.unsqueeze(2) if weight.dim() == 3 else weight
        shape = (x.shape[0], x.shape[1], 1, x.shape[2]) if weight.dim() == 3 else tuple(x.shape)
        return be.prepack_conv(Int8Weight(w, weight_scale, bias), spec, x_qp, shape)

    return _packed(weight, (be.name, spec, x_qp), (weight_scale, bias), make)


def qconv(
    x, x_scale, x_zero_point, weight, weight_scale, bias, stride, padding, dilation, groups,
    out_scale, out_zero_point, out_dtype, post_op, post_op_scalars, post_op_algorithm, backend="onednn",
):  # fmt: skip
    geometry = (stride, padding, dilation, groups)
    be, x_qp, handle = _conv_call(backend, x, x_scale, x_zero_point, weight, weight_scale, bias, geometry)
    out_qp = _out(out_scale, out_zero_point, out_dtype)
    if weight.dim() == 5:
        # the 5-D kernel has no eltwise post-op: a fused relu is the saturation at zero point 0
        if post_op not in ("none", "relu") or (post_op == "relu" and (out_qp is None or out_qp.zero_point != 0)):
            raise ValueError(
                f"conv3d takes post_op 'none', or 'relu' with a uint8 output of zero point 0; got {post_op}"
            )
        return be.conv3d(x, x_qp, handle, out_qp)
    p = _post(post_op, tuple(post_op_scalars), post_op_algorithm)
    if weight.dim() == 3:
        return be.conv2d(x.unsqueeze(2), x_qp, handle, out_qp, p).squeeze(2)
    return be.conv2d(x, x_qp, handle, out_qp, p)


def qconv_add(
    x, x_scale, x_zero_point, weight, weight_scale, bias, stride, padding, dilation, groups,
    other, other_scale, other_zero_point, out_scale, out_zero_point, post_op, backend="onednn",
):  # fmt: skip
    geometry = (stride, padding, dilation, groups)
    be, x_qp, handle = _conv_call(backend, x, x_scale, x_zero_point, weight, weight_scale, bias, geometry)
    if be.conv_add_writes_other and other.is_contiguous(memory_format=torch.channels_last):
        # oneDNN's sum post-op accumulates into `other`; the op is functional, so give it a copy
        # (a non-channels-last `other` is copied by the backend's layout conversion anyway)
        other = other.clone(memory_format=torch.channels_last)
    kind = "add_relu" if post_op == "relu" else "add"
    return be.conv2d(x, x_qp, handle, _qp(out_scale, out_zero_point), kind, other, _qp(other_scale, other_zero_point))


def qlinear(
    x, x_scale, x_zero_point, weight, weight_scale, bias, out_scale, out_zero_point, out_dtype,
    post_op, post_op_scalars, post_op_algorithm, backend="onednn",
):  # fmt: skip
    x_qp = _qp(x_scale, x_zero_point)
    if backend == "gml":  # GML's exact arithmetic for 8-bit weights without VNNI (ADR 011): defined there
        prep = _packed(
            weight, ("gml", x_qp), (weight_scale, bias),
            lambda: exact_int8.prepare(weight, weight_scale, bias, x_scale, x_zero_point),
        )  # fmt: skip
        return exact_int8.run(prep, weight, x, out_scale, out_zero_point, out_dtype, post_op)
    be = _backend(backend)
    handle = _packed(
        weight,
        (be.name, x_qp),
        (weight_scale, bias),
        lambda: be.prepack_linear(Int8Weight(weight, weight_scale, bias), x_qp, tuple(x.shape)),
    )
    p = _post(post_op, tuple(post_op_scalars), post_op_algorithm)
    return be.linear(x, x_qp, handle, _out(out_scale, out_zero_point, out_dtype), p)


def qadd(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale, out_zero_point, post_op, backend="onednn"):
    be = _backend(backend)
    a_qp, b_qp = _qp(a_scale, a_zero_point), _qp(b_scale, b_zero_point)
    return be.add(a, a_qp, b, b_qp, _qp(out_scale, out_zero_point), post_op == "relu")


def qmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale, out_zero_point, backend="onednn"):
    be = _backend(backend)
    return be.mul(a, _qp(a_scale, a_zero_point), b, _qp(b_scale, b_zero_point), _qp(out_scale, out_zero_point))


def qactivation(x, x_scale, x_zero_point, op, scalars, out_scale, out_zero_point, backend="onednn"):
    be = _backend(backend)
    return be.activation(x, _qp(x_scale, x_zero_point), _post(op, tuple(scalars), ""), _qp(out_scale, out_zero_point))


def qmax_pool(x, x_scale, x_zero_point, kernel_size, stride, padding, dilation, ceil_mode, backend="onednn"):
    be = _backend(backend)
    pool = be.max_pool3d if len(kernel_size) == 3 else be.max_pool2d
    return pool(x, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation), ceil_mode)


def qavg_pool2d(
    x, x_scale, x_zero_point, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
    out_scale, out_zero_point, backend="onednn",
):  # fmt: skip
    be = _backend(backend)
    return be.avg_pool2d(
        x, _qp(x_scale, x_zero_point), tuple(kernel_size), tuple(stride), tuple(padding), ceil_mode,
        count_include_pad, divisor_override, _qp(out_scale, out_zero_point),
    )  # fmt: skip


def qadaptive_avg_pool(x, x_scale, x_zero_point, output_size, out_scale, out_zero_point, backend="onednn"):
    be = _backend(backend)
    pool = be.adaptive_avg_pool3d if len(output_size) == 3 else be.adaptive_avg_pool2d
    return pool(x, _qp(x_scale, x_zero_point), tuple(output_size), _qp(out_scale, out_zero_point))


def qbatch_norm(
    x, x_scale, x_zero_point, weight, bias, running_mean, running_var, eps, out_scale, out_zero_point, post_op,
    backend="onednn",
):  # fmt: skip
    be = _backend(backend)
    return be.batch_norm2d(
        x, _qp(x_scale, x_zero_point), weight, bias, running_mean, running_var, eps,
        _qp(out_scale, out_zero_point), post_op == "relu",
    )  # fmt: skip


def qmean(x, x_scale, x_zero_point, dim, keepdim, out_scale, out_zero_point, backend="onednn"):
    be = _backend(backend)
    x_qp, out_qp = _qp(x_scale, x_zero_point), _qp(out_scale, out_zero_point)
    if x.dim() == 4 and sorted(d % 4 for d in dim) == [2, 3]:  # the spatial mean: a global average pool
        y = be.adaptive_avg_pool2d(x, x_qp, (1, 1), out_qp)
        return y if keepdim else y.flatten(2).squeeze(2)
    y = x.float().mean(list(dim), keepdim).sub_(x_qp.zero_point).mul_(x_qp.scale)
    return be.quantize(y, out_qp)


def qcat(xs, x_scales, x_zero_points, dim, out_scale, out_zero_point, backend="onednn"):
    be = _backend(backend)
    qps = [_qp(s, z) for s, z in zip(x_scales, x_zero_points)]
    return be.cat(xs, qps, dim, _qp(out_scale, out_zero_point))


IMPLEMENTATIONS: dict[str, Any] = {
    "quantize": quantize,
    "dequantize": dequantize,
    "requantize": requantize,
    "qconv": qconv,
    "qconv_add": qconv_add,
    "qlinear": qlinear,
    "qadd": qadd,
    "qmul": qmul,
    "qactivation": qactivation,
    "qmax_pool": qmax_pool,
    "qavg_pool2d": qavg_pool2d,
    "qadaptive_avg_pool": qadaptive_avg_pool,
    "qbatch_norm": qbatch_norm,
    "qmean": qmean,
    "qcat": qcat,
    "dynamic_linear": dynamic_int8.dynamic_linear,  # fp32 in / out: the math is defined there
}


@functools.cache
def register() -> torch.library.Library:
    """Install the CPU implementations of the ``gml`` ops (once per process)."""
    library.ops()
    lib = torch.library.Library(library.NAMESPACE, "IMPL")
    missing = set(library.SCHEMAS) - set(IMPLEMENTATIONS)
    if missing:  # pragma: no cover - the op table and this file must agree
        raise RuntimeError(f"no Python implementation for gml ops {sorted(missing)}")
    for name, fn in IMPLEMENTATIONS.items():
        lib.impl(name, fn, "CPU")
    return lib
