"""What gml.quantize's accuracy report measures on when no eval_data is given: the user's own
calibration batches (the last two, :class:`gml.quant.calibrate.KeepLast`), never generated N(0, 1)
inputs that look nothing like them; generated batches only when the calibration was generated too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.quant.calibrate import KeepLast, calibrate

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _conv_relu() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()).eval()


def _pixels(n: int, seed: int) -> list[tuple[torch.Tensor]]:
    """Batches of [0, 1) "pixels": a model fed un-normalized images sees these, never N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(2, 16, 12, 12, generator=gen),) for _ in range(n)]


def test_keep_last_keeps_the_last_batches_of_one_pass():
    kept = KeepLast(iter(range(5)), keep=2)  # a one-shot iterator: read once, never twice
    assert list(kept) == [0, 1, 2, 3, 4]
    assert kept.last == [3, 4]
    short = KeepLast([10, 11, 12], keep=2)
    for i, _ in enumerate(short):  # a pass cut short (calibrate's max_batches) keeps what it read
        if i == 1:
            break
    assert short.last == [10, 11] and len(short) == 3
    with pytest.raises(TypeError):
        len(KeepLast(iter([1])))


def test_calibrate_counts_batches_of_an_unsized_keep_last():
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_fx

    batches = _pixels(3, seed=1)
    prepared = prepare_fx(_conv_relu(), get_default_qconfig_mapping("x86"), batches[0])
    data = KeepLast(iter(batches))
    stats = calibrate(prepared, data)
    assert stats.batches == 3 and [b[0] for b in data.last] == [b[0] for b in batches[1:]]


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
def test_pixels_calibrated_int8_is_judged_on_pixels_not_on_generated_normals(one_shot):
    model, calib = _conv_relu(), _pixels(4, seed=2)
    data = (b for b in calib) if one_shot else calib
    q = gml.quantize(model, data, example_inputs=calib[0], cost_policy="off")
    # before: judged on 2 generated N(0, 1) batches, where the [0, 1) input scale clips every negative
    # value, this INT8 model had cosine ~0.7, was flagged BROKEN and gml.optimize's fp32 came back
    assert q.precision == "int8", q.precision_reason
    assert q.accuracy.broken is None and q.accuracy.cosine > 0.9999
    assert q.accuracy.samples == 4  # the last two batches of two samples
    assert "last 2 calibration batch(es)" in q.accuracy.source and "not held out" in q.accuracy.summary()
    # ... and the report is the truth about the model on such inputs
    x = _pixels(1, seed=3)[0][0]
    with torch.inference_mode():
        cos = torch.nn.functional.cosine_similarity(model(x).flatten(), q.executable(x).flatten(), dim=0)
    assert cos > 0.9999


def test_generated_calibration_is_judged_on_generated_batches_it_did_not_see():
    q = gml.quantize(_conv_relu(), 2, example_inputs=_pixels(1, seed=4)[0], cost_policy="off")
    assert q.accuracy.source.startswith("2 held-out generated batches")


def test_given_eval_data_is_what_the_report_measures_on():
    model, calib = _conv_relu(), _pixels(3, seed=5)
    q = gml.quantize(model, calib, eval_data=_pixels(3, seed=6), cost_policy="off")
    assert q.accuracy.source == "the given eval_data" and q.accuracy.samples == 6
