"""``open_data(path, ...)``: the reader for what ``path`` holds.

* a folder of images, flat or with class sub-folders (``ImageFolder`` layout), or one image file →
  :class:`~gml.data.images.ImageFolderSource`;
* a ``.txt`` file (one sample per line) → :class:`~gml.data.text.TextLinesSource`;
* a ``.pt`` / ``.pth`` / ``.npy`` / ``.safetensors`` file, or a folder of them →
  :class:`~gml.data.tensors.TensorFileSource`.

Anything else is refused with an error naming the file and the kinds accepted. The options
(``--resize/--crop/--mean/--std``, ``--tokenizer``, ``--seq-len``) are one :class:`DataOptions` value.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gml.data.images import ImageOptions, image_extensions
from gml.data.source import DataSource, check_not_empty
from gml.data.tensors import TENSOR_SUFFIXES
from gml.errors import InputError

TEXT_SUFFIXES = (".txt",)
KINDS = "a folder of images (class sub-folders = labels), a .txt file of lines, or tensors (.pt, .npy, .safetensors)"


@dataclass(frozen=True)
class DataOptions:
    """How to turn files into model inputs (``None`` everywhere: from the model, else defaults)."""

    image: ImageOptions = field(default_factory=ImageOptions)
    tokenizer: str | None = None  # a local Hugging Face folder
    seq_len: int | None = None  # text: tokens per line (default: the example input's length)


def _kind(path: str) -> str:
    if not os.path.exists(path):
        raise InputError(f"data path {path} does not exist.", hint=f"give {KINDS}.")
    low = path.lower()
    if os.path.isfile(path):
        if low.endswith(TENSOR_SUFFIXES):
            return "tensors"
        if low.endswith(TEXT_SUFFIXES):
            return "text"
        if low.endswith(image_extensions()):
            return "images"
        what = "a model saved by gml, not data" if low.endswith(".pt2") else f"a '{os.path.splitext(path)[1]}' file"
        raise InputError(
            f"{path} is {what}; data is {KINDS}.", hint="point --calib-data / --eval-data / --input at data."
        )
    names = []
    for dirpath, dirnames, files in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        names.extend(os.path.join(dirpath, f) for f in files if not f.startswith("."))
    if any(n.lower().endswith(image_extensions()) for n in names):
        return "images"
    if any(n.lower().endswith(TENSOR_SUFFIXES) for n in names):
        return "tensors"
    if not names:
        raise InputError(f"data folder {path} is empty.", hint=f"give {KINDS}.")
    shown = ", ".join(os.path.relpath(n, path) for n in sorted(names)[:3])
    raise InputError(f"data folder {path} holds neither images nor tensor files ({shown}, ...).", hint=f"give {KINDS}.")


def open_data(
    path: str,
    example_inputs: Sequence[torch.Tensor],
    *,
    model: Any = None,
    spec: str | None = None,
    options: DataOptions | None = None,
    require_labels: bool = False,
    strict: bool = True,
) -> DataSource:
    """The :class:`DataSource` for ``path``, producing samples shaped like ``example_inputs``.

    ``model`` / ``spec`` (a torchvision name, ``timm:NAME``, a local Hugging Face folder) give the
    image preprocessing and the tokenizer where they have them. ``require_labels``: refuse data
    without labels (``--min-accuracy-drop``). ``strict=False`` (``gml run``): a tensor file of the
    wrong shape makes its samples unreadable items instead of refusing the whole source.
    """
    options = options or DataOptions()
    kind = _kind(path)
    source: DataSource
    if kind == "images":
        from gml.data.images import ImageFolderSource, resolve_preprocess

        shape = tuple(example_inputs[0].shape)
        if len(example_inputs) != 1 or not example_inputs[0].is_floating_point():
            raise InputError(
                f"{path} holds images, but this model takes {len(example_inputs)} input(s) "
                f"({', '.join(str(x.dtype).removeprefix('torch.') for x in example_inputs)}), not one image tensor.",
                hint="give tensors (.pt / .npy / .safetensors) or text lines for this model.",
            )
        if len(shape) == 4 and shape[1] not in (1, 3):
            raise InputError(f"images decode to 1 or 3 channels; this model takes {shape[1]}.")
        timm_spec = spec.removeprefix("timm:") if spec and spec.startswith("timm:") else None
        pre = resolve_preprocess(shape, model=model, spec=None if timm_spec else spec, options=options.image)
        source = ImageFolderSource(path, pre, shape[1], require_labels=require_labels)
    elif kind == "text":
        from gml.data.text import TextLinesSource, load_tokenizer

        folder = options.tokenizer or (spec if spec and os.path.isdir(spec) else None)
        seq_len = options.seq_len or (int(example_inputs[0].shape[-1]) if example_inputs[0].dim() >= 2 else None)
        if seq_len is None or example_inputs[0].is_floating_point():
            raise InputError(
                f"{path} is text, but this model's input is {tuple(example_inputs[0].shape)} "
                f"{str(example_inputs[0].dtype).removeprefix('torch.')}, not token ids.",
                hint="give images or tensors for this model.",
            )
        if require_labels:
            raise InputError(f"{path}: text lines carry no labels.", hint="give labelled tensors (a 'labels' key).")
        source = TextLinesSource(path, load_tokenizer(folder, path), seq_len, len(example_inputs))
    else:
        from gml.data.tensors import TensorFileSource

        source = TensorFileSource(path, example_inputs, strict=strict)
        if require_labels and not source.labelled:
            raise InputError(
                f"{path} holds no labels.",
                hint="save a dict with one tensor per input and 'labels' (N integers), or use an ImageFolder.",
            )
    return check_not_empty(source)
