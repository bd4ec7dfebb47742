"""Wrong inputs are an InputError on every runtime a result can run on: the engine, the Python
executor (``runtime="torch"``, or where the runtime choice picks torch) and a loaded file's graph —
never torch's own error (``mat1 and mat2 shapes cannot be multiplied``, torch.export's
``Expected input at *args[0].shape[2]``, a pytree ``ValueError``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.errors import InputError
from gml.io import load
from gml.runtime import unavailable_reason


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).eval()


X = torch.randn(2, 3, 8, 8)

#: (inputs, what the message says)
BAD = [
    ((torch.randn(2, 4, 8, 8),), r"with 3 channels \(dim 1\)"),
    ((torch.randn(2, 3, 9, 8),), r"cannot run on inputs of shape \(2, 3, 9, 8\)"),  # the linear's width
    ((X, X), r"takes 1 input\(s\), got 2"),
    ((X.double(),), r"torch.float64 tensor .* expects a torch.float32"),
    ((torch.randn(3, 8, 8),), r"of shape \(3, 8, 8\); the model expects .* rank 4"),
    ((), r"takes 1 input\(s\), got 0"),
]


def _runners(tmp_path) -> dict[str, object]:
    fresh_torch = gml.optimize(_model(), (X,), runtime="torch")
    int8_torch = gml.quantize(_model(), [(X,)] * 2, runtime="torch", per_layer=False)
    path = tmp_path / "m.pt2"
    fresh_torch.save(str(path))
    runners = {
        "fp32 executor": fresh_torch.executable,
        "int8 executor": int8_torch.executable,
        "loaded, runtime=torch": load(path, runtime="torch"),
    }
    if unavailable_reason() is None:
        runners["fp32 engine"] = gml.optimize(_model(), (X,)).executable
        runners["loaded engine"] = load(path)
    return runners


def test_wrong_inputs_are_input_errors_on_every_runtime(tmp_path) -> None:
    for name, run in _runners(tmp_path).items():
        with torch.no_grad():
            assert run(X).shape == (2, 4), name
            for inputs, message in BAD:
                with pytest.raises(InputError, match=message):
                    run(*inputs)
            assert run(X).shape == (2, 4), name  # a refused call leaves the model usable


def test_a_loaded_models_input_guard_speaks_first_on_the_torch_path(tmp_path) -> None:
    """A graph the capture specialised to a height keeps the capture's message on the torch path of a
    loaded file: it speaks before torch.export's constraint check (which would name ``*args[0].shape[2]``)."""
    from assets.timm_like import ShapeCheckNet

    torch.manual_seed(0)
    model, x = ShapeCheckNet().eval(), torch.randn(1, 3, 28, 28)
    gml.optimize(model, (x,), runtime="torch").save(str(tmp_path / "s.pt2"))
    loaded = load(tmp_path / "s.pt2", runtime="torch")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-4)
        with pytest.raises(InputError, match=r"captured for \(\*, 3, 28, 28\)"):
            loaded(torch.randn(1, 3, 27, 27))
