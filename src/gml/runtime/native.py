"""Loading the native engine (``gml._engine``, built from native/ by ``pip install``).

``import gml`` never needs it: :func:`load` is called only when a model is compiled for the engine,
and a missing or broken extension becomes a :class:`~gml.errors.UnsupportedError` that says how to
get it back (the reason is kept for the runtime report).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from types import ModuleType

from gml.errors import UnsupportedError

_LIB = "libdnnl.so.3"


def _preload_onednn() -> None:
    # The extension's rpath points at <venv>/lib, where the onednn-cpu-gomp wheel puts libdnnl; if
    # the package sits elsewhere (a --user or --target install) load it from this prefix first.
    for prefix in (sys.prefix, sys.base_prefix):
        path = os.path.join(prefix, "lib", _LIB)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def _load_from(path: str) -> ModuleType:
    # `make sanitize` points GML_ENGINE_LIBRARY at an ASan/UBSan build of the same extension.
    import importlib.util

    _preload_onednn()  # a build tree's rpath does not reach <venv>/lib
    spec = importlib.util.spec_from_file_location("gml._engine", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"GML_ENGINE_LIBRARY={path} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gml._engine"] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    import torch  # noqa: F401  (torch's libgomp first: oneDNN then shares torch's OpenMP runtime)

    override = os.environ.get("GML_ENGINE_LIBRARY")
    if override:
        try:
            return _load_from(override), None
        except (ImportError, OSError) as e:
            return None, f"GML_ENGINE_LIBRARY={override} did not load ({e})"
    try:
        from gml import _engine
    except ImportError as first:
        try:
            _preload_onednn()
            from gml import _engine
        except (ImportError, OSError):
            return None, f"the native engine gml._engine did not load ({first})"
    return _engine, None


def unavailable_reason() -> str | None:
    """Why the engine cannot run here, or ``None`` when it can."""
    return _load()[1]


def load() -> ModuleType:
    """The ``gml._engine`` extension module, or a clear error saying how to build it."""
    module, reason = _load()
    if module is None:
        raise UnsupportedError(
            f"{reason}.",
            hint="reinstall with `pip install -e .` (it builds native/ with CMake; needs a C++17 compiler), "
            "or pass runtime='torch' to run the Python executor.",
        )
    return module
