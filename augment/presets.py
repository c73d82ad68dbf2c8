"""Augmentation pipelines declared as data.

A preset is an ordered list of op specs for training, another for evaluation, and the
normalisation the trainer applies on its own device. Each spec is a one-key mapping
`{op_name: {param: value}}`, the same form as in a user's YAML or JSON preset file:

    name: my-preset
    mean: [0.485, 0.456, 0.406]
    std:  [0.229, 0.224, 0.225]
    train:
      - random_crop: {size: 32, padding: 4}
      - horizontal_flip: {p: 0.5}
    eval:
      - center_crop: {size: 32}

The first op of each list is a geometry op (it fixes the output size); the rest act on
that fixed-size float batch: ours, or any of Kornia's 2D augmentations by name with
Kornia's own arguments, `- kornia.RandomGaussianBlur: {kernel_size: [5, 5], sigma: [0.1, 2.0]}`
(augment/kornia_ops.py). augment/pipeline.py's `Pipeline` turns a list into one module.

An optional top-level `mix: {mixup_alpha: 0.2, cutmix_alpha: 1.0, prob: 1.0}` turns on
MixUp/CutMix, which the trainer applies where the labels are (augment/mix.py).

Light at import (no torch): the entry points check a preset's name and sizes before
anything heavy starts. Checking a preset's ops (preset_from_dict) and scaling its geometry
(at_size) import the ops, and torch with them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from augment.errors import PresetError  # raised here, importable from here
from augment.schedule import MIN_IMAGE_SIZE, resize_side

PRESET_FILE_SUFFIXES = (".yaml", ".yml", ".json")

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    train: tuple  # op specs, {name: {params}} each
    eval: tuple
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    mix: dict | None = None  # MixUp/CutMix settings for the trainer (augment/mix.py); None = off

    def __hash__(self) -> int:  # its op specs are dicts; its JSON form is the identity
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def image_size(self) -> int:
        """Side of the images the model sees (from the first eval op)."""
        return spec_side(self.eval[0])

    @property
    def train_size(self) -> int:
        """Side of the training crops (from the first train op); usually image_size."""
        return spec_side(self.train[0])

    def at_size(self, side: int) -> "Preset":
        """This preset for `side` px images: both first (geometry) ops scaled by side / image_size,
        so the train/eval ratio and the eval resize's ratio to its crop (256/224) stay as written."""
        if side < MIN_IMAGE_SIZE:
            raise PresetError(f"image size {side} px: need at least {MIN_IMAGE_SIZE}")
        base = self.image_size
        if side == base:
            return self
        return dataclasses.replace(
            self,
            train=(scale_geometry(self.train[0], side, base), *self.train[1:]),
            eval=(scale_geometry(self.eval[0], side, base), *self.eval[1:]),
        )

    def train_sides(self, resize: str, epochs: int) -> list[int]:
        """The training crops' side, epoch by epoch, under a progressive-resize schedule
        (augment/schedule.py; "none": the train size every epoch)."""
        return [resize_side(resize, e, epochs, self.train_size) for e in range(epochs)]

    def to_dict(self) -> dict:
        out = {
            "name": self.name,
            "mean": list(self.mean),
            "std": list(self.std),
            "train": list(self.train),
            "eval": list(self.eval),
        }
        return out | ({"mix": dict(self.mix)} if self.mix else {})


def spec_side(spec: dict) -> int:
    """The side (px) a geometry op spec outputs."""
    (params,) = spec.values()
    size = params["size"]
    return int(size if isinstance(size, (int, float)) else size[0])


def scale_geometry(spec: dict, side: int, base: int) -> dict:
    """A geometry op spec for images of `side` px instead of `base`: its size and its other
    lengths (Op.lengths: random_crop's padding, resize_center_crop's resize) times side / base,
    rounded down as timm rounds its eval resize (224 -> 256, 160 -> 182)."""
    from augment.ops import OPS

    ((name, params),) = spec.items()
    params = dict(params)
    size = params["size"]
    params["size"] = size * side // base if isinstance(size, (int, float)) else [v * side // base for v in size]
    for key in OPS[name].lengths:
        if key in params:
            params[key] = params[key] * side // base
    return {name: params}


