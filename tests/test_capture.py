from __future__ import annotations

import pytest
import torch
from torch import nn

from assets.models import DataDependent, SmallCNN
from gml.capture import capture, check_eval_mode, propagate_shapes, trace
from gml.errors import InputError, TraceFailure, UnsupportedError


def test_untraceable_model_names_submodule_line_and_remedy():
    with pytest.raises(TraceFailure) as info:
        trace(DataDependent())
    msg = str(info.value)
    assert "data-dependent control flow" in msg
    assert "models.py:" in msg and "in forward()" in msg
    assert "`if x.sum() > 0:`" in msg
    assert "inside submodule 'inner'" in msg
    assert "--leaf inner" in msg
    assert "Proxy" not in msg and "Traceback" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_leaf_module_makes_it_traceable():
    model = DataDependent().eval()
    gm = trace(model, leaf_modules=["inner"])
    x = torch.ones(1, 8)
    torch.testing.assert_close(gm(x), model(x))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["inner", "fc"]


def test_capture_fills_shapes():
    gm = capture(SmallCNN().eval(), (torch.randn(2, 3, 32, 32),))
    metas = {n.name: n.meta["tensor_meta"] for n in gm.graph.nodes if "tensor_meta" in n.meta}
    assert tuple(metas["conv1"].shape) == (2, 16, 32, 32)
    assert tuple(metas["fc"].shape) == (2, 10)


def test_wrong_input_shape_names_the_node():
    gm = trace(SmallCNN().eval())
    with pytest.raises(InputError) as info:
        propagate_shapes(gm, (torch.randn(1, 4, 32, 32),))
    msg = str(info.value)
    assert "at node 'conv1'" in msg and "(1, 4, 32, 32):float32" in msg
    assert "--input-shape" in msg


def test_too_many_inputs():
    with pytest.raises(InputError, match="2 example inputs given, but the model takes 1"):
        capture(SmallCNN().eval(), (torch.randn(1, 3, 8, 8), torch.randn(1)))


def test_training_mode_is_refused_with_hint():
    with pytest.raises(UnsupportedError, match=r"(?s)training mode .*call model.eval\(\)"):
        check_eval_mode(nn.Sequential(nn.BatchNorm2d(3)))
    check_eval_mode(nn.Sequential(nn.BatchNorm2d(3)).eval())


def test_top_level_iteration_suggests_a_submodule():
    from assets.models import PerImage

    with pytest.raises(TraceFailure) as info:
        trace(PerImage())
    msg = " ".join(str(info.value).split())
    assert "iteration over, or len() of, a traced tensor" in msg
    assert "for img in images" in msg
    assert "--submodule NAME" in msg and "its children: backbone" in msg


def test_a_wrapped_function_may_edit_its_constant_list_arguments():
    """fx stores constant lists as immutable_list; the generated code rebuilds them per call, and
    shape propagation (an Interpreter) must too, or Swin3D fails to capture."""
    import gml
    from assets.models import EditsListArgument

    model, x = EditsListArgument().eval(), torch.randn(1, 2, 4, 4)
    gm = capture(model, (x,))
    torch.testing.assert_close(gm(x), model(x))
    q = gml.quantize(model, [x, x * 2], example_inputs=x)  # the accuracy report interprets the graph too
    assert q.accuracy.cosine > 0.999


def test_renamed_torch_layers_stay_leaves_and_become_the_torch_class():
    """torchvision's Conv3DSimple subclasses nn.Conv3d and only adds a constructor: fx used to trace
    through it, leaving torch.conv3d on get_attr weights that no pass folds BN into or quantizes."""
    from gml.ir.layers import torch_layer_base

    class Renamed(nn.Conv2d):
        def __init__(self) -> None:
            super().__init__(2, 4, 3, padding=1)

        @staticmethod
        def describe() -> str:  # a new name is fine
            return "3x3"

    class Doubled(nn.Conv2d):
        def _conv_forward(self, x, w, b):  # overrides what forward calls: must stay itself
            return 2 * super()._conv_forward(x, w, b)

    assert torch_layer_base(Renamed()) is nn.Conv2d
    assert torch_layer_base(Doubled(2, 4, 3)) is None and torch_layer_base(nn.Conv2d(2, 4, 3)) is None
    model = nn.Sequential(Renamed(), nn.BatchNorm2d(4), nn.Sequential(Doubled(4, 4, 1))).eval()
    x = torch.randn(1, 2, 5, 5)
    gm = capture(model, (x,))
    kinds = [(n.op, type(gm.get_submodule(n.target)) if n.op == "call_module" else n.target) for n in gm.graph.nodes]
    assert ("call_module", nn.Conv2d) in kinds  # Renamed: a leaf, now a plain nn.Conv2d
    assert not any(op == "call_module" and t is Doubled for op, t in kinds)  # traced through as before
    assert type(model[0]) is Renamed  # the caller's model is untouched
    torch.testing.assert_close(gm(x), model(x))


class _DeviceCheck(nn.Module):
    """timm's EfficientViT (efficientvit_mit.py): ``if v.device.type != 'meta':`` around a branch,
    and a dtype read for a cast; both are facts of the example input, not data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        v = self.lin(x)
        if v.device.type != "meta" and not is_causal:
            v = v.relu()
        return v.to(x.dtype) * 2


def test_capture_answers_device_and_dtype_from_the_example():
    model, x = _DeviceCheck().eval(), torch.randn(2, 4)
    gm = capture(model, (x,))
    torch.testing.assert_close(gm(x), model(x))
    assert "relu" in gm.code


def test_a_dict_subclass_output_keeps_its_type() -> None:
    """fx writes a returned dict as a plain dict; a ModelOutput (HF MPNet traces with fx) lost its
    attributes. The capture takes torch.export then, which keeps the output structure."""
    from collections import OrderedDict

    from gml.capture_export import capture_info

    class Out(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> OrderedDict:
            return OrderedDict(y=self.fc(x), z=x * 2)

    model, x = Out().eval(), torch.randn(2, 4)
    gm = capture(model, (x,))
    out = gm(x)
    assert type(out) is OrderedDict and list(out) == ["y", "z"]
    assert "returns a plain dict where Out returns a OrderedDict" in capture_info(gm).reason
    torch.testing.assert_close(out["y"], model(x)["y"])


class _SkippedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache=None, mask=None):
        if cache is not None:
            x = x + cache
        if mask is not None:
            x = x * mask
        return self.lin(x)


def test_none_in_the_example_is_traced_as_none():
    """``(x, None, mask)``: the None parameter is traced as None (a placeholder took the
    ``cache is not None`` branch: "Example inputs ... do not fit the model at node 'add'"); the
    model then takes None there and refuses a tensor."""
    import gml
    from gml.errors import InputError

    model, x, mask = _SkippedParameter().eval(), torch.randn(2, 8), torch.rand(2, 8)
    for runtime in ("engine", "torch"):
        result = gml.optimize(model, (x, None, mask), runtime=runtime)
        with torch.no_grad():
            torch.testing.assert_close(result.executable(x, None, mask), model(x, None, mask))
        with pytest.raises(InputError, match="None"):  # the engine's check, or fx's guard as an InputError
            result.executable(x, x, mask)
