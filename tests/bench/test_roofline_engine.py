"""The roofline's peak probe runs through the native engine and says which ISA oneDNN dispatched
(no timing assertions: the machine is shared; only that the probe runs and what it records)."""

from __future__ import annotations

import pytest

from gml.bench.roofline import measure_engine_peak, measure_peak
from gml.ir.target import Target
from gml.runtime import native

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None, reason=str(native.unavailable_reason()))


def test_engine_probe_measures_every_precision_the_cpu_has_with_its_isa():
    ep = measure_engine_peak(1, reps=1, scale=0.125)
    assert ep.isa == native.load().cpu_isa() and ep.isa
    expect = {"int8", "fp32"} | ({"bf16"} if Target(ep.isa).native_bf16 else set())
    assert set(ep.rates) == set(ep.impls) == expect
    assert all(rate > 0 for rate in ep.rates.values())
    assert all(impl and impl != "?" for impl in ep.impls.values())  # e.g. "brgemm:avx512_core_vnni"


def test_measured_peak_records_the_isa_and_what_reached_each_peak():
    p = measure_peak(1, reps=1, scale=0.125)
    assert p.isa == native.load().cpu_isa()
    assert p.fp32_flops > 0 and p.int8_ops and p.int8_ops > 0
    assert set(p.kernels) >= {"fp32", "int8"}
    assert all(k.startswith(("engine ", "torch ")) for k in p.kernels.values())
    if Target(p.isa).native_bf16:
        assert p.bf16_flops and p.bf16_flops > 0 and p.kernels["bf16"].startswith("engine ")
        assert p.floor_ms(2 * p.bf16_flops, "bf16") == pytest.approx(2000.0)


def test_a_precision_without_its_peak_has_no_floor():
    import torch

    from gml.bench.roofline import Peak

    p = Peak(fp32_flops=1e11, int8_ops=None, threads=1, cpu="test", torch_version=torch.__version__)
    assert p.floor_ms(1e9, "fp32") == pytest.approx(10.0)
    assert p.floor_ms(1e9, "int8") is None and p.floor_ms(1e9, "bf16") is None
