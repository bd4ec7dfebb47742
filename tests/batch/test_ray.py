"""``gml run --ray``: the same job on a local Ray of 2 CPUs gives the in-process outputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torchvision.io import write_png

import gml
from gml.batch import run_batch

ray = pytest.importorskip("ray")
pytest.importorskip("pyarrow")

# torchvision 0.29 deprecates its image encoders in favour of TorchCodec; the tests still write PNGs with them
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_run_equals_in_process(tmp_path, local_ray):
    from assets.models import SmallCNN

    model = SmallCNN().eval()
    gml.optimize(model, torch.randn(1, 3, 32, 32)).save(str(tmp_path / "m.pt2"))
    gen = torch.Generator().manual_seed(0)
    os.makedirs(tmp_path / "in")
    for i in range(20):
        write_png(
            torch.randint(0, 256, (3, 32, 32), generator=gen, dtype=torch.uint8), str(tmp_path / "in" / f"{i:02d}.png")
        )
    (tmp_path / "in" / "07.png").write_bytes(b"junk")
    common = dict(batch_size=4, shard_size=6, progress=False)
    local = run_batch(str(tmp_path / "m.pt2"), str(tmp_path / "in"), str(tmp_path / "local.npy"), **common)
    on_ray = run_batch(
        str(tmp_path / "m.pt2"), str(tmp_path / "in"), str(tmp_path / "ray.npy"), ray_address="", **common
    )
    assert "Ray" in on_ray.runner and on_ray.written == local.written == 19
    assert [s[0] for s in on_ray.skipped] == ["07.png"]
    assert np.load(tmp_path / "ray.ids.npy").tolist() == np.load(tmp_path / "local.ids.npy").tolist()
    np.testing.assert_allclose(np.load(tmp_path / "ray.npy"), np.load(tmp_path / "local.npy"), atol=1e-5)
    assert json.loads((tmp_path / "ray.npy.skipped.json").read_text())[0]["id"] == "07.png"
