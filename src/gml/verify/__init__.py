"""Numerical and structural verification of graph rewrites."""

from __future__ import annotations

from gml.verify.harness import VerifyResult, verify_pass

__all__ = ["VerifyResult", "verify_pass"]
