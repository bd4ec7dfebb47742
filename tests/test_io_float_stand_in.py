"""A loaded static-INT8 file is checked against its float stand-in (``gml.io._float_proxy``, every
INT8 op in float: ``gml.kernels.float_int8``), as ``gml.quantize`` checks against the fp32 model.

Before, only dynamic-INT8 GEMMs had a stand-in: a timm efficientnet_b1 INT8 file whose engine
differs from the Python executor by rounding flips (0.09 of the output range, as close to the fp32
model as the executor) loaded onto torch (docs/benchmarks.md, session 24)."""

from __future__ import annotations

import torch
from torch import nn

import gml
from gml import io
from gml.ir.library import gml_op_name
from gml.kernels.float_int8 import FLOAT
from gml.runtime import select


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(self.body(y) + y)
        y = self.pool(y).mean((2, 3))
        return self.head(y)


def _saved(tmp_path):
    torch.manual_seed(0)
    model = Block().eval()
    data = [(torch.randn(2, 3, 16, 16),) for _ in range(4)]
    q = gml.quantize(model, data, per_layer=False, cost_policy="off")
    assert q.precision == "int8"
    path = tmp_path / "q.pt2"
    q.save(str(path))
    return model, data[0], path


def test_the_stand_in_of_a_static_int8_graph_is_closer_to_fp32(tmp_path):
    model, example, path = _saved(tmp_path)
    gm = io.load(path, runtime="torch")
    assert any(gml_op_name(n) in ("qconv", "qconv_add", "quantize") for n in gm.graph.nodes)
    proxy = io._float_proxy(gm)
    assert proxy is not None and not any(gml_op_name(n) in FLOAT for n in proxy.graph.nodes)
    with torch.no_grad():
        got, stand_in, fp32 = gm(*example), proxy(*example), model(*example)
    assert stand_in.dtype == torch.float32 and stand_in.shape == fp32.shape
    # only the weights' rounding is left: closer to the fp32 model than the INT8 graph
    assert float((stand_in - fp32).norm()) < float((got - fp32).norm())


def test_an_engine_off_by_rounding_flips_is_kept_when_as_close_to_the_stand_in(tmp_path, monkeypatch):
    _, _, path = _saved(tmp_path)
    monkeypatch.setattr(select, "agreement_error", lambda *a: "output 0 differs (a rounding flip)")
    loaded = io.load(path)
    assert loaded.runtime.runtime != "torch" and "as close to the fp32 model" in loaded.runtime.note


def test_a_stand_in_that_cannot_run_keeps_the_file_on_torch(tmp_path, monkeypatch):
    _, example, path = _saved(tmp_path)
    monkeypatch.setattr(select, "agreement_error", lambda *a: "output 0 differs (a rounding flip)")

    def broken(*args, **kwargs):
        raise RuntimeError("no float form")

    monkeypatch.setitem(FLOAT, "qlinear", broken)
    loaded = io.load(path)
    assert loaded.runtime.runtime == "torch" and "disagreed" in loaded.runtime.note
    with torch.no_grad():
        assert loaded(*example).shape == (2, 10)
