"""Small models used by the tests and by `gml inspect tests/assets/models.py:ClassName`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    """Conv-BN-ReLU, a residual block, pooling and a classifier head."""

    example_input_shape = (1, 3, 32, 32)

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(x))
        x = self.relu(x + y)
        return self.fc(torch.flatten(self.pool(x), 1))


class MLP(nn.Module):
    example_input_shape = (4, 32)

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class DataDependent(nn.Module):
    """Branches on a tensor value: torch.fx cannot trace this."""

    example_input_shape = (1, 8)

    def __init__(self) -> None:
        super().__init__()
        self.inner = Gate()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.inner(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class NeedsArgs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)


class PerImage(nn.Module):
    """Loops over the images of its batch at the top level, as torchvision's detectors do; the
    backbone alone traces."""

    example_input_shape = (2, 3, 32, 32)

    def __init__(self) -> None:
        super().__init__()
        self.backbone = SmallCNN()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.backbone(img[None])[0] for img in images])


def add_tail(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x[:, 1:] += y[:, 1:]``, returning ``x``: torchvision's MViT ``_add_shortcut`` in small."""
    x[:, 1:] += y[:, 1:]
    return x


def add_tail_silently(x: torch.Tensor, y: torch.Tensor) -> None:
    x[:, 1:] += y[:, 1:]


# traced as one opaque call_function node each, as torchvision wraps its MViT helpers
torch.fx.wrap("add_tail")
torch.fx.wrap("add_tail_silently")


class OpaqueShortcut(nn.Module):
    """Calls an opaque helper that overwrites ``y`` in place and ignores its result, then reads
    ``y``: a pass (or torch.ao) that takes every op to be pure drops the residual."""

    example_input_shape = (4, 16)

    def __init__(self, returning: bool = True) -> None:
        super().__init__()
        self.returning = returning
        self.lin = nn.Linear(16, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.returning:
            add_tail(y, x)
        else:
            add_tail_silently(y, x)
        return self.out(torch.relu(y))


class OpaqueWriteThroughView(nn.Module):
    """The opaque write to ``y`` is read later through a view ``v`` made before it."""

    example_input_shape = (3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        v = y.view(-1)
        add_tail_silently(y, x)
        return v + 1


def shrink_window(window: list[int], limit: list[int]) -> list[int]:
    """Edits its list argument, as torchvision's Swin3D ``_get_window_and_shift_size`` does."""
    for i in range(len(window)):
        if limit[i] < window[i]:
            window[i] = limit[i]
    return window


torch.fx.wrap("shrink_window")


class EditsListArgument(nn.Module):
    """Calls a wrapped function with constant lists that it edits in place."""

    example_input_shape = (1, 2, 4, 4)

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = shrink_window([8, 8], [x.shape[2], x.shape[3]])  # a traced argument: a node
        return self.conv(x) * window[0]
