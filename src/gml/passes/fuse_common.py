"""Helpers the fp32 fusion passes share: op kinds, shape metadata, layout safety, node surgery.

Kept out of :mod:`gml.passes.utils` because they encode fusion policy (which producers return a fresh
tensor, how a channels-last conv output must be protected from ``.view``), not general graph tools.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from gml import nn as gnn
from gml.ir.alias import mutates, returns_alias, writes_in_place, written_in_place
from gml.ir.ops import ACTIVATION_KINDS as ACTIVATION_KINDS  # re-exported for the fusion passes
from gml.ir.ops import op_kind
from gml.kernels import fp32 as k32
from gml.passes.base import Skip
from gml.passes.utils import modules_of

CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def kind_of(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """:func:`~gml.passes.oplib.op_kind`, plus the module spellings Normalize introduces."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if isinstance(mod, gnn.Add):
            return "add"
        if isinstance(mod, gnn.Mul):
            return "mul"
    return op_kind(node, modules)


def fusable_activation(
    node: fx.Node, modules: dict[str, nn.Module], kind: str, skips: list[Skip]
) -> tuple[fx.Node, k32.PostOp] | None:
    """``(activation, its post-op)`` when an activation reads the ``kind`` (conv / linear) ``node``
    and can be its fused post-op; ``None`` when none reads it, or (with a skip saying why) when
    ``node`` has other readers too or the activation has no post-op form."""
    acts = [u for u in node.users if kind_of(u, modules) in ACTIVATION_KINDS]
    if not acts:
        return None
    if len(node.users) > 1:
        skips.append(Skip(node.name, f"{kind} output has {len(node.users)} users", f"{kind} → act"))
        return None
    found = k32.post_op_of(acts[0], modules)
    if isinstance(found, str):
        skips.append(Skip(acts[0].name, f"post-op not fused: {found}", f"{kind} → act"))
        return None
    return acts[0], found


