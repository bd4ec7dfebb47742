"""Building one-op lowered graphs and comparing the engine with the Python executor."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gml.ir.target import Target
from gml.ir.values import ConvSpec, QParams
from gml.quant import modules as qm
from gml.quant.lower import emit_op_calls
from gml.runtime import compile_engine
from gml.runtime.target import detect_target

IN_QP, OUT_QP = QParams(0.05, 120), QParams(0.2, 100)


def graph_of(*mods: nn.Module, n_inputs: int = 1, wiring: list[tuple[int, ...]] | None = None) -> fx.GraphModule:
    """The lowered IR of ``x0..xk -> mods[0] -> mods[1] ... -> output``: each GML INT8 module becomes
    the ``torch.ops.gml`` call the lowering emits for it (fp32 fused modules stay module calls).
    ``wiring[i]`` lists the value indices module i reads (values: inputs first, then each module's
    output); default: a chain."""
    root = nn.Module()
    g = fx.Graph()
    values = [g.placeholder(f"x{i}") for i in range(n_inputs)]
    for i, m in enumerate(mods):
        root.add_module(f"m{i}", m)
        args = tuple(values[j] for j in wiring[i]) if wiring else (values[-1],)
        values.append(g.call_module(f"m{i}", args))
    g.output(values[-1])
    gm = fx.GraphModule(root, g)
    modules = dict(gm.named_modules())
    emit_op_calls(gm, lambda n: modules.get(str(n.target)) if n.op == "call_module" else None)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def rand_u8(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return x.contiguous(memory_format=torch.channels_last) if len(shape) == 4 else x


def fit_qparams(t: torch.Tensor) -> QParams:
    """uint8 qparams covering ``t``'s range (0 included)."""
    lo, hi = min(float(t.min()), 0.0), max(float(t.max()), 0.0)
    scale = max(hi - lo, 1e-6) / 255.0
    return QParams(scale, round(-lo / scale))


#: the int8 weight range in which every kernel is exact on this process's target (ADR 011: 127 with
#: VNNI/AMX, 64 under ONEDNN_MAX_CPU_ISA=AVX2 / AVX512_CORE or on such a CPU)
W_QMAX = min(127, detect_target().int8.weight_qmax)


def int8_weight(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-W_QMAX, W_QMAX + 1, shape, dtype=torch.int8, generator=gen)
    scale = torch.rand(shape[0], generator=gen) * 0.01 + 0.002
    return w, scale


