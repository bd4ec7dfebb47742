"""Errors that GML-Lab raises on purpose.

Every failure a user can cause (a model that will not trace, a corrupt checkpoint, a wrong input
shape, ...) surfaces as a :class:`GMLError` whose message says what happened *and what to do*.
The CLI prints the message and exits with the error's ``exit_code``; it never shows a torch
traceback for these.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


class GMLError(Exception):
    """Base class for user-facing errors. ``hint`` says what the user can do about it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nWhat you can do: {hint}")


class ModelLoadError(GMLError):
    """A model name, ``file.py:Class`` reference or checkpoint could not be loaded."""

    exit_code = 3


class TraceFailure(GMLError):
    """``torch.fx`` could not capture the model (data-dependent control flow, unsupported Python)."""

    exit_code = 4


class InputError(GMLError):
    """Example or calibration inputs do not fit the model (shape, dtype, NaN/Inf, empty)."""

    exit_code = 5


class PassFailure(GMLError):
    """A pass broke lint or numerics and the pass manager runs with ``strict=True``."""

    exit_code = 6


class UnsupportedError(GMLError):
    """The model uses something a requested stage cannot handle (e.g. BN in training mode)."""

    exit_code = 7


class AccuracyError(GMLError):
    """The INT8 model is less accurate than asked (``gml quantize --min-cosine``, ``min_cosine=``)."""

    exit_code = 8


class AccuracyDropError(AccuracyError):
    """INT8 loses more top-1 accuracy against labels than allowed (``--max-accuracy-drop``,
    ``max_accuracy_drop=``)."""

    exit_code = 9


def first_few(items: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: the first ``shown`` of ``items``, for a message, and how many it leaves out."""
    rest = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {rest} more" if rest > 0 else "")


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """``"did you mean a, b? "`` naming the (at most three) entries of ``known`` closest to ``name``
    (each with ``prefix``), or ``""`` when none is close: the start of a hint for an unknown name."""
    close = difflib.get_close_matches(name, list(known), n=3)
    return f"did you mean {', '.join(prefix + c for c in close)}? " if close else ""
