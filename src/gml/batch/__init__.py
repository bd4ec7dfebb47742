"""Batch inference of saved models (``gml run``): in process or on Ray Data, resumable shards."""

from __future__ import annotations

from gml.batch.run import RunReport, run_batch

__all__ = ["RunReport", "run_batch"]
