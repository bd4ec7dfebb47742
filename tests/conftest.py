from __future__ import annotations

import os
import sys

import torch

# gml.quantize's cost policy times regions on this (shared, noisy) machine: tests that count INT8 ops
# must not depend on timing, and measuring every small model would slow the suite. Tests of the
# policy pass cost_policy explicitly (tests/quant/test_cost_policy.py).
os.environ.setdefault("GML_COST_POLICY", "off")
# The engine picks Winograd or the direct conv by timing at plan build (GML_WINOGRAD=auto, ADR 010):
# the suite forces Winograd on every eligible conv instead, so results do not depend on timing and
# every model test runs the Winograd path (tests/runtime/test_winograd.py sets the mode per test).
os.environ.setdefault("GML_WINOGRAD", "1")

# Tests share 2 cores with each other's processes; a fixed thread count keeps runs comparable.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
sys.path.insert(0, os.path.dirname(__file__))
