"""torch's own transformer modules on the engine: ``nn.TransformerEncoder`` / ``nn.MultiheadAttention``
split their packed in-projection with ``unflatten`` (a view the engine now takes) and turn a bool
``src_key_padding_mask`` into a float mask of ``-inf`` before the attention (an input the segment
now checks for NaN only). Before, the attention and the views around it ran in torch, and a padded
call ran the whole segment on the Python executor: 1.5-2.5x slower than eager. An encoder given a
mask and no ``is_causal`` compares the mask's values with a causal one (export could not trace it:
the whole encoder was one torch node); a decoder's cross-attention splits its packed weight
(its linears stayed in torch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.runtime import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(x, mask=mask, src_key_padding_mask=pad, is_causal=False)


def _inputs(length: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(2, length, dtype=torch.bool)
    pad[1, length - 3 :] = True
    return x, nn.Transformer.generate_square_subsequent_mask(length), pad


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_padded_transformer_encoder_runs_its_plan(precision: str) -> None:
    torch.manual_seed(0)
    model = Encoder().eval()
    x, mask, pad = _inputs()
    res = gml.optimize(model, (x, mask, pad), precision=precision)
    eng = res.engine
    assert eng is not None, res.runtime
    (seg,) = eng.segments()
    assert seg.mask_only, "the float masks are inputs of the segment read only as masks"
    lines = str(res.runtime).splitlines()
    in_torch = [r for r in lines if r.strip().startswith("torch:") and ("unflatten" in r or "attention" in r)]
    assert in_torch == [], in_torch
    ran: list[int] = []
    seg.reference.register_forward_pre_hook(lambda mod, args: ran.append(1))
    for length in (10, 7):  # the example's shape and another
        x2, mask2, pad2 = _inputs(length)
        with torch.enable_grad():  # eager's slow path (SDPA), not its fused fast path
            want = model(x2, mask2, pad2).detach()
        with torch.no_grad():
            got = eng(x2, mask2, pad2)
        tol = 1e-4 if precision == "fp32" else 0.05
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert ran == [], "a call ran on the Python executor"
    assert not seg._report.shape_fallbacks


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder().enc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


class MaskOnly(Plain):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.enc(x, mask=mask)  # is_causal left out: torch sniffs the mask's values


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.dec = nn.TransformerDecoder(layer, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.dec(x, memory)


def test_a_decoder_given_a_view_with_gaps_as_its_example() -> None:
    """``memory = x[:, :6]`` (not dense) as the example: exported on it, torch.export kept a guard
    that the input is not dense and the graph refused dense inputs (the decoder stayed one torch
    node); exported on a dense copy, it runs either."""
    torch.manual_seed(0)
    model = Decoder().eval()
    x, _, _ = _inputs()
    memory = x[:, :6]
    assert not memory.is_contiguous()
    res = gml.optimize(model, (x, memory))
    assert res.engine is not None and len(res.engine.segments()) == 1, res.runtime
    for m in (memory, memory.contiguous(), torch.randn(2, 4, 32)):
        with torch.enable_grad():
            want = model(x, m).detach()
        with torch.no_grad():
            torch.testing.assert_close(res.engine(x, m), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["plain", "mask only", "decoder"])
def test_torch_transformer_modules_are_one_engine_segment(form: str) -> None:
    torch.manual_seed(0)
    x, mask, _ = _inputs()
    model, args = {
        "plain": (Plain(), (x,)),
        "mask only": (MaskOnly(), (x, mask)),
        "decoder": (Decoder(), (x, x[:, :6].contiguous())),
    }[form]
    model.eval()
    detect = nn.modules.transformer._detect_is_causal_mask
    res = gml.optimize(model, args)
    assert nn.modules.transformer._detect_is_causal_mask is detect  # torch's own, again after the export
    assert res.engine is not None, res.runtime
    assert len(res.engine.segments()) == 1, res.runtime
    kept = [r.strip() for r in str(res.runtime).splitlines() if r.strip().startswith("torch:")]
    assert not [r for r in kept if any(w in r for w in ("linear", "attention", "unflatten", "Transformer"))], kept
    with torch.enable_grad():
        want = model(*args).detach()
    with torch.no_grad():
        torch.testing.assert_close(res.engine(*args), want, rtol=1e-4, atol=1e-4)


def test_an_int8_encoder_takes_an_infinite_mask_and_refuses_nan() -> None:
    """An INT8 model refuses NaN / Inf inputs (INT8 cannot represent them), except ``-inf`` in an
    input read only as an attention mask (never quantized): a causal mask of ``-inf`` is a value
    there; a NaN in it is still refused, with the input named."""
    from gml.errors import InputError

    torch.manual_seed(0)
    model = MaskOnly().eval()
    x, mask, _ = _inputs()
    calib = [(torch.randn(2, 10, 32), mask) for _ in range(3)]
    q = gml.quantize(model, calib, example_inputs=(x, mask), cost_policy="off")
    assert q.precision == "int8"
    with torch.enable_grad():
        want = model(x, mask).detach()
    with torch.no_grad():
        got = q.executable(x, mask)
        assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)) > 0.999
        bad = mask.clone()
        bad[0, 0] = torch.nan
        with pytest.raises(InputError, match="input 1 holds 1 NaN"):
            q.executable(x, bad)
        x_inf = x.clone()
        x_inf[0, 0, 0] = torch.inf
        with pytest.raises(InputError, match="input 0 holds 0 NaN and 1 Inf"):
            q.executable(x_inf, mask)
