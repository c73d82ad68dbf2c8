"""Pretrained weights and weight files: --weights NAME (torchvision's weight enums, timm's
pretrained tags), each fetched by its own library into its own cache (torchvision:
$TORCH_HOME/hub/checkpoints; timm: Hugging Face's hub cache) or read from that cache offline;
the eval transform the weights were trained with; and --init-weights files (torch.save'd
state_dicts or .safetensors, with the `module.`/`model.` prefixes DDP, Lightning and timm's
checkpoints write), matched to a model by name and shape.

Light at import (no torch): training/driver/inputs.py checks a --weights name before Ray starts.
"""

from __future__ import annotations

import dataclasses
import dataclasses as dc
import os
import warnings

from training.config import ConfigError

TIMM_PREFIX = "timm/"  # --model timm/NAME
# What a checkpoint wraps its weights in: DDP's `module.`, Lightning's `model.`, both, torch.compile's
# `_orig_mod.`; the one that matches most of the model's names is stripped
PREFIXES = ("", "module.", "model.", "model.module.", "module.model.", "_orig_mod.", "model._orig_mod.")
WRAPPING_KEYS = ("state_dict", "model", "model_state_dict", "module")  # a checkpoint dict's weights, by key
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TORCH_HUB_OFFLINE")  # any set to 1: no download tried


def model_kind(name: str) -> str:
    """--model's kind: "timm" (timm/NAME), "callable" (module.path:function) or "torchvision"."""
    if name.startswith(TIMM_PREFIX):
        return "timm"
    return "callable" if ":" in name else "torchvision"


def offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in OFFLINE_ENV)


# ---- torchvision ----------------------------------------------------------------------------------


def torchvision_weights(model: str, name: str):
    """torchvision's weights enum member `name` of `model` (torchvision.models.get_model_weights);
    ConfigError, one line naming the valid ones, for a name it does not have."""
    import torchvision

    enum = torchvision.models.get_model_weights(model)
    valid = [w.name for w in enum]
    if not valid:
        raise ConfigError(f"--weights {name}: torchvision has no pretrained weights for {model}; drop --weights")
    if name != "DEFAULT" and name not in valid:
        raise ConfigError(
            f"--weights {name}: not a weights name of torchvision's {model}; valid: DEFAULT, {', '.join(valid)}"
        )
    return enum[name] if name != "DEFAULT" else enum.DEFAULT


def torchvision_cache_file(weights) -> str:
    """Where torchvision keeps `weights` (torch.hub.load_state_dict_from_url's file name, from the url)."""
    import torch.hub

    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))


def fetch_torchvision(model: str, name: str) -> None:
    """The weights in torchvision's cache: downloaded by torchvision where they are not and this
    machine may fetch (no *_OFFLINE set), else a ConfigError naming the file and how to fill it."""
    weights = torchvision_weights(model, name)
    path = torchvision_cache_file(weights)
    if os.path.isfile(path):
        return
    fix = (
        f"run python -c \"import torchvision; torchvision.models.get_model('{model}', weights='{weights.name}')\" "
        f"on a machine with a network and copy the file there, or set TORCH_HOME to a cache that holds it"
    )
    if offline():
        raise ConfigError(f"--weights {name}: {path} is not in torchvision's cache and this machine is offline; {fix}")
    try:
        weights.get_state_dict(progress=False)
    except Exception as e:  # noqa: BLE001 - URL, socket and disk errors alike: the file is not there
        raise ConfigError(
            f"--weights {name}: could not download {weights.url} into {path} ({type(e).__name__}); {fix}"
        ) from None


# ---- timm -----------------------------------------------------------------------------------------


def timm_module():
    """timm, or a ConfigError saying how to install it."""
    try:
        import timm
    except ImportError:
        raise ConfigError(
            "--model timm/...: timm is not installed; pip install -e '.[timm]' (or pip install timm)"
        ) from None
    return timm


def timm_pretrained_name(model: str, name: str) -> str:
    """timm's name of the pretrained weights `name` of `model` (timm/ARCH): ARCH for DEFAULT (its
    default tag), ARCH.TAG for a tag; ConfigError naming the valid tags otherwise."""
    timm = timm_module()
    arch = model[len(TIMM_PREFIX) :]
    tags = [n.split(".", 1)[1] for n in timm.list_pretrained(arch) if n.split(".", 1)[0] == arch and "." in n]
    if not tags:
        raise ConfigError(f"--weights {name}: timm has no pretrained weights for {arch}; drop --weights")
    if name == "DEFAULT":
        return arch
    if name not in tags:
        raise ConfigError(f"--weights {name}: not a pretrained tag of timm's {arch}; valid: DEFAULT, {', '.join(tags)}")
    return f"{arch}.{name}"


def hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return constants.HF_HUB_CACHE
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")


def fetch_timm(model: str, name: str) -> None:
    """The weights in Hugging Face's hub cache: timm fetches them there (or reads them offline,
    HF_HUB_OFFLINE=1); ConfigError naming the cache and how to fill it where it cannot."""
    timm, full = timm_module(), timm_pretrained_name(model, name)
    try:
        timm.create_model(full, pretrained=True)
    except Exception as e:  # noqa: BLE001 - hub, socket and disk errors alike: the file is not there
        cache = hf_cache_dir()
        raise ConfigError(
            f"--weights {name}: timm could not fetch or find {full}'s weights in {cache} ({type(e).__name__}); run "
            f"python -c \"import timm; timm.create_model('{full}', pretrained=True)\" on a machine with a network "
            "and copy that folder here, or set HF_HUB_CACHE to a cache that holds them"
        ) from None


