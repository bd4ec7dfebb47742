"""oneDNN 3.2's AMX 1x1 convolution (``jit_1x1:avx512_core_amx``) wrote past the end of its
destination for some output sizes (an INT8 64 -> 128 conv on a 6x6 map: 0.5-1.5 KB past the 4.6 KB
output), corrupting the heap: timm resnet10t INT8 at its 176 px default crashed the process on an AMX
CPU. The engine never takes that kernel (``native/conv.h``, ``skip_broken_impls``). On other CPUs
these tests check the numbers only."""

from __future__ import annotations

import pytest
import torch

from gml.runtime import unavailable_reason

from .helpers import assert_close_int, graph_of, qconv, rand_u8, run_both

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.mark.parametrize("hw", [(6, 6), (1, 33), (6, 7), (1, 48), (4, 4), (10, 10)], ids=str)
@pytest.mark.parametrize("cin,cout", [(64, 128), (256, 512)])
def test_an_int8_1x1_conv_writes_only_its_output(cin: int, cout: int, hw: tuple[int, int]) -> None:
    gm = graph_of(qconv(cin, cout, 1))
    x = rand_u8(1, cin, *hw).contiguous(memory_format=torch.channels_last)
    ref, eng, got = run_both(gm, x)
    assert [impl for _, impl in eng.step_impls() if impl.startswith("jit_1x1:avx512_core_amx")] == []
    with torch.no_grad():
        for _ in range(10):  # a write past the output corrupts the heap: later allocations abort
            got = eng(x)
            junk = [torch.empty(64 + j) for j in range(200)]
            del junk
    assert_close_int(ref, got)
