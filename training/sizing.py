"""A preset at the sizes a run trains and evaluates at: --image-size, and --progressive-resize's
sizes epoch by epoch, each checked by building the preset's pipelines there (a Kornia kernel
larger than the image stops the run before Ray Data starts a task)."""

from __future__ import annotations

from augment.errors import PresetError
from augment.pipeline import Pipeline
from augment.presets import Preset, scale_geometry
from augment.schedule import resize_side
from training.config import ConfigError, TrainConfig
from training.inputs import check_resize_start


def sized_preset(cfg: TrainConfig, preset: Preset) -> Preset:
    """The preset at --image-size, with --progressive-resize checked against its training size."""
    if cfg.image_size:
        preset = preset.at_size(cfg.image_size)
    check_resize_start(cfg, preset.train_size)
    check_sizes(cfg, preset)
    return preset


def check_sizes(cfg: TrainConfig, preset: Preset) -> None:
    """Builds the preset's pipelines at every size the run uses (each epoch's training size, and
    evaluation's), so that an op that does not fit one of them (a Kornia kernel larger than the
    image) stops the run here with one line, not in a Ray Data task."""
    full = preset.train_size
    for side in sorted(set(train_sizes(cfg, preset))):
        first = preset.train[0] if side == full else scale_geometry(preset.train[0], side, full)
        try:
            Pipeline((first, *preset.train[1:]), seed=0)
        except PresetError as e:
            raise ConfigError(f"preset {preset.name!r}: its train ops at {side} px: {e}") from None
    try:
        Pipeline(preset.eval, seed=0)
    except PresetError as e:
        raise ConfigError(f"preset {preset.name!r}: its eval ops at {preset.image_size} px: {e}") from None


def train_sizes(cfg: TrainConfig, preset: Preset) -> list[int]:
    """The training crops' side, epoch by epoch (progressive resizing), for config.json and the console."""
    return [resize_side(cfg.progressive_resize, e, cfg.epochs, preset.train_size) for e in range(cfg.epochs)]
