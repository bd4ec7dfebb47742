"""Detecting the :class:`~gml.ir.target.Target` this process runs on — once, at the API boundary.

The ISA is what oneDNN actually dispatches to, ``ONEDNN_MAX_CPU_ISA`` honoured: the native engine's
``cpu_isa()`` (oneDNN's ``get_effective_cpu_isa()``) where the engine is built; without it, torch's
CPU flags (cpuinfo) capped by ``ONEDNN_MAX_CPU_ISA`` the way oneDNN caps (:func:`gml.ir.target.
capped_isa`). Both oneDNN copies (torch's and the engine's) read the variable once per process, so
the ISA is probed once per process; the thread count is read at each call.

Tests simulate another CPU by passing a :class:`Target` value (``Target("avx2")``), or by running
a subprocess with ``ONEDNN_MAX_CPU_ISA`` set (tests/conftest.py, ``make test``).
"""

from __future__ import annotations

import functools
import os

import torch

from gml.ir.target import Target, capped_isa

ISA_ENV = "ONEDNN_MAX_CPU_ISA"


def _torch_cpu_isa() -> str:
    """The best oneDNN ISA this CPU has, from torch's cpuinfo flags (uncapped)."""
    cpu = getattr(torch._C, "_cpu", None)

    def flag(name: str) -> bool:
        probe = getattr(cpu, f"_is_{name}_supported", None)
        return bool(probe()) if probe is not None else False

    if flag("amx_tile"):
        return "avx512_core_amx"
    if flag("avx512_bf16"):
        return "avx512_core_bf16"
    if flag("avx512_vnni"):
        return "avx512_core_vnni"
    if flag("avx512"):
        return "avx512_core"
    if flag("avx2"):
        return "avx2"
    capability = torch.backends.cpu.get_cpu_capability().lower()  # "AVX2" / "AVX512" / "DEFAULT"
    if capability == "avx512":
        return "avx512_core"
    return "avx2" if capability == "avx2" else "sse41"


@functools.cache
def _probe_isa() -> tuple[str, str]:
    from gml.runtime import native

    if native.unavailable_reason() is None:
        return str(native.load().cpu_isa()), "engine"
    return capped_isa(_torch_cpu_isa(), os.environ.get(ISA_ENV)), "torch"


def detect_target(threads: int | None = None) -> Target:
    """The :class:`Target` of this process: oneDNN's dispatched ISA and ``threads`` (default:
    ``torch.get_num_threads()``). Call it at the API boundary and pass the value down."""
    isa, source = _probe_isa()
    return Target(isa, threads=int(threads) if threads is not None else torch.get_num_threads(), source=source)


#: The lower tiers ``make test`` runs the INT8 tests on again, as ``ONEDNN_MAX_CPU_ISA`` values:
#: AVX2 (no AVX-512, no VNNI: AMD Zen 3, Intel before Cascade Lake) and AVX512_CORE (AVX-512 without
#: VNNI: Skylake-SP). oneDNN (torch's and the engine's) honours the cap; fbgemm does not.
TEST_TIERS = ("AVX2", "AVX512_CORE")


def lower_tiers(target: Target | None = None) -> list[str]:
    """The :data:`TEST_TIERS` strictly below ``target`` (default: this process's) that this CPU can
    run: the caps under which ``make test`` repeats the INT8 tests."""
    from gml.ir.target import ISA_FEATURES

    have = ISA_FEATURES.get(resolve(target).isa, frozenset())
    return [cap for cap in TEST_TIERS if ISA_FEATURES[cap.lower()] < have]


def resolve(target: Target | None) -> Target:
    """``target``, or this process's when None (the API boundary's default)."""
    return target if target is not None else detect_target()


__all__ = ["ISA_ENV", "TEST_TIERS", "detect_target", "lower_tiers", "resolve"]


if __name__ == "__main__":  # `python -m gml.runtime.target`: the target, then the tiers make test adds
    print(detect_target().describe())
    print(" ".join(lower_tiers()))
