"""The model (--model): any classification model of torchvision.models by name, any timm model
(timm/NAME), or a model of the user's (module.path:function, called as function(num_classes=N)),
with a head for the run's classes; at random init, or from --weights (training/weights.py) or an
--init-weights file. torchvision's ResNets take the small-image stem for inputs of 32 px or less
(--small-stem auto)."""

from __future__ import annotations

import difflib
import importlib
import pickle
import re

import torch

from training.config import ConfigError
from training.weights import (
    LoadReport,
    model_kind,
    read_state_dict,
    strip_prefix,
    timm_module,
    timm_pretrained_name,
    torchvision_weights,
)

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


def model_source(name: str, num_classes: int, *, small_stem: bool, image_size: int, width: int = 64) -> dict:
    """How to rebuild --model `name` (model.pt's `model_source`, plain data): torchvision's get_model
    arguments and replaced stem (torchvision_model), timm's create_model arguments, or the user's
    function and its argument."""
    kind = model_kind(name)
    if kind == "timm":
        return {"kind": kind, "create_model": {"model_name": name.split("/", 1)[1], "num_classes": num_classes}}
    if kind == "callable":
        return {"kind": kind, "callable": name, "kwargs": {"num_classes": num_classes}}
    return {
        "kind": kind,
        **torchvision_model(name, num_classes, small_stem=small_stem, image_size=image_size, width=width),
    }


