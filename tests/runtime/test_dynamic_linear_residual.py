"""The residual add after a ``gml::dynamic_linear`` as the last post-op of its engine matmul
(``gml.runtime.rules.linear.fuse_into_dynamic_linear``), against the Python executor."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from gml import nn as gnn
from gml.runtime import unavailable_reason
from runtime.helpers import run_both
from runtime.test_dynamic_linear import dyn_graph, gemm, rows, step_impls  # noqa: F401 (gemm: autouse, both GEMMs)

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def residual_graph(
    k: int, n: int, *, read_again: bool = False, post_op: str = "none", itself: bool = False
) -> fx.GraphModule:
    """``x, r -> dynamic_linear(x) + r`` (and, with ``read_again``, the linear's output returned too;
    with ``itself``, ``dynamic_linear(x) + dynamic_linear(x)``: the same node twice, ``r`` unused)."""
    gm = dyn_graph(k, n, post_op=post_op)
    g = gm.graph
    (x,) = [p for p in g.nodes if p.op == "placeholder"]
    out = next(iter(g.nodes)).graph.output_node()
    lin = out.args[0]
    with g.inserting_after(x):
        r = g.placeholder("r")
    gm.add_module("add", gnn.Add())
    with g.inserting_before(out):
        s = g.call_module("add", (lin, lin if itself else r))
    out.args = ((s, lin),) if read_again else (s,)
    gm.recompile()
    return gm


@pytest.mark.parametrize("shape", [(11, 24), (2, 7, 24), (1, 1, 24)])
def test_linear_then_residual_is_one_matmul_bit_identical(shape):
    gm = residual_graph(24, 16)
    x, r = rows(*shape), rows(*shape[:-1], 16, seed=3)
    ref, eng, got = run_both(gm, x, r)
    assert eng.report.path == "engine", str(eng.report)
    assert len(step_impls(eng)) == 2  # the row quantization and one matmul (no binary add step)
    assert torch.equal(got, ref), float((got - ref).abs().max())


def test_residual_after_a_gelu_post_op():
    """GELU then the residual, in that order (the MLP's second GEMM has none, but the fusion allows it):
    on GML's GEMM the GELU runs on a dense copy and the residual is added after it."""
    gm = residual_graph(40, 24, post_op="gelu")
    x, r = rows(7, 40), rows(7, 24, seed=3)
    ref, eng, got = run_both(gm, x, r)
    assert eng.report.path == "engine" and len(step_impls(eng)) == 2, step_impls(eng)
    tol = 4 * torch.finfo(torch.float32).eps * ref.abs() + 1e-6 * float(ref.abs().max())
    assert bool(((got - ref).abs() <= tol).all()), float((got - ref).abs().max())


def test_a_linear_output_read_again_keeps_its_own_add():
    gm = residual_graph(24, 16, read_again=True)
    x, r = rows(3, 24), rows(3, 16, seed=3)
    ref, eng, got = run_both(gm, x, r)
    assert len(step_impls(eng)) == 3  # quantize, matmul, binary add
    for g, w in zip(got, ref):
        assert torch.equal(g, w)


def test_a_linear_output_added_to_itself_keeps_its_own_add():
    """``y + y`` reads the linear's own output: fused, the residual would be memory the matmul no longer
    writes (gml.runtime.rules.linear._reads_itself)."""
    gm = residual_graph(24, 16, itself=True)
    x, r = rows(3, 24), rows(3, 16, seed=3)
    ref, eng, got = run_both(gm, x, r)
    assert len(step_impls(eng)) == 3  # quantize, matmul, binary add
    assert torch.equal(got, ref)


def test_a_residual_read_from_a_strided_view_is_added_with_its_strides():
    gm = residual_graph(24, 16)
    x = rows(5, 24)
    r = rows(16, 5, seed=3).t()  # a transposed view: not fused (a strided post-op operand would send
    ref, eng, got = run_both(gm, x, r)  # oneDNN's matmul to its reference kernel); a separate add
    assert eng.report.path == "engine" and torch.equal(got, ref)
    impls = step_impls(eng)
    assert len(impls) > 2 and not any(i.startswith("ref") for i in impls), impls
