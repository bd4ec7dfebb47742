"""Winograd F(2x2, 3x3) convolutions in the engine (native/winograd.h, docs/adr/010-winograd-conv.md).

``GML_WINOGRAD=1`` forces it for every eligible conv, ``0`` forbids it, ``auto`` (the default) times
it against the direct conv at plan build. Each forced result is compared element by element with
an exact (float64) convolution of the same bf16 / fp32 operands, within a bound derived from the
algorithm's roundings (:func:`winograd_bound`), and the direct conv within its own bound.

The bound. Per output, let ``B = |A^T| (sum_c |B^T||d||B| * |G||g||G^T|) |A|`` (the transforms
with every matrix and operand taken in absolute value, float64), ``u`` the unit roundoff of the
stored V / U (bf16: 2^-8; fp32: V / U are not rounded again, 0), ``e = 2^-24`` (fp32), and ``C``
the input channels. V (2 fp32 roundings deep, then rounded to the storage type), U (4 fp32
roundings, then stored), the fp32 accumulation over C (at most C roundings, any order) and the
output transform with bias and residual (at most 5 roundings) move the pre-activation result by at
most ``(2u + (C + 16) e) B`` (first order; x1.01 for the second-order terms) plus ``16 e (|bias| +
|residual|)``; rounding the result to the output type adds ``u_out |y|`` (bf16 2^-8, fp32 2^-24); a
ReLU / clip never increases a difference. An error in a transform or an index moves an output
by about its own magnitude, far beyond this bound.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.errors import InputError
from gml.kernels import bf16 as kb
from gml.kernels.fp32 import FusedConv, FusedConvAdd, PostOp
from gml.runtime import compile_engine, unavailable_reason
from gml.runtime.options import EngineOptions
from runtime.helpers import assert_concurrent_calls_agree, graph_of

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
needs_bf16 = pytest.mark.skipif(not kb.bf16_available(), reason=f"no native bf16: {kb.bf16_unavailable_reason()}")

BT = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=torch.float64)
G = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float64)
AT = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=torch.float64)
E32 = 2.0**-24
UNIT = {"bf16": 2.0**-8, "f32": 0.0}
OUT_UNIT = {"bf16": 2.0**-8, "f32": E32}
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def magnitude(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``B`` of the module docstring per output of ``conv2d(x, w, padding=1)`` (NCHW, float64)."""
    n, _, h, wd = x.shape
    th, tw = (h + 1) // 2, (wd + 1) // 2
    d = F.pad(x.abs(), (1, 1 + 2 * tw - wd, 1, 1 + 2 * th - h)).unfold(2, 4, 2).unfold(3, 4, 2)
    v = torch.einsum("ij,nctwjk,lk->nctwil", BT.abs(), d, BT.abs())
    u = torch.einsum("ij,ocjk,lk->ocil", G.abs(), w.abs(), G.abs())
    m = torch.einsum("nctwij,ocij->notwij", v, u)
    b = torch.einsum("ij,notwjk,lk->notwil", AT.abs(), m, AT.abs())
    return b.permute(0, 1, 2, 4, 3, 5).reshape(n, w.shape[0], 2 * th, 2 * tw)[:, :, :h, :wd]


def winograd_bound(dtype: str, exact: torch.Tensor, x, w, bias, other) -> torch.Tensor:
    c = x.shape[1]
    side = bias.abs().view(1, -1, 1, 1) if bias is not None else torch.zeros(1, dtype=torch.float64)
    if other is not None:
        side = side + other.abs()
    return OUT_UNIT[dtype] * exact.abs() + 1.01 * (2 * UNIT[dtype] + (c + 16) * E32) * magnitude(x, w) + 16 * E32 * side


def direct_bound(dtype: str, exact: torch.Tensor, x, w, bias, other) -> torch.Tensor:
    """A direct conv: 9C products accumulated in fp32 (any order), bias / residual, one output rounding."""
    c = x.shape[1]
    side = bias.abs().view(1, -1, 1, 1) if bias is not None else torch.zeros(1, dtype=torch.float64)
    if other is not None:
        side = side + other.abs()
    return OUT_UNIT[dtype] * exact.abs() + 1.01 * (9 * c + 8) * E32 * (F.conv2d(x.abs(), w.abs(), padding=1) + side)