def assert_close_int(ref: torch.Tensor, got: torch.Tensor, *, frac: float = 0.02) -> None:
    """Same dtype and shape; integers differ by at most 1 (a rounding tie), on few elements."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.dtype, ref.shape)
    if ref.dtype == torch.uint8:
        d = (ref.int() - got.int()).abs()
        assert int(d.max()) <= 1, f"max integer difference {int(d.max())}"
        assert float((d > 0).float().mean()) <= frac, f"{float((d > 0).float().mean()):.3f} of elements differ"
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(ref.abs().max())))


def run_both(gm: fx.GraphModule, *inputs: torch.Tensor, target: Target | None = None):
    """``(Python executor's output, EngineModule, engine's output)`` on ``inputs``, the plan made
    for ``target`` (default: this CPU's); the engine must leave the caller's inputs as they were."""
    with torch.no_grad():
        ref = gm(*[t.clone() for t in inputs])
        saved = [t.clone() for t in inputs]
        eng = compile_engine(gm, inputs, target=target)
        got = eng(*inputs)
    for t, s in zip(inputs, saved):
        assert torch.equal(t, s), "the engine wrote into a caller's input"
    return ref, eng, got


def check_engine(gm: fx.GraphModule, *inputs: torch.Tensor, expect_engine: bool = True, frac: float = 0.02):
    """Engine vs the Python executor on ``inputs``; returns the EngineModule."""
    ref, eng, got = run_both(gm, *inputs)
    if expect_engine:
        assert eng.report.path == "engine", str(eng.report)
    assert_close_int(ref, got, frac=frac)
    return eng


def qconv(
    cin: int,
    cout: int,
    k: int | tuple[int, int],
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups=1,
    in_qp=IN_QP,
    out_qp: QParams | None = OUT_QP,
    post_op=None,
    bias=True,
    seed=0,
) -> qm.QConv2d:
    kh, kw = (k, k) if isinstance(k, int) else k
    w, s = int8_weight((cout, cin // groups, kh, kw), seed)
    b = torch.randn(cout, generator=torch.Generator().manual_seed(seed)) if bias else None
    spec = ConvSpec(tuple(stride), tuple(padding), tuple(dilation), groups)
    return qm.QConv2d(w, s, b, spec, in_qp, out_qp, post_op=post_op)


def calibrated_qconv(x: torch.Tensor, **kw) -> qm.QConv2d:
    """A QConv2d whose output qparams fit its fp32-output result on ``x`` (no saturation)."""
    probe = qconv(x.shape[1], kw.pop("cout"), kw.pop("k"), out_qp=None, **kw)
    with torch.no_grad():
        y = probe(x)
    return qconv(x.shape[1], probe.weight.shape[0], tuple(probe.weight.shape[2:]), out_qp=fit_qparams(y), **kw)


def attention_graph(
    n_inputs: int, scale: float | None = None, causal: bool = False, mask_buffer: torch.Tensor | None = None
) -> fx.GraphModule:
    """``attention(q, k, v[, mask])`` as the lowered graph holds it (a call of the gml op); with
    ``mask_buffer`` the mask is a constant of the module (a ``get_attr``: a plan constant)."""
    from gml.ir.attention import attention_op

    g = fx.Graph()
    root = nn.Module()
    xs = [g.placeholder(n) for n in ("q", "k", "v", "mask")[:n_inputs]]
    mask = xs[3] if n_inputs > 3 else None
    if mask_buffer is not None:
        root.register_buffer("mask", mask_buffer)
        mask = g.get_attr("mask")
    g.output(g.call_function(attention_op(), (xs[0], xs[1], xs[2], mask, scale, causal)))
    return fx.GraphModule(root, g)


def strided_heads_graph(batch: int, length: int, heads: int, head_size: int) -> fx.GraphModule:
    """Attention over q / k / v as the QKV merge leaves them: ``qkv`` [B, L, 3·H·E] split in three,
    each piece viewed [B, L, H, E] and transposed to [B, H, L, E] (strided heads, no copies)."""
    import operator

    from gml.ir.attention import attention_op

    g = fx.Graph()
    x = g.placeholder("qkv")
    width = heads * head_size
    parts = g.call_function(torch.split, (x, [width] * 3), {"dim": -1})
    views = []
    for i in range(3):
        piece = g.call_function(operator.getitem, (parts, i))
        views.append(
            g.call_method("transpose", (g.call_method("view", (piece, batch, length, heads, head_size)), 1, 2))
        )
    g.output(g.call_function(attention_op(), (*views, None, None, False)))
    return fx.GraphModule(nn.Module(), g)


def assert_concurrent_calls_agree(eng, calls: list[list[torch.Tensor]], *, threads: int = 2, rounds: int = 4) -> None:
    """``threads`` Python threads each run every call of ``calls`` (argument lists) ``rounds`` times on
    one engine at once: each result equals, bit for bit, the same call made alone (per-call state in
    the Context, never shared)."""
    import threading

    with torch.no_grad():
        alone = [eng(*xs) for xs in calls]
    results: dict[int, list[torch.Tensor]] = {}

    def worker(k: int) -> None:
        with torch.no_grad():
            results[k] = [eng(*xs) for _ in range(rounds) for xs in calls]

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    for k in range(threads):
        assert len(results[k]) == rounds * len(calls)
        for i, got in enumerate(results[k]):
            assert torch.equal(got, alone[i % len(calls)])


def assert_thread_counts_agree(eng, *inputs: torch.Tensor) -> None:
    """One OpenMP thread and two give ``eng``'s result bit for bit, and so do two Python callers at once."""
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = eng(*inputs)
            torch.set_num_threads(2)
            two = eng(*inputs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert_concurrent_calls_agree(eng, [list(inputs)], rounds=1)


def engine_in_mode(monkeypatch, mode: str, mod: nn.Module, xs: list[torch.Tensor], n_inputs: int = 1):
    """``(engine, its output on xs)`` for the IR of ``mod`` planned with ``GML_WINOGRAD=mode`` (``1``
    forces GML's own convs where eligible, ``0`` never, ``auto`` times them); the engine must run it."""
    monkeypatch.setenv("GML_WINOGRAD", mode)
    gm = graph_of(mod, n_inputs=n_inputs, wiring=[tuple(range(n_inputs))])
    with torch.no_grad():
        eng = compile_engine(gm, [t.clone() for t in xs])
        got = eng(*[t.clone() for t in xs])
    assert eng.report.path == "engine", str(eng.report)
    return eng, got


def own_conv_steps(eng, prefix: str) -> list[str]:
    """The engine's steps whose implementation starts with ``prefix`` (one of GML's own conv kernels)."""
    return [impl for _, impl in eng.step_impls() if impl.startswith(prefix)]


def check_forced_conv(
    monkeypatch,
    mod: nn.Module,
    xs: list[torch.Tensor],
    prefix: str,
    *,
    taken: bool = True,
    n_inputs: int = 1,
    against_direct: bool = False,
    mode: str = "1",
):
    """``mod`` planned with GML's own convs forced (``GML_WINOGRAD=mode``: ``1``, or ``f2x3`` for INT8
    Winograd's small tiles): its conv step is (``taken``) or is not GML's kernel ``prefix``, and the
    output matches the Python executor within one rounding step (and, ``against_direct``, the plan of
    oneDNN's direct conv). Returns the forced engine."""
    with torch.no_grad():
        ref = mod(*[t.clone() for t in xs])
    eng, got = engine_in_mode(monkeypatch, mode, mod, xs, n_inputs)
    assert bool(own_conv_steps(eng, prefix)) is taken, eng.step_impls()
    assert_close_int(ref, got)
    if against_direct:
        eng0, direct = engine_in_mode(monkeypatch, "0", mod, xs, n_inputs)
        assert not own_conv_steps(eng0, prefix), eng0.step_impls()
        assert_close_int(direct, got)
    return eng


def _own_kernel_marks() -> list:
    from gml.runtime import unavailable_reason

    return [
        pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
        pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="the kernels need AVX2"),
    ]


#: the qparams the tests of GML's own INT8 convs share: a source without and with a zero point, an INT8 output
OWN_IN, OWN_IN_ZP, OWN_OUT = QParams(0.05, 0), QParams(0.04, 37), QParams(0.5, 3)

#: skip marks of the tests of GML's own AVX2 kernels: the native engine, and a CPU with AVX2
OWN_KERNEL_MARKS = _own_kernel_marks()


class _PosEmb(nn.Module):
    """``ln(x + pos_emb(arange(L)))``: position ids from the input's size only (as BERT's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        from gml import nn as gnn

        self.pos = nn.Embedding(32, 8)
        self.add = gnn.Add()
        self.ln = nn.LayerNorm(8)
        self.ln2 = nn.LayerNorm(8)


def pos_embedding_graph(in_place: bool = False, data_size: bool = False) -> fx.GraphModule:
    """``ln(x + pos_emb(arange(x.shape[1])))`` on ``x`` of shape (N, L, 8). ``in_place``: an
    in-place op on the position ids (a would-be cached value: nothing may be cached);
    ``data_size``: then ``ln2(y) * nonzero(y > 0.5).shape[0]``, a size read from a tensor computed
    from the data, which no input layout fixes."""
    root = _PosEmb().eval()
    g = fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 1))
    ids = g.call_function(torch.arange, (n,))
    ids = g.call_method("unsqueeze", (ids, 0))
    if in_place:
        ids = g.call_method("add_", (ids, 0))
    e = g.call_module("pos", (ids,))
    y = g.call_module("add", (x, e))
    y = g.call_module("ln", (y,))
    if data_size:
        nz = g.call_function(torch.nonzero, (g.call_method("gt", (y, 0.5)),))
        k = g.call_function(torch.ops.aten.sym_size.int, (nz, 0))
        y = g.call_function(torch.mul, (g.call_module("ln2", (y,)), k))
    g.output(y)
    return fx.GraphModule(root, g)
