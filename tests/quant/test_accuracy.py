"""Accuracy report: SQNR math, node pairing, error localisation, labels, bad inputs."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gml.errors import InputError
from gml.quant.accuracy import accuracy_report, sqnr_db, top1_accuracy
from gml.quant.frontend import prepare_reference

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(8 * 36, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flat(self.relu2(self.conv2(self.relu1(self.conv1(x))))))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    m = Net().eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 3, 6, 6, generator=g) for _ in range(4)]
    held_out = [torch.randn(16, 3, 6, 6, generator=g) for _ in range(2)]
    return m, prepare_reference(m, (calib[0],), calib, progress=False), held_out


def test_sqnr_db_math():
    assert sqnr_db(1.0, 0.01) == pytest.approx(20.0)
    assert sqnr_db(4.0, 4.0) == pytest.approx(0.0)
    assert sqnr_db(1.0, 0.0) == math.inf
    assert sqnr_db(0.0, 1.0) == -math.inf


def test_identical_models_agree_perfectly():
    torch.manual_seed(0)
    m = Net().eval()
    gm = torch.fx.symbolic_trace(m)
    assert accuracy_report(m, gm, [torch.randn(1, 3, 6, 6)]).layers == []  # eager fp32: no node names
    rep = accuracy_report(gm, copy.deepcopy(gm), [torch.randn(4, 3, 6, 6)])
    assert rep.samples == 4
    assert rep.cosine == pytest.approx(1.0, abs=1e-12) and rep.max_abs_diff == 0.0
    assert rep.top1_agreement == 1.0
    assert [e.node for e in rep.layers] == ["conv1", "relu1", "conv2", "relu2", "flat", "fc"]
    assert all(e.sqnr_db == math.inf for e in rep.layers)


def test_reference_graph_layers_pair_with_the_float_twin(quantized):
    m, res, held_out = quantized
    rep = accuracy_report(m, res.graph_module, held_out, fp32_graph=res.float_module)
    assert rep.samples == 32
    assert [e.node for e in rep.layers] == ["conv1", "conv2", "flat", "fc"]  # conv+relu are fused
    assert [e.op for e in rep.layers] == ["ConvReLU2d", "ConvReLU2d", "Flatten", "Linear"]
    assert not rep.unmatched
    assert all(30 < e.sqnr_db < 60 for e in rep.layers), [(e.node, e.sqnr_db) for e in rep.layers]
    assert rep.cosine > 0.999 and rep.top1_agreement is not None and rep.top1_agreement >= 0.9
    # fc is the model output: its SQNR and the output cosine describe the same error
    # (for noise uncorrelated with the signal, 1 - cos ≈ 10^(-SQNR/10) / 2)
    assert 1 - rep.cosine == pytest.approx(0.5 * 10 ** (-rep.layers[-1].sqnr_db / 10), rel=0.5)
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(rep.table())
    text = console.export_text()
    assert "SQNR dB" in text and "ConvReLU2d" in text and "output cosine" in text


def test_a_broken_layer_is_the_worst_one(quantized):
    m, res, held_out = quantized
    good = accuracy_report(m, res.graph_module, held_out, fp32_graph=res.float_module)
    bad_graph = copy.deepcopy(res.graph_module)
    with torch.no_grad():
        bad_graph.conv2[0].weight.mul_(1.05)  # a 5% gain error: ~26 dB at that layer
    bad = accuracy_report(m, bad_graph, held_out, fp32_graph=res.float_module)
    by_node = {e.node: e for e in bad.layers}
    good_by_node = {e.node: e for e in good.layers}
    assert by_node["conv1"].sqnr_db == pytest.approx(good_by_node["conv1"].sqnr_db)  # upstream untouched
    assert by_node["conv2"].sqnr_db < 28 < good_by_node["conv2"].sqnr_db
    assert bad.worst(1)[0].node in ("conv2", "flat", "fc")
    assert bad.cosine < good.cosine


def test_lowered_nodes_pair_through_coverage_metadata(quantized):
    m, res, held_out = quantized
    gm = copy.deepcopy(res.graph_module)
    node = next(n for n in gm.graph.nodes if n.name == "conv2")
    node.name = "q_something_else"  # what a lowering might call its module node
    node.meta["gml_coverage"] = SimpleNamespace(nodes=["conv2"])
    gm.recompile()
    rep = accuracy_report(m, gm, held_out[:1], fp32_graph=res.float_module)
    assert "conv2" in [e.node for e in rep.layers]


def test_labels_give_top1_accuracy_of_both_models(quantized):
    m, res, held_out = quantized
    with torch.no_grad():
        labels = [m(x).argmax(1) for x in held_out]  # fp32 is right by construction
    labels[0][0] = (labels[0][0] + 1) % 10  # ... except on one sample
    rep = accuracy_report(m, res.graph_module, held_out, labels=labels, per_layer=False)
    assert rep.fp32_top1 == pytest.approx(31 / 32)
    assert rep.int8_top1 is not None and rep.accuracy_drop == pytest.approx(100 * (rep.fp32_top1 - rep.int8_top1))
    assert rep.layers == []
    x = torch.cat(held_out)
    assert top1_accuracy(m, x, torch.cat(labels), batch_size=5) == pytest.approx(31 / 32)


def test_bad_inputs_are_input_errors(quantized):
    m, res, _ = quantized
    with pytest.raises(InputError, match="no inputs"):
        accuracy_report(m, res.graph_module, [])

    class Two(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(InputError, match="returns 2 outputs, the fp32 model 1"):
        accuracy_report(nn.Identity(), Two(), [torch.randn(2, 3)])


def test_all_zero_outputs_say_the_cosine_is_undefined():
    zero = nn.Linear(4, 3).eval()
    nn.init.zeros_(zero.weight)
    nn.init.zeros_(zero.bias)  # torchvision's ViT head starts like this
    rep = accuracy_report(zero, copy.deepcopy(zero), [torch.randn(2, 4)], per_layer=False)
    assert math.isnan(rep.cosine)
    assert "output cosine undefined" in rep.summary() and "nan" not in rep.summary()
    assert "the fp32 outputs are all zero" in rep.summary()


def test_int8_outputs_that_vanished_are_explained():
    class Tiny(nn.Module):
        def forward(self, x):
            return x * 1e-9  # a random-init network whose signal vanished

    class Zero(nn.Module):
        def forward(self, x):
            return torch.zeros_like(x)  # what INT8 makes of it: below the smallest scale

    rep = accuracy_report(Tiny(), Zero(), [torch.randn(2, 4)], per_layer=False)
    text = rep.summary()
    assert "the INT8 outputs are all zero while the fp32 ones reach only" in text
    assert rep.int8_max_abs == 0 and 0 < rep.fp32_max_abs < 1e-8