PRESETS = {
    # The seed's CIFAR pipeline (torchvision: RandomCrop(32, padding=4), RandomHorizontalFlip,
    # ColorJitter(0.2, 0.2, 0.2), ToTensor, Normalize). Eval is Normalize only; CenterCrop(32)
    # is the identity on 32x32 images and keeps other sizes batchable.
    "cifar": Preset(
        name="cifar",
        train=(
            {"random_crop": {"size": 32, "padding": 4}},
            {"horizontal_flip": {"p": 0.5}},
            {"color_jitter": {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2}},
        ),
        eval=({"center_crop": {"size": 32}},),
        mean=CIFAR_MEAN,
        std=CIFAR_STD,
    ),
    # The seed's ImageNet pipeline = torchvision's classification reference: crop a random
    # 8-100 % of each original photo at aspect 3/4..4/3, resize to 224 (antialiased), flip,
    # ColorJitter(0.2, 0.2, 0.2). Eval: shorter side to 256, centre 224.
    "imagenet": Preset(
        name="imagenet",
        train=(
            {"random_resized_crop": {"size": 224, "scale": [0.08, 1.0], "ratio": [3 / 4, 4 / 3]}},
            {"horizontal_flip": {"p": 0.5}},
            {"color_jitter": {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2}},
        ),
        eval=({"resize_center_crop": {"resize": 256, "size": 224}},),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
    ),
}


def _check_specs(specs, where: str) -> tuple:
    from augment.kornia_ops import check_kornia_params, is_kornia
    from augment.ops import OPS, check_params

    if not isinstance(specs, (list, tuple)) or not specs:
        raise PresetError(f"{where}: expected a non-empty list of ops like [{{random_crop: {{size: 32}}}}]")
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec, str):
            spec = {spec: {}}
        if not isinstance(spec, dict) or len(spec) != 1:
            raise PresetError(f"{where}[{i}]: each op is a one-key mapping {{op_name: {{params}}}}, got {spec!r}")
        ((name, params),) = spec.items()
        if name not in OPS and not is_kornia(name):
            raise PresetError(
                f"{where}[{i}]: unknown op {name!r}; valid ops: {sorted(OPS)}, or a Kornia augmentation by "
                "name (kornia.RandomGaussianBlur, ...)"
            )
        if params is not None and not isinstance(params, dict):
            raise PresetError(f"{where}[{i}]: the parameters of {name!r} are a mapping like {{p: 0.5}}, got {params!r}")
        params = dict(params or {})
        try:
            check_kornia_params(name, params) if is_kornia(name) else check_params(OPS[name], params)
        except ValueError as e:
            raise PresetError(f"{where}[{i}]: {e}") from None
        if (name in OPS and OPS[name].geometry) != (i == 0):
            first = sorted(n for n, c in OPS.items() if c.geometry)
            raise PresetError(
                f"{where}[{i}]: {name!r} cannot come {'first' if i == 0 else 'here'}; the first op, and only the "
                f"first, is a geometry op: {first}"
            )
        out.append({name: params})
    return tuple(out)


