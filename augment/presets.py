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
(augment/kornia_ops.py). `Pipeline` turns a list into one module, once.

An optional top-level `mix: {mixup_alpha: 0.2, cutmix_alpha: 1.0, prob: 1.0}` turns on
MixUp/CutMix, which the trainer applies where the labels are (augment/mix.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from augment.errors import PresetError, check_preset_name  # PresetError: raised here, importable from here
from augment.kornia_ops import check_kornia_params, is_kornia
from augment.mix import check_mix
from augment.ops import OPS, KorniaOp, Op, check_params
from augment.rng import KeyedRng
from augment.schedule import MIN_IMAGE_SIZE, parse_resize, parse_schedule, resize_side, strength

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

    @property
    def image_size(self) -> int:
        """Side of the images the model sees (from the first eval op)."""
        return _side(self.eval[0])

    @property
    def train_size(self) -> int:
        """Side of the training crops (from the first train op); usually image_size."""
        return _side(self.train[0])

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

    def to_dict(self) -> dict:
        out = {
            "name": self.name,
            "mean": list(self.mean),
            "std": list(self.std),
            "train": list(self.train),
            "eval": list(self.eval),
        }
        return out | ({"mix": dict(self.mix)} if self.mix else {})


def _side(spec: dict) -> int:
    (params,) = spec.values()
    size = params["size"]
    return int(size if isinstance(size, (int, float)) else size[0])


def scale_geometry(spec: dict, side: int, base: int) -> dict:
    """A geometry op spec for images of `side` px instead of `base`: its size and its other
    lengths (Op.lengths: random_crop's padding, resize_center_crop's resize) times side / base,
    rounded down as timm rounds its eval resize (224 -> 256, 160 -> 182)."""
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
            Pipeline(getattr(preset, split), seed=0)
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
    if not path.is_file():
        raise PresetError(f"{path}: preset file not found")
    data = parse_preset_file(path)
    if not isinstance(data, dict):
        raise PresetError(f"{path}: expected a mapping with keys train, eval, mean, std")
    try:
        return preset_from_dict(data, where=str(path))
    except (TypeError, ValueError) as e:
        raise PresetError(str(e)) from None


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
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise PresetError(f"{path}: not valid YAML ({problem}{where})") from None


# CPU only: the ops run on chunks of about this many output pixels at a time, so that the
# float intermediates (12 bytes a pixel) stay in the L2/L3 caches (docs/benchmarks.md,
# "Figures that were in code comments"). Each image's result is the same either way (its
# parameters come from its own key); the GPU takes the whole batch at once.
CPU_CHUNK_PIXELS = 4 * 224 * 224


class Pipeline(torch.nn.Module):
    """One module for a list of op specs: canvas + keys in, uint8 (B, S, S, 3) out.

    `schedule` (augment/schedule.py) scales the ops' magnitudes by epoch out of `epochs`;
    `resize` (progressive resizing, same module) sets the first op's output side by epoch,
    from a lower one up to the side the specs give.
    """

    def __init__(self, specs, *, seed: int, schedule: str = "none", epochs: int = 1, resize: str = "none"):
        super().__init__()
        self.seed = seed
        try:
            parse_schedule(schedule)
            parse_resize(resize)
        except ValueError as e:
            raise PresetError(str(e)) from None
        self.schedule, self.epochs, self._strength = schedule, int(epochs), 1.0
        self.specs, self.resize, self.full_side = tuple(specs), resize, _side(specs[0])
        ops = []
        for stream, spec in enumerate(self.specs, start=1):
            ops.append(self._build(stream, spec, size=ops[0].size if ops else None))
        self.ops = torch.nn.ModuleList(ops)
        self.out_hw = self.ops[0].size

    @property
    def cpu_chunk(self) -> int:
        """Images per chunk on the CPU (see CPU_CHUNK_PIXELS)."""
        return max(1, CPU_CHUNK_PIXELS // (self.out_hw[0] * self.out_hw[1]))

    @staticmethod
    def _build(stream: int, spec: dict, size=None):
        """One op; `size`: the batch's (H, W) after the first op, which a Kornia op is tried on."""
        ((name, params),) = spec.items()
        try:
            op = KorniaOp(name, params, size=size) if is_kornia(name) else OPS[name](**params)
        except (TypeError, ValueError) as e:
            raise PresetError(f"[{stream - 1}]: {e}") from None
        op.stream = stream  # the op's own random stream: its position in the list
        return op

    def _first_spec(self, epoch: int) -> dict:
        side = resize_side(self.resize, epoch, self.epochs, self.full_side)
        return self.specs[0] if side == self.full_side else scale_geometry(self.specs[0], side, self.full_side)

    def size_at(self, epoch: int) -> tuple[int, int]:
        """(h, w) of the batches this pipeline makes for `epoch`."""
        (params,) = self._first_spec(epoch).values()
        size = params["size"]
        return (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))

    def _set_epoch(self, epoch: int) -> None:
        """The first op at the epoch's size, every op at the epoch's strength."""
        if self.size_at(epoch) != tuple(self.out_hw):
            self.ops[0] = self._build(1, self._first_spec(epoch))  # geometry ops hold no tensors to move
            self.ops[0].set_strength(self._strength)  # where the other ops are; the new one starts as written
            self.out_hw = self.ops[0].size
        s = strength(self.schedule, epoch, self.epochs)
        if s != self._strength:
            for op in self.ops:
                op.set_strength(s)
            self._strength = s

    @torch.no_grad()
    def geometry(self, sizes: torch.Tensor, keys: torch.Tensor, epoch: int) -> dict:
        """The first (geometry) op's parameters for images of `sizes` (their full size, e.g.
        from the file headers): what `augment` applies, and what tells a decoder how far it may
        shrink each image (the op's max_shrink)."""
        self._set_epoch(epoch)
        return self.ops[0].sample(KeyedRng(keys, self.seed, epoch), sizes)

    @torch.no_grad()
    def draw_rest(self, keys: torch.Tensor, epoch: int) -> list[dict]:
        """The parameters of every op after the first, for a whole batch at once: `augment`
        then applies them a chunk at a time. Each image's come from its own key, so they are
        those a chunk would draw; drawing once saves the per-call cost of many small tensor
        ops in every chunk (docs/benchmarks.md, "Ingest"). An op with a `forward` of its own
        (one that samples from the batch it is given) gets None and draws in each chunk."""
        self._set_epoch(epoch)
        rng = KeyedRng(keys, self.seed, epoch)
        return [op.sample(rng, None) if type(op).forward is Op.forward else None for op in self.ops[1:]]

    @torch.no_grad()
    def augment(self, canvas, sizes, keys, epoch: int, geometry: dict, rest: list[dict] | None = None) -> torch.Tensor:
        """`forward` for one chunk whose geometry parameters are given (by `geometry`, then
        perhaps the op's shrink_params for images decoded at a reduced size), and perhaps the
        other ops' too (`draw_rest`'s rows for the chunk): uint8 (B, S, S, 3)."""
        self._set_epoch(epoch)
        return self._run(canvas, sizes, keys, epoch, geometry, rest).contiguous()

    def _run(self, canvas, sizes, keys, epoch, geometry=None, rest=None) -> torch.Tensor:
        rng = KeyedRng(keys, self.seed, epoch)
        first = self.ops[0]
        x = first(canvas, rng, sizes) if geometry is None else first.apply(canvas, geometry, sizes)  # (B, 3, S, S)
        if x.device.type == "cpu":  # planar: the pixel ops' broadcasts are faster on it there (docs/benchmarks.md)
            x = x.contiguous()
        for i, op in enumerate(self.ops[1:]):
            x = op(x, rng) if rest is None or rest[i] is None else op.apply(x, rest[i])
        return _to_uint8_nhwc(x)

    @torch.no_grad()
    def forward(self, canvas: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor, epoch: int) -> torch.Tensor:
        """canvas: uint8 (B, Hmax, Wmax, 3); sizes: int64 (B, 2); keys: int64 (B,)."""
        self._set_epoch(epoch)
        if canvas.device.type != "cpu":
            return self._run(canvas, sizes, keys, epoch).contiguous()
        b, (oh, ow), chunk = canvas.shape[0], self.out_hw, self.cpu_chunk
        out = torch.empty((b, oh, ow, 3), dtype=torch.uint8)
        for i in range(0, b, chunk):
            out[i : i + chunk] = self._run(canvas[i : i + chunk], sizes[i : i + chunk], keys[i : i + chunk], epoch)
        return out


def _to_uint8_nhwc(x: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) in [0, 1] -> uint8 (B, H, W, 3), rounded. On a GPU x is channels_last
    and the permute already contiguous. On the CPU (planar x) the values go into a float NHWC
    buffer and numpy casts them: torch's float-to-uint8 cast and its uint8 transpose took 2.5
    times as long (0.29 against 0.115 ms per 224 px image), the same bytes."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x.mul(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    b, c, h, w = x.shape
    nhwc = torch.empty((b, h, w, c), dtype=x.dtype)
    torch.mul(x, 255.0, out=nhwc.permute(0, 3, 1, 2)).round_().clamp_(0, 255)
    return torch.from_numpy(nhwc.numpy().astype(np.uint8))
