"""Fuse element-wise chains that one existing CPU kernel computes in a single pass over memory.

Before → after (any spelling of each op; ``x`` is the same node on both sides of ``*``)::

    relu(a + b)            →   AddReLU(a, b)    (ATen ``_add_relu``: one read of a, b, one write)
    x * sigmoid(x)         →   nn.SiLU()(x)     (ATen ``silu``)
    x * hardsigmoid(x)     →   nn.Hardswish()(x) (ATen ``hardswish``; hardswish(x) = x·hardsigmoid(x))

Each chain of two ops reads and writes its intermediate once; the fused kernel never materializes
it. The math is unchanged (``_add_relu`` is ``add`` then ``max(0, ·)`` per element; SiLU and Hardswish
are defined as those products), up to the last ulp of the vectorized sigmoid.

What this pass does **not** do: there is no general element-wise code generator here. ATen and
oneDNN ship kernels for a few fixed chains only, so any other adjacent pair of element-wise ops
(``add → sigmoid``, ``mul → add``, ``sub → tanh``, ...) is reported as a skip ("no single CPU kernel
computes add → sigmoid") instead of being wrapped in a module that would call the same two ops in
Python, which is not a fusion. Inductor's C++ codegen is the tool for those. Element-wise ops that
sit after a conv or linear are the job of the conv/linear fusions, which run first.

Skipped, with the reason: intermediates read elsewhere ("add output has 2 users"), adds with
``alpha != 1`` or a constant operand (``_add_relu`` takes two tensors), operands of different dtypes.
"""

from __future__ import annotations

from torch import fx, nn

from gml.kernels import fp32 as k32
from gml.passes import fuse_common as fc
from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.oplib import SPECS
from gml.passes.utils import add_module, modules_of

ELEMENTWISE_KINDS = frozenset(name for name, spec in SPECS.items() if "elementwise" in spec.tags)
_GATES = {"sigmoid": (nn.SiLU, "x * sigmoid(x)"), "hardsigmoid": (nn.Hardswish, "x * hardsigmoid(x)")}


class FuseElementwise(GraphPass):
    """Replaces ``relu(a+b)``, ``x*sigmoid(x)``, ``x*hardsigmoid(x)`` with one ATen kernel each."""

    name = "fuse_elementwise"
    tolerance = Tolerance(atol=1e-5, rtol=1e-5)

    def call(self, gm: fx.GraphModule) -> PassResult:
        modules = modules_of(gm)
        skips: list[Skip] = []
        done: list[str] = []
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph:  # erased by an earlier rewrite in this loop
                continue
            kind = fc.kind_of(node, modules)
            if kind == "relu":
                self._add_relu(gm, node, modules, skips, done)
            elif kind == "mul":
                self._gated(gm, node, modules, skips, done)
        self._report_other_chains(gm, modules, skips)
        note = f"fused: {', '.join(f'{n} ×{done.count(n)}' for n in sorted(set(done)))}"
        return PassResult.rewrote(gm, len(done), skips, note, prune_modules=True)

    @staticmethod
    def _replace(gm: fx.GraphModule, chain: list[fx.Node], base: str, module: nn.Module, args: tuple) -> None:
        old = chain[-1]
        name = add_module(gm, base, module)
        with gm.graph.inserting_before(old):
            new = gm.graph.call_module(name, args)
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new)
        fc.erase_chain(gm.graph, chain)

    def _add_relu(self, gm, relu: fx.Node, modules, skips: list[Skip], done: list[str]) -> None:
        src = relu.args[0] if relu.args else None
        if not isinstance(src, fx.Node) or fc.kind_of(src, modules) != "add":
            return
        if not isinstance(k32.post_op_of(relu, modules), k32.PostOp):
            return
        ops = fc.add_operands(src, modules)
        why = ops if isinstance(ops, str) else None
        if why is None and len(src.users) != 1:
            why = f"add output has {len(src.users)} users"
        if why is None:
            why = self._same_dtype(*ops)
        if why is None and (write := fc.mutation_between(src, relu, modules)) is not None:
            why = f"in-place {write.name} between the add and the relu"
        if why:
            skips.append(Skip(relu.name, why, "add → relu"))
            return
        self._replace(gm, [src, relu], f"{src.name}_relu", k32.AddReLU(), ops)
        done.append("add+relu")

    def _gated(self, gm, mul: fx.Node, modules, skips: list[Skip], done: list[str]) -> None:
        args = [a for a in mul.args if isinstance(a, fx.Node)]
        if len(args) != 2 or len(mul.args) != 2:
            return
        for x, gate in (args, args[::-1]):
            kind = fc.kind_of(gate, modules)
            if kind not in _GATES or not gate.args or gate.args[0] is not x:
                continue
            module_type, label = _GATES[kind]
            if len(gate.users) != 1:
                skips.append(Skip(mul.name, f"{kind} output has {len(gate.users)} users", label))
                return
            if gate.op == "call_function" and (len(gate.args) > 1 or gate.kwargs.get("inplace")):
                return
            if fc.mutation_between(gate, mul, modules) is not None:
                return
            self._replace(gm, [gate, mul], f"{x.name}_{module_type.__name__.lower()}", module_type(), (x,))
            done.append(label)
            return

    @staticmethod
    def _same_dtype(a: fx.Node, b: fx.Node) -> str | None:
        ma, mb = fc.meta(a), fc.meta(b)
        if ma is not None and mb is not None and ma.dtype != mb.dtype:
            return f"operands are {ma.dtype} and {mb.dtype}"
        return None

    @staticmethod
    def _report_other_chains(gm: fx.GraphModule, modules, skips: list[Skip]) -> None:
        """Adjacent element-wise ops with no single kernel: said, not faked."""
        ew = ELEMENTWISE_KINDS | fc.ACTIVATION_KINDS
        for node in gm.graph.nodes:
            kind = fc.kind_of(node, modules)
            if kind not in ew or len(node.users) != 1:
                continue
            (user,) = node.users
            nxt = fc.kind_of(user, modules)
            if nxt not in ew:
                continue
            skips.append(
                Skip(
                    user.name,
                    f"no single CPU kernel computes {kind} → {nxt} (left as two ops)",
                    "element-wise chain",
                )
            )
