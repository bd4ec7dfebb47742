"""UntieSharedModules: one module object per call site.

Before: ``%a = call_module[relu](x); ...; %b = call_module[relu](y)``   (one ``nn.ReLU`` called twice)
After:  ``%a = call_module[relu](x); ...; %b = call_module[relu_1](y)``  (``relu_1`` = deepcopy of ``relu``)

Why: a pass that rewrites a module *by its path* (replace ``layer1.0.relu`` with a fused module,
fold a BN into ``conv``, swap in a quantized module) silently rewrites every other call of that
path too. torchvision's ``BasicBlock`` calls ``self.relu`` twice; the same bug class is behind pytorch
issues #104593 and #197539 and is why torchao's PT2E quantizer refuses stock ResNet18. After this
pass, every later pass may assume a module has exactly one call site (``passes/INVARIANTS.md`` #10).

Naming is stable and readable: the first call site (in graph order) keeps the original path; the
k-th other site gets the sibling ``<name>_<k>`` (the next free suffix if that is taken), so
``layer1.0.relu`` and ``layer1.0.relu_1`` sit side by side in the same block. The rewrite is exact:
a clone computes what the original computed.

Parameterized modules (a Conv called twice, weight sharing): cloning duplicates their weights. For
inference this is correct, and it is what the downstream rewrites need anyway (the two sites will be
folded, fused or quantized differently), so ``untie_parameterized=True`` is the default and the
growth is reported in the notes (extra parameters and bytes). A user deploying under a memory limit
passes ``untie_parameterized=False``: such modules stay shared and are reported as skips, and
later passes must then treat them as shared (``FoldBatchNorm`` does: it installs a folded copy
beside a shared conv).

Skipped with a reason: a module in training mode that has buffers (BatchNorm's running statistics
update on every call; clones would each keep their own), and shared parameterized modules when
``untie_parameterized=False``. Tied *parameters* of different modules (an embedding shared with an
output projection) are not call-site sharing and are left alone.
"""

from __future__ import annotations

import copy
from collections import Counter

from torch import fx, nn

from gml.passes.base import GraphPass, PassResult, Skip, Tolerance


def _tensor_count_and_bytes(mod: nn.Module) -> tuple[int, int]:
    tensors = [*mod.parameters(), *mod.buffers()]
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


class UntieSharedModules(GraphPass):
    """Give every ``call_module`` site its own module object (see module doc)."""

    name = "untie"
    tolerance = Tolerance(atol=0.0, rtol=0.0)  # clones compute exactly what the original did

    def __init__(self, *, untie_parameterized: bool = True) -> None:
        self.untie_parameterized = untie_parameterized

    def call(self, gm: fx.GraphModule) -> PassResult:
        sites: dict[str, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if node.op == "call_module":
                sites.setdefault(str(node.target), []).append(node)

        skips: list[Skip] = []
        cloned: Counter[str] = Counter()
        extra_numel = extra_bytes = 0
        for target, nodes in sites.items():
            if len(nodes) < 2:
                continue
            mod = gm.get_submodule(target)
            numel, nbytes = _tensor_count_and_bytes(mod)
            label = f"{type(mod).__name__} {target} × {len(nodes)} call sites"
            if mod.training and any(True for _ in mod.buffers()):
                reason = f"{target} is in training mode and updates its buffers on every call; copies would diverge"
                skips.extend(Skip(n.name, reason, label) for n in nodes[1:])
                continue
            if numel and not self.untie_parameterized:
                reason = f"{target} holds {numel} parameters/buffers; left shared (untie_parameterized=False)"
                skips.extend(Skip(n.name, reason, label) for n in nodes[1:])
                continue
            for node in nodes[1:]:
                new_target = self._sibling_name(gm, target)
                gm.add_submodule(new_target, copy.deepcopy(mod))
                node.target = new_target
                self._retarget_meta(node, target, new_target)
                cloned[type(mod).__name__] += 1
                extra_numel += numel
                extra_bytes += nbytes

        matches = sum(cloned.values())
        notes: list[str] = []
        if matches:
            gm.graph.lint()
            gm.recompile()
            total_numel, _ = _tensor_count_and_bytes(gm)
            before = total_numel - extra_numel
            growth = f"+{extra_numel} parameters/buffers ({extra_bytes / 2**20:.2f} MiB"
            growth += f", +{100.0 * extra_numel / before:.2f}%)" if before else ")"
            notes.append("added a copy per extra call site: " + ", ".join(f"{k} ×{v}" for k, v in cloned.most_common()))
            notes.append(f"weight growth from untying: {growth}")
        return PassResult(gm, matches > 0, matches, skips, notes)

    @staticmethod
    def _sibling_name(gm: fx.GraphModule, target: str) -> str:
        parent_path, _, attr = target.rpartition(".")
        parent = gm.get_submodule(parent_path) if parent_path else gm
        k = 1
        while hasattr(parent, f"{attr}_{k}"):
            k += 1
        return f"{parent_path + '.' if parent_path else ''}{attr}_{k}"

    @staticmethod
    def _retarget_meta(node: fx.Node, old: str, new: str) -> None:
        """Keep ``nn_module_stack`` pointing at the module the node now calls."""
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return
        key, (path, cls) = next(reversed(stack.items()))
        if path == old:
            stack = copy.copy(stack)
            stack[key] = (new, cls)
            node.meta["nn_module_stack"] = stack


__all__ = ["UntieSharedModules"]
