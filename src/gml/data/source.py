"""One small interface for the user's data: a numbered list of samples, each read on its own.

Every reader (:mod:`gml.data.images`, :mod:`gml.data.text`, :mod:`gml.data.tensors`) is a
:class:`DataSource`: ``len(source)`` samples, ``source.item_id(i)`` names sample ``i`` (a file path
relative to the data root, ``file.txt:LINE``, ``file.npy[ROW]``), and ``source.read(i)`` returns
its model inputs *without* the batch dimension and its label (or ``None``). A sample that cannot be
read raises :class:`~gml.errors.InputError` naming its file: calibration and evaluation stop there,
``gml run`` skips the sample and lists it.

Batching is shared (:meth:`DataSource.batches`): samples are stacked with
``torch.utils.data.default_collate``. Calibration takes a seeded random subset
(:meth:`DataSource.calibration`), so an ``ImageFolder`` sorted by class still calibrates on every
class; evaluation takes every sample in order (:meth:`DataSource.evaluation`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gml.errors import InputError

Inputs = tuple[torch.Tensor, ...]


@dataclass
class Batch:
    """Stacked model inputs of some samples, their labels (when the source has them) and ids."""

    inputs: Inputs
    labels: torch.Tensor | None
    ids: list[str]


class DataSource(ABC):
    """A numbered list of samples (module docstring). Subclasses set ``path``, ``kind`` and
    ``classes`` (class names in label order, or ``None`` for unlabelled data)."""

    path: str
    kind: str
    classes: list[str] | None = None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def item_id(self, i: int) -> str:
        """A stable name of sample ``i`` (what ``gml run`` writes next to its outputs)."""

    @abstractmethod
    def read(self, i: int) -> tuple[Inputs, int | None]:
        """Sample ``i``'s model inputs (no batch dim) and label; :class:`InputError` naming the file."""

    @abstractmethod
    def describe(self) -> str:
        """One line for reports: what was read and how it was preprocessed."""

    @property
    def labelled(self) -> bool:
        return self.classes is not None

    def batches(self, batch_size: int = 8, indices: Sequence[int] | None = None) -> Iterator[Batch]:
        """Batches of ``batch_size`` samples in the order of ``indices`` (default: all)."""
        from torch.utils.data import default_collate

        if batch_size < 1:
            raise InputError(f"batch size {batch_size} is not positive.", hint="use a batch size of 1 or more.")
        order = list(range(len(self))) if indices is None else list(indices)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            samples = [self.read(i) for i in chunk]
            inputs = default_collate([s[0] for s in samples])
            labels = torch.tensor([s[1] for s in samples]) if self.labelled else None
            yield Batch(tuple(inputs), labels, [self.item_id(i) for i in chunk])

    def calibration(self, samples: int | None = None, batch_size: int = 8, seed: int = 0) -> list[Inputs]:
        """Input batches of a seeded random subset of ``samples`` samples (all when ``None`` or more
        than there are), for :func:`gml.quantize`'s ``calib_data``."""
        n = len(self)
        if samples is not None and samples < 1:
            raise InputError(f"--calib-samples {samples}: calibration needs at least one sample.")
        if samples is None or samples >= n:
            order = list(range(n))
        else:
            gen = torch.Generator().manual_seed(seed)
            order = sorted(torch.randperm(n, generator=gen)[:samples].tolist())
        return [b.inputs for b in self.batches(batch_size, order)]

    def evaluation(self, batch_size: int = 8) -> tuple[list[Inputs], list[torch.Tensor] | None]:
        """Every sample in order: input batches and (for labelled data) one label tensor per batch,
        for :func:`gml.quantize`'s ``eval_data`` / ``eval_labels``."""
        batches = list(self.batches(batch_size))
        labels = [b.labels for b in batches] if self.labelled else None
        return [b.inputs for b in batches], labels  # type: ignore[misc]


def check_not_empty(source: DataSource) -> DataSource:
    if len(source) == 0:
        raise InputError(f"{source.path} holds no samples.", hint="point at a folder or file with data in it.")
    return source


def expected_shapes(example_inputs: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Per-sample shapes (the example inputs without their batch dim)."""
    return [tuple(x.shape[1:]) for x in example_inputs]
