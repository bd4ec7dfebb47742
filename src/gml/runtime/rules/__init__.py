"""Graph → engine translation: ONE table of translation rules, keyed by op, one file per op family.

:func:`read_call` reads a node of the lowered graph — a ``torch.ops.gml.*`` call (docs/ir.md: every
qparam and attribute is an argument, weights are ``get_attr`` constants), a view op, a
``torch.flatten`` of an INT8 value, or a module the engine runs (an fp32 / bf16 fused kernel of
``gml.kernels``, a torch.nn LayerNorm / pool / activation / Embedding) — as a
:class:`~gml.runtime.rules.base.Call`. :data:`TRANSLATION_RULES` maps its
:attr:`~gml.runtime.rules.base.Call.op` (the gml op name, the view's Tensor method name, the module
class, or the function called) to a :class:`~gml.runtime.rules.base.TranslationRule`:

* ``check(call) -> reason | None``: shape-independent; a reason keeps the node in torch (the
  runtime report prints it);
* ``emit(builder, call, inputs, output)``: the engine steps for one input shape, written with the
  :class:`~gml.runtime.plan.Builder` calls. It may raise
  :class:`~gml.runtime.plan.Unsupported` for a shape the engine cannot take (the segment then runs
  in torch for that shape).

The families (each file ends with its ``RULES``): :mod:`.conv`, :mod:`.linear` (and the matmuls a
linear becomes), :mod:`.pool`, :mod:`.eltwise` (element-wise, binary, casts, LayerNorm),
:mod:`.attention` (and the padding mask's arithmetic), :mod:`.shape` (views, flatten, split, cat,
Embedding). An op whose :class:`~gml.ir.library.OpDef` names its own engine step (``gml.rms_norm``)
needs no entry: :mod:`.kernel` is its rule. They import :mod:`.base` and nothing of each other but
:mod:`.linear` (the element-wise rules fold into the linear before them). Adding an op's
translation rule: docs/architecture.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import fx

from gml.ir.library import gml_op_name, op_args
from gml.runtime.plan import Unsupported
from gml.runtime.rules import attention, conv, eltwise, kernel, linear, pool, shape
from gml.runtime.rules.base import Call, OpKey, TranslationRule, always, op_name


def _table(*families: dict[Any, TranslationRule]) -> dict[OpKey, TranslationRule]:
    """The families' rules in one dict; an op in two families is a mistake (no silent override)."""
    table: dict[OpKey, TranslationRule] = {}
    for family in families:
        twice = table.keys() & family.keys()
        if twice:
            raise AssertionError(f"translation rules for {sorted(map(op_name, twice))} given twice")
        table.update(family)
    return table


#: The translation table (see the module docstring). A node whose op is not listed here stays in
#: torch, reported as "no engine kernel". The order is the order a reader meets the ops in a
#: network (the lookup is by key, and no op is in two families, so order never decides a match):
TRANSLATION_RULES: dict[OpKey, TranslationRule] = _table(
    # conv first: the INT8 and float CNN convs, which most plans are made of
    conv.RULES,
    # linears, then what folds into them (eltwise asks linear to extend its last step)
    linear.RULES,
    pool.RULES,
    # quantize / dequantize / casts sit at every segment edge; activations, adds, LayerNorm
    eltwise.RULES,
    # attention and the mask arithmetic feeding it (transformers' mask builder)
    attention.RULES,
    # views last: their checks ask this whole table whether the engine runs their source
    shape.RULES,
)


def _with_table(call: Call) -> Call:
    return Call(call.op, call.a, call.inputs, engine_runs=_engine_runs)


def _flat(v: Any) -> list[Any]:
    return [x for item in v for x in _flat(item)] if isinstance(v, list | tuple) else [v]


