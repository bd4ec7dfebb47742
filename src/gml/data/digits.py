"""A small CNN trained on scikit-learn's bundled digits: a real accuracy check for INT8.

Random-init models only tell us how close INT8 stays to fp32; a trained model tells us whether
the answer is still right. scikit-learn ships the 1,797 8x8 handwritten digits inside the package
(``sklearn.datasets.load_digits`` reads a file on disk, never the network), which makes a model
that trains in a few seconds on two cores and reaches ~98% held-out accuracy.

:class:`DigitsCNN` is built to exercise the INT8 pipeline: Conv+BN+ReLU (BN folds), a residual
block whose ``out += identity`` becomes Conv+Add+ReLU, MaxPool, a functional ReLU and a flatten
the normalize pass rewrites, AdaptiveAvgPool and Linear+ReLU / Linear.

Everything is seeded (data split, init, shuffling), so a given seed gives the same model on every
run with the same thread count. Nothing is written to disk unless ``cache_dir`` is passed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gml.errors import GMLError

IMAGE_SHAPE = (1, 8, 8)
NUM_CLASSES = 10


@dataclass
class DigitsData:
    """Standardized digits as ``(N, 1, 8, 8)`` float tensors and int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    #: the train set's pixel mean and std the inputs were standardized with (raw pixels are 0..16)
    mean: float = 0.0
    std: float = 1.0

    def batches(self, split: str = "train", batch_size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` batches of one split, in order."""
        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_test, self.y_test)
        return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def load_digits(*, test_fraction: float = 0.25, seed: int = 0) -> DigitsData:
    """The sklearn digits, split stratified by class, standardized with the *train* mean/std."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # scikit-learn is a dev extra
        raise GMLError(
            "the digits data set needs scikit-learn, which is not installed.",
            hint="pip install scikit-learn (or pip install -e '.[dev]').",
        ) from exc
    bunch = sk_load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).reshape(-1, *IMAGE_SHAPE)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=bunch.target
    )
    tr, te = torch.tensor(idx_train), torch.tensor(idx_test)
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return DigitsData(x[tr], y[tr], x[te], y[te], float(mean), float(std))


#: a raw digit pixel (0..16) is written as this many PNG levels per unit (16 -> 240): exact in uint8
PNG_SCALE = 15


def save_digits_images(data: DigitsData, root: str, split: str = "test", limit: int | None = None) -> tuple:
    """Write a split as 8x8 grayscale PNGs in torchvision's ImageFolder layout (``root/<digit>/<n>.png``,
    the real-data path of ``gml quantize --calib-data / --eval-data``) and return ``(mean, std)``: the
    normalization (of [0, 1] pixels) that gives back the model's standardized inputs exactly."""
    from torchvision.io import write_png

    x, y = (data.x_train, data.y_train) if split == "train" else (data.x_test, data.y_test)
    n = len(x) if limit is None else min(limit, len(x))
    raw = torch.round(x[:n] * data.std + data.mean).clamp(0, 16)
    pixels = (raw * PNG_SCALE).to(torch.uint8)
    import warnings

    with warnings.catch_warnings():  # torchvision 0.29 points at TorchCodec for encoding
        warnings.simplefilter("ignore", DeprecationWarning)
        for i in range(n):
            folder = os.path.join(root, str(int(y[i])))
            os.makedirs(folder, exist_ok=True)
            write_png(pixels[i], os.path.join(folder, f"{i:04d}.png"))
    scale = PNG_SCALE / 255  # a [0, 1] pixel v is raw * scale
    return (data.mean * scale,), (data.std * scale,)


class DigitsCNN(nn.Module):
    """8x8 digits → 10 logits; ~20k parameters."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        w = width
        self.stem = nn.Conv2d(1, w, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(w)
        self.conv1 = nn.Conv2d(w, w, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.conv2 = nn.Conv2d(w, w, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(w, 2 * w, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(2 * w)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(2 * w, 64)
        self.fc2 = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.stem_bn(self.stem(x)))
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        x = self.pool(self.relu(out))  # 8x8 → 4x4
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc2(F.relu(self.fc1(x)))


@dataclass
class TrainedDigits:
    model: DigitsCNN  # eval mode
    data: DigitsData
    test_accuracy: float  # fraction


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _cache_path(cache_dir: str, seed: int, epochs: int, width: int) -> str:
    key = hashlib.sha256(f"digits-v1-{seed}-{epochs}-{width}-{torch.__version__}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"gml-digits-{key}.pt")


def train_digits_model(
    *,
    seed: int = 0,
    epochs: int = 15,
    batch_size: int = 64,
    lr: float = 3e-3,
    width: int = 16,
    data: DigitsData | None = None,
    cache_dir: str | None = None,
) -> TrainedDigits:
    """Train :class:`DigitsCNN` (Adam, cosine LR decay, light weight decay); seconds on 2 cores.

    With ``cache_dir`` (e.g. ``tempfile.gettempdir()``) the trained weights are saved there and
    reused on the next call with the same settings; without it nothing touches the disk.
    """
    data = data if data is not None else load_digits(seed=seed)
    path = _cache_path(cache_dir, seed, epochs, width) if cache_dir else None
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = DigitsCNN(width)
        if path and os.path.exists(path):
            model.load_state_dict(torch.load(path, weights_only=True))
        else:
            threads = torch.get_num_threads()
            # One thread: the model is tiny (threads only add sync cost, badly so on a busy
            # machine), and the result no longer depends on the machine's core count.
            torch.set_num_threads(1)
            try:
                _train(model, data, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
            finally:
                torch.set_num_threads(threads)
            if path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(model.state_dict(), path)
    model.eval()
    return TrainedDigits(model, data, _accuracy(model, data.x_test, data.y_test))


def _train(model: nn.Module, data: DigitsData, *, epochs: int, batch_size: int, lr: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(data.x_train) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(data.x_train), generator=gen)
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()


__all__ = ["DigitsCNN", "DigitsData", "TrainedDigits", "load_digits", "save_digits_images", "train_digits_model"]
