"""The lowered ops: ``torch.ops.gml.*``, declared with ``torch.library`` schemas and fake kernels.

This is the contract between lowering and execution. A lowered graph is a ``torch.fx`` graph of
calls to these ops (plus plain data movement on uint8: ``reshape``, ``flatten``, ``getitem``), with
dense weights as ``get_attr`` constants. **Every** fact an executor needs is an argument: input and
output quantization parameters, per-channel weight scales, conv geometry, the post-op and its
scalars, the output dtype. Nothing is hidden in a module, so the same graph is read by

* the Python executor (``gml.kernels.int8_ops``: implementations over today's kernels, which
  cache their prepacked weights per weight tensor; never in the graph or on disk),
* ``torch.export`` (ops with schemas export; :mod:`gml.io` saves INT8 models that way),
* a native engine (docs/ir.md is its input contract).

Conventions: activations are ``uint8`` with per-tensor affine qparams ``real = (q - zp) * scale``
(4-D/5-D ones channels-last); weights are dense ``int8``, symmetric, with ``weight_scale`` one
float32 per output channel (or one for the tensor); bias fp32. ``out_dtype`` is ``torch.uint8``
(then ``out_scale``/``out_zero_point`` apply) or ``torch.float32`` (pass 1.0, 0). ``post_op`` is a
oneDNN eltwise attr name (``none``, ``relu``, ``hardtanh`` with ``[min, max]``, ``hardswish``,
``swish``, ``gelu`` with algorithm ``none``/``tanh``). ``backend`` names the Python kernel set that
runs the op (``onednn`` or ``fbgemm``); it is not part of the math and other executors ignore it —
except ``gml``, a ``qlinear`` whose 8-bit weights run on GML's exact arithmetic on a CPU without
VNNI (post-op ``none`` / ``relu``; defined in ``gml.kernels.exact_int8``, ADR 011).

``dynamic_linear`` is the one op with fp32 input and output: an INT8 GEMM whose activations are
quantized per row at run time (symmetric, ``amax / 127`` per row; SmoothQuant's ``smooth_inv``
divides the input channels first), weights int8 ``[N, K]`` with ``weight_scale`` per output channel;
its ``post_op`` is ``none``, ``relu`` or ``gelu``. Its math is defined in
``gml.kernels.dynamic_int8`` (ADR 008).

This module imports no other gml package; it only declares. Importing it twice is harmless.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx

NAMESPACE = "gml"

_X = "float x_scale, int x_zero_point"
_W = "Tensor weight, Tensor weight_scale, Tensor? bias"
_GEO = "int[] stride, int[] padding, int[] dilation, int groups"
_OUT = "float out_scale, int out_zero_point"
_POST = "str post_op, float[] post_op_scalars, str post_op_algorithm"
_B = 'str backend="onednn"'

#: name -> schema (without the name). The table docs/ir.md shows.
SCHEMAS: dict[str, str] = {
    "quantize": f"(Tensor x, {_OUT}) -> Tensor",
    "dequantize": f"(Tensor x, {_X}) -> Tensor",
    "requantize": f"(Tensor x, {_X}, {_OUT}) -> Tensor",
    "qconv": f"(Tensor x, {_X}, {_W}, {_GEO}, {_OUT}, ScalarType out_dtype, {_POST}, {_B}) -> Tensor",
    "qconv_add": (
        f"(Tensor x, {_X}, {_W}, {_GEO}, Tensor other, float other_scale, int other_zero_point, {_OUT}, "
        f"str post_op, {_B}) -> Tensor"
    ),
    "qlinear": f"(Tensor x, {_X}, {_W}, {_OUT}, ScalarType out_dtype, {_POST}, {_B}) -> Tensor",
    "qadd": (
        f"(Tensor a, float a_scale, int a_zero_point, Tensor b, float b_scale, int b_zero_point, {_OUT}, "
        f"str post_op, {_B}) -> Tensor"
    ),
    "qmul": (
        f"(Tensor a, float a_scale, int a_zero_point, Tensor b, float b_scale, int b_zero_point, {_OUT}, "
        f"{_B}) -> Tensor"
    ),
    "qactivation": f"(Tensor x, {_X}, str op, float[] scalars, {_OUT}, {_B}) -> Tensor",
    "qmax_pool": (
        f"(Tensor x, {_X}, int[] kernel_size, int[] stride, int[] padding, int[] dilation, bool ceil_mode, "
        f"{_B}) -> Tensor"
    ),
    "qavg_pool2d": (
        f"(Tensor x, {_X}, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode, "
        f"bool count_include_pad, int? divisor_override, {_OUT}, {_B}) -> Tensor"
    ),
    "qadaptive_avg_pool": f"(Tensor x, {_X}, int[] output_size, {_OUT}, {_B}) -> Tensor",
    "qbatch_norm": (
        f"(Tensor x, {_X}, Tensor weight, Tensor bias, Tensor running_mean, Tensor running_var, float eps, "
        f"{_OUT}, str post_op, {_B}) -> Tensor"
    ),
    "qmean": f"(Tensor x, {_X}, int[] dim, bool keepdim, {_OUT}, {_B}) -> Tensor",
    "qcat": f"(Tensor[] xs, float[] x_scales, int[] x_zero_points, int dim, {_OUT}, {_B}) -> Tensor",
    # fp32 in and out, int8 GEMM inside: activations quantized per row at run time (gml.kernels.dynamic_int8)
    "dynamic_linear": f"(Tensor x, {_W}, Tensor? smooth_inv, {_POST}) -> Tensor",
}

#: ops whose uint8 output keeps the input's qparams (no ``out_*`` arguments)
SAME_QPARAMS_OPS = frozenset({"qmax_pool"})


def channels_last_format(t: torch.Tensor) -> torch.memory_format:
    """The channels-last memory format of ``t``'s rank (2-D and 3-D convs), else contiguous."""
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim(), torch.contiguous_format)


