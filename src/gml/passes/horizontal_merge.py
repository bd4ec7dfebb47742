"""Merge sibling Linear (or same-geometry Conv) nodes that read the same input into one wider op.

Before → after (Q/K/V projections are the classic case)::

    q = Lq(x); k = Lk(x); v = Lv(x)    →   qkv = L(x); q, k, v = torch.split(qkv, [nq, nk, nv], dim=-1)
    math: x [Wq; Wk; Wv]^T + [bq; bk; bv] = [x Wq^T + bq | x Wk^T + bk | x Wv^T + bv]

The merged layer stacks the weights along the output dimension (rows of a Linear weight, output
channels of a Conv weight) and concatenates the biases (a missing bias counts as zeros), so each
slice of the output is exactly one sibling's output. One GEMM/conv with N = nq+nk+nv reads ``x`` once
and keeps the cores busier than three narrow ones, which is what pays at small batch.

Convs (``convs=True``, off by default) merge when they share kernel size, stride, padding, dilation
and have ``groups == 1`` (1x1 branches of an Inception block, say); the split is along channels
(``dim=1``). It is off by default because a channel slice of a channels-last tensor is strided, and
the oneDNN conv that reads it first copies it to a dense tensor: on ResNet50 (``layer1.0.conv1`` +
``downsample``) that copy costs more than the saved read of the input.

If every sibling feeds exactly one activation of the same kind and parameters, the activation is
applied once to the merged output, before the split, so the conv/linear fusions can still fuse it.

The split outputs are views into the merged output: values are identical; code that mutates one
sibling's output in place still touches only its own slice. Run this pass before FuseConvActivation
/ FuseLinearActivation, which then lower the merged ``nn.Linear``/``nn.Conv2d``. The merged module's
weights live under a new name (``q_k_v``), so ``state_dict`` keys of the siblings change.

Skipped, with the reason: siblings whose geometry differs, siblings that feed different
activations (merging would leave those activations unfused on strided slices), modules called at
several sites, siblings called with extra arguments, a sibling whose output a ``.view`` reshapes
across the sliced dimension (eager's output is contiguous, the slice is not: the view would fail).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx, nn

from gml.kernels import fp32 as k32
from gml.passes import fuse_common as fc
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import add_module, get_module, modules_of


def _geometry(mod: nn.Module) -> tuple | str:
    """What must agree for two siblings to merge (or why this one cannot)."""
    if type(mod) is nn.Linear:
        return ("linear", mod.in_features, mod.weight.dtype)
    if type(mod) in fc.CONV_TYPES:
        if mod.groups != 1:
            return f"groups={mod.groups}"
        if mod.padding_mode != "zeros":
            return f"padding_mode={mod.padding_mode!r}"
        return (
            type(mod).__name__,
            mod.in_channels,
            mod.kernel_size,
            mod.stride,
            str(mod.padding),
            mod.dilation,
            mod.weight.dtype,
        )
    return f"{type(mod).__name__} is not a plain Linear/Conv"


def _merged(mods: list[nn.Module]) -> nn.Module:
    first = mods[0]
    weight = torch.cat([m.weight.detach() for m in mods], dim=0)
    has_bias = any(m.bias is not None for m in mods)
    bias = (
        torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods])
        if has_bias
        else None
    )
    if isinstance(first, nn.Linear):
        new: nn.Module = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, dtype=weight.dtype)
    else:
        new = type(first)(
            first.in_channels,
            weight.shape[0],
            first.kernel_size,
            stride=first.stride,
            padding=first.padding,
            dilation=first.dilation,
            bias=has_bias,
            dtype=weight.dtype,
        )
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new.eval()


def _view_fails_on(user: fx.Node, out: fx.Node, piece: torch.Tensor) -> bool:
    """Whether ``user`` is a ``.view`` / ``.view_as`` of ``out`` that ``piece`` (a meta tensor with
    the strides ``out`` would have) cannot take without a copy (unknown shape: assume it fails)."""
    if user.op != "call_method" or user.target not in ("view", "view_as") or not user.args or user.args[0] is not out:
        return False
    shape = fc.shape_of(user)
    if shape is None:
        return True
    try:
        piece.view(shape)
    except RuntimeError:
        return True
    return False


class HorizontalMerge(GraphPass):
    """Merges sibling Linear / Conv nodes over the same input into one op plus a split."""

    name = "horizontal_merge"
    tolerance = Tolerance(atol=1e-5, rtol=1e-5)

    def __init__(self, *, min_siblings: int = 2, convs: bool = False) -> None:
        self.min_siblings = max(2, min_siblings)
        self.convs = convs

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        merged = 0
        notes: list[str] = []
        types = (nn.Linear, *fc.CONV_TYPES) if self.convs else (nn.Linear,)
        for src in list(gm.graph.nodes):
            candidates = [u for u in src.users if isinstance(get_module(gm, u), types)]
            if len(candidates) < self.min_siblings:
                continue
            groups: dict[tuple, list[fx.Node]] = defaultdict(list)
            for user in candidates:
                mod = get_module(gm, user)
                why = self._problem(gm, user, src, mod)
                geo = _geometry(mod)
                if isinstance(geo, str):
                    why = why or geo
                if why:
                    skips.append(Skip(user.name, why, "sibling merge"))
                    continue
                groups[geo].append(user)
            sizes = [len(g) for g in groups.values()]
            if len(groups) > 1 and max(sizes) < self.min_siblings and sum(sizes) >= self.min_siblings:
                names = ", ".join(n.name for g in groups.values() for n in g)
                skips.append(Skip(src.name, f"siblings {names} differ in shape or geometry", "sibling merge"))
            for siblings in groups.values():
                if len(siblings) < self.min_siblings:
                    continue
                ordered = sorted(siblings, key=fc.graph_order(gm).__getitem__)
                write = fc.mutation_between(ordered[0], ordered[-1], modules)
                if write is not None:
                    skips.append(Skip(src.name, f"in-place {write.name} between the siblings", "sibling merge"))
                    continue
                tails = {self._tail(s, modules) for s in siblings}
                if len(tails) > 1 and any(isinstance(t, k32.PostOp) for t in tails):
                    names = ", ".join(s.name for s in siblings)
                    skips.append(
                        Skip(
                            src.name,
                            f"siblings {names} feed different activations (merging would unfuse them)",
                            "sibling merge",
                        )
                    )
                    continue
                siblings = self._drop_strided_views(siblings, modules, skips)
                if len(siblings) < self.min_siblings:
                    continue
                self._merge(gm, src, siblings, modules)
                merged += 1
                notes.append(f"merged {', '.join(str(s.target) for s in siblings)}")
        if merged:
            gm.graph.lint()
            gm.delete_all_unused_submodules()
            gm.recompile()
        return PassResult(gm, bool(merged), merged, skips, notes)

    @staticmethod
    def _tail(node: fx.Node, modules: dict[str, nn.Module]) -> k32.PostOp | str:
        """The activation module a sibling feeds alone (its fusable tail), or "other"."""
        if len(node.users) == 1:
            (user,) = node.users
            if user.op == "call_module" and fc.kind_of(user, modules) in fc.ACTIVATION_KINDS:
                post = k32.post_op_of(user, modules)
                if isinstance(post, k32.PostOp):
                    return post
        return "other"

    @staticmethod
    def _problem(gm: fx.GraphModule, node: fx.Node, src: fx.Node, mod: nn.Module) -> str | None:
        if node.args != (src,) or node.kwargs:
            return "called with extra arguments"
        sites = fc.call_sites(gm, str(node.target))
        if sites > 1:
            return f"module {node.target} is called at {sites} sites (run UntieSharedModules first)"
        return None

    def _drop_strided_views(
        self, siblings: list[fx.Node], modules: dict[str, nn.Module], skips: list[Skip]
    ) -> list[fx.Node]:
        """The siblings whose output may become a strided slice of the merged output.

        A sibling's output is contiguous in eager; merged, it is ``narrow(dim, offset, width)`` of
        the wider output. A ``.view`` that splits or joins the sliced dimension with another (``y.view(b, -1)``
        on a ``[b, s, n]`` slice of ``[b, s, N]``) then fails, where eager's worked (the fuzz property,
        seed 20261128). A view that keeps the sliced dimension apart (``q.view(b, s, heads, d)``, the
        Q/K/V case) works on the slice; only the others are declined, with the reason. A copy
        (``contiguous()``) would change what an in-place write through the view reaches."""
        dims = [-1 if isinstance(modules[str(s.target)], nn.Linear) else 1 for s in siblings]
        shapes = [fc.shape_of(s) for s in siblings]
        if any(shape is None for shape in shapes):
            return siblings
        total = sum(shape[d] for shape, d in zip(shapes, dims))
        post = self._shared_activation(siblings, modules)
        kept: list[fx.Node] = []
        for s, shape, d in zip(siblings, shapes, dims):
            merged = list(shape)
            merged[d] = total
            piece = torch.empty(merged, device="meta").narrow(d, 0, shape[d])  # a slice's strides
            out = next(iter(s.users)) if post is not None else s
            view = next((u for u in out.users if _view_fails_on(u, out, piece)), None)
            if view is None:
                kept.append(s)
            else:
                skips.append(
                    Skip(
                        s.name,
                        f"{view.name} views its output in a shape a slice of the merged output cannot take",
                        "sibling merge",
                    )
                )
        return kept

    def _shared_activation(self, siblings: list[fx.Node], modules: dict[str, nn.Module]) -> k32.PostOp | None:
        """The activation every sibling feeds (alone), if they all feed the same one."""
        tails = {self._tail(s, modules) for s in siblings}
        (tail,) = tails if len(tails) == 1 else (None,)
        return tail if isinstance(tail, k32.PostOp) else None

    def _merge(self, gm: fx.GraphModule, src: fx.Node, siblings: list[fx.Node], modules: dict[str, nn.Module]) -> None:
        order = fc.graph_order(gm)
        siblings = sorted(siblings, key=order.__getitem__)
        mods = [modules[str(s.target)] for s in siblings]
        widths = [m.weight.shape[0] for m in mods]
        dim = -1 if isinstance(mods[0], nn.Linear) else 1
        base = "_".join(str(s.target).rpartition(".")[2] for s in siblings)
        prefix = str(siblings[0].target).rpartition(".")[0]
        name = add_module(gm, f"{prefix}.{base}" if prefix else base, _merged(mods))
        post = self._shared_activation(siblings, modules)
        with gm.graph.inserting_before(siblings[0]):
            out = gm.graph.call_module(name, (src,))
            if post is not None:
                act_target = str(next(iter(siblings[0].users)).target)
                out = gm.graph.call_module(act_target, (out,))
            parts = gm.graph.call_function(torch.split, (out, widths), {"dim": dim})
            slices = [gm.graph.call_function(operator.getitem, (parts, i)) for i in range(len(siblings))]
        for s, piece in zip(siblings, slices):
            tail = next(iter(s.users)) if post is not None else s
            piece.meta = dict(tail.meta)
            tail.replace_all_uses_with(piece)
            fc.erase_chain(gm.graph, [s, tail])
