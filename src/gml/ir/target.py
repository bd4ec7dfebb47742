"""The target CPU as one value: what oneDNN dispatches to, what that ISA can do, and which INT8
arithmetic GML uses there (docs/adr/011-int8-on-every-isa.md).

:class:`Target` is computed **once** at the API boundary (``gml.optimize`` / ``gml.quantize`` /
``gml.load`` / the CLI / ``gml bench``: :func:`gml.runtime.target.detect_target`) and passed down
as a value to the quantizer (weight / activation ranges), the lowering, the runtime choice and the
engine's plan builder. Nothing below the boundary asks the CPU again.

This module is pure: the mapping "oneDNN ISA name → capabilities" (:data:`ISA_FEATURES`) and the
decisions that follow from it. Detection (the engine's ``cpu_isa()``, or torch's CPU flags capped
by ``ONEDNN_MAX_CPU_ISA``) lives in the runtime.

**Why INT8 depends on the ISA.** oneDNN's (and fbgemm's) u8×s8 kernels without a VNNI-class dot
product (``vpdpbusd``: AVX512-VNNI, AVX-VNNI; AMX's ``tdpbusd``) multiply with ``vpmaddubsw``,
which adds *pairs* of u8·s8 products into a **saturating int16**: ``255·127·2 = 64,770 > 32,767``.
With weights in ``[-64, 64]`` a pair is at most ``255·64·2 = 32,640``: it cannot saturate, and the
result is exact integer arithmetic again (:func:`int8_arithmetic`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: oneDNN ISA names (``dnnl::cpu_isa``, as ``gml._engine.cpu_isa()`` spells them), lowest first,
#: with the instruction-set features each one includes (oneDNN's ``cpu_isa_traits``: every ISA is
#: a set of feature bits; ``avx512_core`` does not include AVX-VNNI, ``avx512_core_fp16`` does).
ISA_FEATURES: dict[str, frozenset[str]] = {}


def _isa(name: str, base: str | None, *added: str) -> None:
    ISA_FEATURES[name] = (ISA_FEATURES[base] if base else frozenset()) | frozenset(added)


_isa("sse41", None, "sse41")
_isa("avx", "sse41", "avx")
_isa("avx2", "avx", "avx2")
_isa("avx2_vnni", "avx2", "avx_vnni")
_isa("avx2_vnni_2", "avx2_vnni", "avx_vnni_2")  # + AVX-NE-CONVERT: native bf16
_isa("avx512_core", "avx2", "avx512")
_isa("avx512_core_vnni", "avx512_core", "avx512_vnni")
_isa("avx512_core_bf16", "avx512_core_vnni", "avx512_bf16")
_isa("avx512_core_fp16", "avx512_core_bf16", "avx_vnni", "avx_vnni_2", "avx512_fp16")
_isa("avx512_core_amx", "avx512_core_fp16", "amx")
_isa("avx512_core_amx_fp16", "avx512_core_amx", "amx_fp16")

#: ``ONEDNN_MAX_CPU_ISA`` values (upper case) → the ISA they cap at; ``ALL`` caps nothing.
CAP_NAMES: dict[str, str] = {name.upper(): name for name in ISA_FEATURES}


def capped_isa(cpu_isa: str, cap: str | None) -> str:
    """The ISA oneDNN dispatches to on a CPU whose best ISA is ``cpu_isa`` under
    ``ONEDNN_MAX_CPU_ISA=cap``: the highest ISA whose features the CPU and the cap both include.
    An unknown or empty cap (or ``ALL``) caps nothing."""
    if cpu_isa not in ISA_FEATURES:
        return cpu_isa
    key = (cap or "").strip().upper()
    if key not in CAP_NAMES:
        return cpu_isa
    allowed = ISA_FEATURES[cpu_isa] & ISA_FEATURES[CAP_NAMES[key]]
    best = "sse41"
    for name, features in ISA_FEATURES.items():  # lowest first: the last that fits has the most
        if features <= allowed and len(features) >= len(ISA_FEATURES[best]):
            best = name
    return best


@dataclass(frozen=True)
class Int8Arithmetic:
    """How GML's static INT8 (u8 activations × s8 weights) computes on a target, and why.

    ``weight_qmin..weight_qmax``: the symmetric weight range (8 bits ``[-128, 127]``, torch's qint8
    observer range, or 7 bits ``[-64, 64]`` where the kernels' int16 pairs would saturate: symmetric,
    so an 8-bit weight halved, round half to even, lands in it); ``act_qmin..act_qmax``: the u8
    activation range. With these ranges every kernel on the target computes exact integer sums.
    """

    name: str  # "8-bit" | "7-bit weights"
    weight_qmin: int
    weight_qmax: int
    act_qmin: int
    act_qmax: int
    reason: str
    #: linear layers keep 8-bit weights, in ``[-127, 127]``, on GML's exact AVX2 GEMM
    #: (``gml.qlinear(..., backend="gml")``, gml.kernels.exact_int8) where the convs take 7 bits
    exact_linear: bool = False

    @property
    def weight_bits(self) -> int:
        return 8 if self.weight_qmax > 64 else 7

    @property
    def linear_weight_range(self) -> tuple[int, int]:
        """A linear layer's weight range: ``[-127, 127]`` with :attr:`exact_linear`, else the convs'."""
        return (-127, 127) if self.exact_linear else (self.weight_qmin, self.weight_qmax)

    def describe(self) -> str:
        linear = "; linear layers 8-bit weights on GML's exact AVX2 GEMM" if self.exact_linear else ""
        return f"{self.name} ({self.reason}){linear}"


def _feature(name: str, doc: str) -> property:
    """A :class:`Target` flag: whether its ISA has feature ``name`` (:data:`ISA_FEATURES`)."""
    return property(lambda self: name in self.features, doc=doc)


@dataclass(frozen=True)
class Target:
    """The CPU GML plans for: oneDNN's dispatched ISA (``ONEDNN_MAX_CPU_ISA`` honoured), and threads.

    ``source`` says where the ISA came from (``engine``: oneDNN's ``get_effective_cpu_isa()``;
    ``torch``: torch's CPU flags capped by ``ONEDNN_MAX_CPU_ISA``; ``given``: a caller's value).
    """

    isa: str
    threads: int = 1
    source: str = "given"

    @property
    def features(self) -> frozenset[str]:
        return ISA_FEATURES.get(self.isa, frozenset())

    avx512 = _feature("avx512", "AVX-512 (zmm registers).")
    has_vnni = _feature("avx512_vnni", "AVX512-VNNI (``vpdpbusd`` on zmm).")
    avx_vnni = _feature("avx_vnni", "AVX-VNNI (``vpdpbusd`` on ymm, VEX-encoded).")
    amx = _feature("amx", "AMX tiles (INT8 and bf16).")

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16, AMX-BF16, AVX-NE-CONVERT): elsewhere oneDNN
        emulates bf16 through fp32, slower than fp32."""
        return bool(self.features & {"avx512_bf16", "avx_vnni_2", "amx"})

    @property
    def exact_u8s8(self) -> bool:
        """Whether u8×s8 dot products accumulate in int32 without an int16 step (VNNI, AVX-VNNI,
        AMX): 8-bit weights are exact. Without it (AVX2, AVX-512 without VNNI) pairs saturate."""
        return self.has_vnni or self.avx_vnni or self.amx

    @property
    def int8(self) -> Int8Arithmetic:
        return int8_arithmetic(self)

    @property
    def gml_int8_gemm(self) -> bool:
        """Whether ``gml.dynamic_linear``'s GEMM runs on GML's own exact AVX2 kernel
        (native/int8_gemm_avx2.h: 7-bit weights against ``x + 128`` in ``vpmaddubsw``, pair sums
        <= 32,640; 8-bit weights as ``|x| * (w * sign(x))``, <= 32,258): no VNNI-class dot product,
        where oneDNN's int8 matmul would saturate, and AVX2 present."""
        return not self.exact_u8s8 and "avx2" in self.features

    @property
    def int8_winograd(self) -> bool:
        """Whether stride-1 3×3 INT8 convs may run as GML's INT8 Winograd F(2×2, 3×3)
        (native/winograd_int8.h: int16 transforms, ``vpmaddwd``, exact integer arithmetic), timed
        against the direct conv at plan build (ADR 010). Only without a VNNI-class dot product and with
        AVX2: there the direct conv multiplies 32 bytes per two multiply-port instructions, as
        ``vpmaddwd`` multiplies 16 int16 per one, and Winograd needs 2.25× fewer products; with VNNI
        the direct conv does 4× the products per instruction and Winograd cannot win (not timed).
        The same condition admits GML's patch GEMM for INT8 convs with few input channels
        (native/im2col_int8.h: an RGB stem, where oneDNN's AVX2 INT8 conv runs at half its rate) and
        its depthwise INT8 conv (native/dw_int8.h: two taps per ``vpmaddwd`` lane pair, exact for
        8-bit weights)."""
        return not self.exact_u8s8 and "avx2" in self.features

    @property
    def f32_matmul_brgemm(self) -> bool:
        """Whether oneDNN's f32 *matmul* primitive has a brgemm kernel (3.2: from ``avx512_core``).
        On AVX2 (with or without AVX-VNNI) it runs ``gemm:jit:f32`` while the inner product of the
        same linear runs ``brgemm:avx2``: MLP-Mixer's 2048 → 512 fc2 on 196 tokens took 6.0 ms as a
        matmul with the residual add fused, 4.4 ms as the inner product (Zen 4 capped to AVX2, one
        thread). There a float linear keeps its inner product: an activation after it joins the
        inner product's post-ops, a residual add is a step of its own
        (:func:`gml.runtime.rules.linear.extend_linear`)."""
        return self.avx512

    @property
    def dynamic_weight_qmax(self) -> int:
        """``gml.dynamic_linear``'s int8 weight range ``[-q, q]``: 127 with VNNI / AMX, 64 without —
        the same 7-bit rule as the static scheme's (:func:`int8_arithmetic`). GML's AVX2 kernel is
        exact with either, but 7-bit weights take its u8 path, 1.17-1.24x faster on real MiniLM under
        the AVX2 cap for an embedding cosine of 0.99610 instead of 0.99741 (ADR 011, 2026-11-28)."""
        return 127 if self.exact_u8s8 else 64

    def describe(self) -> str:
        """One line for reports: ``avx2, no VNNI: 7-bit weights (...)``."""
        what = [self.isa]
        if self.amx:
            what.append("AMX")
        elif self.exact_u8s8:
            what.append("VNNI")
        else:
            what.append("no VNNI")
        if self.native_bf16:
            what.append("bf16")
        return f"{', '.join(what)}: INT8 {self.int8.describe()}; {self.threads} thread(s)"


def int8_arithmetic(target: Target) -> Int8Arithmetic:
    """The static INT8 arithmetic for ``target`` (docs/adr/011-int8-on-every-isa.md)."""
    if target.exact_u8s8:
        how = "AMX" if target.amx else "VNNI"
        return Int8Arithmetic("8-bit", -128, 127, 0, 255, f"{how} dot products accumulate in int32")
    return Int8Arithmetic(
        "7-bit weights",
        -64,
        64,
        0,
        255,
        "u8×s8 pairs add in a saturating int16; weights in [-64, 64] cannot saturate it",
        # GML's exact kernel (|x - 128| * (w * sign) pairs <= 32,512) needs AVX2: linears keep 8 bits
        exact_linear=target.gml_int8_gemm,
    )


__all__ = ["CAP_NAMES", "ISA_FEATURES", "Int8Arithmetic", "Target", "capped_isa", "int8_arithmetic"]