def _constant(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value


def read_call(gm: fx.GraphModule, node: fx.Node) -> Call | None:
    """The :class:`Call` of ``node``, or ``None`` for a node no rule reads."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        # nn.ConstantPad2d / ZeroPad2d and nn.Upsample: the rules of F.pad and F.interpolate
        moved = shape.read_pad(node, mod) or shape.read_interpolate(node, mod)
        if moved is not None:
            return _with_table(moved)
        return _with_table(Call(type(mod), mod, tuple(a for a in node.args if isinstance(a, fx.Node))))
    size = shape.read_size(node)  # x.shape, x.size(1), n // 2: fixed for a plan's input shapes
    if size is not None:
        return _with_table(size)
    move = shape.move_name(node)
    if move is not None:
        # sizes computed at run time (a dynamic batch in an exported program) are graph values
        run_time = any(isinstance(a, fx.Node) for a in _flat([*node.args[1:], *node.kwargs.values()]))
        return _with_table(Call(move, SimpleNamespace(run_time_sizes=run_time), (node.args[0],)))
    split = shape.read_split(node)  # torch.split's pieces (the QKV merge's q, k, v): views
    if split is not None:
        return _with_table(split)
    cat = shape.read_cat(node)  # torch.cat of float values (the INT8 graph's is gml.qcat)
    if cat is not None:
        return _with_table(cat)
    # float F.pad / roll / interpolate / mean / sum / softmax / normalize / addcmul
    moved = (
        shape.read_pad(node)
        or shape.read_roll(node)
        or shape.read_interpolate(node)
        or pool.read_mean(node)
        or pool.read_sum(node)
        or eltwise.read_softmax(node)
        or eltwise.read_normalize(node)
        or eltwise.read_addcmul(node)
    )
    if moved is not None:
        return _with_table(moved)
    product = linear.read_matmul(node)  # q @ k.transpose(-2, -1) of attention written out
    if product is not None:
        return _with_table(product)
    mask = attention.read_mask_op(node)  # a padding mask's arithmetic (transformers' mask builder)
    if mask is not None:
        return _with_table(mask)
    if node.op != "call_function":
        return None
    if node.target in eltwise.CASTS and isinstance(node.args[0], fx.Node):  # gml.kernels.bf16 dtype conversions
        return _with_table(Call(node.target, SimpleNamespace(), (node.args[0],)))
    # torch.flatten in a traced graph; aten.flatten.using_ints in a torch.export program (gml.io)
    if node.target in shape.FLATTENS and isinstance(node.args[0], fx.Node):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return _with_table(Call("flatten", SimpleNamespace(start_dim=start, end_dim=end), (node.args[0],)))
    name = gml_op_name(node)
    if name is None:
        return None
    args = op_args(node)
    inputs = tuple(v for v in _flat(list(args.values())) if isinstance(v, fx.Node) and v.op != "get_attr")
    resolved = {k: (_constant(gm, v) if isinstance(v, fx.Node) and v.op == "get_attr" else v) for k, v in args.items()}
    return _with_table(Call(name, SimpleNamespace(**resolved), inputs))


def _engine_runs(node: fx.Node) -> bool:
    """Whether the engine runs ``node`` (an fp32 / bf16 kernel module, a cast, LayerNorm, ...)."""
    gm = node.graph.owning_module
    if gm is None or node.op not in ("call_module", "call_function", "call_method"):  # x.softmax(-1) too
        return False
    return rule_for(read_call(gm, node))[0] is not None


def rule_for(call: Call | None) -> tuple[TranslationRule | None, str | None]:
    """``(rule, None)`` when the engine runs ``call``, else ``(None, reason)``."""
    if call is None:
        return None, "not a lowered GML op (runs in torch)"
    # the table, else the generic rule of an op that names its own engine step (rules/kernel.py)
    rule = TRANSLATION_RULES.get(call.op) or kernel.rule_for_op(call.op)
    if rule is None:
        return None, f"no engine kernel for {call.name}"
    backend = getattr(call.a, "backend", "onednn")
    backend = getattr(backend, "name", backend)
    if backend != "onednn" and backend not in rule.other_backends:
        return None, f"{call.name} uses the {backend} backend (the engine runs oneDNN's math)"
    reason = rule.check(call)
    return (None, reason) if reason else (rule, None)


__all__ = ["TRANSLATION_RULES", "Call", "TranslationRule", "Unsupported", "always", "read_call", "rule_for"]
