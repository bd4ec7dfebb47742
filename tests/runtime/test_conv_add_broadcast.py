"""A float conv + add whose addend broadcasts over the output (visformer's position embedding,
batch 1, added to its patch embedding at a larger batch). oneDNN's ``sum`` post-op adds a tensor of
the destination's shape in place: the plan read past the batch-1 addend, and every image after the
first came out wrong, differently on each run. The engine now runs the conv, then a broadcasting
binary add (``_conv_then_broadcast_add``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gml.ir.values import PostOp
from gml.kernels import bf16 as kb
from gml.kernels.fp32 import FusedConv, FusedConvAdd
from gml.runtime import unavailable_reason

from .helpers import graph_of, run_both

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _conv(cin: int, cout: int, k: int, **kw) -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(cin, cout, k, **kw).eval()


def _graph(relu: bool, then_conv: bool, bf16: bool = False):
    """``[conv1x1](relu?(patchify(x) + pos))``, pos an input of batch 1."""
    add = FusedConvAdd.from_conv(_conv(3, 8, 4, stride=4), relu=relu, inplace=False)
    mods: list[nn.Module] = [add]
    if then_conv:
        mods.append(FusedConv.from_conv(_conv(8, 16, 1), PostOp("swish")))
    if bf16:
        mods = [kb.Bf16ConvAdd.from_fused(add)] + [kb.Bf16Conv.from_fused(m) for m in mods[1:]]
    wiring = [(0, 1)] + [(2,)] * (len(mods) - 1)
    return graph_of(*mods, n_inputs=2, wiring=wiring)


@pytest.mark.parametrize("then_conv", [False, True], ids=["output", "then-a-conv"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("batch", [2, 3])
def test_fp32_conv_add_with_a_batch_1_addend(batch: int, relu: bool, then_conv: bool) -> None:
    gm = _graph(relu, then_conv)
    x, pos = torch.randn(batch, 3, 32, 32), torch.randn(1, 8, 8, 8)
    ref, eng, got = run_both(gm, x, pos)
    assert eng.report.path == "engine" and not eng.report.shape_fallbacks, str(eng.report)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    again = eng(x, pos)  # the same numbers on every call (the bug read bytes nobody wrote)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    impls = [impl for _, impl in eng.step_impls()]
    assert any("binary" in impl or impl.startswith("jit:uni") for impl in impls), impls


@pytest.mark.skipif(not kb.bf16_available(), reason=f"no native bf16: {kb.bf16_unavailable_reason()}")
@pytest.mark.parametrize("relu", [False, True])
def test_bf16_conv_add_with_a_batch_1_addend(relu: bool) -> None:
    gm = _graph(relu, then_conv=True, bf16=True)
    x = torch.randn(3, 3, 32, 32)
    pos = torch.randn(1, 8, 8, 8).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    ref, eng, got = run_both(gm, x, pos)
    assert eng.report.path == "engine" and not eng.report.shape_fallbacks, str(eng.report)
    err = float((got.float() - ref.float()).abs().max())
    assert err <= 2.0**-7 * float(ref.float().abs().max()), err


class _PatchEmbed(nn.Module):
    """A ViT-style stem: ``conv1x1(patchify(x) + pos)`` with ``pos`` a parameter of batch 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Conv2d(3, 8, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 8, 8, 8))
        self.mlp = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.proj(x) + self.pos).relu()


def test_a_model_compiled_at_batch_1_is_right_at_other_batches() -> None:
    """End to end as the zoo found it: optimized with a batch-1 example, called at batches 2 and 3."""
    import gml

    model = _PatchEmbed().eval()
    res = gml.optimize(model, torch.randn(1, 3, 32, 32), runtime="engine")
    with torch.no_grad():
        for batch in (2, 3, 1, 2):
            x = torch.randn(batch, 3, 32, 32)
            torch.testing.assert_close(res.executable(x), model(x), rtol=1e-4, atol=1e-5)
    assert not res.runtime.shape_fallbacks, str(res.runtime)
