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
import pickle, sys, torch
import torch._weights_only_unpickler as weights_only

blobs = [torch.load(io, weights_only=True) for io in sys.argv[2::2]]


def forbidden(*args, **kwargs):
    raise AssertionError("an unpickler ran while loading the model")


class NoUnpickler:
    def __init__(self, *args, **kwargs):
        forbidden()


# from here on every unpickler (pickle's and torch.load's weights-only one) raises
for mod in (pickle, weights_only):
    for name in ("load", "loads", "Unpickler"):
        if hasattr(mod, name):
            setattr(mod, name, NoUnpickler if name == "Unpickler" else forbidden)
import gml.io

for path, blob in zip(sys.argv[1::2], blobs):
    m = gml.io.load(path)  # no trust_pickle: the engine's plan is rebuilt here
    with torch.no_grad():
        y = m(blob["x"])
    graph = gml.io.load(path, runtime="torch").graph
    ops = sorted({str(n.target) for n in graph.nodes if str(n.target).startswith("gml.")})
    print(
        type(m).__name__, m.runtime.path, float((y - blob["y_engine"]).abs().max()),
        float((y - blob["y"]).abs().max()), float(blob["y"].abs().max()), ",".join(ops),
    )
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
            torch.save({"x": x2, "y": res.module(x2), "y_engine": res.executable(x2)}, io)
        files += [str(path), str(io)]
    out = subprocess.run([sys.executable, "-c", _LOAD, *files], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")[:2]
    for line in lines:
        kind, path, err_engine, err_torch, ref, names = line.split()
        # the engine rebuilt in a fresh process computes what the engine of the quantizing process did
        assert kind == "EngineModule" and path == "engine" and float(err_engine) == 0.0, line
        assert float(err_torch) <= 0.05 * float(ref) and float(ref) > 0.1  # vs the Python executor
        assert {"gml.qconv.default", "gml.qconv_add.default", "gml.qlinear.default"} <= set(names.split(","))
    # `gml inspect` of the saved INT8 model shows the gml ops it holds
    from gml.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    assert main(["inspect", files[0], "--no-nodes"]) == 0
    out = capsys.readouterr().out
    assert "gml.qconv.default" in out and "gml.qconv_add.default" in out and "gml.quantize.default" in out
    assert "loads onto runtime: engine (" in out  # the plan it compiles on this machine
