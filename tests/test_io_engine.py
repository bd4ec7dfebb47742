"""Saved INT8 models load onto the native engine: every op kind the lowering emits round-trips
through the no-pickle format and runs in the rebuilt plan; what cannot be exported fails clearly."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import gml
from gml import io as gio
from gml.errors import GMLError, InputError, ModelLoadError
from gml.ir import library
from gml.ir.values import QParams
from gml.quant import modules as qm
from gml.runtime import EngineModule, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


class EveryKind(nn.Module):
    """One model whose INT8 lowering emits every op kind the engine runs, and an fp32 op between."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.hs = nn.Hardswish()
        self.fc1 = nn.Linear(16, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        a = torch.relu(self.c1(x))  # quantize, qconv (relu)
        b = self.c2(a) + a  # qconv_add
        d = self.pool(b) + self.pool(self.c3(a))  # qmax_pool, qadd
        q = self.avg(torch.sin(d))  # dequantize, sin in fp32, quantize, qavg_pool2d
        h = self.hs(torch.cat([d, q], 1))  # qcat, qactivation (hardswish)
        g = torch.flatten(self.gap(h), 1)  # qadaptive_avg_pool, flatten
        g = g * torch.sigmoid(self.fc1(g))  # qlinear, qactivation (sigmoid), qmul
        return self.fc(g)  # qlinear to fp32


KINDS = {
    "quantize", "dequantize", "qconv", "qconv_add", "qlinear", "qadd", "qmax_pool", "qavg_pool2d",
    "qadaptive_avg_pool", "qcat", "qactivation", "qmul",
}  # fmt: skip


def _ops(gm) -> Counter:
    return Counter(library.gml_op_name(n) for n in gm.graph.nodes if library.gml_op_name(n))


def test_every_int8_op_kind_round_trips_and_runs_in_the_rebuilt_engine(tmp_path):
    torch.manual_seed(0)
    model, x = EveryKind().eval(), torch.randn(1, 3, 16, 16)
    res = gml.quantize(model, 4, example_inputs=(x,), per_layer=False)
    assert set(_ops(res.module)) == KINDS
    path = tmp_path / "kinds.pt2"
    res.save(str(path))
    loaded = gml.load(str(path))
    assert isinstance(loaded, EngineModule)
    assert [(n.name, n.reason) for n in loaded.runtime.torch_nodes] == [
        ("sin", "not a lowered GML op (runs in torch)")
    ], str(loaded.runtime)
    assert set(_ops(gio.load(path, runtime="torch"))) == KINDS  # the file holds the gml ops themselves
    with torch.no_grad():
        for n in (1, 3):
            xn = torch.randn(n, 3, 16, 16)
            ref, got = res.module(xn), loaded(xn)
            assert torch.equal(got, res.executable(xn))  # the same plan as in the quantizing process
            assert float((got - ref).abs().max()) <= 0.02 * float(ref.abs().max())
    with pytest.raises(InputError, match=r"expects a torch\.float32 tensor of rank 4 with 3 channels"):
        loaded(torch.randn(1, 4, 16, 16))


class SequenceNet(nn.Module):
    """The rest of the op kinds: a 1-D conv, hardtanh, data movement, a standalone BN, a rank-3
    linear and a mean (BN and mean stay in torch between engine segments)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):  # [N, 4, L]
        y = nn.functional.relu6(self.c1(x))
        z = self.bn(y.unsqueeze(-1)).squeeze(-1).permute(0, 2, 1)  # [N, L, 8]
        return self.fc(z).mean(1)


def test_sequence_op_kinds_round_trip(tmp_path):
    torch.manual_seed(0)
    model, x = SequenceNet().eval(), torch.randn(1, 4, 12)
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    res = gml.quantize(model, 4, example_inputs=(x,), per_layer=False)
    assert {"qconv", "qactivation", "qbatch_norm", "qlinear", "qmean"} <= set(_ops(res.module))
    res.save(str(tmp_path / "seq.pt2"))
    loaded = gml.load(str(tmp_path / "seq.pt2"))
    assert sorted(n.op for n in loaded.runtime.torch_nodes) == ["qbatch_norm", "qmean"], str(loaded.runtime)
    assert {n.op for n in loaded.runtime.nodes if n.runs_in == "engine"} >= {"permute", "squeeze", "unsqueeze"}
    with torch.no_grad():
        x2 = torch.randn(3, 4, 12)
        assert torch.equal(loaded(x2), res.executable(x2))


def test_requantize_quantize_dequantize_round_trip(tmp_path):
    from runtime.helpers import graph_of

    in_qp = QParams(0.05, 120)
    gm = graph_of(
        qm.Quantize(in_qp),
        qm.QMaxPool2d((2, 2), (2, 2), (0, 0), (1, 1), False, in_qp, QParams(0.1, 60)),  # + requantize
        qm.Dequantize(QParams(0.1, 60)),
    )
    assert set(_ops(gm)) == {"quantize", "qmax_pool", "requantize", "dequantize"}
    x = torch.randn(2, 4, 6, 6)
    loaded = gio.load(gio.save(gm, tmp_path / "rq.pt2", example_inputs=(x,)))
    assert isinstance(loaded, EngineModule) and loaded.runtime.path == "engine", str(loaded.runtime)
    with torch.no_grad():
        ref = gm(x)
        assert float((loaded(x) - ref).abs().max()) <= 0.1 + 1e-6  # at most one output step


class DataDependent(nn.Module):
    def forward(self, x):
        return x * 2 if float(x.sum()) > 0 else x  # a Python branch on a tensor's value


def test_a_graph_torch_export_cannot_take_is_a_clear_error_and_pickle_needs_trust(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), DataDependent(), nn.Conv2d(4, 4, 1)).eval()
    x = torch.randn(1, 3, 8, 8)
    res = gml.quantize(model, 2, example_inputs=(x,), per_layer=False, leaf_modules=[DataDependent])
    with pytest.raises(GMLError, match=r"torch\.export could not capture the optimized model") as err:
        res.save(str(tmp_path / "m.pt2"))
    assert "format='pickle'" in err.value.hint and not (tmp_path / "m.pt2").exists()
    path = gio.save(res.module, tmp_path / "m.pkl", (x,), format="pickle")  # the shapes go in the manifest
    with pytest.raises(ModelLoadError, match="was refused: it is a pickled model"):
        gml.load(str(path))
    loaded = gml.load(str(path), trust_pickle=True)  # the opted-in path also rebuilds the engine
    assert loaded.runtime.engine_nodes > 0, str(loaded.runtime)
    with torch.no_grad():
        assert float((loaded(x) - res.module(x)).abs().max()) <= 0.02 * float(res.module(x).abs().max()) + 1e-6


def test_runtime_argument_is_checked_before_the_file_is_read(tmp_path):
    with pytest.raises(GMLError, match="unknown runtime 'gpu'"):
        gml.load(str(tmp_path / "missing.pt2"), runtime="gpu")


def test_gml_bench_of_a_saved_file_times_the_rebuilt_engine(tmp_path, capsys, monkeypatch):
    from gml.cli import main

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    res = gml.quantize(model, 2, example_inputs=(torch.randn(1, 3, 8, 8),), per_layer=False)
    path = tmp_path / "small.pt2"
    res.save(str(path))
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    assert main(["bench", str(path), "--batch-sizes", "1,3", "--rounds", "2", "--settle-ms", "0"]) == 0
    out = capsys.readouterr().out
    assert "a model saved by gml; runtime: engine (" in out and "oneDNN ISA" in out
    rows = [line for line in out.splitlines() if "engine " in line and "│" in line]
    assert len(rows) == 2 and all("python executor" not in r for r in rows)  # one engine row per batch size


def test_optimize_and_quantize_of_a_saved_file_say_what_to_do(tmp_path, capsys, monkeypatch):
    from gml.cli import main

    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    gm = gml.optimize(model, torch.randn(1, 3, 8, 8)).module
    path = gio.save(gm, tmp_path / "m.pt2")
    monkeypatch.setenv("COLUMNS", "200")
    for command in ("optimize", "quantize"):
        capsys.readouterr()
        assert main([command, str(path)]) == ModelLoadError.exit_code
        out = " ".join(capsys.readouterr().out.split())  # rich wraps long paths
        assert "is a model saved by gml: it is already optimized" in out and f"gml bench {path}" in out
