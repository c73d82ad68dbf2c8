"""torchvision's ResNet18, with the small-image stem for inputs of 32 px or less (--small-stem auto)."""

from __future__ import annotations

import pickle
import re

import torch

from training.config import ConfigError

# --small-stem auto: the small stem at or below this side (docs/design.md, "Choices and where they were measured")
SMALL_IMAGE_MAX_SIDE = 32


def uses_small_stem(setting: str, image_size: int) -> bool:
    return setting == "on" or (setting == "auto" and image_size <= SMALL_IMAGE_MAX_SIDE)


def resnet18(num_classes: int, *, small_stem: bool) -> torch.nn.Module:
    """Random init from torch's global RNG: seed it first so every rank builds the same weights."""
    # here, not at the top: its import pulls torch._dynamo, slow to import (docs/design.md, "Choices and where
    # they were measured"), which the driver needs only to check an --init-weights file
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
    ConfigError, one line naming the file and the fix, for a file that torch.load with
    weights_only=True refuses (a pickled object: it could run code), that is no state_dict,
    or that holds no ResNet18 weights. The driver runs this once before Ray starts
    (training.inputs.check_inputs), as every train worker does.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch errors alike mean "not a state_dict file"
        raise ConfigError(f"--init-weights {path}: {load_refusal(e)}; {INIT_WEIGHTS_FIX}") from None
    if isinstance(state, dict) and "state_dict" in state:  # our own model.pt
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(
            f"--init-weights {path}: holds a {type(state).__name__}, not a state_dict; {INIT_WEIGHTS_FIX}"
        )
    own = model.state_dict()
    matched = {
        k: v
        for k, v in state.items()
        if k in own and not k.startswith("fc.") and isinstance(v, torch.Tensor) and own[k].shape == v.shape
    }
    if not any(k.startswith("layer") for k in matched):
        raise ConfigError(
            f"--init-weights {path}: no ResNet18 weights found (expected keys like 'layer1.0.conv1.weight' with "
            f"ResNet18's shapes); {INIT_WEIGHTS_FIX}"
        )
    model.load_state_dict(matched, strict=False)  # fc and a reshaped stem keep their fresh init
    return sorted(k for k in own if k not in matched)


INIT_WEIGHTS_FIX = "give a torchvision ResNet18 state_dict saved with torch.save(model.state_dict(), path)"


def load_refusal(error: Exception) -> str:
    """Why torch.load(weights_only=True) did not load a file, in a few words: a pickled object
    it refuses (torch names its class or function), or not a file it reads."""
    text = str(error)
    name = re.search(r"GLOBAL ([\w.]+)", text)
    if isinstance(error, pickle.UnpicklingError) and name:
        return (
            f"torch.load(weights_only=True) refuses it: it holds a pickled object ({name.group(1)}), which may run code"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(\S.*)", text) or re.search(r"(\S.*)", text)
    why = detail.group(1)[:200] if detail else "no details"
    return f"not a file torch.load reads ({type(error).__name__}: {why})"
