"""The engine's step families (gml.runtime.plan_steps ↔ native/*.h): every step the Builder
records has a function filling its typed description, every description the engine binds is
filled by one, and a description is filled by field name only."""

from __future__ import annotations

import inspect
import re

import pytest

from gml.ir import library
from gml.runtime import native, plan, plan_steps

needs_engine = pytest.mark.skipif(native.unavailable_reason() is not None, reason=str(native.unavailable_reason()))


def test_every_recorded_step_method_has_an_emitter():
    # a step is recorded by Builder._step, or by Builder._windowed for the convs and pools
    recorded = set(re.findall(r'self\._(?:step|windowed)\(\s*"(\w+)"', inspect.getsource(plan.Builder)))
    assert recorded == set(plan_steps.EMITTERS)


@needs_engine
def _rule_modules() -> list:
    import importlib
    import pkgutil

    import gml.runtime.rules as rules

    return [importlib.import_module(f"{rules.__name__}.{m.name}") for m in pkgutil.iter_modules(rules.__path__)]


def test_every_native_step_description_is_filled_by_one_family_function_or_the_generic_one():
    eng = native.load()
    bound = {name for name in dir(eng) if name.endswith("Step")}
    filled = {
        name
        for fn in set(plan_steps.EMITTERS.values())
        for name in re.findall(r"cx\.native\.(\w+Step)\b", inspect.getsource(fn))
    }
    # ... or by the generic kernel step of an op that names its own (gml.runtime.rules.kernel)
    own = {d.engine_step for d in library.vocabulary().values() if d is not None and d.engine_step}
    # ... or by a translation rule's own ``b.kernel("XStep", ...)`` (F.interpolate's ResizeStep)
    ruled = {name for mod in _rule_modules() for name in re.findall(r'kernel\(\s*"(\w+Step)"', inspect.getsource(mod))}
    assert own and not own & filled
    assert filled | own | ruled == bound


@needs_engine
def test_a_description_takes_only_its_own_fields():
    eng = native.load()
    step = plan_steps.describe(eng.ReorderStep, src=0, dst=1, src_q=(0.5, 3), name="r")
    assert (step.src, step.dst, step.src_q, step.dst_q, step.name) == (0, 1, (0.5, 3), None, "r")
    with pytest.raises(AttributeError):
        plan_steps.describe(eng.ReorderStep, src=0, dts=1)  # a misspelt field is an error, not ignored
