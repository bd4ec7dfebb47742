from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Fuzzed models are tiny: one thread is faster than two fighting over a busy machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