def check_weights(model: str, name: str) -> None:
    """Before Ray: the name is one the model has, and its weights are in (or reach) the cache."""
    kind = model_kind(model)
    if kind == "callable":
        raise ConfigError(
            f"--weights {name}: a model of your own ({model}) loads its own weights; drop --weights, or give "
            "--init-weights FILE"
        )
    (fetch_timm if kind == "timm" else fetch_torchvision)(model, name)


# ---- the weights' eval transform ------------------------------------------------------------------


def pretrained_transform(model: str, name: str) -> dict:
    """The eval transform the weights were made with: {resize, crop (px), mean, std, interpolation}
    (torchvision's weights.transforms(); timm's pretrained_cfg, its resize the crop / crop_pct)."""
    if model_kind(model) == "timm":
        import math

        timm = timm_module()
        cfg = timm.models.get_pretrained_cfg(timm_pretrained_name(model, name))
        crop = int(cfg.input_size[-1])
        return {
            "resize": math.floor(crop / cfg.crop_pct),
            "crop": crop,
            "mean": [float(v) for v in cfg.mean],
            "std": [float(v) for v in cfg.std],
            "interpolation": str(cfg.interpolation),
        }
    t = torchvision_weights(model, name).transforms()
    return {
        "resize": int(t.resize_size[0]),
        "crop": int(t.crop_size[0]),
        "mean": [float(v) for v in t.mean],
        "std": [float(v) for v in t.std],
        "interpolation": t.interpolation.value,
    }


def weights_preset(preset, transform: dict, image_size: int = 0):
    """A built-in preset with the weights' normalisation, and where it evaluates photos (a
    resize_center_crop first eval op) their crop (`image_size` where the user set one) and their
    resize-to-crop ratio. A thumbnail preset keeps its side: a 32 px image is not made 224."""
    preset = dc.replace(preset, mean=tuple(transform["mean"]), std=tuple(transform["std"]))
    ((op, _),) = preset.eval[0].items()
    if op != "resize_center_crop":
        return preset
    side = image_size or transform["crop"]
    preset = preset.at_size(side)
    first = {"resize_center_crop": {"resize": side * transform["resize"] // transform["crop"], "size": side}}
    return dc.replace(preset, eval=(first, *preset.eval[1:]))


# ---- weight files ---------------------------------------------------------------------------------


def read_state_dict(path: str) -> dict:
    """The tensors of a weights file: safetensors' (by suffix), or torch.load's with weights_only
    (a pickled object is refused) unwrapped from a checkpoint dict's `state_dict`/`model` key.
    Raises what the loaders raise; ValueError for a file holding no mapping of tensors."""
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError("reading .safetensors needs the safetensors package (pip install safetensors)") from None
        return load_file(path, device="cpu")
    import torch

    with warnings.catch_warnings():  # torch warns of a plain pickle's protocol before it refuses the file
        warnings.simplefilter("ignore")
        state = torch.load(path, map_location="cpu", weights_only=True)
    while isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        inner = next((state[k] for k in WRAPPING_KEYS if isinstance(state.get(k), dict)), None)
        if inner is None:
            break
        state = inner
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a state_dict")
    return state


def strip_prefix(state: dict, names) -> tuple[dict, str]:
    """`state` with the PREFIXES entry that makes most of its keys names of `names` removed, and that prefix."""
    names = set(names)

    def hits(prefix):
        return sum(k[len(prefix) :] in names for k in state if k.startswith(prefix))

    best = max(PREFIXES, key=hits)
    return {k[len(best) :]: v for k, v in state.items() if k.startswith(best)}, best


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Which of a model's tensors came from the weights, for the line that starts the run."""

    source: str  # the weights' name or file
    loaded: int
    total: int
    new: tuple[str, ...]  # the model's tensors left at their fresh init
    classes: tuple[int, int] | None = None  # (the weights' class count, the run's) where they differ

    def describe(self) -> str:
        new = f"; new: {', '.join(self.new[:6])}{', ...' if len(self.new) > 6 else ''}" if self.new else ""
        change = f" ({self.classes[0]} -> {self.classes[1]} classes)" if self.classes else ""
        return f"weights: {self.source}, {self.loaded} of {self.total} tensors loaded{new}{change}"


def weights_record(cfg) -> dict | None:
    """config.json's and model.pt's `weights`: which first weights the run had, and for --weights
    the eval transform they were made with and whether the run's preset took it (a built-in one
    does; a preset file keeps its own)."""
    if cfg.weights:
        builtin = not cfg.preset.lower().endswith((".yaml", ".yml", ".json"))
        transform = pretrained_transform(cfg.model, cfg.weights)
        return {"name": cfg.weights, "transform": transform, "eval_transform_from_weights": builtin}
    return {"init_weights": cfg.init_weights} if cfg.init_weights else None
