"""Inputs given by name: a dict of example inputs / calibration batches (a tokenizer's output) and
keyword calls of the model GML returns (``model(**batch)``), on the engine and on the executor.

Before, a dict as ``example_inputs`` failed in capture with HF's own ``AttributeError`` inside
both tracers, dict calibration batches were refused, and ``result.executable(input_ids=...)`` was a
raw ``TypeError`` from ``EngineModule.forward``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.errors import InputError
from gml.optimizing import forward_inputs


class TwoInputs(nn.Module):
    """``forward(x, bias=None, scale=None, flag=True)``: two optional tensors, one non-None default."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, bias=None, scale=None, flag=True):
        y = torch.relu(self.conv(x))
        if bias is not None:
            y = y + bias
        if scale is not None:
            y = y * scale
        return self.fc(y.mean((2, 3)))


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2, 3, 16, 16, generator=g), "scale": torch.rand(1, 8, 1, 1, generator=g) + 0.5}


def test_forward_inputs_places_names_and_leaves_optional_gaps_none():
    m, named = TwoInputs().eval(), _inputs()
    x, bias, scale = forward_inputs(m, named)
    assert x is named["x"] and bias is None and scale is named["scale"]
    assert forward_inputs(m, {"x": named["x"]}) == (named["x"],)


@pytest.mark.parametrize(
    ("named", "match"),
    [
        ({"x": 1, "nope": 2}, "takes no input 'nope'"),
        ({"scale": 1}, "input 'x' .*required.* was not given"),
        ({"x": 1, "flag": False, "missing": 1}, "takes no input 'missing'"),
    ],
)
def test_forward_inputs_refuses_what_it_cannot_place(named, match):
    with pytest.raises(InputError, match=match):
        forward_inputs(TwoInputs().eval(), named)


def test_a_left_out_input_whose_default_is_not_none_is_refused():
    class Flagged(nn.Module):
        def forward(self, x, flag=True, y=None):
            return x if y is None else x + y

    with pytest.raises(InputError, match=r"'flag' .*defaults to True.*was not given") as e:
        forward_inputs(Flagged(), {"x": torch.ones(1), "y": torch.ones(1)})
    assert "give 'flag' too" in e.value.hint


@pytest.mark.parametrize("wrapped", [False, True], ids=["dict", "tuple-of-dict"])
def test_optimize_takes_example_inputs_by_name_and_the_result_is_called_by_name(wrapped):
    m, named = TwoInputs().eval(), _inputs()
    result = gml.optimize(m, (named,) if wrapped else named)
    with torch.no_grad():
        want = m(**named)
        by_name = result.executable(**named)
        positional = result.executable(named["x"], None, named["scale"])
        mixed = result.executable(named["x"], scale=named["scale"])
    for got in (by_name, positional, mixed):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_python_executor_takes_inputs_by_name_too():
    m, named = TwoInputs().eval(), _inputs()
    result = gml.optimize(m, named, runtime="torch")
    assert result.engine is None
    with torch.no_grad():
        torch.testing.assert_close(result.executable(**named), m(**named), rtol=1e-4, atol=1e-4)


def test_wrong_names_at_call_time_are_input_errors():
    m, named = TwoInputs().eval(), _inputs()
    exe = gml.optimize(m, named).executable
    with pytest.raises(InputError, match="takes no input named 'scales'") as e:
        exe(x=named["x"], scales=named["scale"])
    assert "x, bias, scale" in e.value.hint
    with pytest.raises(InputError, match="'x' was given both by position and by name"):
        exe(named["x"], x=named["x"], scale=named["scale"])


def test_quantize_takes_calibration_batches_by_name():
    m = TwoInputs().eval()
    batches = [_inputs(seed) for seed in range(4)]
    q = gml.quantize(m, batches, cost_policy="off")
    assert q.precision == "int8", q.precision_reason
    with torch.no_grad():
        want, got = m(**batches[0]), q.executable(**batches[0])
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


def test_quantize_reads_a_generator_of_dict_batches():
    m = TwoInputs().eval()
    q = gml.quantize(m, (_inputs(seed) for seed in range(3)), example_inputs=_inputs(), cost_policy="off")
    assert q.precision == "int8", q.precision_reason


def test_a_none_input_does_not_break_later_captures_in_the_process():
    """fx guards an input traced as None with ``_assert_is_none``, a ``torch.fx.wrap``-ed function;
    torch.ao's re-trace in ``gml.quantize`` left a ``wrap`` registration under a name its globals do
    not hold, and every later capture in the process failed with a ``KeyError`` on it. Capture drops
    the guard (the input checks keep a None input None)."""
    m, named = TwoInputs().eval(), _inputs()
    batches = [(named["x"], None, named["scale"])] * 2
    for _ in range(2):
        assert gml.quantize(m, batches, cost_policy="off").precision == "int8"
    result = gml.optimize(m, batches[0])
    with pytest.raises(InputError, match="was None in the example"):
        result.executable(named["x"], named["scale"], named["scale"])


class NoneBetween(nn.Module):
    """``forward(x, bias=None, scale=None)``: given as ``(x, None, scale)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x, bias=None, scale=None):
        y = torch.relu(self.conv(x))
        return y if scale is None else y * scale


@pytest.mark.parametrize("model", [NoneBetween, TwoInputs], ids=["none-between", "omitted-flag"])
def test_an_int8_model_given_a_none_input_saves_loads_and_is_called_by_name(tmp_path, model):
    """The INT8 lowering drops the None input's metadata and its guard: the saved program's
    stand-in inputs give an input no node reads None (it was "input 'bias_1' has no shape
    metadata"). ``flag=True``, left out of the example, is no input of the graph at all (its
    equality guard kept it read: "input 'flag_1' has no shape metadata")."""
    m, named = model().eval(), _inputs()
    q = gml.quantize(m, [named] * 3, cost_policy="off")
    assert q.precision == "int8", q.precision_reason
    q.save(str(tmp_path / "m.pt2"))
    loaded = gml.load(str(tmp_path / "m.pt2"))
    with torch.no_grad():
        want = q.executable(**named)
        torch.testing.assert_close(loaded(**named), want)
        torch.testing.assert_close(loaded(named["x"], None, named["scale"]), want)
