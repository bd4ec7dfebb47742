"""GML-Lab: torch.fx graph rewriting for fast, verified CPU inference."""

from __future__ import annotations

from typing import Any

from gml import data  # gml.data.open_data: the user's images / text / tensors as model inputs
from gml.api import OptimizeResult, QuantizeResult, optimize, quantize, verify
from gml.capture import capture
from gml.errors import GMLError
from gml.llm import llm  # the function gml.llm(...) (binds over the subpackage's name; see gml/llm/__init__.py)
from gml.verify import VerifyResult, verify_pass


def load(
    path: str, *, runtime: str = "engine", trust_pickle: bool = False, target: Any = None, options: Any = None
) -> Any:
    """Load a model saved by ``gml.optimize(...).save`` / ``gml.quantize(...).save`` (no pickle, no
    model source) and rebuild it for this machine (``target``: a :class:`gml.ir.target.Target`,
    default this process's; ``options``: a :class:`gml.runtime.options.EngineOptions`, default the
    ``GML_*`` variables'); ``runtime="engine"`` compiles the native engine's plan here. See
    :func:`gml.io.load`. A file ``lm.save`` wrote loads as a :class:`gml.llm.api.LLM` (its kernels
    chosen for ``target``; ``gml.llm(path, max_length=...)`` takes the LLM's own options)."""
    from gml.io import load as _load

    return _load(path, runtime=runtime, trust_pickle=trust_pickle, target=target, options=options)


__all__ = [
    "GMLError",
    "OptimizeResult",
    "QuantizeResult",
    "VerifyResult",
    "capture",
    "data",
    "llm",
    "load",
    "optimize",
    "quantize",
    "verify",
    "verify_pass",
]
__version__ = "0.1.0"
