"""torchvision's ResNet18, with the small-image stem for inputs of 64 px or less."""

from __future__ import annotations

import torch

SMALL_IMAGE_MAX_SIDE = 64  # at or below this the ImageNet stem (7x7/2 conv + max-pool) loses too much


def uses_small_stem(setting: str, image_size: int) -> bool:
    return setting == "on" or (setting == "auto" and image_size <= SMALL_IMAGE_MAX_SIDE)


def resnet18(num_classes: int, *, small_stem: bool) -> torch.nn.Module:
    """Random init from torch's global RNG: seed it first so every rank builds the same weights."""
    # here, not at the top: its import pulls torch._dynamo (seconds; docs/benchmarks.md), which the driver never needs
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_stem:
        # CIFAR-style stem: 3x3 stride-1 conv, no max-pool; 32 px keeps a 4x4 final feature map
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
    return model.to(memory_format=torch.channels_last)


def load_init_weights(model: torch.nn.Module, path: str) -> list[str]:
    """Copy every tensor of a torchvision ResNet18 state_dict whose name and shape match.

    The classification head (fc) is always left at its fresh init, and so is a stem whose
    shape differs (ImageNet 7x7 weights into the small 3x3 stem). Returns the skipped names.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:  # our own model.pt
        state = state["state_dict"]
    own = model.state_dict()
    matched = {k: v for k, v in state.items() if k in own and not k.startswith("fc.") and own[k].shape == v.shape}
    if not any(k.startswith("layer") for k in matched):
        raise ValueError(
            f"{path}: no ResNet18 weights found (expected torchvision resnet18 state_dict keys like "
            "'layer1.0.conv1.weight')"
        )
    model.load_state_dict(matched, strict=False)  # fc and a reshaped stem keep their fresh init
    return sorted(k for k in own if k not in matched)
