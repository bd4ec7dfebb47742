"""Small modules that give a module form to ops PyTorch only ships as functions.

:class:`~gml.passes.normalize.Normalize` rewrites ``x + y``, ``torch.add(x, y, alpha=a)``,
``x.mul(0.5)`` and friends into calls of these modules, so that later passes (fusion, INT8
lowering) match one node kind by *module type* instead of every function/method spelling.

Each forward runs exactly the op it replaces (same broadcasting, type promotion and rounding), so
the rewrite is bit-exact. Scalar operands are stored as plain Python numbers (not buffers): they
are constants of the graph, and a buffer would change ``x + 1`` (int scalar) into a tensor add with
different type promotion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Number = int | float | bool


class Add(nn.Module):
    """``x + alpha * y`` for two tensors (``alpha=1``: plain ``x + y``)."""

    def __init__(self, alpha: Number = 1) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.alpha == 1:
            return x + y
        return torch.add(x, y, alpha=self.alpha)

    def extra_repr(self) -> str:
        return "" if self.alpha == 1 else f"alpha={self.alpha}"


class AddScalar(nn.Module):
    """``x + alpha * other`` where ``other`` is a Python number fixed at trace time."""

    def __init__(self, other: Number, alpha: Number = 1) -> None:
        super().__init__()
        self.other = other
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alpha == 1:
            return x + self.other
        return torch.add(x, self.other, alpha=self.alpha)

    def extra_repr(self) -> str:
        return f"other={self.other}" + ("" if self.alpha == 1 else f", alpha={self.alpha}")


class Mul(nn.Module):
    """``x * y`` for two tensors."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y


class MulScalar(nn.Module):
    """``x * other`` where ``other`` is a Python number fixed at trace time."""

    def __init__(self, other: Number) -> None:
        super().__init__()
        self.other = other

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.other

    def extra_repr(self) -> str:
        return f"other={self.other}"


class ReturnOverwritten(nn.Module):
    """``fn(*args)`` for a call that overwrites ``args[index]`` in place and returns something else
    (``operator.setitem``, a helper that ends in ``x[...] += y``), returning the overwritten tensor.

    The write becomes a value in the graph: later readers of the tensor read this node, so the call
    can no longer look dead to a pass (or to torch.ao) that treats every op as pure.
    """

    def __init__(self, fn: Callable[..., Any], index: int) -> None:
        super().__init__()
        self.fn = fn
        self.index = index

    def forward(self, *args: Any) -> Any:
        self.fn(*args)
        return args[self.index]

    def extra_repr(self) -> str:
        return f"fn={getattr(self.fn, '__qualname__', self.fn)}, index={self.index}"


class InputGuard(nn.Module):
    """Refuse inputs of other shapes than the ones a graph was specialised to.

    :func:`gml.capture` answers shape-only Python in ``forward`` (``if x.shape[-2] < k``, timm's
    ``Conv2dSame`` padding from ``x.size()``) with the example input's sizes, so the captured graph
    holds constants that are right for that input shape only. This node, first in the graph, makes a
    call with another shape fail with a clear error instead of computing something else. Impure, so
    dead-code elimination keeps it although nothing reads its result.
    """

    _is_impure = True

    def __init__(self, shapes: list[tuple[int | None, ...] | int | None], why: str = "") -> None:
        super().__init__()
        #: per input: its shape (``None`` for a dim the graph is not specialised to: a batch no read
        #: depended on, gml.capture._batch_free_inputs), or only its rank (an int) when forward() read
        #: nothing but ranks
        self.shapes = [
            s if s is None or isinstance(s, int) else tuple(None if d is None else int(d) for d in s) for s in shapes
        ]
        self.why = why

    def forward(self, *args: Any) -> None:
        for i, (a, want) in enumerate(zip(args, self.shapes)):
            if want is None or not isinstance(a, torch.Tensor):
                continue
            if isinstance(want, int):
                ok = a.dim() == want
            else:
                ok = a.dim() == len(want) and all(w is None or w == g for w, g in zip(want, a.shape))
            if not ok:
                from gml.errors import InputError

                if isinstance(want, int):
                    what = f"{want}-D input"
                else:  # a free dim shows as *
                    what = "(" + ", ".join("*" if d is None else str(d) for d in want) + ")"
                raise InputError(
                    f"input {i} has shape {tuple(a.shape)}, but this model was captured for {what}: "
                    f"its forward() computes with the input's size in Python ({self.why}), which the graph "
                    "holds as constants.",
                    hint="capture / optimize / quantize again with an example input of the shape you will run.",
                )

    def extra_repr(self) -> str:
        return f"shapes={self.shapes}"

    def to_json(self) -> dict[str, Any]:
        """The guard as a saved model's header records it (:func:`gml.io.save`)."""
        return {"shapes": [list(s) if isinstance(s, tuple) else s for s in self.shapes], "why": self.why}

    @classmethod
    def from_json(cls, data: Any, n_inputs: int) -> InputGuard:
        """The guard a saved model's header records, for a graph of ``n_inputs`` inputs. The header
        is untrusted: ValueError names the first field that is not what :meth:`to_json` writes."""
        if not isinstance(data, dict) or set(data) != {"shapes", "why"}:
            raise ValueError("the input guard is not {'shapes': [...], 'why': '...'}")
        shapes, why = data["shapes"], data["why"]
        if not isinstance(why, str) or len(why) > 2000:
            raise ValueError("the input guard's reason is not a short string")
        if not isinstance(shapes, list) or not 0 < len(shapes) <= n_inputs:
            n = len(shapes) if isinstance(shapes, list) else "?"
            raise ValueError(f"the input guard names {n} inputs, the graph has {n_inputs}")

        def dim(d: Any) -> bool:
            return d is None or (type(d) is int and 0 <= d < 2**40)

        for s in shapes:
            rank = type(s) is int and 0 <= s <= 64
            shape = isinstance(s, list) and len(s) <= 64 and all(dim(d) for d in s)
            if not (s is None or rank or shape):
                raise ValueError(f"the input guard's shape {str(s)[:60]} is not a rank, a list of sizes or null")
        return cls([tuple(s) if isinstance(s, list) else s for s in shapes], why)


def install_input_guard(gm: Any, guard: InputGuard) -> None:
    """Put ``guard`` first in the ``fx.GraphModule`` ``gm``: a call reading the inputs it checks,
    right after the placeholders (impure: dead-code elimination keeps it)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm.add_submodule("input_guard", guard)
    with gm.graph.inserting_after(placeholders[-1]):
        gm.graph.call_module("input_guard", tuple(placeholders[: len(guard.shapes)]))
    gm.graph.lint()
    gm.recompile()


__all__ = ["Add", "AddScalar", "InputGuard", "Mul", "MulScalar", "ReturnOverwritten", "install_input_guard"]
