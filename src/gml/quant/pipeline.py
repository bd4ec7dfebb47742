"""The INT8 pipeline, in one place and in order (``gml.quantize`` / ``gml quantize`` run exactly this).

::

    model ─ capture
          ─ reference_passes()        fp32 PassManager (checked, reported):
                                      Normalize → RecognizeTanhGelu → Untie → FoldBatchNorm → FoldPadIntoConv →
                                      fold_self_add_into_conv →
                                      conv_operand_first
          ─ prepare / calibrate /     torch.ao (gml.quant.frontend.prepare_reference):
            convert_to_reference      a reference Q/DQ graph
          ─ lowering_passes(backend)  PassManager (checked, reported):
                                      LowerToGML → FuseQConvAdd → LiftCombineQuant →
                                      FloatFromReference → UnfuseFloatModules → the fp32 fusion passes
                                      (gml.optimize's: what stays fp32 runs GML's fused fp32 kernels)
          ─ the lowered graph: torch.ops.gml calls (docs/ir.md), run by the Python executor,
            saved through torch.export

Every step of both lists is a :class:`~gml.passes.base.GraphPass` the manager checks against the
step before it and reports; no pass runs another pass inside itself.
"""

from __future__ import annotations

from gml.ir.target import Target
from gml.passes.base import FunctionPass, GraphPass, Tolerance
from gml.passes.bf16 import LowerToBf16
from gml.passes.fuse_all import fusion_passes
from gml.passes.group_norm import RecognizeGroupNorm
from gml.passes.leaf_format import LeafMemoryFormat
from gml.passes.lift_combine_quant import LiftCombineQuant
from gml.passes.pipeline import canonical_passes
from gml.quant.float_remainder import FloatFromReference, UnfuseFloatModules
from gml.quant.fuse_int8 import FuseQConvAdd
from gml.quant.lower import LowerToGML
from gml.quant.reference_rewrites import conv_operand_first, fold_self_add_into_conv


def reference_passes() -> list[GraphPass]:
    """The fp32 passes before ``prepare_fx``."""
    exact = Tolerance(atol=0.0, rtol=0.0)
    return [
        # Normalize (one module type per op, which the BackendConfig matches), untie (every fusion
        # owns its modules), fold BN (the convs carry final weights when their ranges are observed)
        *canonical_passes(),
        # y + y as a conv with doubled weights: the BackendConfig then fuses it like any conv.
        # Exact for y + y; other factors round differently by about an ulp (see its docstring)
        FunctionPass(fold_self_add_into_conv, "fold_self_add_into_conv", Tolerance(atol=0.0, rtol=1e-5)),
        # the fusable conv first in each add: the one operand order the BackendConfig lists
        FunctionPass(conv_operand_first, "conv_operand_first", exact),
    ]


def lowering_passes(
    backend: str | None = "onednn", *, fallback: str = "fp32", target: Target | None = None
) -> list[GraphPass]:
    """The passes after ``convert_to_reference_fx``. ``fallback="bf16"``: what stays out of INT8
    then runs on bf16 kernels (:class:`~gml.passes.bf16.LowerToBf16`, last; check the CPU first).
    ``target``: the CPU the graph is lowered for (default: this process's)."""
    return [
        # reads torch.ao's reference Q/DQ form, so it runs first: DQ → op → Q patterns become
        # torch.ops.gml calls on uint8 values; what has no INT8 kernel stays fp32 with a reason
        LowerToGML(backend, target),
        # on the gml ops: a conv feeding a residual add joins it (one kernel, oneDNN's sum post-op)
        FuseQConvAdd(),
        # last: the quantize ops left at fp32 → INT8 boundaries move above views, equal ones merge,
        # dequantize → quantize pairs with equal qparams vanish (all exact)
        LiftCombineQuant(),
        *fp32_remainder_passes(),
        *([LowerToBf16(target=target)] if fallback == "bf16" else []),
    ]


def fp32_remainder_passes() -> list[GraphPass]:
    """What stays fp32 after the lowering (kept by the cost policy, or no INT8 kernel) gets
    ``gml.optimize``'s rewriting: torch.ao's containers and reference modules become plain modules
    (:mod:`gml.quant.float_remainder`), then the same fusion passes (and leaf layout) as
    :func:`gml.passes.pipeline.fp32_passes` turn them into GML's fused fp32 kernels, which the
    native engine runs; a GroupNorm (no INT8 kernel) becomes ``gml.group_norm`` there too, so it
    runs inside the INT8 plan rather than splitting it (BiT: 50 segments)."""
    return [FloatFromReference(), UnfuseFloatModules(), RecognizeGroupNorm(), *fusion_passes(), LeafMemoryFormat()]
