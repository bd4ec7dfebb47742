"""GML Runtime: lowered graphs executed as oneDNN primitives by the native engine (native/).

``compile_engine(gm, example_inputs)`` partitions a lowered GraphModule into engine segments and
torch nodes and returns an :class:`EngineModule` whose ``report`` says which path runs each node.
The graph → engine translation is one table (:mod:`gml.runtime.rules`). See docs/architecture.md
("GML Runtime") and docs/adr/006-native-engine.md.
"""

from __future__ import annotations

from gml.runtime.compile import EngineModule, EngineSegment, RuntimeReport, compile_engine, partition
from gml.runtime.native import unavailable_reason
from gml.runtime.options import EngineOptions

__all__ = [
    "EngineModule",
    "EngineOptions",
    "EngineSegment",
    "RuntimeReport",
    "compile_engine",
    "partition",
    "unavailable_reason",
]
