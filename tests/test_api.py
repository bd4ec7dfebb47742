from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from assets.models import SmallCNN
from gml.errors import GMLError, UnsupportedError
from gml.passes.fold_bn import FoldBatchNorm


def test_optimize_folds_bn_and_keeps_numerics():
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    res = gml.optimize(model, x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in res.module.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())  # caller's model untouched
    assert res.max_abs_err < 1e-4
    assert res.report.record("fold_bn").matches == 2
    assert not res.report.rolled_back
    torch.testing.assert_close(res.module(x), model(x), atol=1e-4, rtol=1e-4)


def test_optimize_with_explicit_passes():
    res = gml.optimize(SmallCNN().eval(), torch.randn(1, 3, 8, 8), passes=[FoldBatchNorm()])
    assert [r.name for r in res.report.records] == ["fold_bn"]


def test_optimize_refuses_training_mode():
    with pytest.raises(UnsupportedError, match="training mode"):
        gml.optimize(SmallCNN(), torch.randn(1, 3, 8, 8))


def test_unknown_pass_name():
    from gml.passes.pipeline import passes_by_name

    with pytest.raises(GMLError, match="Unknown pass"):
        passes_by_name(["fold_bn", "nope"])


def test_quantize_lowers_every_op_of_a_residual_cnn():
    from gml.ir import library

    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    res = gml.quantize(model, [(torch.randn(2, 3, 16, 16),) for _ in range(4)], example_inputs=x)
    counts = res.coverage.counts()
    assert counts["qconv"] == 1 and counts["qconv_add"] == 1 and counts["qlinear"] == 1
    assert res.coverage.kept_fp32 == []
    assert res.accuracy.cosine > 0.999
    kinds = {library.gml_op_name(n) for n in res.module.graph.nodes}
    assert {"quantize", "qconv", "qconv_add", "qlinear"} <= kinds
    assert not any(n.op == "call_module" for n in res.module.graph.nodes)  # gml ops, no modules
    with torch.no_grad():
        out, ref = res.module(x), model(x)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert float(cos) > 0.999


def test_quantize_needs_example_inputs_for_generated_calibration():
    from gml.errors import InputError

    with pytest.raises(InputError, match="example_inputs are needed"):
        gml.quantize(SmallCNN().eval(), 4)
    with pytest.raises(InputError, match="calib_data is empty"):
        gml.quantize(SmallCNN().eval(), [])


def test_a_model_that_writes_its_input_is_compared_on_fresh_copies():
    """`x.add_(1)` in forward(): eager and optimized runs must each see the caller's values, or the
    reported error is the second write, not the optimization (it read 2.47)."""

    class Bump(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x.add_(1)
            return self.fc(x)

    x = torch.randn(2, 4)
    before = x.clone()
    res = gml.optimize(Bump().eval(), (x,))
    # the error of result.executable: the engine's GEMM rounds differently from eager's (ulps), a
    # second write of the input would show as ~1
    assert res.max_abs_err < 1e-5
    assert torch.equal(x, before)  # the caller's tensor is not written by the checks either


def test_optimize_reports_the_error_against_the_output_scale():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 32, 32)
    res = gml.optimize(model, (x,))
    with torch.no_grad():
        assert res.max_abs_ref == pytest.approx(float(model(x).abs().max()))
    assert res.rel_err == pytest.approx(res.max_abs_err / res.max_abs_ref)