_cl = channels_last_format


def _conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    num = size + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil else num // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _fake_empty(like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    out = like.new_empty(tuple(shape), dtype=dtype)
    return out.contiguous(memory_format=_cl(out)) if out.dim() in (4, 5) else out


# ---------------------------------------------------------------- fake (meta) kernels
def _fake_quantize(x, out_scale, out_zero_point):
    return _fake_empty(x, x.shape, torch.uint8)


def _fake_dequantize(x, x_scale, x_zero_point):
    return x.new_empty(x.shape, dtype=torch.float32)


def _fake_same(x, *args, **kwargs):
    return _fake_empty(x, x.shape, torch.uint8)


def _fake_qconv(x, xs, xz, weight, ws, bias, stride, padding, dilation, groups, os_, oz, out_dtype, *rest):
    n = weight.dim() - 2
    spatial = [_conv_out(x.shape[2 + i], weight.shape[2 + i], stride[i], padding[i], dilation[i]) for i in range(n)]
    return _fake_empty(x, [x.shape[0], weight.shape[0], *spatial], out_dtype)


def _fake_qconv_add(x, xs, xz, weight, ws, bias, stride, padding, dilation, groups, other, *rest):
    return _fake_empty(other, other.shape, torch.uint8)


def _fake_qlinear(x, xs, xz, weight, ws, bias, os_, oz, out_dtype, *rest):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _fake_dynamic_linear(x, weight, *rest):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def _fake_binary(a, a_s, a_z, b, *rest):
    return _fake_empty(a, torch.broadcast_shapes(a.shape, b.shape), torch.uint8)


def _fake_qmax_pool(x, xs, xz, kernel_size, stride, padding, dilation, ceil_mode, backend="onednn"):
    n = len(kernel_size)
    lead = list(x.shape[: x.dim() - n])
    spatial = [
        _pool_out(x.shape[x.dim() - n + i], kernel_size[i], stride[i], padding[i], dilation[i], ceil_mode)
        for i in range(n)
    ]
    return _fake_empty(x, lead + spatial, torch.uint8)


def _fake_qavg_pool2d(x, xs, xz, kernel_size, stride, padding, ceil_mode, *rest):
    lead = list(x.shape[: x.dim() - 2])
    spatial = [_pool_out(x.shape[x.dim() - 2 + i], kernel_size[i], stride[i], padding[i], 1, ceil_mode) for i in (0, 1)]
    return _fake_empty(x, lead + spatial, torch.uint8)


def _fake_qadaptive(x, xs, xz, output_size, *rest):
    return _fake_empty(x, [*x.shape[: x.dim() - len(output_size)], *output_size], torch.uint8)


def _fake_qmean(x, xs, xz, dim, keepdim, *rest):
    dims = {d % x.dim() for d in dim}
    shape = [1 if i in dims else s for i, s in enumerate(x.shape) if keepdim or i not in dims]
    return x.new_empty(shape, dtype=torch.uint8)


def _fake_qcat(xs, scales, zps, dim, *rest):
    return torch.cat([x.contiguous() for x in xs], dim)


_FAKES: dict[str, Any] = {
    "quantize": _fake_quantize,
    "dequantize": _fake_dequantize,
    "requantize": _fake_same,
    "qconv": _fake_qconv,
    "qconv_add": _fake_qconv_add,
    "qlinear": _fake_qlinear,
    "qadd": _fake_binary,
    "qmul": _fake_binary,
    "qactivation": _fake_same,
    "qmax_pool": _fake_qmax_pool,
    "qavg_pool2d": _fake_qavg_pool2d,
    "qadaptive_avg_pool": _fake_qadaptive,
    "qbatch_norm": _fake_same,
    "qmean": _fake_qmean,
    "qcat": _fake_qcat,
    "dynamic_linear": _fake_dynamic_linear,
}


@functools.cache
def _define() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        torch.library.register_fake(f"{NAMESPACE}::{name}", _FAKES[name], lib=lib)
    return lib


