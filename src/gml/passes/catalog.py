"""Known fusible patterns, for ``gml inspect`` and the missed-fusion report.

Each entry is a chain over canonical op kinds (any spelling matches: ``F.relu``, ``x.relu()``
and ``nn.ReLU`` are all ``"relu"``) and the rewrite that would apply. The passes themselves own
the exact conditions; this catalog only answers "which opportunities does this graph contain?".
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from gml.passes.base import Skip
from gml.passes.oplib import SPECS, op_kind
from gml.passes.utils import match_chain, modules_of

ACTIVATIONS = tuple(name for name, spec in SPECS.items() if "activation" in spec.tags)


def _is_activation(node: fx.Node, modules: dict) -> bool:
    return op_kind(node, modules) in ACTIVATIONS


_is_activation.__name__ = "activation"


@dataclass(frozen=True)
class Pattern:
    name: str
    chain: tuple
    rewrite: str


PATTERNS: tuple[Pattern, ...] = (
    Pattern("conv → batchnorm", ("conv", "batchnorm"), "fold BN into the conv weights"),
    Pattern("conv_transpose → batchnorm", ("conv_transpose", "batchnorm"), "fold BN into the weights"),
    Pattern("linear → batchnorm", ("linear", "batchnorm"), "fold BN into the linear weights"),
    Pattern("conv → batchnorm → activation", ("conv", "batchnorm", _is_activation), "fold + fused conv kernel"),
    Pattern("conv → activation", ("conv", _is_activation), "oneDNN conv with post-op"),
    Pattern("conv → add → relu", ("conv", "add", "relu"), "oneDNN conv with binary add+relu post-op"),
    Pattern("conv → add", ("conv", "add"), "oneDNN conv with binary add post-op"),
    Pattern("linear → activation", ("linear", _is_activation), "oneDNN linear with post-op"),
    Pattern("matmul → add → relu", ("matmul", "add", "relu"), "fused linear (bias + relu)"),
)


@dataclass
class Occurrence:
    pattern: Pattern
    nodes: list[str]


def find_patterns(gm: fx.GraphModule) -> tuple[list[Occurrence], list[tuple[Pattern, Skip]]]:
    """Every occurrence of each catalog pattern, and the candidates blocked by fan-out."""
    found: list[Occurrence] = []
    blocked: list[tuple[Pattern, Skip]] = []
    modules_of(gm)  # fail early on a broken module tree
    for pat in PATTERNS:
        matches, skips = match_chain(gm, pat.chain, name=pat.name)
        found.extend(Occurrence(pat, [n.name for n in m.nodes]) for m in matches)
        blocked.extend((pat, s) for s in skips)
    return found, blocked


def sibling_groups(gm: fx.GraphModule, kinds: tuple[str, ...] = ("linear",)) -> list[list[str]]:
    """Groups of ≥2 nodes of ``kinds`` reading the same input: horizontal-merge candidates."""
    modules = modules_of(gm)
    groups = []
    for node in gm.graph.nodes:
        sibs = [u.name for u in node.users if op_kind(u, modules) in kinds and u.args[:1] == (node,)]
        if len(sibs) >= 2:
            groups.append(sibs)
    return groups
