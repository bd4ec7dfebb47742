"""The engine's switches as one value, :class:`EngineOptions`, carried from the API to the plans.

``gml.optimize`` / ``gml.quantize`` / ``gml.load`` (and :func:`gml.runtime.compile_engine`,
:func:`gml.runtime.select.attach_runtime`) take ``options=``; ``None`` there means
:meth:`EngineOptions.from_env`, the one place the ``GML_*`` variables are read: they set defaults
at the API boundary (a deployment's or the test suite's, tests/conftest.py), and nothing below
reads them. The value travels next to the :class:`~gml.ir.target.Target` (on the
:class:`~gml.runtime.compile.RuntimeReport`, which the engine's segments plan from).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gml.errors import InputError

#: ``winograd`` values and what the engine gets for them (native/conv.h ``try_winograd``,
#: ``try_winograd_int8``, ``try_im2col_int8``, ``try_dw_int8``): Winograd F(2x2, 3x3) for eligible
#: fp32 / bf16 3x3 stride-1 convs, and on targets without VNNI (``Target.int8_winograd``; ``1`` forces
#: them on any AVX2 CPU) GML's own INT8 convs: Winograd for 3x3 stride-1 ones, a patch GEMM for
#: few-channel ones (an RGB stem), a tap-pair kernel for depthwise ones; never, always, or when timed
#: faster than the direct conv at plan build (the default; docs/adr/010-winograd-conv.md). INT8
#: Winograd has two tile sizes, F(4x4, 3x3) where its exactness bound holds and F(2x2, 3x3): ``1``
#: forces the larger eligible one, ``f2x3`` forces the smaller one everywhere (tests, A/B runs).
WINOGRAD_MODES = {"0": 0, "1": 1, "auto": 2, "f2x3": 3}
#: ``attention`` values: which attention path the engine plans (docs/adr/009-fused-bf16-attention.md)
ATTENTION_PATHS = ("auto", "fused", "primitives")
#: ``cost_policy`` values (gml.quant.cost_policy.POLICIES): ``off`` times nothing
COST_POLICIES = ("measure", "off")

#: the environment variable that sets each option's default (read by :meth:`EngineOptions.from_env` only)
WINOGRAD_ENV, ATTENTION_ENV, COST_POLICY_ENV = "GML_WINOGRAD", "GML_ATTENTION", "GML_COST_POLICY"


@dataclass(frozen=True)
class EngineOptions:
    """How the engine plans and is chosen (all switches the runtime reads; defaults: the shipped ones).

    ``winograd``: ``"auto"`` (per conv, Winograd when timed faster at plan build; then the whole
    plan against the direct-only one, the faster kept, where ``cost_policy`` allows), ``"1"`` (every
    eligible 3x3 conv), ``"f2x3"`` (the same with INT8 Winograd's 2x2 output tiles only) or ``"0"``
    (direct convs only). ``attention``: ``"auto"`` (GML's fused
    kernels where ADR 009 measured them no slower: fp32 on AVX512-BF16 and on AVX2 without AVX-512,
    bf16 but not on AMX),
    ``"fused"`` or ``"primitives"``. ``cost_policy``:
    ``"measure"`` (the runtime choice times the engine against the Python executor; ``gml.quantize``
    times INT8 regions) or ``"off"`` (nothing timed: runs that must not depend on timing).
    """

    winograd: str = "auto"
    attention: str = "auto"
    cost_policy: str = "measure"

    def __post_init__(self) -> None:
        _check("winograd", self.winograd, tuple(WINOGRAD_MODES), "0 (direct convolutions only), 1 (Winograd for "
               "every eligible 3x3 conv), f2x3 (the same, INT8 with 2x2 output tiles only) "
               "or auto (the default)")  # fmt: skip
        _check("attention", self.attention, ATTENTION_PATHS, "auto, fused or primitives")
        _check("cost_policy", self.cost_policy, COST_POLICIES, "measure or off")

    @property
    def winograd_mode(self) -> int:
        """``winograd`` as the engine's ``conv(winograd=...)`` takes it."""
        return WINOGRAD_MODES[self.winograd]

    @classmethod
    def from_env(cls) -> EngineOptions:
        """The defaults a process's ``GML_WINOGRAD`` / ``GML_ATTENTION`` / ``GML_COST_POLICY`` set."""
        values = {}
        for name, env, default in (
            ("winograd", WINOGRAD_ENV, "auto"),
            ("attention", ATTENTION_ENV, "auto"),
            ("cost_policy", COST_POLICY_ENV, "measure"),
        ):
            value = os.environ.get(env, default).strip().lower() or default
            try:
                cls(**{name: value})
            except InputError as e:
                raise InputError(f"{env}={value!r}: {e.message}", hint=e.hint) from None
            values[name] = value
        return cls(**values)


def _check(name: str, value: str, allowed: tuple[str, ...], hint: str) -> None:
    if value not in allowed:
        raise InputError(f"{name}={value!r} is not a setting of the engine.", hint=f"use {hint}.")


def resolve_options(options: EngineOptions | None) -> EngineOptions:
    """``options``, or the environment's defaults when None (the API boundary's default)."""
    return options if options is not None else EngineOptions.from_env()


__all__ = ["ATTENTION_PATHS", "COST_POLICIES", "WINOGRAD_MODES", "EngineOptions", "resolve_options"]
