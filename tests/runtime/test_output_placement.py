"""Issue #24 item 4: a segment output that is a view of a bigger value (a select of a LayerNorm's first
token, as HF Dinov2's pooler output) must not get the whole value placed in the caller's smaller
output tensor. It did: the LayerNorm wrote past the output tensor (heap corruption: a segfault in
gml.optimize, "double free or corruption" in gml.quantize). `make sanitize` runs this file under
AddressSanitizer, which reports the overflow directly."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.runtime import compile_engine, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


class NormThenFirstToken(nn.Module):
    """add -> LayerNorm -> (the LayerNorm's first token, the whole LayerNorm): Dinov2's last segment."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, y):
        h = self.norm(x + y)
        return h[:, 0], h.contiguous()


@pytest.mark.parametrize("batch", [1, 3])
def test_first_token_of_a_layer_norm_is_copied_out_not_placed(batch):
    torch.manual_seed(0)
    gm = fx.symbolic_trace(NormThenFirstToken().eval())
    x, y = torch.randn(batch, 17, 32), torch.randn(batch, 17, 32)
    engine = compile_engine(gm, [x, y])
    assert engine.report.engine_nodes > 0, str(engine.report)
    for _ in range(3):  # the overflow corrupted the heap; later calls crashed
        with torch.no_grad():
            first, whole = engine(x, y)
            ref_first, ref_whole = gm(x, y)
        torch.testing.assert_close(first, ref_first, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(whole, ref_whole, atol=1e-5, rtol=1e-5)


def test_hf_dinov2_runs_on_the_engine():
    transformers = pytest.importorskip("transformers")
    import gml

    cfg = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    model = transformers.Dinov2Model(cfg).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
    res = gml.optimize(model, x)
    with torch.no_grad():
        for _ in range(3):
            out = res.executable(x)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)
