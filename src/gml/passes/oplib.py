"""The op vocabulary, as the passes import it: defined once in :mod:`gml.ir.ops`.

Kept as an import path (``gml.passes.oplib``) for the passes and tools that read op kinds.
"""

from __future__ import annotations

from gml.ir.ops import ACTIVATION_KINDS, OPS, SPECS, OpSpec, has_tag, node_label, op_kind

__all__ = ["ACTIVATION_KINDS", "OPS", "SPECS", "OpSpec", "has_tag", "node_label", "op_kind"]
