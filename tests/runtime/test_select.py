"""gml.runtime.select: when the engine's outputs are trusted over the Python executor's."""

from __future__ import annotations

import torch

from gml.runtime.select import AS_CLOSE_TO_FP32, agreement_error, fp32_closeness_error


def test_agreement_error_is_relative_to_the_output_range() -> None:
    ref = torch.linspace(-1, 1, 100)
    assert agreement_error(ref, ref + 0.04) is None  # INT8_TOLERANCE 5% of the range
    assert agreement_error(ref, ref + 0.06) == "output 0 differs by 0.06 (outputs reach 1)"
    assert agreement_error((ref,), (ref, ref)) == "2 outputs instead of 1"


def test_agreement_error_ignores_differences_among_denormal_numbers() -> None:
    # oneDNN flushes denormals to zero; torch keeps them (a random-init model's vanishing outputs)
    tiny = torch.tensor([7e-40, -3e-40, 0.0])
    assert agreement_error(tiny, torch.zeros(3)) is None
    assert (
        agreement_error(tiny, torch.tensor([7e-40, -3e-40, 2e-38])) == "output 0 differs by 2e-38 (outputs reach 7e-40)"
    )


def test_an_int8_engine_as_close_to_fp32_as_the_executor_is_accepted_a_wrong_one_is_not() -> None:
    """Run-time INT8 rounding flips: engine and executor each carry their own ~1% noise around fp32
    (they disagree with each other by more than INT8_TOLERANCE here), but a miscompile is far from fp32."""
    gen = torch.Generator().manual_seed(0)
    fp32 = torch.randn(64, 384, generator=gen)
    py = fp32 + 0.01 * torch.randn(fp32.shape, generator=gen)
    eng = fp32 + 0.01 * torch.randn(fp32.shape, generator=gen)
    eng[0, 0] += 0.5  # one large flip: beyond the 5% agreement bound, not further from fp32 overall
    assert agreement_error(py, eng) is not None
    assert fp32_closeness_error(py, eng, fp32) is None
    wrong = eng.clone()
    wrong[:8] = 0  # a miscompiled block of rows
    why = fp32_closeness_error(py, wrong, fp32)
    assert why is not None and why.startswith("output 0 is further from fp32 than the executor's")
    # the bound is a ratio of the executor's own error
    assert fp32_closeness_error(py, fp32 + (AS_CLOSE_TO_FP32 + 0.2) * (py - fp32), fp32) is not None


def test_an_engine_slower_than_the_executor_is_not_chosen(monkeypatch) -> None:
    """The runtime choice times both (interleaved) unless GML_COST_POLICY=off: an engine that a
    slow oneDNN kernel makes slower than torch is not the default (timm mixnet_s fp32: 3x eager)."""
    from torch import nn

    import gml
    from gml.runtime import timing

    model, x = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval(), torch.randn(1, 3, 16, 16)
    assert gml.optimize(model, x).runtime.path == "engine"  # the suite's default: no timing
    monkeypatch.setenv("GML_COST_POLICY", "measure")
    monkeypatch.setattr(timing, "median_ms_interleaved", lambda fns, **kw: [10.0, 2.0])
    res = gml.optimize(model, x)
    assert res.engine is None and res.runtime.path == "torch"
    assert "the engine ran slower than the Python executor on the example (10.00 ms vs 2.00 ms)" in res.runtime.note
    monkeypatch.setattr(timing, "median_ms_interleaved", lambda fns, **kw: [2.1, 2.0])  # within ENGINE_SLOWER_LIMIT
    assert gml.optimize(model, x).runtime.path == "engine"
