"""Decoder-only causal LMs on CPU: capture (:mod:`.spec`), GML's KV cache and layers (:mod:`.model`),
sampling (:mod:`.sampling`) and the API (:mod:`.api`). See docs/llm.md.

``gml.llm`` (the attribute of the ``gml`` package) is the function :func:`gml.llm.api.llm`; import this
package's contents with ``from gml.llm.api import LLM`` (``import gml.llm`` then names the function).
"""

from __future__ import annotations

from gml.llm.api import LLM, GenerationStats, llm

__all__ = ["LLM", "GenerationStats", "llm"]