def emulate(dtype: str, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(conv2d(x, w, padding=1), B)`` computed as the engine does: V and U in fp32 in
    native/winograd.h's order of operations, rounded to the storage type (bf16: round to nearest
    even, as torch and oneDNN round), then the 16 products and the output transform in float64;
    ``B`` as in :func:`magnitude` of the rounded V and U. The engine's result differs from it by
    its fp32 accumulation (at most ``(C + 8) 2^-24 B``) and its output rounding only."""
    n, _, h, wd = x.shape
    th, tw = (h + 1) // 2, (wd + 1) // 2
    d = F.pad(x.float(), (1, 1 + 2 * tw - wd, 1, 1 + 2 * th - h)).unfold(2, 4, 2).unfold(3, 4, 2)
    r = [d[..., i, :] for i in range(4)]
    t = torch.stack([r[0] - r[2], r[1] + r[2], r[2] - r[1], r[1] - r[3]], dim=-2)  # B^T d
    c = [t[..., j] for j in range(4)]
    v = torch.stack([c[0] - c[2], c[1] + c[2], c[2] - c[1], c[1] - c[3]], dim=-1)  # (B^T d) B
    g = w.float()
    gr = [g[..., i, :] for i in range(3)]
    t = torch.stack([gr[0], 0.5 * (gr[0] + gr[1] + gr[2]), 0.5 * (gr[0] - gr[1] + gr[2]), gr[2]], dim=-2)  # G g
    c = [t[..., j] for j in range(3)]
    u = torch.stack([c[0], 0.5 * (c[0] + c[1] + c[2]), 0.5 * (c[0] - c[1] + c[2]), c[2]], dim=-1)  # (G g) G^T
    v, u = (z.to(DTYPES[dtype]).double() for z in (v, u))
    out = []
    for mv, mu, at in ((v, u, AT), (v.abs(), u.abs(), AT.abs())):
        m = torch.einsum("nctwij,ocij->notwij", mv, mu)
        y = torch.einsum("ij,notwjk,lk->notwil", at, m, at)
        out.append(y.permute(0, 1, 2, 4, 3, 5).reshape(n, w.shape[0], 2 * th, 2 * tw)[:, :, :h, :wd])
    return out[0], out[1]


def _module(dtype: str, cin: int, cout: int, *, bias: bool, post: str, seed: int = 0, **conv_kw) -> nn.Module:
    torch.manual_seed(seed)
    conv = nn.Conv2d(cin, cout, 3, **({"padding": 1} | conv_kw), bias=bias).eval()
    if post == "sum_relu":
        mod = FusedConvAdd.from_conv(conv, relu=True, inplace=False)
        return kb.Bf16ConvAdd.from_fused(mod) if dtype == "bf16" else mod
    named = {"none": PostOp(), "relu": PostOp("relu"), "relu6": PostOp("hardtanh", (0.0, 6.0))}
    mod = FusedConv.from_conv(conv, named.get(post) or PostOp(post))
    return kb.Bf16Conv.from_fused(mod) if dtype == "bf16" else mod


def _inputs(dtype: str, mod: nn.Module, n: int, h: int, w: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cin, cout = mod.weight.shape[1] * getattr(mod, "groups", 1), mod.weight.shape[0]
    xs = [torch.randn(n, cin, h, w, generator=gen)]
    if isinstance(mod, FusedConvAdd):
        xs.append(torch.randn(n, cout, h, w, generator=gen))
    return [x.to(DTYPES[dtype]).contiguous(memory_format=torch.channels_last) for x in xs]


def _graph(mod: nn.Module) -> fx.GraphModule:
    return graph_of(mod, n_inputs=2, wiring=[(0, 1)]) if isinstance(mod, FusedConvAdd) else graph_of(mod)


def _exact(mod: nn.Module, xs: list[torch.Tensor], post: str) -> torch.Tensor:
    x, w = xs[0].double(), mod.weight.double()
    b = None if mod.bias is None else mod.bias.double()
    y = F.conv2d(x, w, b, padding=1)
    if post == "sum_relu":
        return torch.relu(y + xs[1].double())
    return {"none": y, "relu": torch.relu(y), "relu6": y.clamp(0.0, 6.0)}[post]


def _run(monkeypatch, mode: str, mod: nn.Module, xs: list[torch.Tensor]):
    monkeypatch.setenv("GML_WINOGRAD", mode)
    with torch.no_grad():
        eng = compile_engine(_graph(mod), [t.clone() for t in xs])
        got = eng(*[t.clone() for t in xs])
    assert eng.report.path == "engine", str(eng.report)
    return eng, got


def _winograd_steps(eng) -> list[str]:
    return [impl for _, impl in eng.step_impls() if impl.startswith("gml:winograd_f2x3+")]


SHAPES = [  # (batch, Cin, Cout, H, W): odd sizes, channels off the 16-lane vectors, batch > 1, 1-pixel rows
    (1, 16, 24, 7, 7),
    (3, 20, 13, 5, 9),
    (2, 32, 48, 8, 8),
    (2, 5, 7, 1, 4),
    # 255 tiles: two chunks (the second padded with a zero tile), transforms on the OpenMP team
    (1, 64, 40, 30, 34),
]


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16), "f32"])
@pytest.mark.parametrize("post,bias", [("relu", True), ("none", False), ("relu6", True), ("sum_relu", True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forced_winograd_and_direct_within_their_bounds(monkeypatch, dtype, post, bias, shape):
    n, cin, cout, h, w = shape
    mod = _module(dtype, cin, cout, bias=bias, post=post)
    xs = _inputs(dtype, mod, n, h, w)
    exact = _exact(mod, xs, post)
    args = (xs[0].double(), mod.weight.double(), None if mod.bias is None else mod.bias.double())
    other = xs[1].double() if len(xs) > 1 else None
    eng, wino = _run(monkeypatch, "1", mod, xs)
    assert len(_winograd_steps(eng)) == 1, eng.step_impls()
    assert eng.report.winograd_convs == 1 and "1 3x3 conv(s) run as Winograd" in str(eng.report)
    assert wino.dtype == DTYPES[dtype] and wino.shape == exact.shape
    err = (wino.double() - exact).abs()
    bound = winograd_bound(dtype, exact, *args, other)
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"

    eng, direct = _run(monkeypatch, "0", mod, xs)
    assert not _winograd_steps(eng), eng.step_impls()
    assert eng.report.winograd_convs == 0 and "Winograd" not in str(eng.report)
    err = (direct.double() - exact).abs()
    assert bool((err <= direct_bound(dtype, exact, *args, other)).all())


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16), "f32"])
@pytest.mark.parametrize("post,bias", [("relu", True), ("none", False), ("sum_relu", True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_winograd_kernel_matches_its_emulation(monkeypatch, dtype, post, bias, shape):
    """The tight check of the kernel itself (indexing, borders, bias, residual, rounding): the
    engine's Winograd output vs :func:`emulate` followed by the same post-ops in float64, within
    the output rounding (``u_out |y|``) plus the fp32 accumulation of the GEMM and the output
    transform (``1.01 (C + 8) 2^-24 B + 8 2^-24 (|bias| + |residual|)``)."""
    n, cin, cout, h, w = shape
    mod = _module(dtype, cin, cout, bias=bias, post=post)
    xs = _inputs(dtype, mod, n, h, w)
    y, mag = emulate(dtype, xs[0].double(), mod.weight.double())
    side = torch.zeros(1, dtype=torch.float64)
    if mod.bias is not None:
        y = y + mod.bias.double().view(1, -1, 1, 1)
        side = side + mod.bias.double().abs().view(1, -1, 1, 1)
    if post == "sum_relu":
        y = y + xs[1].double()
        side = side + xs[1].double().abs()
    y = y if post == "none" else torch.relu(y)
    eng, got = _run(monkeypatch, "1", mod, xs)
    assert len(_winograd_steps(eng)) == 1, eng.step_impls()
    bound = OUT_UNIT[dtype] * y.abs() + 1.01 * (cin + 8) * E32 * mag + 8 * E32 * side
    err = (got.double() - y).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16), "f32"])
def test_auto_choice_runs_either_kernel_within_the_bound(monkeypatch, dtype):
    mod = _module(dtype, 32, 32, bias=True, post="relu")
    xs = _inputs(dtype, mod, 1, 14, 14)
    monkeypatch.delenv("GML_WINOGRAD", raising=False)  # the default: auto
    with torch.no_grad():
        eng = compile_engine(_graph(mod), [t.clone() for t in xs])
        got = eng(*xs)
    impls = [impl for _, impl in eng.step_impls() if "conv" in impl or "winograd" in impl]
    assert len(impls) == 1, eng.step_impls()  # the timed choice: one of the two kernels, whichever is faster here
    exact = _exact(mod, xs, "relu")
    args = (xs[0].double(), mod.weight.double(), mod.bias.double())
    assert bool(((got.double() - exact).abs() <= winograd_bound(dtype, exact, *args, None)).all())


INELIGIBLE = {
    "stride2": dict(stride=2),
    "dilation2": dict(dilation=2, padding=2),
    "groups2": dict(groups=2),
    "padding0": dict(padding=0),
    "padding2": dict(padding=2),
}


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16), "f32"])
@pytest.mark.parametrize("kw", INELIGIBLE.values(), ids=INELIGIBLE.keys())
def test_ineligible_convs_never_take_winograd(monkeypatch, dtype, kw):
    mod = _module(dtype, 8, 8, bias=True, post="relu", **kw)
    eng, _ = _run(monkeypatch, "1", mod, _inputs(dtype, mod, 1, 9, 9))
    assert not _winograd_steps(eng), eng.step_impls()


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16), "f32"])
def test_1x1_conv_and_other_post_ops_never_take_winograd(monkeypatch, dtype):
    torch.manual_seed(0)
    one = FusedConv.from_conv(nn.Conv2d(8, 8, 1).eval(), PostOp("relu"))
    swish = _module(dtype, 8, 8, bias=True, post="swish")  # not one of the post-ops the output transform applies
    for mod in (kb.Bf16Conv.from_fused(one) if dtype == "bf16" else one, swish):
        eng, _ = _run(monkeypatch, "1", mod, _inputs(dtype, mod, 1, 6, 6))
        assert not _winograd_steps(eng), eng.step_impls()


def test_a_bad_setting_is_an_input_error(monkeypatch):
    mod = _module("f32", 4, 4, bias=True, post="relu")
    monkeypatch.setenv("GML_WINOGRAD", "yes")
    with pytest.raises(InputError, match="GML_WINOGRAD"), torch.no_grad():
        compile_engine(_graph(mod), _inputs("f32", mod, 1, 4, 4))
    with pytest.raises(InputError, match="winograd='yes'"):
        EngineOptions(winograd="yes")


def test_the_option_value_wins_over_the_environment(monkeypatch):
    """``options=`` is the setting; ``GML_WINOGRAD`` only sets the default when none is given (read
    at the API boundary, gml.runtime.options), and a plan built later for a new shape keeps it."""
    mod = _module("f32", 16, 16, bias=True, post="relu")
    monkeypatch.setenv("GML_WINOGRAD", "1")
    with torch.no_grad():
        forced = compile_engine(_graph(mod), _inputs("f32", mod, 1, 8, 8))
        direct = compile_engine(_graph(mod), _inputs("f32", mod, 1, 8, 8), options=EngineOptions(winograd="0"))
        monkeypatch.setenv("GML_WINOGRAD", "0")  # too late: the options were taken at compile time
        forced(*_inputs("f32", mod, 2, 8, 8))
    assert _winograd_steps(forced) and not _winograd_steps(direct), (forced.step_impls(), direct.step_impls())
    assert len(_winograd_steps(forced)) == 2  # both plans (batch 1 and batch 2) run Winograd


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16), "f32"])
def test_two_threads_running_one_winograd_plan(monkeypatch, dtype):
    """V, M and the matmul's scratchpad are per-call state: concurrent calls of one plan agree with
    the same calls made one at a time (the same kernels: bit for bit)."""
    mod = _module(dtype, 24, 40, bias=True, post="sum_relu")
    calls = [_inputs(dtype, mod, 2, 9, 11, seed=s) for s in range(8)]
    eng, _ = _run(monkeypatch, "1", mod, calls[0])
    assert len(_winograd_steps(eng)) == 1
    assert_concurrent_calls_agree(eng, calls, rounds=5)


PORTABLE_CHECK = """
import os, sys
sys.path.insert(0, sys.argv[1])
from runtime import test_winograd as T
class Env:
    def setenv(self, key, value):
        os.environ[key] = value
for shape in T.SHAPES:
    for post, bias in (("relu", True), ("none", False), ("sum_relu", True)):
        T.test_winograd_kernel_matches_its_emulation(Env(), "bf16", post, bias, shape)
print("checked", len(T.SHAPES) * 3)
"""


@needs_bf16
def test_portable_bf16_kernels_match_their_emulation_too():
    """With oneDNN held to AVX512_CORE (no AVX512_BF16), the bf16 transforms take the portable
    kernels (GCC vector code, rounding by integer arithmetic) instead of the AVX512_BF16 ones: the
    emulation checks again, in a process started with ONEDNN_MAX_CPU_ISA=AVX512_CORE."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", PORTABLE_CHECK, tests], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"checked {len(SHAPES) * 3}" in proc.stdout
