"""Tensors saved to files: ``.pt`` (``torch.load(weights_only=True)``: no pickled code runs),
``.npy`` (``numpy.load(allow_pickle=False)``) and ``.safetensors``; one file or a folder of them.

A file holds either one tensor of shape ``(N, *sample)`` (or exactly one sample's shape), or — for
``.pt`` / ``.safetensors`` — named tensors: one per model input (``input_ids`` / ``attention_mask``
keep that order; other names keep the file's) and optionally labels (``labels``, ``label``,
``targets``, ``target`` or ``y``: N integers). Every file's shapes are checked when the source is
opened, against the model's example inputs without their batch dimension; floating tensors are
cast to the model's floating dtype, integer ones to its integer dtype (float data for an integer
input is refused). Files are memory-mapped and read a sample at a time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from gml.data.source import DataSource, Inputs
from gml.errors import InputError

TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")
LABEL_KEYS = ("labels", "label", "targets", "target", "y")
_ORDER = ("input_ids", "attention_mask", "token_type_ids")


def _load(path: str) -> dict[str, torch.Tensor] | torch.Tensor:
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".npy":
            import numpy as np

            return torch.from_numpy(np.load(path, mmap_mode="r", allow_pickle=False).copy())
        if suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise InputError(
                    f"{path} is a .safetensors file and the `safetensors` package is not installed.",
                    hint="pip install safetensors (or save the tensors with torch.save / numpy.save).",
                ) from None
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except InputError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise InputError(
            f"cannot read tensor file {path}: {type(exc).__name__}: {first}",
            hint="the file is damaged, not of the kind its extension says, or holds pickled objects other than "
            "tensors (refused: loading them could run code).",
        ) from None


def _split(path: str, data: Any, n_inputs: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``(inputs, labels)`` of one file's content."""
    if isinstance(data, torch.Tensor):
        return [data], None
    if isinstance(data, list | tuple) and all(isinstance(t, torch.Tensor) for t in data):
        return list(data), None
    if isinstance(data, dict) and all(isinstance(t, torch.Tensor) for t in data.values()):
        label_key = next((k for k in LABEL_KEYS if k in data), None)
        names = [k for k in data if k != label_key]
        known = [k for k in _ORDER if k in names]
        names = known + [k for k in names if k not in known]
        return [data[k] for k in names], data[label_key] if label_key else None
    raise InputError(
        f"{path} holds a {type(data).__name__}, not tensors.",
        hint="save a tensor of shape (N, ...) or a dict of them (one per model input, optionally 'labels').",
    )


class TensorFileSource(DataSource):
    """Samples from tensor files (module docstring). ``strict=False`` (``gml run``) keeps a bad file's
    samples as unreadable items instead of refusing the whole source."""

    kind = "tensors"

    def __init__(
        self,
        path: str,
        example_inputs: Sequence[torch.Tensor],
        *,
        strict: bool = True,
        files: Sequence[str] | None = None,
    ) -> None:
        self.path = path
        self.shapes = [tuple(x.shape[1:]) for x in example_inputs]
        self.dtypes = [x.dtype for x in example_inputs]
        self.files = list(files) if files is not None else _list(path)
        self.index: list[tuple[int, int]] = []  # sample -> (file, row)
        self.errors: dict[int, str] = {}  # file -> why its samples are unreadable
        self.single: dict[int, bool] = {}  # file holds one sample without a batch dim
        labels_seen: list[int] = []
        has_labels: set[bool] = set()
        for f, name in enumerate(self.files):
            try:
                inputs, labels, single = self._check(name, _load(name))
            except InputError as exc:
                if strict:
                    raise
                self.errors[f] = exc.message
                self.index.append((f, 0))
                continue
            n = 1 if single else int(inputs[0].shape[0])
            self.single[f] = single
            has_labels.add(labels is not None)
            if labels is not None:
                labels_seen.extend(int(v) for v in labels.reshape(-1).tolist())
            self.index.extend((f, r) for r in range(n))
        self.labelled_files = has_labels == {True}
        self.classes = [str(k) for k in range(max(labels_seen) + 1)] if self.labelled_files and labels_seen else None
        self._cache: tuple[int, list[torch.Tensor], torch.Tensor | None] | None = None

    def _check(self, name: str, data: Any) -> tuple[list[torch.Tensor], torch.Tensor | None, bool]:
        inputs, labels = _split(name, data, len(self.shapes))
        if len(inputs) != len(self.shapes):
            raise InputError(
                f"{name} holds {len(inputs)} input tensor(s); the model takes {len(self.shapes)}.",
                hint="save one tensor per model input (a dict, e.g. {'input_ids': ..., 'attention_mask': ...}).",
            )
        single = all(tuple(t.shape) == s for t, s in zip(inputs, self.shapes))
        for j, (t, s, dt) in enumerate(zip(inputs, self.shapes, self.dtypes)):
            if not single and tuple(t.shape[1:]) != s:
                raise InputError(
                    f"{name}: input {j} has shape {tuple(t.shape)}; the model takes samples of shape {s} "
                    f"(a file holds (N, {', '.join(map(str, s))}) or one sample of shape {s}).",
                    hint="reshape or preprocess the tensors as the model expects (--input-shape sets the model's).",
                )
            if t.is_floating_point() != dt.is_floating_point or t.is_complex():
                raise InputError(
                    f"{name}: input {j} is {str(t.dtype).removeprefix('torch.')}; the model takes "
                    f"{str(dt).removeprefix('torch.')}.",
                    hint="save token ids as integers and everything else as floats.",
                )
        n = 1 if single else int(inputs[0].shape[0])
        if any((1 if single else int(t.shape[0])) != n for t in inputs):
            raise InputError(f"{name}: its input tensors hold different numbers of samples.")
        if labels is not None and (labels.is_floating_point() or labels.numel() != n):
            raise InputError(
                f"{name}: labels must be {n} integers (one per sample); they are {tuple(labels.shape)} "
                f"{str(labels.dtype).removeprefix('torch.')}.",
            )
        return inputs, labels, single

    @property
    def labelled(self) -> bool:
        return self.classes is not None

    def __len__(self) -> int:
        return len(self.index)

    def item_id(self, i: int) -> str:
        f, row = self.index[i]
        name = os.path.relpath(self.files[f], self.path) if os.path.isdir(self.path) else os.path.basename(self.path)
        return name if self.single.get(f) else f"{name}[{row}]"

    def read(self, i: int) -> tuple[Inputs, int | None]:
        f, row = self.index[i]
        if f in self.errors:
            raise InputError(self.errors[f])
        if self._cache is None or self._cache[0] != f:
            inputs, labels = _split(self.files[f], _load(self.files[f]), len(self.shapes))
            self._cache = (f, inputs, labels)
        _, inputs, labels = self._cache
        if self.single[f]:
            sample = tuple(t.to(dt) for t, dt in zip(inputs, self.dtypes))
        else:
            sample = tuple(t[row].to(dt) for t, dt in zip(inputs, self.dtypes))
        label = int(labels.reshape(-1)[row]) if labels is not None and self.labelled else None
        return sample, label

    def describe(self) -> str:
        labels = f", labels for {len(self.classes)} classes" if self.classes else ""
        return f"{len(self)} samples from {len(self.files)} tensor file(s) in {self.path}{labels}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}


def _list(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(dirpath, f)
        for dirpath, _, names in os.walk(path)
        for f in names
        if f.lower().endswith(TENSOR_SUFFIXES)
    )
