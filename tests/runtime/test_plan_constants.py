"""Model constants read inside an engine plan, and shape checks between its steps.

* A conv plus a constant of its output's shape (visformer's position embedding after the stem and
  each stage's patch embed): the conv's in-place ``sum`` must not accumulate into the plan's copy
  of the constant (that copy is read again on the next call), so the constant is copied first, into
  the layout the conv writes (NHWC for fp32), never into its own NCHW one.
* A matmul reading a transposed or broadcast view of a constant (botnet26t's relative-position
  tables, ``q @ self.height_rel.transpose(-1, -2)``): the view is a plan constant of its own.
* ``torch._assert`` on sizes between two steps (visformer's stages check ``H == self.img_size``):
  it held when the plan was made for these shapes, so it is no step; before, each one cut the plan.

Before (AMD EPYC Zen 4): visformer_tiny fell back to torch for three segments' shapes ("a view of a
plan constant") and ran 4 segments; botnet26t_256 6 shapes, 13 segments.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.errors import InputError
from gml.runtime import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


class ConvPlusPosition(nn.Module):
    """A stem conv plus a learned position term of the conv's output shape, then a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.pos = nn.Parameter(torch.randn(1, 16, 8, 8))
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.stem(x) + self.pos))


class MatmulOfATable(nn.Module):
    """A conv, then its pixels times a transposed constant table (a relative-position logit)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 1)
        self.table = nn.Parameter(torch.randn(24, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.conv(x).flatten(2).transpose(1, 2)  # [B, HW, 16]
        return torch.relu(q @ self.table.transpose(-1, -2))


class CheckedStages(nn.Module):
    """Two convs with a size check between them, as timm's patch embeds write it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        torch._assert(x.shape[2] == 8, f"Input height ({x.shape[2]}) doesn't match model (8).")
        return self.b(x)


def _plan(model: nn.Module, x: torch.Tensor):
    res = gml.optimize(model, x, runtime="engine")
    assert not res.runtime.shape_fallbacks, res.runtime.shape_fallbacks
    assert len(res.engine.segments()) == 1, str(res.runtime)
    return res


def test_a_conv_plus_a_constant_leaves_the_constant_as_it_was():
    torch.manual_seed(0)
    model, x = ConvPlusPosition().eval(), torch.randn(1, 3, 16, 16)
    res = _plan(model, x)
    with torch.no_grad():
        want = model(x)
        for _ in range(3):  # a sum into the plan's copy of pos would grow by stem(x) every call
            torch.testing.assert_close(res.executable(x), want, rtol=1e-5, atol=1e-5)
        y = torch.randn(1, 3, 16, 16)
        torch.testing.assert_close(res.executable(y), model(y), rtol=1e-5, atol=1e-5)


def test_a_conv_plus_a_constant_writes_no_plain_layout():
    """The constant's copy is NHWC, the fp32 conv's own layout. Copied as NCHW, the conv wrote a
    plain destination: oneDNN's GEMM-based conv (``x64:gemm:jit``) behind a ``simple:any`` copy."""
    torch.manual_seed(0)
    res = _plan(ConvPlusPosition().eval(), torch.randn(1, 3, 16, 16))
    impls = [impl for _, impl in res.engine.step_impls() if not impl.startswith("gml:")]  # GML's Winograd
    slow = [impl for impl in impls if "gemm" in impl or impl.startswith(("simple:", "ref:"))]
    assert not slow, list(res.engine.step_impls())


def test_a_matmul_reads_a_view_of_a_constant():
    torch.manual_seed(0)
    model, x = MatmulOfATable().eval(), torch.randn(2, 8, 6, 5)
    res = _plan(model, x)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_size_check_between_steps_is_no_step():
    torch.manual_seed(0)
    model, x = CheckedStages().eval(), torch.randn(1, 3, 16, 16)
    res = _plan(model, x)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_failing_size_check_is_the_users_error_with_the_models_message():
    """Another shape makes another plan; its check runs while the plan is made, and fails as
    eager's would, with the model's message (not an internal error)."""
    torch.manual_seed(0)
    model = CheckedStages().eval()
    res = _plan(model, torch.randn(1, 3, 16, 16))
    with pytest.raises(InputError, match="doesn't match model"):
        res.executable(torch.randn(1, 3, 20, 20))
