"""Fuse convolutions with what follows them onto oneDNN's fused conv kernels.

Two passes, each one job:

:class:`FuseConvAdd` — the residual tail, before → after::

    y = conv(x); z = y + other; [out = relu(z)]   →   out = FusedConvAdd(x, other)
    math: out = [relu](conv(x, W) + b + other), one ``_convolution_pointwise.binary`` call

The conv may be either operand of the add. ``other`` is an argument of the add, so it is computed
before the fused node, which takes the add's place. When nothing reads ``other`` after the add and
``other`` is a fresh tensor (a conv/pool/add output, not a model input or a view), the sum is
accumulated into ``other``'s buffer (``_convolution_pointwise_.binary``, oneDNN's sum post-op), which
saves the output allocation; otherwise the out-of-place kernel runs.

:class:`FuseConvActivation` — conv + element-wise activation, and every other conv, before → after::

    y = conv(x); out = act(y)   →   out = FusedConv[act](x)      math: act(conv(x, W) + b)
    y = conv(x)                 →   y = FusedConv[none](x)       (prepacked weight, channels-last)

``act`` is any activation with a oneDNN post-op (ReLU, ReLU6/Hardtanh, Sigmoid, Tanh, SiLU,
Hardswish, Hardsigmoid, LeakyReLU, GELU erf/tanh). Run FuseConvAdd first: it needs the bare conv.

Both passes keep the module path: the fused module replaces the conv at its dotted name, so the
``state_dict`` keys of the weights do not change (``layer1.0.conv1.weight``).

Fused convs return channels-last tensors, which is what makes consecutive oneDNN convs reorder-free.
Two consequences are handled here: ``.view`` calls downstream become ``.reshape`` (a view of a
channels-last tensor can fail where the NCHW one worked), and 4-D/5-D model outputs computed from a
fused conv are made contiguous again, so callers see the layout they saw before.

Skipped, with the reason in the report: conv output read by more than the activation/add
("conv output has 2 users"), activations without a oneDNN post-op (ELU, ...), adds that broadcast
or have ``alpha != 1`` or non-fp32 operands, add operands without shape metadata, grouped or 1-D
convs into an add (the binary kernel fuses only ``groups == 1`` 2-D/3-D convs), a non-ReLU
activation after the add (fused: conv + add; the activation stays), ``padding_mode`` other than
zeros, asymmetric ``padding='same'``, conv modules called at several sites (run UntieSharedModules).
"""

from __future__ import annotations

from torch import fx, nn

from gml.ir.alias import alias_set, may_alias
from gml.kernels import fp32 as k32
from gml.passes import fuse_common as fc
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import get_module, modules_of, replace_module

# oneDNN reorders and accumulates in a different order than ATen's conv: a few ulp per output.
FUSION_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-4)


def _finish(gm: fx.GraphModule, fused_nodes: list[fx.Node], notes: list[str], keep_output_layout: bool) -> None:
    views = fc.make_views_layout_safe(gm, fused_nodes)
    if views:
        notes.append(f"{views} .view() call(s) after fused convs became .reshape() (channels-last outputs)")
    if keep_output_layout:
        outs = fc.restore_output_layout(gm, fused_nodes)
        if outs:
            notes.append(f"{outs} model output(s) made contiguous again after channels-last fused convs")
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


