from __future__ import annotations

import torch
from torch import nn

from assets.models import MLP, SmallCNN
from gml.passes.base import GraphPass, PassResult
from gml.verify import verify_pass


class FoldIdentityScale(GraphPass):
    """Correct rewrite: multiply fc1 weights by 2 and fc2 weights by 0.5 around a ReLU (positive scale)."""

    name = "rescale"

    def call(self, gm):
        gm.fc1.weight.data.mul_(2)
        gm.fc1.bias.data.mul_(2)
        gm.fc2.weight.data.mul_(0.5)
        return PassResult(gm, True, matches=1)


class WrongSign(GraphPass):
    """Wrong rewrite: flips the sign of fc2's bias."""

    name = "wrong_sign"

    def call(self, gm):
        gm.fc2.bias.data.neg_()
        return PassResult(gm, True, matches=1)


class GrowParams(GraphPass):
    name = "grow"

    def call(self, gm):
        gm.add_submodule("unused", nn.Linear(64, 64))
        return PassResult(gm, True, matches=1)


class BreakGrad(GraphPass):
    """Same forward values, but the backward path is cut (detach): gradients differ."""

    name = "break_grad"

    def call(self, gm):
        fc1 = next(n for n in gm.graph.nodes if n.target == "fc1")
        with gm.graph.inserting_after(fc1):
            det = gm.graph.call_method("detach", (fc1,))
        fc1.replace_all_uses_with(det)
        det.args = (fc1,)
        gm.recompile()
        return PassResult(gm, True, matches=1)


X = (torch.randn(4, 32),)


def test_correct_rewrite_passes_all_checks():
    model = MLP().eval()
    before = model.fc1.weight.clone()
    res = verify_pass(model, FoldIdentityScale(), X, n_inputs=5)
    assert res.passed, res.summary()
    assert res.numerics_ok and res.lint_ok and res.grad_ok
    assert res.max_abs_err < 1e-5
    assert res.n_inputs == 5 and res.matches == 1
    assert res.params_before == res.params_after == 32 * 64 + 64 + 64 * 8 + 8
    assert torch.equal(model.fc1.weight, before)  # the user's model is untouched


def test_wrong_rewrite_is_detected():
    res = verify_pass(MLP().eval(), WrongSign(), X)
    assert not res.passed
    assert not res.numerics_ok
    assert res.max_abs_err > 1e-3
    assert "exceeds" in res.numerics_detail


def test_parameter_growth_is_detected():
    res = verify_pass(MLP().eval(), GrowParams(), X)
    assert res.numerics_ok and not res.params_ok and not res.passed
    assert res.params_after - res.params_before == 64 * 64 + 64


def test_gradient_difference_is_detected():
    res = verify_pass(MLP().eval(), BreakGrad(), X)
    assert res.numerics_ok
    assert res.grad_ok is False and not res.passed


def test_noop_on_conv_model():
    class Noop(GraphPass):
        name = "noop"

        def call(self, gm):
            return PassResult(gm, False)

    res = verify_pass(SmallCNN().eval(), Noop(), (torch.randn(1, 3, 16, 16),), n_inputs=2)
    assert res.passed and res.max_abs_err == 0.0
