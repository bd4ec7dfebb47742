from __future__ import annotations

import os
import sys

import torch

# Tests share 2 cores with each other's processes; a fixed thread count keeps runs comparable.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
sys.path.insert(0, os.path.dirname(__file__))
