"""The small public API: ``optimize``, ``quantize``, ``verify``, ``benchmark``.

Each takes an ``nn.Module`` (eval mode) and example inputs, never mutates the caller's model, and
returns a result object carrying the rewritten module *and* the report that explains it. This module
only gathers them: ``gml.optimize`` is :mod:`gml.optimizing`, ``gml.quantize`` (one driver, the INT8
schemes) :mod:`gml.quantizing`.
"""

from __future__ import annotations

from gml.optimizing import PRECISIONS, check_precision, optimize, optimize_graph, verify
from gml.quantizing import SCHEMES, check_accuracy_drop, check_min_cosine, choose_scheme, quantize
from gml.results import OptimizeResult, QuantizeResult

__all__ = [
    "PRECISIONS",
    "SCHEMES",
    "OptimizeResult",
    "QuantizeResult",
    "check_accuracy_drop",
    "check_min_cosine",
    "check_precision",
    "choose_scheme",
    "optimize",
    "optimize_graph",
    "quantize",
    "verify",
]
