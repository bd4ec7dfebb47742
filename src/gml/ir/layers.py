"""Which ``torch.nn`` layer a module computes: a subclass is not always its base class.

A rewrite that reads a module by its class must know whether the module computes what that class
computes. ``isinstance`` answers a different question: timm's ``Conv2dSame`` subclasses
``nn.Conv2d`` and pads "same"-style in its own ``forward``, ``BatchNormAct2d`` subclasses
``nn.BatchNorm2d`` and adds an activation, while torchvision's ``Conv3DSimple`` only adds a
constructor and is a plain ``nn.Conv3d``. One definition here, used by capture, normalization, the
op table and the lowering rules.
"""

from __future__ import annotations

from torch import nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_HARMLESS = {"__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__"}
_HARMLESS |= {"__static_attributes__", "__annotations__", "__parameters__", "__orig_bases__"}


def torch_layer_base(m: nn.Module) -> type[nn.Module] | None:
    """The ``torch.nn`` layer class a module subclasses without changing its ``forward``, if any.

    torchvision's video ResNets build ``Conv3DSimple(nn.Conv3d)``, which only adds a constructor
    and a static method. fx traces such a class through (it is not from ``torch.nn``), leaving a
    bare ``torch.conv3d`` on ``get_attr`` weights that no pass folds BN into or quantizes.
    """
    cls = type(m)
    if cls.__module__.startswith("torch.") or isinstance(m, _CONTAINERS):
        return None
    mro = cls.__mro__
    for i, base in enumerate(mro[1:], start=1):
        if base is nn.Module or not base.__module__.startswith("torch.nn."):
            continue
        # the torch.nn ancestor must be what runs: the subclasses in between may add a constructor
        # and new names (Conv3DSimple.get_downsample_stride) but override nothing the layer has
        added = {name for sub in mro[:i] for name in vars(sub)} - _HARMLESS
        return None if any(hasattr(base, name) for name in added) else base
    return None


def behaves_as(m: object, cls: type | tuple[type, ...]) -> bool:
    """Whether module ``m`` computes what ``cls`` (a ``torch.nn`` layer class) computes.

    ``isinstance`` is not enough: timm's ``Conv2dSame`` subclasses ``nn.Conv2d`` and pads its input
    "same"-style in its own ``forward``; ``BatchNormAct2d`` subclasses ``nn.BatchNorm2d`` and adds an
    activation. A rewrite that reads such a module as its base class drops what the subclass adds.
    True for ``cls`` itself, torch's own subclasses (fused/reference modules of ``torch.ao``), and a
    user subclass that overrides nothing of its torch ancestor (:func:`torch_layer_base`).
    """
    if not isinstance(m, cls):
        return False
    if type(m).__module__.startswith("torch."):
        return True
    base = torch_layer_base(m)  # type: ignore[arg-type]
    return base is not None and issubclass(base, cls)


__all__ = ["behaves_as", "torch_layer_base"]
