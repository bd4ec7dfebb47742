"""Calibration and evaluation on real files: ``gml quantize --calib-data / --eval-data`` and the API,
top-1 / top-5 against labels, and the accuracy-drop gate (exit 9, nothing saved)."""

from __future__ import annotations

import os

import pytest
import torch

import gml
from gml.cli import main
from gml.data import DataOptions, ImageOptions, open_data, save_digits_images, train_digits_model
from gml.errors import AccuracyDropError, InputError
from gml.quant.accuracy import AccuracyReport

pytest.importorskip("sklearn")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

DIGITS = os.path.join(os.path.dirname(gml.__file__), "data", "digits.py") + ":DigitsCNN"


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The trained digits CNN, its weights file, 64 train digits and the held-out ones as PNG folders."""
    root = tmp_path_factory.mktemp("digits")
    trained = train_digits_model(seed=0, cache_dir=str(root))
    torch.save(trained.model.state_dict(), root / "w.pt")
    mean, std = save_digits_images(trained.data, str(root / "train"), "train", limit=64)
    save_digits_images(trained.data, str(root / "test"), "test")
    return trained, root, mean, std


def _cli(root, mean, std, *extra):
    argv = ["quantize", DIGITS, "--weights", str(root / "w.pt"), "--input-shape", "1x1x8x8", "--no-time"]
    argv += ["--no-per-layer", "--mean", str(mean[0]), "--std", str(std[0]), *extra]
    return main(argv)


def test_cli_calibrates_and_evaluates_on_image_folders(digits, capsys, tmp_path):
    trained, root, mean, std = digits
    out = tmp_path / "q.pt2"
    code = _cli(root, mean, std, "--calib-data", str(root / "train"), "--calib-samples", "32",
                "--eval-data", str(root / "test"), "--max-accuracy-drop", "2", "--out", str(out))  # fmt: skip
    text = " ".join(capsys.readouterr().out.split())
    assert code == 0, text
    assert "calibration data: 64 images" in text and "; 32 used" in text
    assert "evaluation data: 450 images" in text and "10 classes (ImageFolder layout)" in text
    fp32 = f"top-1 accuracy fp32 {100 * trained.test_accuracy:.2f}%"  # the readers give the model's inputs exactly
    assert fp32 in text and "top-5 accuracy fp32" in text
    assert out.exists()


def test_accuracy_drop_gate_fails_with_exit_9_and_saves_nothing(digits, capsys, tmp_path):
    trained, root, mean, std = digits
    # calibrated on inputs 100x too small: the INT8 input scale clips real digits to noise. Such a result
    # is BROKEN, which gml.quantize does not return by default (gml.optimize's model comes back and loses
    # nothing); --keep-broken returns it, and the gate must then refuse it
    torch.save(trained.data.x_train[:64] * 0.01, tmp_path / "tiny.pt")
    out = tmp_path / "q.pt2"
    code = _cli(root, mean, std, "--calib-data", str(tmp_path / "tiny.pt"), "--eval-data", str(root / "test"),
                "--min-accuracy-drop", "1", "--keep-broken", "--out", str(out))  # fmt: skip
    text = " ".join(capsys.readouterr().out.split())
    assert code == 9, text
    assert "points of top-1 accuracy" in text and not out.exists()


def test_gate_needs_labelled_eval_data(digits, capsys):
    _, root, mean, std = digits
    assert _cli(root, mean, std, "--max-accuracy-drop", "1") == 1
    assert "needs --eval-data with labels" in " ".join(capsys.readouterr().out.split())


def test_check_accuracy_drop_on_a_report():
    rep = AccuracyReport(100, 0.99, 0.1, top1_agreement=0.9, fp32_top1=0.9, int8_top1=0.85)
    with pytest.raises(AccuracyDropError, match=r"loses 5\.00 points") as err:
        gml.api.check_accuracy_drop(rep, 4.0)
    assert err.value.exit_code == 9
    gml.api.check_accuracy_drop(rep, 5.0)  # exactly the allowed drop passes
    with pytest.raises(InputError, match="needs labels"):
        gml.api.check_accuracy_drop(AccuracyReport(10, 0.99, 0.1), 1.0)


def test_api_takes_data_sources(digits):
    trained, root, mean, std = digits
    x = trained.data.x_test[:1]
    opts = DataOptions(image=ImageOptions(mean=mean, std=std))
    calib = open_data(str(root / "train"), (x,), options=opts)
    held_out = open_data(str(root / "test"), (x,), options=opts)
    q = gml.quantize(trained.model, calib, example_inputs=(x,), eval_data=held_out, per_layer=False,
                     max_accuracy_drop=2.0)  # fmt: skip
    assert q.accuracy.samples == 450 and q.accuracy.fp32_top1 == pytest.approx(trained.test_accuracy)
    assert q.accuracy.int8_top5 is not None
    with pytest.raises(InputError, match="needs labelled evaluation data"):
        gml.quantize(trained.model, calib, example_inputs=(x,), max_accuracy_drop=1.0)


def test_bench_calibrates_and_scores_on_real_data(digits):
    from gml.bench.runner import run_bench

    trained, root, mean, std = digits
    result = run_bench(
        trained.model, input_shape=(1, 1, 8, 8), batch_sizes=[16], variants="eager,gml-int8", rounds=2, warmup=1,
        peak=None, footprint=False, progress=False, calib_data=str(root / "train"), calib_samples=32,
        eval_data=str(root / "test"), data_options=DataOptions(image=ImageOptions(mean=mean, std=std)),
    )  # fmt: skip
    assert result.settings["calib_data"].startswith("64 images") and result.settings["eval_data"].startswith("450")
    eager, int8 = result.batches[0].variants
    n = 450 // 16 * 16  # full batches only: the variants are built for one shape
    want = float((trained.model(trained.data.x_test[:n]).argmax(1) == trained.data.y_test[:n]).float().mean())
    assert eager.top1_accuracy == pytest.approx(want)
    assert int8.ok and int8.top1_accuracy is not None and abs(int8.top1_accuracy - want) < 0.03
