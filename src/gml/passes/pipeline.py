"""The default pass pipelines, as explicit ordered lists.

Order matters and is fixed here, not discovered:

* ``FoldConstants`` first: what depends only on parameters (timm's standardized conv weights) becomes
  a stored tensor, so Normalize can give the conv that reads it a module form.
* ``Normalize`` next, so every later pass sees one node kind per op (ADR 001).
* ``RecognizeTanhGelu`` right after it (it matches Normalize's modules): the tanh GELU spelled as
  eight ops (HF ``gelu_new``: GPT-2, ALBERT) becomes one ``nn.GELU``, which the fusions take as a
  post-op of the linear before it.
* ``UntieSharedModules`` before anything that rewrites a module, so a rewrite at one call site
  can never change another (BasicBlock's shared ``relu``).
* ``FoldBatchNorm`` before fusion: conv+BN+ReLU becomes conv+ReLU, which the fused kernels take.
* ``MergeBranches`` right after it: once each branch's BN is folded, RepVGG/MobileOne-style parallel
  conv + identity branches summed by an add are one conv (structural re-parameterization); then
  ``FoldBatchNorm`` once more, for a BN that read the sum and now reads that conv.
* ``FoldPadIntoConv`` after them (a BN folds forward only into an unpadded conv, so the pad stays
  visible to it): a symmetric zero pad becomes the conv's padding.
* ``FuseAttention`` after Normalize (which removes eval dropout between softmax and the second
  matmul) and before the fusions: attention becomes one ``gml.attention`` call they leave alone.
* ``RecognizeRMSNorm`` after Normalize and FoldConstants (it matches their modules and Gemma's folded
  ``1 + w``), fp32 only: RMSNorm becomes one ``gml.rms_norm`` op the engine runs between the linears.
* ``RecognizeGroupNorm`` beside it, fp32 only: ``nn.GroupNorm`` and timm's ``F.group_norm`` calls
  become one ``gml.group_norm`` op the engine runs between the convs (before, each ended a segment).
* fusions last, since they replace modules with kernel modules that other passes do not look into;
  their own order (and why) is in :mod:`gml.passes.fuse_all`.
* ``LeafMemoryFormat`` after them: fused convs write channels-last; an opaque leaf gets back the
  layout it was traced with.
"""

from __future__ import annotations

from gml.passes.attention import FuseAttention
from gml.passes.base import GraphPass
from gml.passes.fold_bn import FoldBatchNorm
from gml.passes.fold_constants import FoldConstants
from gml.passes.fold_pad import FoldPadIntoConv
from gml.passes.fuse_all import FUSION_PASS_CLASSES, fusion_passes
from gml.passes.gelu import RecognizeTanhGelu
from gml.passes.group_norm import RecognizeGroupNorm
from gml.passes.leaf_format import LeafMemoryFormat
from gml.passes.merge_branches import MergeBranches
from gml.passes.normalize import Normalize
from gml.passes.rms_norm import RecognizeRMSNorm
from gml.passes.untie import UntieSharedModules


def canonical_passes() -> list[GraphPass]:
    """Fold constants → normalize → tanh GELU → untie → fold BN → merge branches → fold pads: the exact rewrites
    both the fp32 and INT8 pipelines start with."""
    return [
        FoldConstants(),
        Normalize(),
        RecognizeTanhGelu(),
        UntieSharedModules(),
        FoldBatchNorm(),
        MergeBranches(),
        FoldBatchNorm(),  # a BN after a merged sum (RepViT's bn(conv(x) + conv1(x) + x)) now follows a conv
        FoldPadIntoConv(),
    ]


def fp32_passes() -> list[GraphPass]:
    """The default fp32 pipeline of ``gml optimize`` / :func:`gml.optimize`."""
    return [
        *canonical_passes(),
        FuseAttention(),
        RecognizeRMSNorm(),
        RecognizeGroupNorm(),
        *fusion_passes(),
        LeafMemoryFormat(),
    ]


def available_passes() -> dict[str, type[GraphPass]]:
    """Pass name → class, for ``gml optimize --passes``; names are the passes' own ``name``."""
    classes: list[type[GraphPass]] = [FoldConstants, Normalize, RecognizeTanhGelu, UntieSharedModules, FoldBatchNorm]
    classes += [MergeBranches]
    classes += [FoldPadIntoConv]
    classes += [FuseAttention, RecognizeRMSNorm, RecognizeGroupNorm]
    classes += [*FUSION_PASS_CLASSES, LeafMemoryFormat]
    return {cls.name: cls for cls in classes}


def passes_by_name(names: list[str]) -> list[GraphPass]:
    """Instantiate passes with default options, in the order given; unknown names raise GMLError."""
    from gml.errors import GMLError

    table = available_passes()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise GMLError(f"Unknown pass(es): {', '.join(unknown)}.", hint=f"available: {', '.join(table)}.")
    return [table[n]() for n in names]
