"""``gml run``: batch inference over real files, resumable shards, bad inputs skipped and listed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.io import write_png

import gml
from gml.cli import main
from gml.data import open_data

# torchvision 0.29 deprecates its image encoders in favour of TorchCodec; the tests still write PNGs with them
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Wide(nn.Module):
    """Enough work per image (32x32) that a run over a few hundred takes a few seconds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, padding=1), nn.ReLU()]
        for _ in range(3):
            layers += [nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _images(root, n: int, size: int = 32) -> None:
    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        write_png(
            torch.randint(0, 256, (3, size, size), generator=gen, dtype=torch.uint8), os.path.join(root, f"{i:04d}.png")
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    model = Wide().eval()
    gml.optimize(model, torch.randn(1, 3, 32, 32)).save(str(d / "wide.pt2"))
    return model, str(d / "wide.pt2")


def _eager(model, folder: str) -> dict[str, np.ndarray]:
    src = open_data(folder, (torch.zeros(1, 3, 32, 32),))
    with torch.no_grad():
        return {b.ids[j]: row for b in src.batches(16) for j, row in enumerate(model(*b.inputs).numpy())}


def _read(output: str) -> tuple[list[str], np.ndarray]:
    if output.endswith(".parquet"):
        import pyarrow.parquet as pq

        t = pq.read_table(output)
        return t.column("id").to_pylist(), np.array(t.column("output").to_pylist(), np.float32)
    return np.load(output[:-4] + ".ids.npy").tolist(), np.load(output)


@pytest.mark.parametrize("fmt", ["npy", "parquet"])
def test_run_matches_eager_and_skips_bad_inputs(tmp_path, saved, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    model, path = saved
    _images(tmp_path / "in", 11)
    ref = _eager(model, str(tmp_path / "in"))
    (tmp_path / "in" / "0005.png").write_bytes(b"\x89PNG broken")  # unreadable: skipped, listed
    out = str(tmp_path / f"out.{fmt}")
    argv = ["run", path, "--input", str(tmp_path / "in"), "--output", out, "--batch-size", "4", "--shard-size", "4"]
    assert main([*argv, "--no-progress"]) == 0
    ids, values = _read(out)
    assert ids == [f"{i:04d}.png" for i in range(11) if i != 5]
    np.testing.assert_allclose(values, np.stack([ref[i] for i in ids]), atol=1e-4)
    skipped = json.loads(Path(out + ".skipped.json").read_text())
    assert [s["id"] for s in skipped] == ["0005.png"] and "cannot read image" in skipped[0]["error"]
    assert not os.path.exists(out + ".parts")
    assert main([*argv, "--no-progress"]) == 1  # a finished output is not overwritten


def test_killed_run_resumes_and_writes_every_input_once(tmp_path, saved):
    model, path = saved
    _images(tmp_path / "in", 300)
    out = str(tmp_path / "out.npy")
    cmd = [sys.executable, "-m", "gml.cli", "run", path, "--input", str(tmp_path / "in"), "--output", out]
    cmd += ["--batch-size", "4", "--shard-size", "16", "--no-progress", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    parts = out + ".parts"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(parts) and len([f for f in os.listdir(parts) if f.startswith("part-")]) >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(parts) and not os.path.exists(out), "the run was not killed mid-way"
    done = len([f for f in os.listdir(parts) if f.startswith("part-")])
    assert 2 <= done < 300 // 16 + 1
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "already written by an earlier run" in rerun.stdout
    ids, values = _read(out)
    assert ids == [f"{i:04d}.png" for i in range(300)]  # every input, once, in order
    ref = _eager(model, str(tmp_path / "in"))
    np.testing.assert_allclose(values, np.stack([ref[i] for i in ids]), atol=1e-4)


def test_resume_refuses_another_job(tmp_path, saved):
    _, path = saved
    _images(tmp_path / "in", 4)
    out = tmp_path / "out.npy"
    os.makedirs(str(out) + ".parts")
    (tmp_path / "out.npy.parts" / "plan.json").write_text(json.dumps({"items": 99}))
    code = main(["run", path, "--input", str(tmp_path / "in"), "--output", str(out), "--no-progress"])
    assert code == 1


def test_run_bad_arguments(tmp_path, saved, capsys):
    _, path = saved
    _images(tmp_path / "in", 2)
    assert main(["run", path, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o.csv")]) == 1
    assert "must end in .parquet or .npy" in " ".join(capsys.readouterr().out.split())
    assert (
        main(["run", str(tmp_path / "in"), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o.npy")]) == 1
    )
    assert "not a model saved by gml" in " ".join(capsys.readouterr().out.split())
