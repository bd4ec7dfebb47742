"""Graph passes: the pass contract, the manager that verifies each pass, and the passes themselves."""

from __future__ import annotations

from gml.passes.base import FunctionPass, GraphPass, PassResult, Skip, Tolerance
from gml.passes.manager import PassManager, PipelineReport, PipelineResult

__all__ = [
    "FunctionPass",
    "GraphPass",
    "PassManager",
    "PassResult",
    "PipelineReport",
    "PipelineResult",
    "Skip",
    "Tolerance",
]