class FuseConvAdd(GraphPass):
    """Replaces ``[relu](conv(x) + other)`` with one :class:`~gml.kernels.fp32.FusedConvAdd`."""

    name = "fuse_conv_add"
    tolerance = FUSION_TOLERANCE

    def __init__(self, *, inplace: bool = True, keep_output_layout: bool = True) -> None:
        self.inplace = inplace
        self.keep_output_layout = keep_output_layout

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        order = fc.graph_order(gm)
        skips: list[Skip] = []
        notes = fc.fallback_notes()
        fused: list[fx.Node] = []
        n_inplace = 0
        for add in list(gm.graph.nodes):
            if fc.kind_of(add, modules) != "add":
                continue
            ops = fc.add_operands(add, modules)
            if isinstance(ops, str):
                if any(fc.kind_of(a, modules) == "conv" for a in add.all_input_nodes):
                    skips.append(Skip(add.name, ops, "conv → add"))
                continue
            choice, reasons = None, []
            for conv, other in dict.fromkeys((ops, ops[::-1])):  # one order when x + x
                why = self._problem(gm, modules, conv, other, add)
                if why is None:
                    choice = (conv, other)
                    break
                if why:
                    reasons.append(f"{conv.name}: {why}")
            if choice is None:
                if reasons:
                    skips.append(Skip(add.name, "; ".join(reasons), "conv → add"))
                continue
            conv, other = choice
            tail, relu = add, False
            if len(add.users) == 1:
                (user,) = add.users
                kind = fc.kind_of(user, modules)
                if kind in fc.ACTIVATION_KINDS:
                    post = k32.post_op_of(user, modules)
                    if isinstance(post, k32.PostOp) and post.attr == "relu":
                        tail, relu = user, True
                    else:
                        skips.append(
                            Skip(
                                user.name,
                                f"{post if isinstance(post, k32.PostOp) else kind} after conv+add is not fused "
                                "(the binary kernel fuses only relu after the add)",
                                "conv → add → act",
                            )
                        )
            # The fused node reads the conv's input; it can stay where the conv was if the residual
            # already exists there, else it moves to the add, past any in-place write in between.
            at = conv if order[other] < order[conv] else add
            if at is add:
                write = fc.mutation_between(conv, add, modules)
                if write is not None:
                    skips.append(Skip(add.name, f"in-place {write.name} between the conv and the add", "conv → add"))
                    continue
            inplace = self.inplace and self._can_overwrite(other, conv, add, order, modules) is None
            mod = modules[str(conv.target)]
            new_mod = k32.FusedConvAdd.from_conv(mod, relu=relu, inplace=inplace, input_size=fc.shape_of(conv.args[0]))
            replace_module(gm, str(conv.target), new_mod)
            with gm.graph.inserting_before(at):
                new = gm.graph.call_module(str(conv.target), (conv.args[0], other))
            new.meta = fc.fused_meta(conv, tail)
            tail.replace_all_uses_with(new)
            fc.erase_chain(gm.graph, [conv, add, tail])
            modules[str(conv.target)] = new_mod
            order[new] = order[add]
            fused.append(new)
            n_inplace += inplace
        if fused:
            notes.append(f"{n_inplace}/{len(fused)} conv+add kernels accumulate in place into the residual")
            _finish(gm, fused, notes, self.keep_output_layout)
        return PassResult(gm, bool(fused), len(fused), skips, notes)

    @staticmethod
    def _problem(
        gm: fx.GraphModule, modules: dict[str, nn.Module], conv: fx.Node, other: fx.Node, add: fx.Node
    ) -> str | None:
        """Why ``conv`` cannot be fused into ``add`` with ``other`` as the residual ('' = not a conv)."""
        mod = get_module(gm, conv)
        if mod is None or type(mod) not in fc.CONV_TYPES:
            return ""
        if other is conv:
            return "the add reads the conv output twice (x + x)"
        why = fc.conv_problem(gm, conv, mod)
        if why:
            return why
        if mod.weight.dim() == 3:
            return "conv1d: the binary-add kernel takes 2-D and 3-D convs only"
        if mod.groups != 1:
            return f"groups={mod.groups}: oneDNN's binary-add conv falls back to unfused ops for groups > 1"
        if len(conv.users) != 1:
            return f"conv output has {len(conv.users)} users"
        a, b = fc.shape_of(conv), fc.shape_of(other)
        if a is None or b is None:
            return "add operand shapes unknown (no tensor_meta: capture with example inputs)"
        if a != b:
            return f"add operands have different shapes {list(a)} vs {list(b)} (broadcast)"
        return fc.dtype_problem(conv, other)

    @staticmethod
    def _can_overwrite(
        other: fx.Node, conv: fx.Node, add: fx.Node, order: dict[fx.Node, int], modules: dict[str, nn.Module]
    ) -> str | None:
        if other.op != "call_module" or not isinstance(modules.get(str(other.target)), fc.fresh_output_types()):
            return "residual is not a fresh module output"
        if may_alias(conv.args[0], other, modules):
            return "the conv reads the residual itself (the kernel would overwrite its own input)"
        # a read of the residual after the add, directly or through a view of it (a permute of the
        # residual read later: the fuzz property, seed 20261128 — the in-place sum changed that read)
        aliases = alias_set(other, modules)
        late = [u for a in aliases for u in a.users if u is not add and u not in aliases and order[u] > order[add]]
        if late:
            return f"residual is read after the add by {late[0].name}"
        return None


class FuseConvActivation(GraphPass):
    """Replaces ``act(conv(x))`` with one :class:`~gml.kernels.fp32.FusedConv` and lowers other convs."""

    name = "fuse_conv"
    tolerance = FUSION_TOLERANCE

    def __init__(self, *, lower_unfused: bool = True, keep_output_layout: bool = True) -> None:
        self.lower_unfused = lower_unfused
        self.keep_output_layout = keep_output_layout

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        notes = fc.fallback_notes()
        fused: list[fx.Node] = []
        lowered = 0
        for conv in list(gm.graph.nodes):
            mod = get_module(gm, conv)
            if mod is None or not isinstance(mod, fc.CONV_TYPES):
                continue
            why = fc.conv_problem(gm, conv, mod)
            if why:
                skips.append(Skip(conv.name, why, "conv → act"))
                continue
            post, tail = k32.NO_POST_OP, conv
            act = fc.fusable_activation(conv, modules, "conv", skips)
            if act is not None:
                tail, post = act
            if tail is conv and not self.lower_unfused:
                continue
            new_mod = k32.FusedConv.from_conv(mod, post, input_size=fc.shape_of(conv.args[0]))
            replace_module(gm, str(conv.target), new_mod)
            modules[str(conv.target)] = new_mod
            if tail is not conv:
                conv.meta = fc.fused_meta(conv, tail)
                tail.replace_all_uses_with(conv)
                fc.erase_chain(gm.graph, [tail])
            else:
                lowered += 1
            fused.append(conv)
        if fused:
            notes.append(f"{len(fused) - lowered} conv+activation fused, {lowered} conv(s) lowered without post-op")
            _finish(gm, fused, notes, self.keep_output_layout)
        return PassResult(gm, bool(fused), len(fused) - lowered, skips, notes)
