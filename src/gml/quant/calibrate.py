"""Calibration: run a prepared (observed) model over representative inputs.

The observers that ``prepare`` inserted record activation ranges while the model runs in fp32;
the quality of the INT8 model is decided here. This module knows nothing about how the observers
got there (torch.ao today, a PT2E frontend tomorrow): it feeds batches, validates them and shows
progress.

Accepted data: any iterable of batches, where a batch is a tensor, or a tuple/list of tensors (one
per ``forward`` argument). A ``DataLoader`` over ``(inputs, labels)`` pairs works as is: extra
trailing items beyond the model's argument count are dropped. With no user data,
:func:`generate_batches` makes seeded random batches shaped like the example inputs.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gml.errors import InputError


@dataclass
class CalibrationStats:
    """What calibration saw."""

    batches: int
    samples: int
    seconds: float
    source: str = "user data"  # or "generated"
    warnings: list[str] = field(default_factory=list)  # what is weak about this calibration


class CalibrationWarning(UserWarning):
    """Calibration ran but is weak (too few samples); the INT8 model is made anyway."""


#: Fewer calibration samples than this get a warning: ranges from a handful of images are noisy.
MIN_SAMPLES = 8
#: A largest |value| this many times the 99.9th percentile of |values| is an outlier that would set
#: the whole input's scale (a 1e6 pixel among N(0, 1) data: INT8 cosine 0.73, every observer).
OUTLIER_RATIO = 1e3
#: Values this large are not data (uninitialised memory, a float limit): refused.
EXTREME_ABS = 1e15


class _RangeTracker:
    """What calibration saw of each floating model input: range, largest |value| and where, and a
    robust scale (99.9th percentile of |value| on a subsample), to tell degenerate data apart."""

    def __init__(self) -> None:
        self.lo: dict[int, float] = {}
        self.hi: dict[int, float] = {}
        self.peak: dict[int, tuple[float, int]] = {}  # input -> (max |x|, batch index)
        self.typical: dict[int, float] = {}  # input -> largest per-batch 99.9th percentile of |x|

    def update(self, args: tuple[Any, ...], index: int) -> None:
        for j, a in enumerate(args):
            if not (isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()):
                continue
            flat = a.detach().reshape(-1).float()
            self.lo[j] = min(self.lo.get(j, math.inf), float(flat.min()))
            self.hi[j] = max(self.hi.get(j, -math.inf), float(flat.max()))
            mag = flat.abs()
            peak = float(mag.max())
            if peak > self.peak.get(j, (-1.0, 0))[0]:
                self.peak[j] = (peak, index)
            sample = mag[:: max(1, mag.numel() // 100_000)]
            k = max(1, math.ceil(0.999 * sample.numel()))
            self.typical[j] = max(self.typical.get(j, 0.0), float(sample.kthvalue(k).values))

    def problems(self) -> list[str]:
        """Why these inputs cannot calibrate anything (refused), one line per input."""
        out = []
        for j in sorted(self.lo):
            lo, hi = self.lo[j], self.hi[j]
            peak, at = self.peak[j]
            if lo == hi == 0:
                out.append(f"input {j} is all zeros in every batch")
            elif lo == hi:
                out.append(f"input {j} is the constant {lo:g} in every batch")
            elif peak >= EXTREME_ABS:
                out.append(f"input {j} reaches {peak:.3g} (batch {at}): not a value real data takes")
            elif self.typical[j] > 0 and peak > OUTLIER_RATIO * self.typical[j]:
                out.append(
                    f"input {j} has an outlier {peak:.3g} in batch {at}, {peak / self.typical[j]:.0f}x its "
                    f"99.9th percentile {self.typical[j]:.3g}: it would set the scale and crush every other value"
                )
        return out


class KeepLast:
    """The user's calibration batches, iterated as given, keeping the last ``keep`` of each pass.

    Without ``eval_data`` the accuracy report measures on these (:attr:`last`): batches from the
    user's own data, not generated N(0, 1) ones. Generated inputs only look like data the model sees
    after ImageNet-style normalization; measured on them, a conv calibrated on images in [0, 1] had
    output cosine 0.73 ("BROKEN", fp32 returned) where its real inputs gave 0.99997. They were seen
    by the calibration, which is said wherever the report is printed (:attr:`AccuracyReport.source`).
    A one-shot iterator works too: nothing is read twice.
    """

    def __init__(self, data: Iterable[Any], keep: int = 2) -> None:
        self.data = data
        self.keep = keep
        self.last: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        from collections import deque

        recent: deque[Any] = deque(maxlen=self.keep)
        for batch in self.data:
            recent.append(batch)
            self.last = list(recent)  # a pass cut short (max_batches) still leaves what it read
            yield batch

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]  # TypeError for an unsized iterable, as len()


def batch_misfit(kind: str, i: int, args: Sequence[Any], exc: Exception, looks: str) -> InputError:
    """The error for ``kind`` (calibration / evaluation) batch ``i`` that the model raised ``exc`` on:
    its shapes, the first line of ``exc``, and that batches must look like the example inputs
    (``looks`` says how)."""
    shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
    return InputError(
        f"{kind} batch {i} (shapes {shapes}) does not fit the model: {type(exc).__name__}: "
        f"{(str(exc).strip().splitlines() or [''])[0]}",
        hint=f"{kind} batches must look like the example inputs ({looks}).",
    )


def _is_mask(x: torch.Tensor) -> bool:
    """An integer 0/1 tensor (an ``attention_mask``): generated batches repeat it as given."""
    return x.dtype == torch.bool or (x.numel() > 0 and bool(((x == 0) | (x == 1)).all()))


def _int_range(x: torch.Tensor, token_range: tuple[int, int] | None) -> tuple[int, int]:
    if token_range is not None:
        return token_range
    return (int(x.min()), int(x.max())) if x.numel() else (0, 0)


def generate_batches(
    example_inputs: Sequence[Any],
    n: int,
    *,
    seed: int = 0,
    batch_size: int | None = None,
    token_range: tuple[int, int] | None = None,
) -> list[tuple[Any, ...]]:
    """``n`` seeded random batches shaped like ``example_inputs``.

    Floating inputs are drawn from N(0, 1) (what torchvision models see after normalization).
    Integer inputs (token ids) are drawn uniformly from ``token_range`` (the model's vocabulary,
    e.g. :func:`gml.models_hf.token_range`), else from the example's own ``[min, max]``: varied
    ids, not ``n`` copies of one batch (#15). 0/1 integer tensors (attention masks), bool and
    non-tensor inputs are repeated as given. ``batch_size`` replaces dim 0 of floating inputs.
    :func:`describe_generated` says what was generated.
    """
    if n < 1:
        raise InputError(f"cannot generate {n} calibration batches.", hint="ask for at least 1 batch.")
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        batch = []
        for x in example_inputs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                shape = (batch_size, *x.shape[1:]) if batch_size and x.dim() else tuple(x.shape)
                batch.append(torch.randn(shape, generator=gen, dtype=x.dtype))
            elif isinstance(x, torch.Tensor) and not x.is_complex() and not _is_mask(x):
                lo, hi = _int_range(x, token_range)
                batch.append(torch.randint(lo, hi + 1, tuple(x.shape), generator=gen).to(x.dtype))
            else:
                batch.append(x)
        batches.append(tuple(batch))
    return batches


def describe_generated(example_inputs: Sequence[Any], token_range: tuple[int, int] | None = None) -> str:
    """What :func:`generate_batches` makes of ``example_inputs``, for reports (honest labels, #15)."""
    parts = []
    for j, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            parts.append(f"input {j}: N(0, 1) values")
        elif isinstance(x, torch.Tensor) and not x.is_complex() and not _is_mask(x):
            lo, hi = _int_range(x, token_range)
            where = "the model's vocabulary" if token_range is not None else "the example's own range"
            parts.append(f"input {j}: random integer ids uniform in [{lo}, {hi}] ({where}; not text)")
        elif isinstance(x, torch.Tensor):
            parts.append(f"input {j}: the example's {'mask' if x.dim() else 'value'}, repeated")
        else:
            parts.append(f"input {j}: {type(x).__name__} repeated")
    return "generated batches (" + "; ".join(parts) + ")"


def _arity(model: nn.Module) -> int | None:
    if isinstance(model, fx.GraphModule):
        return sum(1 for n in model.graph.nodes if n.op == "placeholder")
    return None


def _as_args(batch: Any, arity: int | None) -> tuple[Any, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, dict):
        raise InputError(
            "calibration batches are dicts; GML-Lab feeds batches positionally.",
            hint="yield tensors or tuples of tensors (one per forward() argument).",
        )
    if isinstance(batch, tuple | list):
        args = tuple(batch)
        # (inputs, labels) pairs from a DataLoader: keep the model's own arguments only.
        return args[:arity] if arity is not None and len(args) > arity else args
    raise InputError(
        f"calibration batch of type {type(batch).__name__} is not a tensor or a tuple of tensors.",
        hint="yield tensors or tuples of tensors (one per forward() argument).",
    )


def _check_finite(args: tuple[Any, ...], index: int) -> None:
    for j, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.isfinite(a).all():
            n_bad = int((~torch.isfinite(a)).sum())
            raise InputError(
                f"calibration batch {index} (input {j}, shape {tuple(a.shape)}) contains {n_bad} NaN/Inf "
                "values; observers would record an infinite range.",
                hint="clean or drop that batch (torch.nan_to_num, or filter with torch.isfinite).",
            )


def _progress_bar(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    return Progress(*columns, transient=True, disable=not enabled)


def _iterator(data: Iterable[Any]) -> Iterator[Any]:
    try:
        return iter(data)
    except TypeError:
        raise InputError(
            f"calibration data of type {type(data).__name__} is not iterable.",
            hint="pass a DataLoader, a list of tensors / tuples, or a number of batches to generate.",
        ) from None


def calibrate(
    prepared: nn.Module,
    data: Iterable[Any],
    progress: bool = True,
    *,
    max_batches: int | None = None,
    source: str = "user data",
) -> CalibrationStats:
    """Run ``prepared`` over ``data`` (no grad) so its observers record ranges.

    Raises :class:`~gml.errors.InputError` if ``data`` is empty, a batch holds NaN/Inf (naming the
    batch index), or a batch does not fit the model.
    """
    arity = _arity(prepared)
    total = None
    try:
        total = len(data)  # type: ignore[arg-type]
    except TypeError:  # a generator, or KeepLast over one
        total = None
    if total is not None and max_batches is not None:
        total = min(total, max_batches)
    bar = _progress_bar(progress)
    t0 = time.perf_counter()
    batches = samples = 0
    ranges = _RangeTracker()
    with bar, torch.no_grad():
        task = bar.add_task("calibrating", total=total)
        for i, batch in enumerate(_iterator(data)):
            if max_batches is not None and i >= max_batches:
                break
            args = _as_args(batch, arity)
            _check_finite(args, i)
            ranges.update(args, i)
            try:
                prepared(*args)
            except Exception as exc:
                raise batch_misfit("calibration", i, args, exc, "same rank, channels, dtype") from None
            batches += 1
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            samples += int(first.shape[0]) if first is not None and first.dim() else 1
            bar.advance(task)
    if batches == 0:
        raise InputError(
            "calibration data is empty: the observers saw nothing, so every scale would be a guess.",
            hint="pass at least one batch, or a number of batches to generate (e.g. --calib 8).",
        )
    problems = ranges.problems()
    if problems:
        raise InputError(
            "calibration data is degenerate: " + "; ".join(problems) + ". INT8 scales chosen from it would "
            "not fit real inputs (all-zero batches gave cosine 0.98 and 0% top-1 agreement, one 1e6 outlier 0.73).",
            hint="calibrate on real, preprocessed inputs (as the model sees them in production); drop or clip "
            "outliers (torch.clamp) and check the data pipeline for padding-only or uninitialised batches.",
        )
    notes = []
    if samples < MIN_SAMPLES:
        notes.append(
            f"calibrated on {samples} sample(s): activation ranges from fewer than {MIN_SAMPLES} are noisy; "
            "pass more batches for stable INT8 scales"
        )
        warnings.warn(notes[-1], CalibrationWarning, stacklevel=2)
    return CalibrationStats(batches, samples, time.perf_counter() - t0, source, notes)


__all__ = [
    "EXTREME_ABS",
    "MIN_SAMPLES",
    "OUTLIER_RATIO",
    "CalibrationStats",
    "CalibrationWarning",
    "KeepLast",
    "calibrate",
    "describe_generated",
    "generate_batches",
]