def model_names() -> list[str]:
    """torchvision's classification models (its detection, segmentation, video and optical-flow
    models live in submodules, which this leaves out)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_model(name: str, *, small_stem: str) -> None:
    """ConfigError, one line with the fix, for a --model that torchvision or timm does not have (with
    the closest names), a callable that does not import, or a small stem asked of a model that is
    no torchvision ResNet."""
    kind = model_kind(name)
    if kind == "callable":
        user_callable(name)
    elif kind == "timm":
        arch = name.split("/", 1)[1]
        timm = timm_module()
        if not timm.is_model(arch):
            close = difflib.get_close_matches(arch, timm.list_models(), n=4, cutoff=0.6)
            maybe = f"did you mean {', '.join('timm/' + c for c in close)}? " if close else ""
            raise ConfigError(
                f"--model {name}: not a model of timm {timm.__version__}; {maybe}timm.list_models() lists them"
            )
    elif name not in model_names():
        names = model_names()
        close = difflib.get_close_matches(name, names, n=4, cutoff=0.6)
        maybe = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"--model {name}: not a classification model of torchvision {_version()}; {maybe}"
            "torchvision.models.list_models(module=torchvision.models) lists them, timm/NAME a timm model, "
            "module.path:function one of yours"
        )
    if small_stem == "on" and not has_small_stem(name):
        raise ConfigError(f"--small-stem on: the small stem is a ResNet's, and {name} is none; drop --small-stem")


def user_callable(name: str):
    """The function `name` (module.path:function) names, imported as the workers import it (from
    the job's working directory, PYTHONPATH or a runtime_env's working_dir or py_modules);
    ConfigError, one line, where it does not import or is not callable."""
    module, _, attr = name.partition(":")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", module) or not re.fullmatch(r"[A-Za-z_][\w.]*", attr):
        raise ConfigError(f"--model {name}: a model of your own is module.path:function, like my_pkg.models:build")
    try:
        found = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module: whatever its import raises
        raise ConfigError(
            f"--model {name}: cannot import {module} ({type(e).__name__}: {str(e)[:200]}); run the job from the "
            "folder that holds it, or add that folder to PYTHONPATH"
        ) from None
    fn = found
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(
            f"--model {name}: {module} has no function {attr}; give module.path:function, a function that returns "
            "an nn.Module for num_classes"
        )
    return fn


def check_model_output(name: str, num_classes: int, image_size: int) -> None:
    """A model of the user's: function(num_classes=N) returns an nn.Module that maps a batch of
    two image_size images to N logits each; ConfigError, one line, where it does not."""
    if model_kind(name) != "callable":
        return
    try:
        model = user_callable(name)(num_classes=num_classes)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ConfigError(f"--model {name}: {name}(num_classes={num_classes}) raised {type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"--model {name}: returned a {type(model).__name__}, not a torch.nn.Module")
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(2, 3, image_size, image_size))
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ConfigError(
            f"--model {name}: the model fails on a batch of 2 x 3 x {image_size} x {image_size} images "
            f"({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"--model {name}: a batch of 2 images gave {shape}, not (2, {num_classes}) logits; build the head "
            "with num_classes outputs"
        )


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
    """--model `name` at random init (from torch's global RNG: seed it first so every rank builds the
    same weights), with a head for `num_classes`; a torchvision ViT for `image_size`."""
    kind = model_kind(name)
    if kind == "timm":
        model = timm_module().create_model(name.split("/", 1)[1], pretrained=False, num_classes=num_classes)
    elif kind == "callable":
        model = user_callable(name)(num_classes=num_classes)
    else:
        model = torchvision_build(name, num_classes, small_stem=small_stem, image_size=image_size)
    return model.to(memory_format=torch.channels_last)


def torchvision_build(name: str, num_classes: int, *, small_stem: bool, image_size: int) -> torch.nn.Module:
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
    return model


def initial_model(cfg, num_classes: int, image_size: int) -> tuple[torch.nn.Module, LoadReport | None]:
    """The run's model as training starts it: built (seeded by the caller), then --weights or
    --init-weights loaded; and which tensors those gave (None at random init)."""
    small = uses_small_stem(cfg.small_stem, image_size, cfg.model)
    if cfg.weights and model_kind(cfg.model) == "timm":
        return timm_pretrained(cfg.model, cfg.weights, num_classes)
    model = build_model(cfg.model, num_classes, small_stem=small, image_size=image_size)
    if cfg.weights:
        return model, load_torchvision_weights(model, cfg.model, cfg.weights, num_classes)
    if cfg.init_weights:
        return model, load_init_weights(model, cfg.init_weights, cfg.model)
    return model, None


def timm_pretrained(model: str, weights: str, num_classes: int) -> tuple[torch.nn.Module, LoadReport]:
    """timm's model with its pretrained weights (timm reads them from Hugging Face's cache or
    fetches them there), its classifier new where the class count differs (timm drops it then)."""
    timm, full = timm_module(), timm_pretrained_name(model, weights)
    net = timm.create_model(full, pretrained=True, num_classes=num_classes)
    cfg = net.pretrained_cfg
    own = list(net.state_dict())
    heads = cfg.get("classifier") or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    differs = cfg.get("num_classes", num_classes) != num_classes
    new = tuple(k for k in own if differs and k.startswith(tuple(h + "." for h in heads)))
    report = LoadReport(
        f"{full} (timm)", len(own) - len(new), len(own), new, (cfg["num_classes"], num_classes) if differs else None
    )
    return net.to(memory_format=torch.channels_last), report


def load_torchvision_weights(model: torch.nn.Module, name: str, weights: str, num_classes: int) -> LoadReport:
    """torchvision's pretrained `weights` of `name` into `model` (read from torchvision's cache, or
    fetched there): every tensor whose name and shape match; the head is new where the class count
    differs, and so is a small stem."""
    w = torchvision_weights(name, weights)
    state = w.get_state_dict(progress=False)
    own = model.state_dict()
    matched = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(matched, strict=False)
    head = head_prefix(model) + "weight"  # the weights' own head says how many classes they were trained for
    trained = state[head].shape[0] if head in state else len(w.meta.get("categories") or ()) or num_classes
    classes = (trained, num_classes) if trained != num_classes else None
    return LoadReport(w.name, len(matched), len(own), tuple(k for k in own if k not in matched), classes)


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


def load_init_weights(model: torch.nn.Module, path: str, name: str = "resnet18") -> LoadReport:
    """Copy every tensor of a state_dict file of `name` whose name and shape match: a torch.save'd
    dict or a .safetensors file, wrapped or not in a checkpoint's `state_dict`/`model` key, its
    names with or without DDP's `module.` or Lightning's `model.` prefix (training/weights.py).

    The classification head (head_prefix) is always left at its fresh init, and so is a stem
    whose shape differs (ImageNet 7x7 weights into the small 3x3 stem). Returns which tensors
    were loaded. ConfigError, one line naming the file and the fix, for a file that torch.load
    with weights_only=True refuses (a pickled object: it could run code), that is no state_dict,
    or in which fewer than half of the model's other tensors are found. The driver runs this
    once before Ray starts (training.driver.inputs.check_inputs), as every train worker does.
    """
    fix = init_weights_fix(name)
    try:
        state = read_state_dict(path)
    except ValueError as e:
        raise ConfigError(f"--init-weights {path}: {e}; {fix}") from None
    except Exception as e:  # noqa: BLE001 - pickle, zip, safetensors and torch errors alike: not a state_dict file
        raise ConfigError(f"--init-weights {path}: {load_refusal(e)}; {fix}") from None
    own, head = model.state_dict(), head_prefix(model)
    body = [k for k in own if not k.startswith(head)]
    state, _ = strip_prefix(state, body)
    matched = {k: v for k, v in state.items() if k in body and isinstance(v, torch.Tensor) and own[k].shape == v.shape}
    if len(matched) * 2 < len(body):
        example = next((k for k in body if k.endswith(".weight")), body[0])
        raise ConfigError(
            f"--init-weights {path}: no {name} weights found ({len(matched)} of its {len(body)} tensors, "
            f"expected keys like {example!r} with {name}'s shapes); {fix}"
        )
    model.load_state_dict(matched, strict=False)  # the head and a reshaped stem keep their fresh init
    return LoadReport(path, len(matched), len(own), tuple(k for k in own if k not in matched))


def init_weights_fix(name: str) -> str:
    return f"give a {name} state_dict saved with torch.save(model.state_dict(), path) or as .safetensors"


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
