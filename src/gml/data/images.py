"""A folder of images, optionally in torchvision's ``ImageFolder`` layout (class sub-folders = labels).

Decoding is torchvision's (``torchvision.io.decode_image``: JPEG, PNG, GIF, WebP; the other
``ImageFolder`` extensions through PIL), the class list is ``ImageFolder``'s
(``torchvision.datasets.folder.find_classes`` / ``make_dataset``: sorted sub-folder names), and
preprocessing is a ``torchvision.transforms.v2`` pipeline: resize → center crop → float in [0, 1]
→ normalize. Where the numbers come from (:func:`resolve_preprocess`):

1. the model's own metadata: a timm model's ``timm.data.resolve_data_config`` (input size,
   ``crop_pct``, interpolation, mean/std), or a torchvision model name's weights enum
   (``get_model_weights(name).DEFAULT.transforms()``: resize, crop, mean/std). GML builds
   torchvision models with random weights; only the enum's metadata is read, nothing is downloaded;
2. otherwise: resize straight to the example input's height × width, pixels scaled to [0, 1], no
   normalization — said so in :meth:`ImagePreprocess.describe`;
3. ``--resize`` / ``--crop`` / ``--mean`` / ``--std`` override either, field by field.

Images are decoded to the model's channel count (1: grayscale, 3: RGB).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from gml.data.source import DataSource, Inputs
from gml.errors import InputError


def image_extensions() -> tuple[str, ...]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return tuple(IMG_EXTENSIONS)


#: what torchvision.io.decode_image reads itself; the rest of IMG_EXTENSIONS goes through PIL
_DECODE_IMAGE = (".jpg", ".jpeg", ".png", ".gif", ".webp")


@dataclass(frozen=True)
class ImagePreprocess:
    """Resize (shorter side, or ``(h, w)``) → center crop ``(h, w)`` → [0, 1] → normalize."""

    resize: int | tuple[int, int]
    crop: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    source: str = "defaults"  # where the numbers come from, for reports

    def transform(self) -> Any:
        from torchvision.transforms import v2

        mode = v2.InterpolationMode(self.interpolation)
        return v2.Compose(
            [
                v2.Resize(self.resize, interpolation=mode, antialias=True),
                v2.CenterCrop(self.crop),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(list(self.mean), list(self.std)),
            ]
        )

    def describe(self) -> str:
        size = "x".join(map(str, self.resize)) if isinstance(self.resize, tuple) else f"shorter side {self.resize}"
        norm = (
            "pixels in [0, 1], not normalized"
            if all(m == 0 for m in self.mean) and all(s == 1 for s in self.std)
            else f"mean {_fmt(self.mean)}, std {_fmt(self.std)}"
        )
        crop = "x".join(map(str, self.crop))
        return f"resize {size} ({self.interpolation}), center crop {crop}, {norm} ({self.source})"


def _fmt(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def _from_timm(model: Any) -> ImagePreprocess | None:
    if not (getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)):
        return None
    try:
        from timm.data import resolve_data_config
    except ImportError:
        return None
    cfg = resolve_data_config({}, model=model)
    _, h, w = cfg["input_size"]
    crop_pct = float(cfg.get("crop_pct") or 1.0)
    return ImagePreprocess(
        resize=math.floor(h / crop_pct),
        crop=(int(h), int(w)),
        mean=tuple(float(v) for v in cfg["mean"]),
        std=tuple(float(v) for v in cfg["std"]),
        interpolation=str(cfg.get("interpolation") or "bilinear"),
        source=f"timm resolve_data_config of {type(model).__name__}",
    )


def _from_torchvision(name: str) -> ImagePreprocess | None:
    import torchvision.models as tvm

    try:
        weights = tvm.get_model_weights(name).DEFAULT  # an enum: metadata only, nothing downloaded
        t = weights.transforms()
        resize, crop = list(t.resize_size), list(t.crop_size)
        mean, std, mode = t.mean, t.std, t.interpolation
    except Exception:  # not a torchvision name, or weights of another kind (video, segmentation)
        return None
    return ImagePreprocess(
        resize=int(resize[0]) if len(resize) == 1 else (int(resize[0]), int(resize[1])),
        crop=(int(crop[0]), int(crop[-1])),
        mean=tuple(float(v) for v in mean),
        std=tuple(float(v) for v in std),
        interpolation=str(getattr(mode, "value", mode)),
        source=f"torchvision {weights} transforms metadata",
    )


@dataclass(frozen=True)
class ImageOptions:
    """``--resize`` / ``--crop`` / ``--mean`` / ``--std`` (``None``: from the model or the defaults)."""

    resize: int | None = None
    crop: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


def resolve_preprocess(
    example_shape: tuple[int, ...],
    model: Any = None,
    spec: str | None = None,
    options: ImageOptions | None = None,
) -> ImagePreprocess:
    """The preprocessing for a model whose input is ``example_shape`` (``(N, C, H, W)``): from the
    model's metadata, else defaults, then ``options`` (module docstring). Checks mean/std against C."""
    options = options or ImageOptions()
    if len(example_shape) != 4:
        raise InputError(
            f"images need a model input of shape (N, C, H, W); this model's is {tuple(example_shape)}.",
            hint="give tensors (.pt / .npy / .safetensors) shaped like the model's input instead.",
        )
    channels, h, w = example_shape[1:]
    pre = (_from_timm(model) if model is not None else None) or (_from_torchvision(spec) if spec else None)
    if pre is None:
        pre = ImagePreprocess(
            (h, w), (h, w), (0.0,) * channels, (1.0,) * channels, source="defaults: the model has none"
        )
    changed = []
    if options.resize is not None:
        pre = replace(pre, resize=options.resize)
        changed.append("--resize")
    if options.crop is not None:
        pre = replace(pre, crop=(options.crop, options.crop))
        changed.append("--crop")
    for name in ("mean", "std"):
        value = getattr(options, name)
        if value is not None:
            value = tuple(value) * channels if len(value) == 1 else tuple(value)
            pre = replace(pre, **{name: value})
            changed.append(f"--{name}")
    if changed:
        pre = replace(pre, source=f"{pre.source}; {', '.join(changed)} given")
    for name in ("mean", "std"):
        value = getattr(pre, name)
        if len(value) != channels:
            raise InputError(
                f"--{name} has {len(value)} value(s) but the model takes {channels}-channel images.",
                hint=f"give one value or {channels} comma-separated values, e.g. --{name} "
                + ",".join(["0.5"] * channels)
                + ".",
            )
    if any(s == 0 for s in pre.std):
        raise InputError("--std holds a zero: normalizing would divide by zero.", hint="give positive values.")
    return pre


