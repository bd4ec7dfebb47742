"""A query row whose every key is masked, on every attention path of the engine, is what SDPA gives
(torch >= 2.5): zeros for a bool mask (an input or a constant) and for an all ``-inf`` row, the
values' mean for a finite float mask (``torch.finfo.min``, transformers' eager masks: softmax of
equal scores). Before, the engine gave the mean for all of them: a padded batch with an all-padding
sequence came out 3.8 away from eager MiniLM's, and an example holding one made ``gml.optimize``
refuse the engine for the whole model (it disagreed with the Python executor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gml.ir.target import Target
from gml.runtime import compile_engine, native, unavailable_reason
from gml.runtime.options import ATTENTION_ENV
from gml.runtime.target import detect_target
from runtime.helpers import attention_graph

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

TARGETS = {"this CPU": None}
if "avx2" in native.load().fused_attention_kernels():
    TARGETS["avx2"] = Target("avx2")  # the AVX2 fused kernel and gemm:jit primitives, on any CPU with AVX2


def _qkv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 5, 16, generator=g) for _ in range(3)]


def _masks() -> dict[str, torch.Tensor]:
    pad = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]  # item 1: all padding
    rows = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    rows[..., 0] = True
    rows[0, 0, 2] = rows[1, 0, 4] = False  # two fully masked query rows
    minimum = torch.zeros(2, 1, 1, 5).masked_fill(~pad, torch.finfo(torch.float32).min)
    minus_inf = torch.zeros(2, 1, 1, 5).masked_fill(~pad, -torch.inf)
    return {"bool padding": pad, "bool rows": rows, "finfo.min": minimum, "-inf": minus_inf}


def _run_kernels(monkeypatch, gm, inputs, target=None) -> tuple[torch.Tensor, list[str]]:
    """The engine's output and step implementations. A mask holding ``finfo.min`` or ``-inf`` reads
    as non-finite to the segment's input check (its sum overflows), which would send the call to the
    Python executor: the check is skipped to reach the kernels, as a mask computed inside a segment
    (transformers' masks are) does."""
    with torch.no_grad():
        eng = compile_engine(gm, inputs, target=target)
        (seg,) = eng.segments()
        monkeypatch.setattr(seg, "_finite", lambda inputs, key: True)
        (got,) = seg(*inputs)
    return got, [i for p, _ in seg._plans.values() for i in p.step_impls()]


@pytest.mark.parametrize("target", list(TARGETS), ids=list(TARGETS))
@pytest.mark.parametrize("path", ["fused", "primitives"])
@pytest.mark.parametrize("mask", list(_masks()))
def test_a_fully_masked_row_is_what_sdpa_gives(monkeypatch, target, path, mask):
    monkeypatch.setenv(ATTENTION_ENV, path)
    q, k, v = _qkv()
    m = _masks()[mask]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    got, impls = _run_kernels(monkeypatch, attention_graph(4), (q, k, v, m), TARGETS[target])
    assert any(("attention" in i) == (path == "fused") for i in impls), impls
    if mask == "-inf" and path == "primitives":
        # the gap left (rules/attention.py's docstring): oneDNN's softmax of an all -inf row is NaN
        # and nothing in the plan tells a float mask's -inf row from its finite ones
        assert got[1].isnan().all() and torch.equal(got[0], got[0])
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if mask in ("bool padding", "-inf"):
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    if mask == "finfo.min":
        torch.testing.assert_close(got[1], v[1].mean(-2, keepdim=True).expand_as(got[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["fused", "primitives"])
def test_a_constant_bool_mask_with_a_fully_masked_row(monkeypatch, path):
    monkeypatch.setenv(ATTENTION_ENV, path)
    q, k, v = _qkv(2)
    const = torch.ones(5, 5, dtype=torch.bool)
    const[3] = False
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=const)
    got, _ = _run_kernels(monkeypatch, attention_graph(3, mask_buffer=const), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got[..., 3, :].abs().max()) == 0.0


@pytest.mark.skipif(not detect_target().native_bf16, reason="no native bf16 on this target")
@pytest.mark.parametrize("path", ["fused", "primitives"])
def test_bf16_zeros_a_fully_masked_row(monkeypatch, path):
    monkeypatch.setenv(ATTENTION_ENV, path)
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(3))
    m = _masks()["bool padding"]
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m)
    got, _ = _run_kernels(monkeypatch, attention_graph(4), (q, k, v, m))
    assert float((got.float() - want).abs().max()) <= 2.0**-7 * 1.25 * float(v.float().abs().max())
    assert torch.equal(got[1].float(), torch.zeros_like(got[1].float()))


def test_a_float_mask_of_finfo_min_is_a_finite_input():
    """The segment's NaN / Inf check sums each input: a mask of ``torch.finfo.min`` values overflows
    its sum, and read as non-finite it sent every padded call of a T5 encoder (2 of its 5 segments)
    or an eager-attention BERT to the Python executor. A sum that is not finite is now checked
    element by element; a real Inf or NaN is still found."""
    from gml.kernels.fp32 import all_finite
    from gml.runtime.compile import _finite_inputs

    mask = _masks()["finfo.min"]
    assert not torch.isfinite(mask.sum()) and all_finite(mask)
    assert _finite_inputs([*_qkv(), mask])
    assert not all_finite(_masks()["-inf"]) and not all_finite(torch.tensor([1.0, float("nan")]))
