"""FuseQConvAdd: a conv and the residual add reading it become one INT8 kernel (oneDNN's sum post-op).

Before::

    u = gml.qconv(x, sx, zx, W, sw, b, geo..., su, zu, uint8, "none", ...)
    y = gml.qadd(u, su, zu, r, sr, zr, so, zo, act)          # act: "none" | "relu"

After::

    y = gml.qconv_add(x, sx, zx, W, sw, b, geo..., r, sr, zr, so, zo, act)

Math: ``Q_o(act(DQ_u(Q_u(conv(x))) + DQ_r(r)))`` becomes ``Q_o(act(conv(x) + DQ_r(r)))``: the
intermediate rounding of ``u`` to its own scale disappears, which moves results by at most about one
step of ``u``'s scale — so the pass has no tolerance (``None``) and tests compare it by cosine.

Declined, with the reason: a conv with its own post-op (``act(conv) + r`` is not ``act(conv + r)``),
a conv output read elsewhere, a 1-D or 3-D conv (the fused kernel is 2-D), a conv writing fp32, a
backend without the kernel (FBGEMM), a broadcasting add, an add of a value with itself.
"""

from __future__ import annotations

from torch import fx

from gml.ir import library
from gml.ir.match import Match, Op, Rule, Var, apply_rules
from gml.kernels.registry import get_backend
from gml.passes.base import GraphPass, PassResult, Skip


class ConvAddRule(Rule):
    """Replaces ``qadd(qconv(x), r)`` with ``qconv_add(x, r)``."""

    name = "qconv+qadd"
    pattern = Op("qadd", Op("qconv", Var("x"), name="conv"), Var("other"), name="add", commutative=True)

    def check(self, m: Match) -> str | None:
        conv, other = m["conv"], m["other"]
        c = library.op_args(conv)
        if not get_backend(c["backend"]).supports_conv_add:
            return f"the {c['backend']} backend has no conv kernel with a residual-add post-op"
        if other is conv:
            return "both add operands are the same conv output"
        if c["post_op"] != "none":
            return f"the conv has its own post-op ({c['post_op']}); act(conv) + r is not act(conv + r)"
        if len(conv.users) != 1:
            return f"the conv output has {len(conv.users)} users"
        if str(c["out_dtype"]) != "torch.uint8":
            return "the conv writes fp32"
        shape = conv.meta.get("tensor_meta")
        ndim = len(c["stride"])
        if ndim != 2:
            return f"a {ndim}-D conv (the fused residual kernel is 2-D)"
        other_meta = other.meta.get("tensor_meta")
        if shape is not None and other_meta is not None and tuple(shape.shape) != tuple(other_meta.shape):
            return f"the add broadcasts ({list(shape.shape)} + {list(other_meta.shape)})"
        return None

    def prefer(self, ms: list[Match]) -> Match:
        # two convs feeding one add: fuse the later one, whose residual is ready when it runs
        order = {n: i for i, n in enumerate(ms[0].root.graph.nodes)}
        return max(ms, key=lambda m: order[m["conv"]])

    def rewrite(self, m: Match) -> fx.Node:
        conv, add, other = m["conv"], m["add"], m["other"]
        c, a = library.op_args(conv), library.op_args(add)
        other_qp = (a["b_scale"], a["b_zero_point"]) if add.args[0] is conv else (a["a_scale"], a["a_zero_point"])
        args = (
            c["x"], c["x_scale"], c["x_zero_point"], c["weight"], c["weight_scale"], c["bias"],
            c["stride"], c["padding"], c["dilation"], c["groups"],
            other, *other_qp, a["out_scale"], a["out_zero_point"], a["post_op"], c["backend"],
        )  # fmt: skip
        with add.graph.inserting_before(add):
            new = add.graph.call_function(library.op("qconv_add"), args)
        new.meta.update({k: v for k, v in add.meta.items() if k != "gml_coverage"})
        conv_entry, add_entry = conv.meta.get("gml_coverage"), add.meta.get("gml_coverage")
        if conv_entry is not None and add_entry is not None:
            add_entry.nodes = conv_entry.nodes + add_entry.nodes
            add_entry.op = f"{conv_entry.op} + {add_entry.op}"
        if add_entry is not None:
            add_entry.result = "qconv_add"
            new.meta["gml_coverage"] = add_entry
        return new


class FuseQConvAdd(GraphPass):
    """Replaces ``gml.qadd(gml.qconv(x), r)`` with one ``gml.qconv_add(x, r)`` (see the module docstring)."""

    name = "fuse_qconv_add"
    tolerance = None

    def call(self, gm: fx.GraphModule) -> PassResult:
        report = apply_rules(gm, [ConvAddRule()])
        skips = [Skip(node.name, reason, rule) for node, rule, reason in report.declined]
        if report.total:
            gm.graph.lint()
            gm.recompile()
        notes = []
        if report.total:
            notes.append(
                f"fused {report.total} qconv → qadd pair(s) into qconv_add; the conv output is no longer "
                "rounded to its own scale before the add"
            )
        return PassResult(gm, modified=report.total > 0, matches=report.total, skips=skips, notes=notes)
