"""The INT8 backends by name: the one place that knows every implementation.

``gml.kernels.backend`` is the interface and imports no implementation; each implementation
imports the interface; this module imports the implementations. No import circle.
"""

from __future__ import annotations

from gml.errors import InputError, UnsupportedError
from gml.kernels.backend import Int8Backend
from gml.kernels.fbgemm_int8 import FbgemmBackend
from gml.kernels.onednn_int8 import OneDNNBackend

_CLASSES: dict[str, type[Int8Backend]] = {"onednn": OneDNNBackend, "fbgemm": FbgemmBackend}
BACKENDS: tuple[str, ...] = tuple(_CLASSES)
_INSTANCES: dict[str, Int8Backend] = {}


def get_backend(name: str | Int8Backend | None = None) -> Int8Backend:
    """The backend called ``name`` (``None``: oneDNN if this build has it, else FBGEMM).

    Backends are stateless, so one instance per name is shared."""
    if isinstance(name, Int8Backend):
        return name
    if name is None:
        name = "onednn" if OneDNNBackend.is_available() else "fbgemm"
    inst = _INSTANCES.get(name)
    if inst is not None:
        return inst
    cls = _CLASSES.get(name)
    if cls is None:
        raise InputError(f"unknown INT8 backend {name!r}.", hint=f"choose one of: {', '.join(BACKENDS)}.")
    if not cls.is_available():
        raise UnsupportedError(
            f"the {name} INT8 kernels are not in this PyTorch build.",
            hint="use --backend " + ("fbgemm" if name == "onednn" else "onednn") + ".",
        )
    inst = _INSTANCES[name] = cls()
    return inst
