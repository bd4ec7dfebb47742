from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gml.cli import main

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "models.py")


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, out


def test_inspect_resnet18_prints_table_histogram_and_patterns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = _run(capsys, "inspect", "resnet18")
    assert code == 0
    assert "resnet18: 71 nodes, 11,689,512 parameters" in out
    assert "layer1.0.conv1: Conv2d" in out and "(1, 64, 56, 56) float32" in out
    assert "call_module   │    60" in out
    assert "BatchNorm2d       │    20" in out
    assert "conv → batchnorm " in out


def test_inspect_file_model(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = _run(capsys, "inspect", f"{ASSETS}:SmallCNN", "--no-nodes")
    assert code == 0
    assert "inputs (1, 3, 32, 32)" in out
    assert "Conv2d" in out


def test_inspect_untraceable_is_one_paragraph_error(capsys):
    code, out = _run(capsys, "inspect", f"{ASSETS}:DataDependent")
    assert code == 4
    assert "error: Cannot capture DataDependent" in out
    assert "Traceback" not in out
    assert "--leaf inner" in " ".join(out.split())


def test_inspect_with_leaf_succeeds(capsys):
    code, _ = _run(capsys, "inspect", f"{ASSETS}:DataDependent", "--leaf", "inner", "--no-nodes")
    assert code == 0


def test_submodule_optimizes_the_traceable_part(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    # torch.fx cannot iterate over the batch; the torch.export path unrolls the loop for this batch (#15)
    code, out = _run(capsys, "inspect", f"{ASSETS}:PerImage", "--no-nodes")
    assert code == 0 and "captured with torch.export" in out and "static" in out
    # the input shape is the part's own declared one (SmallCNN: 1x3x32x32), not the whole model's
    code, out = _run(capsys, "optimize", f"{ASSETS}:PerImage", "--submodule", "backbone")
    assert code == 0
    assert "gml optimize" in out and "models.py:PerImage.backbone" in out
    assert "fold_bn" in out and "max abs error vs eager" in out


def test_unknown_submodule_lists_children(capsys):
    code, out = _run(capsys, "inspect", f"{ASSETS}:PerImage", "--submodule", "backbone.cnv1")
    text = " ".join(out.split())
    assert code != 0 and "has no submodule 'backbone.cnv1'" in text
    assert "children of 'backbone': conv1, bn1, conv2" in text and "Traceback" not in text


def test_inspect_dot_file(tmp_path, capsys):
    path = tmp_path / "g.dot"
    code, _ = _run(capsys, "inspect", f"{ASSETS}:MLP", "--no-nodes", "--svg", str(path))
    assert code == 0
    assert "fc1" in path.read_text()


@pytest.mark.parametrize(
    ("argv", "code", "text"),
    [
        (["inspect", "resnet81"], 3, "did you mean resnet18"),
        (["inspect", "resnet18", "--input-shape", "1x4x224x224"], 5, "do not fit the model"),
        (["inspect", "resnet18", "--input-shape", "1xfoo"], 5, "Cannot read input shape"),
    ],
)
def test_bad_inputs_exit_codes(capsys, argv, code, text):
    got, out = _run(capsys, *argv)
    assert got == code
    assert text in " ".join(out.split())
    assert "Traceback" not in out


def test_help_is_complete():
    out = subprocess.run([sys.executable, "-m", "gml.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("inspect", "optimize", "quantize", "bench", "demo"):
        assert command in out
    sub = subprocess.run(
        [sys.executable, "-m", "gml.cli", "inspect", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--input-shape", "--weights", "--unsafe-load", "--leaf", "--submodule", "--svg", "--no-nodes"):
        assert flag in sub
    for command in ("optimize", "bench"):
        sub = subprocess.run(
            [sys.executable, "-m", "gml.cli", command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert "--precision {fp32,bf16}" in sub


def test_optimize_prints_report(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = _run(capsys, "optimize", f"{ASSETS}:SmallCNN", "--no-time")
    assert code == 0
    assert "fold_bn" in out and "applied" in out
    assert "max abs error vs eager" in out and "of the largest output" in out  # read against the scale


def test_optimize_bf16_prints_each_ops_precision(capsys, monkeypatch):
    from gml.kernels import bf16 as kb

    if not kb.bf16_available():
        pytest.skip(f"no native bf16: {kb.bf16_unavailable_reason()}")
    monkeypatch.setenv("COLUMNS", "200")
    code, out = _run(capsys, "optimize", f"{ASSETS}:SmallCNN", "--no-time", "--precision", "bf16")
    assert code == 0
    assert "lower_bf16" in out and "Precision per op" in out and "Bf16Conv" in out
    assert "precision: bf16 on oneDNN ISA" in out or "precision: bf16 on torch" in out
    assert "runtime:" in out  # the engine where it covers the graph


def test_optimize_bf16_on_a_cpu_without_bf16_warns_and_runs_fp32(capsys, monkeypatch):
    from gml.kernels import bf16 as kb

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(
        kb, "bf16_unavailable_reason", lambda target=None: "this CPU has no native bf16 instructions (simulated)"
    )
    with pytest.warns(RuntimeWarning):
        code, out = _run(capsys, "optimize", f"{ASSETS}:SmallCNN", "--no-time", "--precision", "bf16")
    assert code == 0
    text = " ".join(out.split())
    assert "warning: bf16 requested but this CPU has no native bf16 instructions (simulated)" in text
    assert "precision: fp32 (requested bf16" in text and "lower_bf16" not in out


def test_quantize_prints_coverage_and_accuracy(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = _run(capsys, "quantize", f"{ASSETS}:SmallCNN", "--calib", "2", "--no-time")
    assert code == 0
    assert "INT8 lowering coverage" in out and "qconv_add" in out
    assert "output cosine" in out
    assert "precision per op:" in out


def test_quantize_fallback_precision_bf16_without_bf16_cpu_warns(capsys, monkeypatch):
    """--fallback-precision bf16 reaches gml.quantize; a CPU without bf16 (simulated) is told, and
    the fallback is fp32."""
    from gml.kernels import bf16 as kb

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(
        kb, "bf16_unavailable_reason", lambda target=None: "this CPU has no native bf16 instructions (simulated)"
    )
    with pytest.warns(RuntimeWarning, match="bf16 requested but this CPU has no native bf16"):
        code, out = _run(
            capsys, "quantize", f"{ASSETS}:SmallCNN", "--calib", "2", "--no-time", "--fallback-precision", "bf16"
        )
    assert code == 0
    assert "precision per op:" in out and "simulated" in out


TOKENS = """
import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def example_inputs():
    return (torch.randint(0, 50, (2, 6)),)
"""


def test_integer_example_inputs_keep_their_dtype_and_range(tmp_path, capsys):
    """An embedding model's ids: generated inputs are int64 in the declared range, not N(0, 1)."""
    import argparse

    from gml.cli import load_from_args

    path = tmp_path / "tokens.py"
    path.write_text(TOKENS)
    spec = f"{path}:Bag"
    ns = argparse.Namespace(model=spec, weights=None, unsafe_load=False, submodule=None, input_shape="4x9")
    _, (ids,) = load_from_args(ns)
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (4, 9)
    assert int(ids.min()) >= 0 and int(ids.max()) < 50
    for command in ("optimize", "quantize"):
        code, out = _run(capsys, command, spec, "--no-time")
        assert code == 0, out
    assert "lowered to INT8: 1 qlinear" in " ".join(out.split())