def add_operands(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[fx.Node, fx.Node] | str:
    """The two tensor operands of a plain ``a + b`` in any spelling, or why it is not one."""
    if node.op == "call_module":
        mod = modules[str(node.target)]
        if isinstance(mod, gnn.Add) and mod.alpha != 1:
            return f"add with alpha={mod.alpha}"
        args = list(node.args) + list(node.kwargs.values())
    else:
        if node.kwargs.get("alpha", 1) != 1:
            return f"add with alpha={node.kwargs['alpha']}"
        if node.target in (operator.iadd,) or str(node.target) == "add_":
            return "in-place add (run Normalize first)"
        if len(node.args) > 2 and node.args[2] != 1:
            return f"add with alpha={node.args[2]}"
        args = list(node.args[:2]) + [v for k, v in node.kwargs.items() if k == "other"]
    tensors = [a for a in args if isinstance(a, fx.Node)]
    if len(tensors) != 2 or len(args) != 2:
        return "add of a tensor and a constant"
    return tensors[0], tensors[1]


def fused_meta(head: fx.Node, tail: fx.Node) -> dict:
    """The meta of the node a fusion leaves for ``head → ... → tail``: the tail's (its value), plus
    the head's GML report entries (``gml_*`` keys the tail lacks, e.g. why the INT8 lowering kept the
    head fp32), so that a report read off the fused graph still lists them."""
    out = dict(tail.meta)
    for k, v in head.meta.items():
        if k.startswith("gml_") and k not in out:
            out[k] = v
    return out


def meta(node: fx.Node) -> TensorMetadata | None:
    m = node.meta.get("tensor_meta")
    return m if isinstance(m, TensorMetadata) else None


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    m = meta(node)
    return tuple(m.shape) if m is not None else None


def dtype_problem(*nodes: fx.Node) -> str | None:
    """Why these values are not fp32 (from ``tensor_meta``), or ``None`` (fp32 or unknown)."""
    for n in nodes:
        m = meta(n)
        if m is not None and m.dtype != torch.float32:
            return f"{n.name} is {m.dtype}, the fp32 kernels take float32"
    return None


def call_sites(gm: fx.GraphModule, target: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == target)


def conv_problem(gm: fx.GraphModule, node: fx.Node, mod: nn.Module) -> str | None:
    """Why this ``nn.ConvNd`` call cannot become a oneDNN fused conv, or ``None``."""
    if type(mod) not in CONV_TYPES:
        return f"{type(mod).__name__} is not a plain nn.Conv1d/2d/3d"
    if mod.padding_mode != "zeros":
        return f"padding_mode={mod.padding_mode!r} (oneDNN pads with zeros only)"
    pad = k32.conv_padding(mod)
    if isinstance(pad, str):
        return pad
    if mod.weight.dtype != torch.float32:
        return f"weight is {mod.weight.dtype}, the fp32 kernels take float32"
    if len(node.args) != 1 or node.kwargs:
        return "conv called with extra arguments"
    why = dtype_problem(node.args[0])
    if why:
        return why
    sites = call_sites(gm, str(node.target))
    if sites > 1:
        return f"conv module {node.target} is called at {sites} sites (run UntieSharedModules first)"
    modules = modules_of(gm)
    write = written_in_place(node, modules)
    if write is not None:
        # a channels-last result turns later views into copies, and the write would miss the output
        return f"its output is overwritten in place by {write.name} (through a view)"
    hazard = write_missing_a_downstream_value(node, modules)
    if hazard is not None:
        write, base = hazard
        return (
            f"{write.name} writes in place through a view of {base.name}, which is computed from this conv's "
            f"output and read again after the write (a channels-last result would make that view a copy)"
        )
    return None


def write_missing_a_downstream_value(conv: fx.Node, modules: dict[str, nn.Module]) -> tuple[fx.Node, fx.Node] | None:
    """``(write, base)``: an in-place write through a view of ``base``, a value computed from
    ``conv``'s output, where ``base`` (or another view of it) is read after the write.

    The fused conv returns channels-last; BN, activations and element-wise ops keep that layout, so
    ``base`` is channels-last too and a later ``.view``/``flatten`` of it (made a ``reshape`` by
    :func:`make_views_layout_safe`) is a *copy*: the write lands in the copy, and whoever reads
    ``base`` afterwards misses it (fuzz seed 424242: conv → bn → ``.view`` → ``relu_``, bn read again).
    A write directly on ``base`` is safe (no view, no copy); so is one nobody observes through ``base``.
    """
    order = {n: i for i, n in enumerate(conv.graph.nodes)}
    for w in conv.graph.nodes:
        if order[w] <= order[conv] or not (writes_in_place(w, modules) and w.args and isinstance(w.args[0], fx.Node)):
            continue
        chain = [w.args[0]]  # the written value back to the first non-view: the base it aliases
        while returns_alias(chain[-1], modules) and chain[-1].args and isinstance(chain[-1].args[0], fx.Node):
            chain.append(chain[-1].args[0])
        if len(chain) < 2:
            continue  # written directly: same tensor in either layout
        base = chain[-1]
        if not (base is conv or _reaches(conv, base)) or not _read_after(base, chain[0], w, modules, order):
            continue
        return w, base
    return None


def _reaches(src: fx.Node, dst: fx.Node) -> bool:
    work, seen = [dst], {dst}
    while work:
        for parent in work.pop().all_input_nodes:
            if parent is src:
                return True
            if parent not in seen:
                seen.add(parent)
                work.append(parent)
    return False


def _read_after(
    base: fx.Node, written: fx.Node, write: fx.Node, modules: dict[str, nn.Module], order: dict[fx.Node, int]
) -> bool:
    """Whether ``base`` or a view of it other than ``written`` (and its own views) is read after ``write``."""
    skip: set[fx.Node] = {written, write}
    work = [written]
    while work:  # the written tensor's own views see the write in both layouts
        for user in work.pop().users:
            if user not in skip and returns_alias(user, modules) and user.args and user.args[0] in skip:
                skip.add(user)
                work.append(user)
    work, seen = [base], {base}
    while work:
        current = work.pop()
        for user in current.users:
            if user in skip:
                continue
            if order[user] > order[write]:
                return True
            if user not in seen and returns_alias(user, modules) and user.args and user.args[0] is current:
                seen.add(user)
                work.append(user)
    return False


def graph_order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def fresh_output_types() -> tuple[type[nn.Module], ...]:
    """Modules whose output is a new tensor (not a view of an input): safe to overwrite once dead."""
    return (
        *CONV_TYPES,
        *k32.fp32_kernel_modules(),
        nn.MaxPool2d,
        nn.MaxPool3d,
        nn.AvgPool2d,
        nn.AvgPool3d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        gnn.Add,
    )


def mutation_between(start: fx.Node, end: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The first op strictly between ``start`` and ``end`` (graph order) that writes into a tensor.

    A rewrite that moves a read of some tensor from ``start``'s position to ``end``'s would see that
    write; passes decline instead of proving the write touches a different tensor.
    """
    node = start.next
    while node is not end and node.op != "root":
        if mutates(node, modules):
            return node
        node = node.next
    return None


def erase_chain(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase exactly the given replaced nodes (last first), each only once nothing reads it.

    Deliberately not recursive: an input of the chain with no other reader may be an in-place op
    whose effect someone else sees (``relu_`` on a model input), which FX does not mark impure.
    """
    alive = set(graph.nodes)
    for node in reversed(list(dict.fromkeys(nodes))):
        if node in alive and not node.users:
            graph.erase_node(node)


def fallback_notes() -> list[str]:
    why = k32.kernel_unavailable_reason()
    if why is None:
        return []
    return [f"oneDNN fp32 kernels unavailable ({why}): fused modules compute with unfused ATen ops"]


def make_views_layout_safe(gm: fx.GraphModule, roots: Iterable[fx.Node]) -> int:
    """Turn ``.view(...)`` downstream of ``roots`` into ``.reshape(...)``; returns how many.

    The fused convs return channels-last tensors; ``x.view(n, -1)`` on one raises where the NCHW
    original worked. ``reshape`` gives the same values (copying only when the strides require it).
    """
    seen: set[fx.Node] = set()
    work = list(roots)
    changed = 0
    while work:
        node = work.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if (
                user.op == "call_method"
                and user.target == "view"
                and not any(isinstance(a, torch.dtype) for a in user.args[1:])
            ):
                user.target = "reshape"
                changed += 1
            work.append(user)
    return changed


def restore_output_layout(gm: fx.GraphModule, roots: Iterable[fx.Node]) -> int:
    """Make graph outputs computed from channels-last fused convs contiguous again (NCHW)."""
    roots = set(roots)
    reach: set[fx.Node] = set()
    work = list(roots)
    while work:
        n = work.pop()
        for u in n.users:
            if u not in reach:
                reach.add(u)
                work.append(u)
    reach |= roots
    out = next(n for n in gm.graph.nodes if n.op == "output")
    changed = 0

    def fix(a: object) -> object:
        nonlocal changed
        if isinstance(a, fx.Node) and a in reach:
            m = meta(a)
            if m is not None and len(m.shape) >= 3:
                with gm.graph.inserting_before(out):
                    c = gm.graph.call_method("contiguous", (a,))
                c.meta = dict(a.meta)
                changed += 1
                return c
        return a

    out.args = (fx.node.map_aggregate(out.args[0], fix),)
    return changed
