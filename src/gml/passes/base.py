"""The pass contract every GML-Lab graph pass follows.

It keeps the shape of ``torch.fx.passes.infra`` (a pass maps a ``GraphModule`` to a result that says
whether it changed anything) and adds what a user needs to trust a rewrite: how many patterns
matched, and every candidate the pass *declined* with a reason a person can read.

A pass is either a subclass of :class:`GraphPass` or a plain function ``gm -> PassResult``; wrap the
function with :class:`FunctionPass` to give it a name and a tolerance. Options are constructor
arguments; there are no global flags.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from torch import fx


@dataclass(frozen=True)
class Tolerance:
    """How far a pass may move the model's outputs: ``max|a-b| <= atol + rtol*max|b|`` per output.

    The bound scales with the output's largest magnitude rather than each element's: reordering
    float sums (folding, fused kernels) moves every element by an amount proportional to the
    magnitudes involved, so an element that happens to be near zero gets no smaller error.

    ``None`` as a pass's tolerance means the pass changes numerics on purpose (quantization) and
    the manager only checks that outputs stay finite and keep their shapes.
    """

    atol: float = 1e-5
    rtol: float = 1e-4


@dataclass
class Skip:
    """A candidate a pass looked at and declined."""

    node: str
    reason: str
    pattern: str = ""

    def __str__(self) -> str:
        where = f"{self.pattern} at {self.node}" if self.pattern else self.node
        return f"{where}: {self.reason}"


@dataclass
class PassResult:
    """What a pass did: the module, whether it changed, matches rewritten, candidates skipped."""

    graph_module: fx.GraphModule
    modified: bool
    matches: int = 0
    skips: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def rewrote(
        cls, gm: fx.GraphModule, matches: int, skips: Sequence[Skip], note: str, *, prune_modules: bool = False
    ) -> PassResult:
        """The result of a pass that rewrote ``matches`` places. If it changed anything, the graph is
        linted and recompiled (INVARIANTS.md; with ``prune_modules`` the submodules no node calls any
        more are deleted first) and ``note`` says what was done."""
        if matches:
            if prune_modules:
                gm.delete_all_unused_submodules()
            gm.graph.lint()
            gm.recompile()
        return cls(gm, matches > 0, matches, list(skips), [note] if matches else [])


class GraphPass(ABC):
    """Base class of a graph pass: one job, named, with a numeric tolerance.

    Subclasses implement :meth:`call`. They may mutate ``gm``'s graph and submodules in place (the
    :class:`~gml.passes.manager.PassManager` snapshots it first) but replace, never write, the
    tensors they change, and must leave it lint-clean and recompiled; see ``passes/INVARIANTS.md``.
    """

    name: ClassVar[str] = ""
    tolerance: Tolerance | None = Tolerance()
    #: True for a pass that writes tensors of the module in place (INVARIANTS.md 11): the manager
    #: then snapshots a full copy of the weights instead of sharing them
    writes_tensors: ClassVar[bool] = False

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        self.requires(gm)
        result = self.call(gm)
        self.ensures(result.graph_module)
        return result

    @abstractmethod
    def call(self, gm: fx.GraphModule) -> PassResult:
        """Rewrite ``gm`` and report what changed."""

    def requires(self, gm: fx.GraphModule) -> None:  # noqa: B027 - optional hook
        """Check preconditions; raise :class:`~gml.errors.GMLError` if the pass cannot run."""

    def ensures(self, gm: fx.GraphModule) -> None:  # noqa: B027 - optional hook
        """Check postconditions after :meth:`call`."""

    @property
    def pass_name(self) -> str:
        return self.name or type(self).__name__

    def __repr__(self) -> str:
        return f"<pass {self.pass_name}>"


class FunctionPass(GraphPass):
    """Adapts a plain function ``gm -> PassResult`` to the pass contract."""

    def __init__(
        self,
        fn: Callable[[fx.GraphModule], PassResult],
        name: str | None = None,
        tolerance: Tolerance | None = Tolerance(),
    ) -> None:
        self.fn = fn
        self._name = name or fn.__name__
        self.tolerance = tolerance

    @property
    def pass_name(self) -> str:
        return self._name

    def call(self, gm: fx.GraphModule) -> PassResult:
        return self.fn(gm)
