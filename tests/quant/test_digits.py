"""A model trained on real data keeps its accuracy through INT8 (reference graph and lowered)."""

from __future__ import annotations

import os

import pytest
import torch

from gml.data import DigitsCNN, load_digits, train_digits_model
from gml.quant.accuracy import accuracy_report, top1_accuracy
from gml.quant.frontend import prepare_reference

pytest.importorskip("sklearn")
pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


@pytest.fixture(scope="module")
def trained():
    return train_digits_model(seed=0)


@pytest.fixture(scope="module")
def int8(trained):
    d = trained.data
    return prepare_reference(trained.model, (d.x_train[:1],), d.batches("train", 128), progress=False)


def test_digits_split_is_stratified_and_standardized():
    d = load_digits(seed=0)
    assert d.x_train.shape == (1347, 1, 8, 8) and d.x_test.shape == (450, 1, 8, 8)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert abs(float(d.x_train.mean())) < 1e-5 and float(d.x_train.std()) == pytest.approx(1.0, abs=1e-4)
    test_counts = torch.bincount(d.y_test, minlength=10).double()
    totals = test_counts + torch.bincount(d.y_train, minlength=10)
    assert ((test_counts - 0.25 * totals).abs() <= 1).all()  # stratified: every class split 75/25
    assert sum(len(x) for x, _ in d.batches("test", 128)) == 450


def test_training_is_deterministic_and_restores_threads(tmp_path):
    threads = torch.get_num_threads()
    a = train_digits_model(seed=3, epochs=1)
    b = train_digits_model(seed=3, epochs=1, cache_dir=str(tmp_path))
    assert torch.get_num_threads() == threads
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert len(os.listdir(tmp_path)) == 1  # written only where asked
    c = train_digits_model(seed=3, epochs=1, cache_dir=str(tmp_path))  # loaded, not retrained
    assert c.test_accuracy == a.test_accuracy
    assert not c.model.training


def test_trained_fp32_model_is_accurate(trained):
    assert isinstance(trained.model, DigitsCNN)
    assert trained.test_accuracy >= 0.97
    d = trained.data
    assert top1_accuracy(trained.model, d.x_test, d.y_test) == pytest.approx(trained.test_accuracy)


def test_digits_model_exercises_the_int8_patterns(int8):
    ops = {o.node: o for o in int8.report.ops}
    assert not int8.report.fp32
    assert ops["conv2"].detail == "fused Conv2d + Add + ReLU"
    assert ops["fc1"].detail == "fused Linear + ReLU"
    assert {o.op for o in int8.report.quantized} >= {"ConvReLU2d", "MaxPool2d", "AdaptiveAvgPool2d", "Flatten"}


def test_int8_reference_accuracy_within_half_a_point(trained, int8):
    d = trained.data
    batches = d.batches("test", 150)
    rep = accuracy_report(
        trained.model,
        int8.graph_module,
        [x for x, _ in batches],
        labels=[y for _, y in batches],
        fp32_graph=int8.float_module,
    )
    assert rep.fp32_top1 == pytest.approx(trained.test_accuracy)
    assert abs(rep.accuracy_drop) <= 0.5, rep.summary()
    assert rep.top1_agreement >= 0.99
    assert min(e.sqnr_db for e in rep.layers) > 25


def test_int8_lowered_accuracy_within_half_a_point(trained, int8):
    lower = pytest.importorskip("gml.quant.lower")
    import copy

    gm = copy.deepcopy(int8.graph_module)
    result = lower.LowerToGML()(gm)
    assert result.modified
    lowered = result.graph_module
    d = trained.data
    acc = top1_accuracy(lowered, d.x_test, d.y_test, batch_size=150)
    assert abs(100 * (trained.test_accuracy - acc)) <= 0.5, (trained.test_accuracy, acc)
