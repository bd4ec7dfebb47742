"""The one rule for calling a model GML returns with inputs that require grad (issue #11, #24).

Every executor GML returns (the fused fp32 / INT8 ``GraphModule`` on the Python executor, the native
engine's :class:`~gml.runtime.compile.EngineModule`, a model :func:`gml.load` read back) is for
inference: its kernels do not propagate gradients. Called with an input that requires grad while
autograd is on, each raises :class:`~gml.errors.InputError` instead of returning an output whose
``backward()`` silently leaves the input's ``.grad`` None (or, from the engine, a detached output
that looks like any other). Under ``torch.no_grad()`` / ``torch.inference_mode()`` nothing is
checked.

INT8 models add one rule: a NaN or Inf input is refused (:func:`refuse_nonfinite_inputs`), since INT8
has no code for either and would answer with finite numbers.

Inputs by name (:func:`inputs_by_name`): every executor also takes its inputs as keywords, named as
the model's ``forward`` names them (``model(**tokenizer(text, return_tensors="pt"))``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gml.errors import InputError


def inputs_by_name(names: Sequence[str], args: Sequence[Any], named: Mapping[str, Any]) -> tuple:
    """``args`` then ``named`` as one positional tuple over ``names`` (the graph's inputs, in order:
    the model's ``forward`` parameters it was captured with), up to the last input given. One given
    neither way before it is None — an optional input left out (HF's ``token_type_ids``); the
    executor's input check then says what the model takes if it needs a tensor there."""
    unknown = [k for k in named if k not in names]
    if unknown:
        raise InputError(
            f"the model takes no input named {unknown[0]!r}.",
            hint=f"its inputs, in order: {', '.join(names) or '(none)'}.",
        )
    twice = [k for k in named if list(names).index(k) < len(args)]
    if twice:
        raise InputError(
            f"input {twice[0]!r} was given both by position and by name.",
            hint=f"give it once; the inputs, in order: {', '.join(names)}.",
        )
    last = max(list(names).index(k) for k in named)
    return (*args, *(named.get(n) for n in names[len(args) : last + 1]))


def refuse_grad_inputs(args: Any) -> None:
    """Raise :class:`InputError` if autograd is on and a tensor in ``args`` requires grad."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise InputError(
            "This GML-optimized module is for inference: its fused kernels do not propagate gradients, so "
            "an input that requires grad would give an output whose backward() leaves the input's .grad None.",
            hint="call it under torch.inference_mode() / torch.no_grad(), or pass x.detach(); train the "
            "original nn.Module instead.",
        )


def refuse_autograd(module: nn.Module) -> None:
    """Make ``module`` apply :func:`refuse_grad_inputs` to its inputs on every call (once per module)."""
    _check_every_call(module, refuse_grad_inputs, "_gml_refuses_autograd")


def _check_every_call(module: nn.Module, check: Callable[[tuple], None], flag: str) -> None:
    """Run ``check`` on ``module``'s inputs before every call: a forward pre-hook, registered once
    (``flag``: the attribute that records it)."""
    if not getattr(module, flag, False):
        # a partial of named functions, not a lambda: hooks are pickled with the module by torch.save
        module.register_forward_pre_hook(functools.partial(_check_inputs, check))
        setattr(module, flag, True)


def _check_inputs(check: Callable[[tuple], None], module: nn.Module, args: tuple) -> None:
    check(args)


def refuse_nonfinite_inputs(args: Any, masks: tuple[int, ...] = ()) -> None:
    """Raise :class:`InputError` if a floating-point tensor in ``args`` holds a NaN or an Inf: an
    INT8 model cannot represent them (quantization clamps an Inf to the range's end and a NaN to
    some code), so its answer would be finite numbers that look valid (issue #24). One sum per
    input when every value is finite (:func:`gml.kernels.fp32.all_finite`). The inputs at ``masks``
    are read only as attention masks (never quantized): ``-inf`` is a value there, a NaN is not."""
    from gml.kernels.fp32 import all_finite, no_nan

    floats = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    checked = [a for i, a in floats if i not in masks]
    given = [a for i, a in floats if i in masks]
    if not floats or (all_finite(*checked) and no_nan(*given)):
        return
    for i, a in floats:
        nan = int(torch.isnan(a).sum())
        bad = nan if i in masks else int((~torch.isfinite(a)).sum())
        if bad:
            raise InputError(
                f"This INT8 model cannot represent NaN or Inf, and input {i} holds {nan} NaN and {bad - nan} Inf "
                "value(s): INT8 would turn them into finite numbers that look valid.",
                hint="clean the input first (torch.nan_to_num, or drop the sample), or run the fp32 model "
                "(gml.optimize), which propagates NaN and Inf as eager does.",
            )


def refuse_nonfinite(module: nn.Module, masks: tuple[int, ...] = ()) -> None:
    """Make INT8 ``module`` apply :func:`refuse_nonfinite_inputs` on every call (once per module);
    ``masks``: the positions of inputs read only as attention masks
    (:func:`gml.runtime.rules.attention.mask_only_inputs`). A module with a ``refuses_nonfinite``
    flag (the engine's) checks its inputs itself: a hook would take every call through
    ``nn.Module``'s slow path."""
    if isinstance(getattr(module, "refuses_nonfinite", None), bool):
        module.refuses_nonfinite = True
        module.nonfinite_masks = tuple(masks)
        return
    _check_every_call(module, functools.partial(refuse_nonfinite_inputs, masks=tuple(masks)), "_gml_refuses_nonfinite")
