"""GML-Lab: torch.fx graph rewriting for fast, verified CPU inference."""

from __future__ import annotations

from gml.api import OptimizeResult, QuantizeResult, optimize, quantize, verify
from gml.capture import capture
from gml.errors import GMLError
from gml.verify import VerifyResult, verify_pass

__all__ = [
    "GMLError",
    "OptimizeResult",
    "QuantizeResult",
    "VerifyResult",
    "capture",
    "optimize",
    "quantize",
    "verify",
    "verify_pass",
]
__version__ = "0.1.0"
