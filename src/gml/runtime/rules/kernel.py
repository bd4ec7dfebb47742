"""The one translation rule of every op that names its own engine step (``OpDef.engine_step``,
:mod:`gml.ir.library`): such an op needs no translation code of its own.

The op's native step description (a ``struct`` of its native/*.h family header, bound by
``GML_BIND``) has one field per schema argument, by the same name, plus ``dst``:

* a tensor argument is a plan value: the activation the graph gives, or a plan-owned copy of a
  constant (a ``get_attr`` weight);
* a number, bool, string or list of them is set as it is; ``None`` leaves the field's default;
* the op's output is ``dst``.

Every tensor is fp32 and dense row-major for the step (an input in another layout is copied
first; an output whose planned layout is not dense is written to a dense temporary and copied);
an op with other dtypes stays in torch with the reason. The step builder checks shapes and throws
for what it cannot take, which sends that input shape to the Python executor.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx

from gml.ir.library import op_def
from gml.runtime.rules import base
from gml.runtime.rules.base import Builder, Call, TranslationRule, Unsupported, Val

_SCALARS = (bool, int, float, str)


def _scalar(v: Any) -> bool:
    if isinstance(v, list | tuple):
        return all(isinstance(x, _SCALARS) for x in v)
    return isinstance(v, _SCALARS)


def _check(c: Call) -> str | None:
    for name, v in vars(c.a).items():
        if isinstance(v, fx.Node):
            if base.meta_dtype(v) not in (None, torch.float32):
                return f"{c.name} reads {name} as {base.meta_dtype(v)} (the engine step takes fp32)"
        elif isinstance(v, torch.Tensor):
            if v.dtype != torch.float32:
                return f"{c.name}'s constant {name} is {v.dtype} (the engine step takes fp32)"
        elif v is not None and not _scalar(v):
            return f"{c.name}'s argument {name} is a {type(v).__name__} (no engine step field takes it)"
    return None


def _emit(step: str, b: Builder, c: Call, ins: list[Val], out: Val) -> None:
    reads: dict[str, Val] = {}
    fields: dict[str, Any] = {}
    activations = iter(ins)
    for name, v in vars(c.a).items():
        if isinstance(v, fx.Node):
            reads[name] = base.dense(b, next(activations))
        elif isinstance(v, torch.Tensor):
            reads[name] = b.constant(v.detach())
        elif v is not None:
            fields[name] = list(v) if isinstance(v, tuple) else v
    for name, v in reads.items():
        if v.dtype_name != "f32":
            raise Unsupported(f"{c.name} reads {name} as {v.dtype_name} (the engine step takes fp32)")
    if out.dtype_name != "f32":
        raise Unsupported(f"{c.name} writes {out.dtype_name} (the engine step writes fp32)")
    plain = base.contiguous_strides(out.shape)
    dst = out if out.stride == plain else b.temp(out.shape, plain, "f32")
    b.kernel(step, reads, {"dst": dst}, **fields)
    if dst is not out:
        b.reorder(dst, out, src_q=None, dst_q=None)


@functools.cache
def _rule(step: str) -> TranslationRule:
    return TranslationRule(_check, functools.partial(_emit, step), arity=None)


def rule_for_op(op: Any) -> TranslationRule | None:
    """The generic rule of ``op`` when its :class:`~gml.ir.library.OpDef` names an engine step."""
    d = op_def(op) if isinstance(op, str) else None
    return None if d is None or d.engine_step is None else _rule(d.engine_step)
