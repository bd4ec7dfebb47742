"""The Python executor's packed weight copies, as one thing to drop.

The fp32 / bf16 fused modules (:mod:`gml.kernels.fp32`, :mod:`gml.kernels.bf16`) keep a copy of
their weight reordered for oneDNN (``_Prepacked._packed``) and the INT8 ops
(:mod:`gml.kernels.int8_ops`) a packing per weight tensor. Both are derived state, rebuilt on the
next call. Once the native engine runs a graph, the copies the Python executor made while the engine
was compiled and checked against it are a second (and third) copy of every weight that nothing
calls: :func:`drop_packed` releases them (issue #28).
"""

from __future__ import annotations

from torch import nn


def drop_packed(module: nn.Module) -> int:
    """Drop every packed weight copy made for ``module``'s submodules and tensor constants; the
    number dropped. The Python executor packs again on its next call."""
    from gml.kernels import int8_ops
    from gml.kernels.fp32 import _Prepacked
    from gml.memory import module_tensors

    dropped = 0
    for mod in module.modules():
        if isinstance(mod, _Prepacked) and mod._packed is not None:
            mod._packed = None
            dropped += 1
    return dropped + int8_ops.drop_packs(module_tensors(module))