@dataclass(frozen=True)
class OpDef:
    """An op of the vocabulary declared in its own module of :mod:`gml.ir` (``gml.attention``,
    ``gml.woq_linear``, ``gml.rms_norm``): its schema, its Python kernel (``impl``: the op's one
    kernel for every device, CompositeExplicitAutograd: the Python executor), a ``fake`` kernel so
    graphs holding it export, and what else runs it:

    * ``engine_step``: the native step description that runs it (a ``struct`` of a native/*.h
      family header, e.g. ``"RmsNormStep"``) when the generic translation rule
      (:mod:`gml.runtime.rules.kernel`) can build it: the struct's fields are the schema's argument
      names plus ``dst``; ``None``: the op has its own translation rule, or none;
    * ``saved``: whether a saved model (:mod:`gml.io`) may call it.

    Its module calls :func:`register` at import; :func:`declare` defines it with torch on first use."""

    name: str
    schema: str
    impl: Callable[..., Any]
    fake: Callable[..., Any]
    engine_step: str | None = None
    saved: bool = True


_DEFS: dict[str, OpDef] = {}


def register(d: OpDef) -> OpDef:
    """Record ``d`` in the vocabulary (its module does this at import; nothing is defined yet)."""
    known = _DEFS.setdefault(d.name, d)
    if known is not d and known != d:
        raise AssertionError(f"gml.{d.name} is registered twice, differently")
    return d


def declare(d: OpDef) -> torch._ops.OpOverload:
    """``torch.ops.gml.<name>.default`` for ``d``, defining it in its own ``torch.library`` fragment
    of the namespace on first use (once per process)."""
    register(d)
    _fragment(d.name, d.impl, d.fake, d.schema)
    return getattr(torch.ops.gml, d.name).default


@functools.cache
def _fragment(name: str, impl: Callable[..., Any], fake: Callable[..., Any], schema: str) -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(name + schema)
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    return lib


@functools.cache
def vocabulary() -> dict[str, OpDef | None]:
    """Every op of the ``gml`` namespace, declared: the INT8 table (``None``: defined here) and each
    :class:`OpDef` of the other :mod:`gml.ir` modules, which are imported for it — so a saved graph's
    ops exist before it is read, and a new op module needs no list of modules updated."""
    import importlib
    import pkgutil

    import gml.ir

    ops()
    for info in pkgutil.iter_modules(gml.ir.__path__):
        importlib.import_module(f"{gml.ir.__name__}.{info.name}")
    table: dict[str, OpDef | None] = dict.fromkeys(SCHEMAS)
    for name, d in _DEFS.items():
        declare(d)
        table[name] = d
    return table


def op_def(name: str) -> OpDef | None:
    """The :class:`OpDef` of op ``name`` (of its module, once imported), or ``None``."""
    return _DEFS.get(name)


def ops() -> Any:
    """``torch.ops.gml``, with every op defined (declaring them on first use)."""
    _define()
    return torch.ops.gml


def op(name: str) -> torch._ops.OpOverload:
    """The overload a lowered graph calls for op ``name`` (``op("qconv")`` is ``torch.ops.gml.qconv.default``)."""
    return getattr(ops(), name).default


def gml_op_name(node: fx.Node) -> str | None:
    """``"qconv"`` for a call of ``torch.ops.gml.qconv``, ``None`` for anything else."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    ns, _, rest = target.name().partition("::")
    return rest.split(".")[0] if ns == NAMESPACE else None


@functools.cache
def _arg_names(name: str) -> tuple[str, ...]:
    return tuple(a.name for a in op(name)._schema.arguments)


def schema_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of a call of any op overload by schema name, however the call passed them
    (positionally or by keyword), defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def op_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of a ``gml`` op call by schema name (defaults filled in)."""
    if gml_op_name(node) is None:
        raise ValueError(f"{node.name} is not a gml op call")
    return schema_args(node)


def output_qparams_args(node: fx.Node) -> tuple[float, int] | None:
    """``(scale, zero_point)`` of the uint8 value a gml op call produces; ``None`` if it produces
    fp32 (``dequantize``, or an ``out_dtype=float32`` conv / linear)."""
    name = gml_op_name(node)
    if name is None or name == "dequantize":
        return None
    args = op_args(node)
    if args.get("out_dtype", torch.uint8) != torch.uint8:
        return None
    if name in SAME_QPARAMS_OPS:
        return float(args["x_scale"]), int(args["x_zero_point"])
    if "out_scale" not in args:  # an fp32 op of the gml namespace (gml.attention)
        return None
    return float(args["out_scale"]), int(args["out_zero_point"])


def describe() -> SimpleNamespace:
    """The op table as data: ``describe().qconv`` is the full schema string (for docs and tests)."""
    return SimpleNamespace(**{name: f"{NAMESPACE}::{name}{schema}" for name, schema in SCHEMAS.items()})