def decode(path: str, channels: int) -> torch.Tensor:
    """``(C, H, W)`` uint8 image in ``channels`` channels (1 or 3); :class:`InputError` naming the file."""
    from torchvision.io import ImageReadMode, decode_image

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    try:
        if path.lower().endswith(_DECODE_IMAGE):
            with warnings.catch_warnings():  # torchvision 0.29 points at TorchCodec, a package we do not need
                warnings.simplefilter("ignore", DeprecationWarning)
                return decode_image(path, mode=mode)
        from PIL import Image
        from torchvision.transforms.v2.functional import pil_to_tensor

        with Image.open(path) as im:
            return pil_to_tensor(im.convert("L" if channels == 1 else "RGB"))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        # torchvision's decoders prefix their C++ source location ("decode_png, /__w/.../decode_png.cpp:66, ")
        first = re.sub(r"^\w+, \S+\.cpp:\d+, ", "", first)[:200]
        raise InputError(
            f"cannot read image {path}: {first}",
            hint="the file is damaged or not an image of the kind its extension says; re-export it or remove it.",
        ) from None


class ImageFolderSource(DataSource):
    """Images in a folder: flat (unlabelled), or one sub-folder per class (``ImageFolder`` layout)."""

    kind = "images"

    def __init__(self, root: str, preprocess: ImagePreprocess, channels: int, *, require_labels: bool = False) -> None:
        self.path = root
        self.preprocess = preprocess
        self.channels = channels
        self._transform = preprocess.transform()
        exts = image_extensions()
        if os.path.isfile(root):
            self.files, self.labels, self.classes = [root], [None], None
            self._root = os.path.dirname(root)
            return
        self._root = root
        entries = sorted(os.scandir(root), key=lambda e: e.name)
        subdirs = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
        images = [e.path for e in entries if e.is_file() and e.name.lower().endswith(exts)]
        if subdirs and images:
            raise InputError(
                f"{root} holds both images and sub-folders ({', '.join(subdirs[:3])}): neither a flat image "
                "folder nor torchvision's ImageFolder layout (one sub-folder of images per class).",
                hint="move the loose images into a class folder, or point at a folder holding only images.",
            )
        if subdirs:
            self._classes_from_folders(root, exts)
        else:
            if not images:
                others = [e.name for e in entries if e.is_file()]
                raise InputError(
                    f"{root} holds no images ({', '.join(exts)})"
                    + (f"; it holds {', '.join(others[:3])}" if others else " and nothing else")
                    + ".",
                    hint="point at a folder of images, a .txt file of lines, or tensor files "
                    "(.pt, .npy, .safetensors).",
                )
            self.files, self.labels, self.classes = images, [None] * len(images), None
        if require_labels and self.classes is None:
            raise InputError(
                f"{root} has no class sub-folders, so its images have no labels.",
                hint="lay the images out as torchvision's ImageFolder does: root/<class name>/<image>.",
            )

    def _classes_from_folders(self, root: str, exts: tuple[str, ...]) -> None:
        from torchvision.datasets.folder import find_classes, make_dataset

        classes, class_to_idx = find_classes(root)
        counts = dict.fromkeys(classes, 0)
        samples = make_dataset(root, class_to_idx, extensions=exts, allow_empty=True)
        for _, label in samples:
            counts[classes[label]] += 1
        empty = [c for c, n in counts.items() if n == 0]
        if empty:
            raise InputError(
                f"class folder {os.path.join(root, empty[0])} holds no images"
                + (f" (nor do {len(empty) - 1} other class folder(s))" if len(empty) > 1 else "")
                + f"; images are files ending in {', '.join(exts)}.",
                hint="remove the empty class folder or put its images in it: an empty class would shift every "
                "later class's label index.",
            )
        self.files = [p for p, _ in samples]
        self.labels = [label for _, label in samples]
        self.classes = classes

    def __len__(self) -> int:
        return len(self.files)

    def item_id(self, i: int) -> str:
        return os.path.relpath(self.files[i], self._root)

    def read(self, i: int) -> tuple[Inputs, int | None]:
        from torchvision import tv_tensors

        image = tv_tensors.Image(decode(self.files[i], self.channels))
        return (self._transform(image).as_subclass(torch.Tensor),), self.labels[i]

    def describe(self) -> str:
        labels = f", {len(self.classes)} classes (ImageFolder layout)" if self.classes is not None else ""
        return f"{len(self)} images from {self.path}{labels}; {self.preprocess.describe()}"

    def __getstate__(self) -> dict[str, Any]:  # for Ray actors: the transform is rebuilt there
        state = dict(self.__dict__)
        state.pop("_transform", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._transform = self.preprocess.transform()
