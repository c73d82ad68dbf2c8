"""The model: any classification model of torchvision.models by name (--model), built with
weights=None and the run's class count; ResNets take the small-image stem for inputs of 32 px
or less (--small-stem auto)."""

from __future__ import annotations

import difflib
import pickle
import re

import torch

from training.config import ConfigError

# --small-stem auto: the small stem at or below this side (docs/design.md, "Choices and where they were measured")
SMALL_IMAGE_MAX_SIDE = 32
RESNETS = ("resnet", "resnext", "wide_resnet")  # torchvision's ResNet family: the ones with a stem to swap
SMALL_STEM_CONV = {"kernel_size": 3, "stride": 1, "padding": 1, "bias": False}  # the small stem's conv1, after 3, width


def has_small_stem(model: str) -> bool:
    return model.startswith(RESNETS)


def uses_small_stem(setting: str, image_size: int, model: str = "resnet18") -> bool:
    """--small-stem: on, or auto at SMALL_IMAGE_MAX_SIDE or less; a ResNet's only."""
    small = setting == "on" or (setting == "auto" and image_size <= SMALL_IMAGE_MAX_SIDE)
    return small and has_small_stem(model)


def model_names() -> list[str]:
    """torchvision's classification models (its detection, segmentation, video and optical-flow
    models live in submodules, which this leaves out)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_model(name: str, *, small_stem: str) -> None:
    """ConfigError, one line with the fix, for a --model that torchvision does not have, or a
    small stem asked of a model that is no ResNet."""
    names = model_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=4, cutoff=0.6)
        maybe = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"--model {name}: not a classification model of torchvision {_version()}; {maybe}"
            "torchvision.models.list_models(module=torchvision.models) lists them"
        )
    if small_stem == "on" and not has_small_stem(name):
        raise ConfigError(f"--small-stem on: the small stem is a ResNet's, and {name} is none; drop --small-stem")


def check_model_sizes(name: str, image_sizes: list[int]) -> None:
    """ConfigError for a ViT at sides its patches do not divide, or at more than one side: its
    position embedding is made for one."""
    if name.startswith("vit_"):
        patch = int(re.search(r"_(\d+)$", name).group(1))
        sides = sorted(set(image_sizes))
        if len(sides) > 1 or sides[0] % patch:
            raise ConfigError(
                f"--model {name}: a ViT takes one input side, a multiple of its {patch} px patches, and this run "
                f"trains at {', '.join(map(str, sides))} px; set --image-size to a multiple of {patch} and drop "
                "--progressive-resize"
            )


def _version() -> str:
    import torchvision

    return torchvision.__version__


def build_model(name: str, num_classes: int, *, small_stem: bool, image_size: int) -> torch.nn.Module:
    """torchvision's `name` at random init (from torch's global RNG: seed it first so every rank
    builds the same weights), with a head for `num_classes`; a ViT for `image_size`."""
    # here, not at the top: its import pulls torch._dynamo, slow to import (docs/design.md, "Choices and where
    # they were measured"), which the driver needs only to check an --init-weights file
    import torchvision

    sized = {"image_size": image_size} if name.startswith("vit_") else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **sized)
    if small_stem:
        # CIFAR-style stem: 3x3 stride-1 conv, no max-pool; 32 px keeps a 4x4 final feature map
        width = model.conv1.out_channels
        model.conv1 = torch.nn.Conv2d(3, width, **SMALL_STEM_CONV)
        model.maxpool = torch.nn.Identity()
    return model.to(memory_format=torch.channels_last)


def torchvision_model(name: str, num_classes: int, *, small_stem: bool, image_size: int, width: int = 64) -> dict:
    """How torchvision alone rebuilds build_model's model (model.pt's `torchvision_model`, plain data):
    get_model's arguments, and the layers the small stem replaces, by name (a Conv2d's arguments, or
    "identity"; `width`: the stem's channels, conv1's out_channels). A strict load_state_dict catches
    a conv1 left as it was, not a max-pool left in: both are written out."""
    sized = {"image_size": image_size} if name.startswith("vit_") else {}
    stem = {"conv1": {"in_channels": 3, "out_channels": width, **SMALL_STEM_CONV}, "maxpool": "identity"}
    return {"get_model": {"name": name, "num_classes": num_classes, **sized}, "replace": stem if small_stem else {}}


def resnet18(num_classes: int, *, small_stem: bool) -> torch.nn.Module:
    return build_model("resnet18", num_classes, small_stem=small_stem, image_size=224)


def head_prefix(model: torch.nn.Module) -> str:
    """The name of a torchvision classifier's head ("fc." of a ResNet, "classifier." or
    "heads.head." of others): the last module with parameters of its own, in every
    torchvision classification model."""
    owners = [name for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    return owners[-1] + "."


def load_init_weights(model: torch.nn.Module, path: str, name: str = "resnet18") -> list[str]:
    """Copy every tensor of a torchvision `name` state_dict whose name and shape match.

    The classification head (head_prefix) is always left at its fresh init, and so is a stem
    whose shape differs (ImageNet 7x7 weights into the small 3x3 stem). Returns the skipped
    names. ConfigError, one line naming the file and the fix, for a file that torch.load with
    weights_only=True refuses (a pickled object: it could run code), that is no state_dict,
    or in which fewer than half of the model's other tensors are found. The driver runs this
    once before Ray starts (training.inputs.check_inputs), as every train worker does.
    """
    fix = init_weights_fix(name)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch errors alike mean "not a state_dict file"
        raise ConfigError(f"--init-weights {path}: {load_refusal(e)}; {fix}") from None
    if isinstance(state, dict) and "state_dict" in state:  # our own model.pt
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"--init-weights {path}: holds a {type(state).__name__}, not a state_dict; {fix}")
    own, head = model.state_dict(), head_prefix(model)
    body = [k for k in own if not k.startswith(head)]
    matched = {k: v for k, v in state.items() if k in body and isinstance(v, torch.Tensor) and own[k].shape == v.shape}
    if len(matched) * 2 < len(body):
        example = next((k for k in body if k.endswith(".weight")), body[0])
        raise ConfigError(
            f"--init-weights {path}: no {name} weights found ({len(matched)} of its {len(body)} tensors, "
            f"expected keys like {example!r} with {name}'s shapes); {fix}"
        )
    model.load_state_dict(matched, strict=False)  # the head and a reshaped stem keep their fresh init
    return sorted(k for k in own if k not in matched)


def init_weights_fix(name: str) -> str:
    return f"give a torchvision {name} state_dict saved with torch.save(model.state_dict(), path)"


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
