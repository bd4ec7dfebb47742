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
    """The engine's output and step implementations, the segment's input check skipped (a mask
    computed inside a segment, as transformers' are, reaches the kernels without it; the check of a
    mask input is :func:`test_an_infinite_mask_input_runs_the_plan_and_a_nan_one_does_not`'s)."""
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
    # (the primitive path's -inf row: oneDNN's softmax of it is NaN; the scores are clipped to
    # -FLT_MAX and P·V multiplied by the row's "has a key above -inf" factor)
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


@pytest.mark.parametrize("path", ["fused", "primitives"])
def test_a_constant_float_mask_with_an_all_minus_inf_row(monkeypatch, path):
    """A model's float buffer with a row that is ``-inf`` everywhere (and one partly ``-inf``): zeros
    for the first row, as SDPA; no NaN on the primitive path (its ``-inf`` is ``-FLT_MAX`` there)."""
    monkeypatch.setenv(ATTENTION_ENV, path)
    q, k, v = _qkv(4)
    const = torch.zeros(5, 5)
    const[3] = -torch.inf
    const[1, 2:] = -torch.inf
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=const)
    got, impls = _run_kernels(monkeypatch, attention_graph(3, mask_buffer=const), (q, k, v))
    assert any(("attention" in i) == (path == "fused") for i in impls), impls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got[..., 3, :].abs().max()) == 0.0


@pytest.mark.parametrize("path", ["fused", "primitives"])
def test_an_infinite_mask_input_runs_the_plan_and_a_nan_one_does_not(monkeypatch, path):
    """A segment input read only as an attention mask may hold ``-inf`` (nn.MultiheadAttention's
    padding masks): the segment checks it for NaN only, so the plan runs it (before, every such call
    ran on the Python executor); a NaN in it still sends the call there (NaN out, as SDPA)."""
    from gml.runtime.compile import _inputs_key

    monkeypatch.setenv(ATTENTION_ENV, path)
    q, k, v = _qkv(5)
    m = _masks()["-inf"]
    with torch.no_grad():
        eng = compile_engine(attention_graph(4), (q, k, v, m))
        (seg,) = eng.segments()
        assert seg.mask_only == (3,)
        ran: list[str] = []
        seg.reference.register_forward_pre_hook(lambda mod, args: ran.append("python"))
        got = eng(q, k, v, m)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m), rtol=1e-5, atol=1e-5)
        assert ran == [] and seg._finite((q, k, v, m), _inputs_key((q, k, v, m)))
        nan = m.clone()
        nan[0, 0, 0, 1] = torch.nan
        assert eng(q, k, v, nan)[0].isnan().any() and ran == ["python"]
        inf_q = q.clone()
        inf_q[0, 0, 0, 0] = torch.inf  # q is no mask: an Inf there is still non-finite
        assert not seg._finite((inf_q, k, v, m), _inputs_key((inf_q, k, v, m)))


def test_which_inputs_are_masks_only():
    """Golden: through views, casts and adds of masks to ``attn_mask``: a mask; a value that is also
    read as q, or added into the scores' other operand, is not."""
    from torch import fx

    from gml.ir.attention import attention_op
    from gml.runtime.rules.attention import mask_only_inputs

    g = fx.Graph()
    q, k, v, m, pad, other = (g.placeholder(n) for n in ("q", "k", "v", "m", "pad", "other"))
    both = g.call_function(
        torch.ops.aten.add.Tensor, (g.call_method("unsqueeze", (m, 0)), g.call_method("view", (pad, 2, 1, 1, 5)))
    )
    a1 = g.call_function(attention_op(), (q, k, v, g.call_method("expand", (both, 2, 2, 5, 5))))
    a2 = g.call_function(attention_op(), (other, k, v, other))  # `other` is q too
    g.output((a1, a2))
    assert mask_only_inputs(fx.GraphModule(torch.nn.Module(), g)) == (3, 4)


def test_no_nan_allows_inf():
    from gml.kernels.fp32 import no_nan

    assert no_nan(_masks()["-inf"], torch.tensor([torch.inf, 1.0]))
    assert not no_nan(torch.tensor([1.0, torch.nan]))
    assert not no_nan(torch.tensor([torch.inf, -torch.inf, torch.nan]))
    assert no_nan(torch.tensor([torch.inf, -torch.inf]))  # (the sum is NaN: read again, none)


def test_a_long_chain_of_views_is_read_without_recursion():
    """A loaded file is hostile: 5,000 views between a mask input and the attention are followed by
    a loop, not a recursion (no RecursionError at load)."""
    from torch import fx

    from gml.ir.attention import attention_op
    from gml.runtime.rules.attention import mask_only_inputs

    g = fx.Graph()
    q, k, v, m = (g.placeholder(n) for n in ("q", "k", "v", "m"))
    for _ in range(5000):
        m = g.call_method("view", (m, 2, 1, 1, 5))
    g.output(g.call_function(attention_op(), (q, k, v, m)))
    assert mask_only_inputs(fx.GraphModule(torch.nn.Module(), g)) == (3,)
