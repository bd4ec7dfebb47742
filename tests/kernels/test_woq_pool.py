"""native/woq_pool.h: one-row woq_linear calls split over helper threads give the one-thread result bit
for bit (a row's sum never depends on the split), with any thread count and from concurrent callers."""

from __future__ import annotations

import threading

import pytest
import torch

from gml.ir.llm_ops import quantize_weight
from gml.kernels.woq import detect_kernel, woq_linear_bound, woq_linear_native

ISA = detect_kernel()
pytestmark = pytest.mark.skipif(ISA is None, reason="the native engine is not built")


@pytest.mark.parametrize(
    "bits,group,act_bits", [(8, None, 0), (8, None, 8), (8, 32, 0), (8, 32, 8), (4, 32, 0), (4, 32, 8)]
)
def test_split_equals_one_thread(bits, group, act_bits):
    torch.manual_seed(0)
    # 1,030 rows: chunks of row blocks of 4 with a 2-row tail; INT8 per channel and in groups of 32
    w = quantize_weight(torch.randn(1030, 256), bits, group)
    x = torch.randn(1, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = woq_linear_native(x, w, None, ISA, act_bits)
        for n in (2, 3, 5):
            torch.set_num_threads(n)
            for _ in range(20):  # helpers asleep, spinning, or arriving late
                assert torch.equal(woq_linear_native(x, w, None, ISA, act_bits), ref)
    finally:
        torch.set_num_threads(threads)


def test_concurrent_callers_and_bound_calls():
    torch.manual_seed(1)
    ws = [quantize_weight(torch.randn(n, 128), 8) for n in (64, 640, 4100)]
    xs = [torch.randn(1, 128) for _ in ws]
    refs = [woq_linear_native(x, w, None, ISA, 8) for x, w in zip(xs, ws)]
    errors = []

    def caller(i: int) -> None:
        y = torch.empty(1, ws[i].out_features)
        call = woq_linear_bound(xs[i], ws[i], None, y, ISA, 8)
        for _ in range(200):
            call()
            if not torch.equal(y, refs[i]):
                errors.append(i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(ws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_bound_call_refuses_buffers_that_do_not_fit():
    w = quantize_weight(torch.randn(8, 64), 8)
    with pytest.raises(ValueError, match="do not fit"):
        woq_linear_bound(torch.randn(1, 32), w, None, torch.empty(1, 8), ISA)
    with pytest.raises(ValueError, match="contiguous fp32"):
        woq_linear_bound(torch.randn(1, 64, dtype=torch.float64), w, None, torch.empty(1, 8), ISA)
