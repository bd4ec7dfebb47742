"""Fuse ``nn.Linear`` with the activation after it onto oneDNN's fused inner product.

Before → after::

    y = linear(x); out = act(y)   →   out = FusedLinear[act](x)     math: act(x W^T + b)
    y = linear(x)                 →   y = FusedLinear[none](x)      (prepacked weight)

This is the fusion practice's manual pass (phase 2): a walker over the nodes that checks the
*module type* of each ``call_module`` (``torch.fx.subgraph_rewriter`` would compare attribute names),
finds the single activation user of each Linear and swaps in one fused module.

``act`` is any activation oneDNN fuses (see :func:`gml.kernels.fp32.post_op_of`). The fused module
keeps the Linear's dotted name, so ``state_dict`` keys do not change.

Backend per shape (:func:`gml.kernels.fp32.choose_linear_backend`, measured in docs/fp32-kernels.md):
oneDNN's prepacked inner product from 2 rows and ~1M multiply-adds up (about 2x MKL's ``F.linear``
here), MKL's packed GEMV for one row and a large weight, and plain ``nn.Linear`` for tiny layers,
where oneDNN's ~10 us call cost dominates. Only the oneDNN path fuses the activation; a Linear+act
left on MKL/ATen because that measured faster is reported as a skip with the reason.

Skipped, with the reason: Linear output read by more than the activation ("linear output has 2
users"), activations with no oneDNN post-op, shapes where the unfused kernels are faster,
non-fp32 weights/inputs, Linear modules called at several sites (run UntieSharedModules first),
subclasses of nn.Linear (their forward may differ).
"""

from __future__ import annotations

import math

import torch
from torch import fx, nn

from gml.kernels import fp32 as k32
from gml.passes import fuse_common as fc
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import get_module, modules_of, replace_module


class FuseLinearActivation(GraphPass):
    """Replaces ``act(linear(x))`` with one :class:`~gml.kernels.fp32.FusedLinear`; lowers other Linears."""

    name = "fuse_linear"
    tolerance = Tolerance(atol=1e-4, rtol=1e-4)  # different GEMM blocking: a few ulp per output

    def __init__(self, *, lower_unfused: bool = True, backend: str = "auto") -> None:
        if backend not in ("auto", "onednn", "mkl"):
            raise ValueError(f"backend must be 'auto', 'onednn' or 'mkl', not {backend!r}")
        self.lower_unfused = lower_unfused
        self.backend = backend

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        notes = fc.fallback_notes()
        fused = 0
        backends: dict[str, int] = {}
        for node in list(gm.graph.nodes):
            mod = get_module(gm, node)
            if not isinstance(mod, nn.Linear):
                continue
            why = self._problem(gm, node, mod)
            if why:
                skips.append(Skip(node.name, why, "linear → act"))
                continue
            shape = fc.shape_of(node.args[0])
            rows = math.prod(shape[:-1]) if shape else None
            backend = self._backend(rows, mod)
            post, tail = k32.NO_POST_OP, node
            act = fc.fusable_activation(node, modules, "linear", skips)
            if act is not None and backend != "onednn":
                where = "MKL's packed GEMV" if backend == "mkl" else "ATen's F.linear"
                skips.append(
                    Skip(
                        act[0].name,
                        f"not fused: for {rows} row(s) x {mod.in_features}->{mod.out_features}, {where} "
                        "measured faster than oneDNN's fused kernel (docs/fp32-kernels.md)",
                        "linear → act",
                    )
                )
            elif act is not None:
                tail, post = act
            if tail is node and (not self.lower_unfused or backend == "aten"):
                backends["aten (kept nn.Linear)"] = backends.get("aten (kept nn.Linear)", 0) + 1
                continue
            new_mod = k32.FusedLinear.from_linear(mod, post, rows=rows, backend=backend)
            backends[new_mod.backend] = backends.get(new_mod.backend, 0) + 1
            replace_module(gm, str(node.target), new_mod)
            if tail is not node:
                node.meta = fc.fused_meta(node, tail)
                tail.replace_all_uses_with(node)
                fc.erase_chain(gm.graph, [tail])
                fused += 1
        lowered = sum(n for b, n in backends.items() if not b.startswith("aten")) - fused
        if backends:
            per = ", ".join(f"{n} on {b}" for b, n in sorted(backends.items()))
            notes.append(f"{fused} linear+activation fused, {lowered} linear(s) lowered without post-op ({per})")
        modified = fused + lowered > 0
        if modified:
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()
        return PassResult(gm, modified, fused, skips, notes)

    def _backend(self, rows: int | None, mod: nn.Linear) -> str:
        if not k32.kernels_available():
            return "aten"
        if self.backend != "auto":
            return self.backend
        return k32.choose_linear_backend(rows, mod.in_features, mod.out_features)

    @staticmethod
    def _problem(gm: fx.GraphModule, node: fx.Node, mod: nn.Linear) -> str | None:
        if type(mod) is not nn.Linear:
            return f"{type(mod).__name__} is a subclass of nn.Linear (its forward may differ)"
        if mod.weight.dtype != torch.float32:
            return f"weight is {mod.weight.dtype}, the fp32 kernels take float32"
        if len(node.args) != 1 or node.kwargs:
            return "linear called with extra arguments"
        why = fc.dtype_problem(node.args[0])
        if why:
            return why
        sites = fc.call_sites(gm, str(node.target))
        if sites > 1:
            return f"linear module {node.target} is called at {sites} sites (run UntieSharedModules first)"
        return None
