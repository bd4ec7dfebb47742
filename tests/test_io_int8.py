"""INT8 models save through torch.export (the gml ops have schemas) and load with no pickle and
no model source: checked in a fresh process that never imports torchvision or this file."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
import torchvision

import gml
from gml.ir import library

pytestmark = pytest.mark.slow

_LOAD = """
import sys, torch, gml.io
for path, io in zip(sys.argv[1::2], sys.argv[2::2]):
    blob = torch.load(io, weights_only=True)
    m = gml.io.load(path)  # no trust_pickle: nothing in the file is unpickled as code
    y = m(blob["x"])
    ops = sorted({str(n.target) for n in m.graph.nodes if str(n.target).startswith("gml.")})
    print(float((y - blob["y"]).abs().max()), float(blob["y"].abs().max()), ",".join(ops))
assert "torchvision" not in sys.modules, "loading needed the model's source"
"""


def _randomize_bn(model: torch.nn.Module) -> None:
    # torchvision's random init gives MobileNetV2 ~1e-9 outputs (zero-init BN in the blocks): make
    # the statistics and affine parameters non-trivial so the comparison means something
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.weight.data = torch.rand(n, generator=g) + 0.5
            m.bias.data = torch.randn(n, generator=g) * 0.1
            m.running_mean = torch.randn(n, generator=g) * 0.1
            m.running_var = torch.rand(n, generator=g) + 0.5


def test_int8_resnet18_and_mobilenet_v2_round_trip_through_torch_export_in_a_fresh_process(
    tmp_path, capsys, monkeypatch
):
    files: list[str] = []
    for arch in ("resnet18", "mobilenet_v2"):
        torch.manual_seed(0)
        model = getattr(torchvision.models, arch)().eval()
        _randomize_bn(model)
        x = torch.randn(1, 3, 64, 64)
        res = gml.quantize(model, 2, example_inputs=(x,), per_layer=False)
        ops = Counter(library.gml_op_name(n) for n in res.module.graph.nodes)
        assert ops["qconv"] > 0 and ops["qconv_add"] > 0 and ops["qlinear"] == 1
        assert not any(n.op == "call_module" for n in res.module.graph.nodes)  # ops, not modules
        path, io = tmp_path / f"{arch}.pt2", tmp_path / f"{arch}_io.pt"
        res.save(str(path))
        x2 = torch.randn(3, 3, 64, 64)  # another batch size: the batch is exported dynamic
        with torch.no_grad():
            torch.save({"x": x2, "y": res.module(x2)}, io)
        files += [str(path), str(io)]
    out = subprocess.run([sys.executable, "-c", _LOAD, *files], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")[:2]
    for line in lines:
        err, ref, names = line.split()
        assert float(err) == 0.0 and float(ref) > 0.1
        assert {"gml.qconv.default", "gml.qconv_add.default", "gml.qlinear.default"} <= set(names.split(","))
    # `gml inspect` of the saved INT8 model shows the gml ops it holds
    from gml.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    assert main(["inspect", files[0], "--no-nodes"]) == 0
    out = capsys.readouterr().out
    assert "gml.qconv.default" in out and "gml.qconv_add.default" in out and "gml.quantize.default" in out
