"""PyTorch models in plain ``torch.nn`` (no torchvision): ResNet-50 v1.5 and two small CPU models.

Every model takes uint8 NHWC images, the layout the input pipelines produce, and normalizes
them on the device. Viewing NHWC as NCHW gives channels-last strides for free, the layout
tensor cores and oneDNN convolutions are fastest with.
"""

from __future__ import annotations

import torch
from torch import nn

from training.data.imagenet import MEAN, STD


class Normalize(nn.Module):
    """uint8 NHWC -> float32 NCHW (channels-last memory), ImageNet mean/std normalized.

    One elementwise pass, ``x * (1/std) - mean/std``, which reads the uint8 batch and writes the
    float one: the plain ``(x.float() - mean) / std`` is three passes over the float batch (about
    0.8 GB of memory traffic per step at ResNet-50's batch 256), which eager mode pays on every step
    and torchvision's recipe, whose input is already float, does not. Compiled, Inductor fuses
    either form. Equal to the plain form within float32 rounding (tests/training/test_speed_paths.py).
    """

    def __init__(self) -> None:
        super().__init__()
        mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
        self.register_buffer("scale", 1.0 / std, persistent=False)
        self.register_buffer("shift", -mean / std, persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # uint8 times float32 promotes inside the kernel: no float copy of the batch is made first
        return torch.addcmul(self.shift, images.permute(0, 3, 1, 2), self.scale)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: the stride sits on the 3x3 convolution, not the first 1x1."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = _projection(in_channels, out_channels, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
        )
        self.shortcut = _projection(in_channels, width, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def _projection(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
    )


class ResNet(nn.Module):
    def __init__(
        self,
        block: type[Bottleneck] | type[BasicBlock],
        depths: list[int],
        widths: list[int],
        num_classes: int,
        stem: nn.Module,
        stem_channels: int,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [Normalize(), stem]
        channels = stem_channels
        for stage, (depth, width) in enumerate(zip(depths, widths, strict=True)):
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(block(channels, width, stride))
                channels = width * block.expansion
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
        self.layers = nn.Sequential(*layers)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (Bottleneck, BasicBlock)):
                # Zero-init the last BN of each residual branch: every block starts as identity,
                # which keeps large-batch training stable early on (Goyal et al., 2017).
                nn.init.zeros_(module.body[-1].weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


def resnet50(num_classes: int) -> ResNet:
    stem = nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )
    return ResNet(Bottleneck, [3, 4, 6, 3], [64, 128, 256, 512], num_classes, stem, 64)


def resnet_tiny(num_classes: int) -> ResNet:
    """Three basic blocks (16/32/64 channels) for CPU tests on small images."""
    stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
    return ResNet(BasicBlock, [1, 1, 1], [16, 32, 64], num_classes, stem, 16)


def simple_cnn(num_classes: int) -> nn.Module:
    """Two convolutions and a linear layer, no batch norm: per-worker batch statistics would
    make N workers x batch B differ from one worker x batch N*B, so equivalence tests use this."""
    return nn.Sequential(
        Normalize(),
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


MODELS = {"resnet50": resnet50, "resnet_tiny": resnet_tiny, "simple_cnn": simple_cnn}


def build_model(name: str, num_classes: int) -> nn.Module:
    return MODELS[name](num_classes)
