"""The fp32 remainder of a lowered INT8 graph, in the form ``gml.optimize``'s fusion passes take.

After :class:`~gml.quant.lower.LowerToGML`, the ops that stay fp32 — kept by the cost policy, by the
whole-model guard, or because INT8 has no kernel for them — are still torch.ao's modules: the float
twin's fused containers (``ConvReLU2d``, ``ConvAdd2d``, GML's ``ConvAct2d``/``LinearAct``), and, for
a weighted op the lowering declined, torch.ao's *reference* module (which quantizes and dequantizes
its weight on every call). Neither is what GML runs fp32 ops on: the fusion passes of the fp32
pipeline (:func:`gml.passes.fuse_all.fusion_passes`) match plain ``nn.Conv2d → activation`` chains
and turn them into GML's fused oneDNN kernels, which the native engine runs. Two passes bring the
remainder into that form; :func:`gml.quant.pipeline.lowering_passes` runs the fusion passes after
them, so a kept region gets exactly ``gml.optimize``'s rewriting and kernels.

:class:`FloatFromReference` — a reference conv/linear that stays fp32 runs its fp32 weight::

    y = RefConv2d[w → quantize → dequantize](x)   →   y = nn.Conv2d[w](x)

:class:`UnfuseFloatModules` — torch.ao's fused containers become the chain they compute::

    y = ConvReLU2d(x)          →   t = conv(x);  y = relu(t)
    y = ConvAddReLU2d(x, o)    →   t = conv(x);  s = add(t, o);  y = relu(s)
"""

from __future__ import annotations

import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.quantized.reference as nnqr
from torch import fx, nn

from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import add_module, modules_of, replace_module

_REFERENCE_TYPES: tuple[type[nn.Module], ...] = (nnqr.Conv1d, nnqr.Conv2d, nnqr.Conv3d, nnqr.Linear)


def float_of_reference(mod: nn.Module) -> nn.Module | None:
    """The plain ``torch.nn`` conv/linear of a torch.ao reference module, with its fp32 weight and
    bias (not the INT8-rounded ``get_weight()``), or None for any other module."""
    if isinstance(mod, nnqr.Linear):
        new: nn.Module = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
    elif isinstance(mod, nnqr.Conv1d | nnqr.Conv2d | nnqr.Conv3d):
        base = nn.Conv1d if isinstance(mod, nnqr.Conv1d) else nn.Conv2d if isinstance(mod, nnqr.Conv2d) else nn.Conv3d
        new = base(
            mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.groups,
            mod.bias is not None, mod.padding_mode,
        )  # fmt: skip
    else:
        return None
    new.weight = nn.Parameter(mod.weight.detach().clone(), requires_grad=False)
    if mod.bias is not None:
        new.bias = nn.Parameter(mod.bias.detach().clone(), requires_grad=False)
    return new.eval()


class FloatFromReference(GraphPass):
    """A torch.ao reference conv/linear left fp32 by the lowering becomes the ``torch.nn`` module with
    its fp32 weight (module doc). Changes numerics on purpose, by removing the weight's INT8 rounding
    that the reference simulated (tolerance ``None``: shapes and finiteness are checked; the
    tests compare the result with eager)."""

    name = "float_from_reference"
    tolerance = None

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        matches = 0
        for node in gm.graph.nodes:
            if node.op != "call_module":
                continue
            mod = modules[str(node.target)]
            children = list(mod.named_children()) if isinstance(mod, nni._FusedModule) else [("", mod)]
            for child_name, child in children:
                if not isinstance(child, _REFERENCE_TYPES):
                    continue
                new = float_of_reference(child)
                assert new is not None
                replace_module(gm, f"{node.target}.{child_name}" if child_name else str(node.target), new)
                matches += 1
        if matches:
            gm.recompile()
        return PassResult(gm, matches > 0, matches, notes=[f"{matches} reference module(s) run their fp32 weights"])


def _chain(mod: nn.Module) -> list[nn.Module] | None:
    """The modules a fused container applies one after the other (the first one takes the inputs)."""
    if type(mod).forward is nn.Sequential.forward:
        return list(mod.children())
    if isinstance(mod, nni.ConvAddReLU2d):
        return [mod[0], mod.add, mod.relu]
    if isinstance(mod, nni.ConvAdd2d):
        return [mod[0], mod.add]
    return None


def _broadcast_problem(node: fx.Node, first: nn.Module) -> str | None:
    """Why ``node``'s first module may not take its place: for a conv + add container, a conv
    whose output the add broadcasts (its shape is not the container's), or unknown shapes."""
    if len(node.args) < 2:
        return None  # a chain of one input: activations keep the shape
    src, out = node.args[0], node.meta.get("tensor_meta")
    meta = src.meta.get("tensor_meta") if isinstance(src, fx.Node) else None
    if meta is None or out is None or not hasattr(meta, "shape") or not hasattr(out, "shape"):
        return "conv + add operand shapes unknown (no tensor_meta): kept as is"
    with torch.no_grad():
        conv_shape = tuple(first(torch.zeros(tuple(meta.shape), dtype=meta.dtype)).shape)
    if conv_shape != tuple(out.shape):
        return f"the add broadcasts the conv output {list(conv_shape)} to {list(out.shape)}: kept as is"
    return None


class UnfuseFloatModules(GraphPass):
    """Every torch.ao fused container (``nni._FusedModule``) in the graph becomes the chain of its
    modules (module doc): ``y = F(x, *rest)`` with ``F = [m0, m1, ...]`` → ``t0 = m0(x); t1 = m1(t0,
    *rest); ...``; ``rest`` (the residual of ``ConvAdd2d``) goes to the second module. The first
    module takes the container's place (its node keeps its name and report entries); the others are
    registered next to it. Exact: the same modules run in the same order.

    Skipped, with the reason: a container whose ``forward`` is neither ``nn.Sequential``'s nor
    ``ConvAdd2d``'s / ``ConvAddReLU2d``'s (its order of operations is not known here); a conv + add
    whose add broadcasts the conv output (the first module's value would not have the container's
    shape; the fp32 conv+add fusion declines broadcasts anyway).
    """

    name = "unfuse_float_modules"
    tolerance = Tolerance(atol=0.0, rtol=0.0)

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        matches = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_module" or not isinstance(modules[str(node.target)], nni._FusedModule):
                continue
            mod = modules[str(node.target)]
            chain = _chain(mod)
            if chain is None or not chain:
                skips.append(Skip(node.name, "fused module with its own forward: kept as is", type(mod).__name__))
                continue
            why = _broadcast_problem(node, chain[0])
            if why:
                skips.append(Skip(node.name, why, type(mod).__name__))
                continue
            target = str(node.target)
            first_args, rest = node.args[:1], node.args[1:]
            users = list(node.users)
            replace_module(gm, target, chain[0])
            node.args = first_args
            prev = node
            for i, m in enumerate(chain[1:]):
                name = add_module(gm, f"{target}_{type(m).__name__.lower()}", m)
                with gm.graph.inserting_after(prev):
                    prev = gm.graph.call_module(name, (prev, *rest) if i == 0 else (prev,))
                if "tensor_meta" in node.meta:  # every value of the chain has the container's shape
                    prev.meta["tensor_meta"] = node.meta["tensor_meta"]
            for u in users:
                u.replace_input_with(node, prev)
            matches += 1
        return PassResult.rewrote(
            gm, matches, skips, f"{matches} fused container(s) unfused for the fp32 fusion passes"
        )


__all__ = ["FloatFromReference", "UnfuseFloatModules", "float_of_reference"]
