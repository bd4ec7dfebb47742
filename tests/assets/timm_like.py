"""Tiny local copies of the timm building blocks that broke GML (issue #16), with timm's structure.

No timm needed: each class reproduces what matters to a graph rewrite — a subclass with its own
``forward`` (``Conv2dSame``, ``BatchNormAct2d``, ``StdConv2d``), shape-only Python in ``forward``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def get_same_padding(x: int, k: int, s: int, d: int) -> int:
    return max((math.ceil(x / s) - 1) * s + (k - 1) * d + 1 - x, 0)


def pad_same(x: torch.Tensor, k: tuple[int, ...], s: tuple[int, ...], d: tuple[int, ...]) -> torch.Tensor:
    ih, iw = x.size()[-2:]
    pad_h, pad_w = get_same_padding(ih, k[0], s[0], d[0]), get_same_padding(iw, k[1], s[1], d[1])
    return F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))


class Conv2dSame(nn.Conv2d):
    """timm.layers.Conv2dSame: TensorFlow "SAME" padding computed from the input size in forward."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, bias: bool = True) -> None:
        super().__init__(cin, cout, k, stride, 0, 1, groups, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_same(x, self.weight.shape[-2:], self.stride, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm.layers.BatchNormAct2d: F.batch_norm on its own buffers, then an activation."""

    def __init__(self, num_features: int, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            bn_training,
            0.0 if self.momentum is None else self.momentum,
            self.eps,
        )
        return self.act(self.drop(x))


class StdConv2d(nn.Conv2d):
    """timm.layers.StdConv2d: the weight standardized (per output channel) on every call."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0, eps: float = 1e-6) -> None:
        super().__init__(cin, cout, k, stride, padding, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0, eps=self.eps
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ScaledStdConv2d(nn.Conv2d):
    """timm.layers.ScaledStdConv2d (NFNets): standardized weight times a learned gain."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0, eps: float = 1e-6) -> None:
        super().__init__(cin, cout, k, stride, padding, bias=True)
        self.gain = nn.Parameter(torch.full((cout, 1, 1, 1), 1.0))
        self.scale = (self.weight[0].numel()) ** -0.5
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics, so folding them is visible in the numbers."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) * 0.4 - 0.2)
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


class SameNet(nn.Module):
    """tf_efficientnet_lite0's shape: a strided depthwise Conv2dSame between plain convs; the head
    pools, so a lowering that drops the "same" padding keeps the logits' shape."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6())
        self.dw = Conv2dSame(16, 16, 3, stride=2, groups=16, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.act = nn.ReLU6()
        self.pw = nn.Conv2d(16, 32, 1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.pw(self.act(self.bn(self.dw(self.stem(x)))))))


class GlobalContextNet(nn.Module):
    """gcresnet33ts's global-context block: ``x + conv(pool(x))`` adds a (N, C, 1, 1) conv output to
    an (N, C, H, W) map (broadcasting), next to ordinary residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.mlp = nn.Conv2d(16, 16, 1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.conv1(x) + x)  # an ordinary residual: still fuses
        y = y + self.mlp(self.pool(y))  # broadcasting conv → add
        return self.head(torch.relu(self.conv2(y) + y))


class BnActNet(nn.Module):
    """efficientnet/regnet-style blocks built from BatchNormAct2d, plus a BN no conv precedes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = BatchNormAct2d(16, nn.SiLU)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.bn2 = BatchNormAct2d(16, nn.ReLU)
        self.pool = nn.MaxPool2d(2)
        self.bn3 = nn.BatchNorm2d(16)  # after a pool: nothing to fold into backwards
        self.conv3 = nn.Conv2d(16, 32, 1)  # 1x1, no padding: the BN folds forward, exactly
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.head(torch.relu(self.conv3(self.bn3(self.pool(x)))))


class StdConvNet(nn.Module):
    """resnetv2_bit / nf_resnet: weight-standardized convs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = StdConv2d(3, 16, 3, padding=1)
        self.act = nn.ReLU()
        self.conv2 = ScaledStdConv2d(16, 16, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv2(self.act(self.conv1(x)))))


class ShapeCheckNet(nn.Module):
    """vgg's ConvMlp (`if x.shape[-2] < k: pad`) and a Conv2dSame traced through: shape-only Python."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = 7
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.same = Conv2dSame(16, 16, 3, stride=2)
        self.fc = nn.Conv2d(16, 32, self.kernel)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.same(self.stem(x))
        if x.shape[-2] < self.kernel or x.size(-1) < self.kernel:
            output_size = max(self.kernel, x.shape[-2]), max(self.kernel, x.shape[-1])
            x = F.adaptive_avg_pool2d(x, output_size)
        return self.head(torch.relu(self.fc(x)))


class ValueBranchNet(nn.Module):
    """Real data-dependent control flow: must still fail to trace, with a clear message."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if y.sum() > 0:
            return y
        return -y