def preset_from_dict(data: dict, where: str = "preset") -> Preset:
    """The preset a mapping describes, every op checked by building its pipelines once."""
    from augment.mix import check_mix
    from augment.ops import build_ops

    allowed = {"name", "train", "eval", "mean", "std", "mix"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PresetError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(allowed)}")
    missing = sorted({"train", "eval"} - set(data))
    if missing:
        raise PresetError(f"{where}: missing {missing}")
    preset = Preset(
        name=str(data.get("name", where)),
        train=_check_specs(data["train"], f"{where}: train"),
        eval=_check_specs(data["eval"], f"{where}: eval"),
        mean=_channels(data.get("mean", IMAGENET_MEAN), f"{where}: mean"),
        std=_channels(data.get("std", IMAGENET_STD), f"{where}: std", positive=True),
        mix=check_mix(data["mix"]) if data.get("mix") is not None else None,
    )
    for split in ("train", "eval"):  # constructor errors (bad values; Kornia's own, from its probe) surface now
        try:
            build_ops(getattr(preset, split))
        except (TypeError, ValueError) as e:  # an op's own message starts with its index, "[0]: ..."
            raise PresetError(f"{where}: {split}{'' if str(e).startswith('[') else ': '}{e}") from None
    return preset


def _channels(value, where: str, positive: bool = False) -> tuple[float, float, float]:
    """mean or std: three numbers, one per RGB channel (std above 0)."""
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3 or (positive and min(out) <= 0):
        need, like = ("three numbers above 0", IMAGENET_STD) if positive else ("three numbers", IMAGENET_MEAN)
        raise PresetError(f"{where}: expected {need}, one per RGB channel, like {list(like)}; got {value!r}")
    return out


def check_preset_name(name: str) -> bool:
    """True for a preset file's path (to be loaded and checked), False for a built-in name;
    PresetError for anything else."""
    if name in PRESETS:
        return False
    if name.lower().endswith(PRESET_FILE_SUFFIXES):
        return True
    raise PresetError(
        f"unknown preset {name!r}; built-in presets: {sorted(PRESETS)}, or a path to a .yaml/.json preset file"
    )


def load_preset(name_or_path: str) -> Preset:
    """A built-in preset by name, or a user preset from a .yaml/.yml/.json file."""
    if not check_preset_name(name_or_path):
        return PRESETS[name_or_path]
    if "://" in name_or_path:
        raise PresetError(
            f"{name_or_path}: a preset file is read from local disk only, not object storage; copy it to this "
            "machine and give its path"
        )
    path = Path(name_or_path)
    if path.is_dir() or (path.exists() and not path.is_file()):  # a pipe too: a resume reads the file again
        what = "a folder" if path.is_dir() else "a pipe or device"
        raise PresetError(f"{path} is {what}, not a file; give a .yaml/.json preset file")
    if not path.is_file():
        raise PresetError(f"{path}: preset file not found")
    data = parse_preset_file(path)
    if not isinstance(data, dict):
        raise PresetError(f"{path}: expected a mapping with keys train, eval, mean, std")
    try:
        return preset_from_dict(data, where=str(path))
    except (TypeError, ValueError) as e:
        raise PresetError(str(e)) from None


def refuse_alias_or_tag(event, path: Path) -> None:
    """PresetError for a YAML event that is an alias, an anchor or a tag: a preset file has no use
    for them, and an alias bomb (a few hundred bytes, billions of items once expanded) would take
    the machine's memory as soon as a message showed a value."""
    import yaml

    line = event.start_mark.line + 1
    if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
        raise PresetError(
            f"{path}: line {line}: an alias or anchor ({event.anchor}); they are not read, write the value"
        )
    tag = getattr(event, "tag", None)
    if tag is not None:
        tag = tag.replace("tag:yaml.org,2002:", "!!")[:80]
        raise PresetError(f"{path}: line {line}: a tag ({tag}); tags are not read, write a plain value")


def parse_preset_file(path: Path):
    """The file's YAML or JSON document (by its suffix); PresetError naming the file, the
    position and the problem for one that does not parse or cannot be read as text."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PresetError(f"{path}: not UTF-8 text; a preset file is YAML or JSON") from None
    except OSError as e:
        raise PresetError(f"{path}: cannot read the preset file ({e.strerror or e})") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise PresetError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    import yaml

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # before anything is built, or expanded
            refuse_alias_or_tag(event, path)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise PresetError(f"{path}: not valid YAML ({problem}{where})") from None
