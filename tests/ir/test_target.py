"""gml.ir.target: the one mapping "oneDNN ISA → capabilities", the cap, the INT8 arithmetic per ISA."""

from __future__ import annotations

import os

import pytest

from gml.ir.target import ISA_FEATURES, Target, capped_isa


@pytest.mark.parametrize(
    ("isa", "vnni", "bf16", "amx", "avx512"),
    [
        ("avx2", False, False, False, False),
        ("avx2_vnni", True, False, False, False),
        ("avx512_core", False, False, False, True),
        ("avx512_core_vnni", True, False, False, True),
        ("avx512_core_bf16", True, True, False, True),
        ("avx512_core_amx", True, True, True, True),
    ],
)
def test_capabilities_follow_the_isa(isa: str, vnni: bool, bf16: bool, amx: bool, avx512: bool) -> None:
    t = Target(isa)
    assert (t.exact_u8s8, t.native_bf16, t.amx, t.avx512) == (vnni, bf16, amx, avx512)
    # oneDNN 3.2's f32 matmul has brgemm kernels from avx512_core only (AVX2: gemm:jit)
    assert t.f32_matmul_brgemm == avx512


def test_int8_arithmetic_cannot_saturate_an_int16_pair_on_any_isa() -> None:
    for isa in ISA_FEATURES:
        a = Target(isa).int8
        worst_pair = 2 * a.act_qmax * max(-a.weight_qmin, a.weight_qmax)
        if Target(isa).exact_u8s8:
            assert a.weight_bits == 8, isa  # int32 accumulation: the full range
        else:
            assert worst_pair <= 32767, (isa, a)  # vpmaddubsw's saturating int16 pair
            assert a.weight_bits == 7


def test_the_cap_is_the_highest_isa_both_allow() -> None:
    assert capped_isa("avx512_core_amx", "AVX2") == "avx2"
    assert capped_isa("avx512_core_amx", "avx512_core") == "avx512_core"
    assert capped_isa("avx512_core_amx", "AVX512_CORE_VNNI") == "avx512_core_vnni"
    assert capped_isa("avx512_core_amx", "AVX2_VNNI") == "avx2_vnni"  # SPR has AVX-VNNI
    assert capped_isa("avx512_core_vnni", "AVX2_VNNI") == "avx2"  # Cascade Lake has no AVX-VNNI
    assert capped_isa("avx2", "AVX512_CORE") == "avx2"  # a cap never raises the ISA
    assert capped_isa("avx512_core_amx", None) == "avx512_core_amx"
    assert capped_isa("avx512_core_amx", "ALL") == "avx512_core_amx"


def test_describe_names_the_isa_and_the_int8_arithmetic() -> None:
    line = Target("avx2", threads=2).describe()
    assert line.startswith("avx2, no VNNI: INT8 7-bit weights") and "2 thread" in line
    assert "8-bit" in Target("avx512_core_vnni").describe()


def test_detected_target_honours_the_cap() -> None:
    from gml.runtime.target import detect_target

    t = detect_target()
    assert t.isa in ISA_FEATURES
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if cap and cap.upper() in ("AVX2", "AVX512_CORE"):
        assert t.isa == cap.lower() or ISA_FEATURES[t.isa] <= ISA_FEATURES[cap.lower()]
