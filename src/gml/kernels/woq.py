"""The native executor of ``torch.ops.gml.woq_linear`` (native/woq*.h), and which of its kernels a CPU runs.

The op's reference kernels (:mod:`gml.ir.llm_ops`) define the math; these read the INT8 / INT4 weights
in place, so a decode step reads each weight byte once (the GEMV is memory bound):

* ``act_bits=0`` (fp32 activations), few rows: native/woq.h expands the weights to fp32 in registers;
* ``act_bits=0``, ``GEMM_MIN_ROWS`` rows or more (prefill): native/woq_gemm.h dequantizes 128-row tiles
  into oneDNN's fp32 GEMM;
* ``act_bits=8``: native/woq_int8act.h quantizes x per block of 32 and runs integer dot products.

Kernel tiers (:data:`KERNEL_ISAS`): ``vnni`` (AVX-512 VNNI), ``avx512`` (AVX-512F/BW), ``avxvnni``
(AVX2 + AVX-VNNI), ``avx2`` (AVX2 + FMA), ``scalar``; the VNNI tiers differ from their base only with
int8 activations (``vpdpbusd``). :func:`kernel_isa` maps GML's CPU description
(:class:`~gml.ir.target.Target`, whose ISA honours ``ONEDNN_MAX_CPU_ISA``) to one; the choice is made
once at the API boundary (``gml.llm``) and passed down.
"""

from __future__ import annotations

import functools

import torch

from gml.ir.llm_ops import QuantizedWeight
from gml.ir.target import Target

KERNEL_ISAS = ("vnni", "avx512", "avxvnni", "avx2", "scalar")

#: From this many rows of ``x`` on (prefill), the weight is dequantized in tiles into oneDNN's fp32 GEMM
#: (native/woq_gemm.h) instead of running the GEMV kernel once per row: measured faster from 2 rows on
#: (INT4) and from 2-3 (INT8), see docs/llm.md. ``gml.llm``'s int8 activations apply below it (decode).
GEMM_MIN_ROWS = 2


def kernel_isa(target: Target) -> str:
    """The woq kernel for ``target`` (GML's one CPU description, :mod:`gml.ir.target`)."""
    if target.has_vnni:
        return "vnni"
    if target.avx512:
        return "avx512"
    if target.avx_vnni:
        return "avxvnni"
    if "avx2" in target.features:
        return "avx2"
    return "scalar"


def detect_kernel(target: Target | None = None) -> str | None:
    """The kernel for ``target`` (default: this process's), or ``None`` when the native engine is not
    built with ``woq_linear``."""
    from gml.runtime.native import _load
    from gml.runtime.target import resolve

    engine, _ = _load()
    if engine is None or not hasattr(engine, "woq_linear"):
        return None
    return kernel_isa(resolve(target))


#: the decode attention kernels (native/decode_attention.h: 0 scalar, 1 AVX2 + FMA + F16C, 2 AVX-512F) a
#: woq kernel tier's CPU runs (``None``: no native engine)
ATTENTION_TIERS = {"vnni": 2, "avx512": 2, "avxvnni": 1, "avx2": 1, "scalar": 0, None: 0}


def native_kernel_runs(isa: str) -> bool:
    """Whether the native engine is built with woq_linear and this CPU runs its ``isa`` kernel."""
    from gml.runtime.native import _load

    engine, _ = _load()
    return engine is not None and hasattr(engine, "woq_linear") and engine.woq_isa_supported(isa)


def native_supports(w: QuantizedWeight) -> bool:
    """Whether the native kernel reads this weight (symmetric INT8, per channel or in groups of 32/64/128, or
    INT4 in groups of 32/64/128)."""
    return w.zeros is None or w.bits == 4


def woq_linear_native(
    x: torch.Tensor,
    w: QuantizedWeight,
    bias: torch.Tensor | None,
    isa: str,
    act_bits: int = 0,
    gemm_min_rows: int = GEMM_MIN_ROWS,
) -> torch.Tensor:
    """``torch.ops.gml.woq_linear(x, w, bias, act_bits)`` on the native kernel ``isa``. ``act_bits=0``:
    the GEMV kernel (native/woq.h) for fewer than ``gemm_min_rows`` rows of ``x``, else dequantized tiles
    into oneDNN's fp32 GEMM (native/woq_gemm.h); ``act_bits=8``: native/woq_int8act.h, any rows."""
    from gml.runtime.native import load

    engine = load()
    k = w.in_features
    x2 = x.reshape(-1, k).float().contiguous()
    y = torch.empty(x2.shape[0], w.out_features, dtype=torch.float32)
    zeros = 0 if w.zeros is None else w.zeros.data_ptr()
    bias = None if bias is None else bias.float().contiguous()  # kept alive until the call returns
    b = 0 if bias is None else bias.data_ptr()
    args = (
        x2.data_ptr(), x2.shape[0], k, w.qweight.data_ptr(), w.bits, w.group_size, w.scales.data_ptr(), zeros, b,
        y.data_ptr(), w.out_features, isa, torch.get_num_threads(),
    )  # fmt: skip
    if act_bits == 0 and x2.shape[0] >= gemm_min_rows:
        engine.woq_gemm(*args)
    else:
        engine.woq_linear(*args, act_bits)
    return y.reshape(*x.shape[:-1], w.out_features)


def woq_linear_bound(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, y: torch.Tensor, isa: str, act_bits: int = 0
) -> functools.partial:
    """A call of the GEMV kernel (as :func:`woq_linear_native` with fewer than ``GEMM_MIN_ROWS`` rows)
    from the preallocated ``x: [M, K]`` into ``y: [M, N]`` (contiguous fp32), its arguments fixed once:
    the addresses of ``x``, ``y``, the weight and ``bias``, and the torch thread count now. The caller
    keeps ``x``, ``y`` (and the weight, ``bias``) alive while it uses the call."""
    from gml.runtime.native import load

    m, k = x.shape
    if x.dtype != torch.float32 or y.dtype != torch.float32 or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("woq_linear_bound: x and y must be contiguous fp32")
    if k != w.in_features or tuple(y.shape) != (m, w.out_features) or m >= GEMM_MIN_ROWS:
        raise ValueError(
            f"woq_linear_bound: x {tuple(x.shape)} / y {tuple(y.shape)} do not fit a {w.out_features} x {k} GEMV"
        )
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("woq_linear_bound: bias must be contiguous fp32")
    zeros = 0 if w.zeros is None else w.zeros.data_ptr()
    b = 0 if bias is None else bias.data_ptr()
    args = (
        x.data_ptr(), m, k, w.qweight.data_ptr(), w.bits, w.group_size, w.scales.data_ptr(), zeros, b,
        y.data_ptr(), w.out_features, isa, torch.get_num_threads(), act_bits,
    )  # fmt: skip
    return functools.partial(load().woq_linear, *args)
