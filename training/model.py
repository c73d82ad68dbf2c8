"""torchvision's ResNet18, with the small-image stem for inputs of 64 px or less."""

from __future__ import annotations

import torch
import torchvision

SMALL_IMAGE_MAX_SIDE = 64  # at or below this the ImageNet stem (7x7/2 conv + max-pool) loses too much


def resnet18(num_classes: int, *, image_size: int) -> torch.nn.Module:
    """Random init (torch's global RNG: seed it first so every rank builds the same weights)."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if image_size <= SMALL_IMAGE_MAX_SIDE:
        # CIFAR-style stem: 3x3 stride-1 conv, no max-pool; 32 px keeps a 4x4 final feature map
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
    return model.to(memory_format=torch.channels_last)
