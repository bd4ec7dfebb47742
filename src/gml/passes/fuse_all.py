"""The fp32 fusion passes in their recommended order (after Normalize → UntieSharedModules → FoldBatchNorm).

* ``HorizontalMerge`` first: it merges plain ``nn.Linear`` siblings, which the later passes lower.
* ``FuseConvAdd`` before ``FuseConvActivation``: the residual fusion needs the bare ``nn.Conv2d``;
  the activation pass lowers every conv it sees, so it would hide the conv from the add.
* ``FuseLinearActivation`` and ``FuseMatmulAddRelu`` touch disjoint nodes (modules vs matmul calls).
* ``FuseElementwise`` last: an ``add → relu`` next to a conv is the conv fusion's job, not ``_add_relu``'s.
"""

from __future__ import annotations

from gml.passes.base import GraphPass
from gml.passes.fuse_conv import FuseConvActivation, FuseConvAdd
from gml.passes.fuse_elementwise import FuseElementwise
from gml.passes.fuse_linear import FuseLinearActivation
from gml.passes.fuse_matmul import FuseMatmulAddRelu
from gml.passes.horizontal_merge import HorizontalMerge

FUSION_PASS_CLASSES: tuple[type[GraphPass], ...] = (
    HorizontalMerge,
    FuseConvAdd,
    FuseConvActivation,
    FuseLinearActivation,
    FuseMatmulAddRelu,
    FuseElementwise,
)


def fusion_passes() -> list[GraphPass]:
    """Fresh instances of the fp32 fusion passes, default options, recommended order."""
    return [cls() for cls in FUSION_PASS_CLASSES]


__all__ = ["FUSION_PASS_CLASSES", "fusion_passes"]
