"""The user's inputs, checked before any cluster or heavy import: settings, the image tree,
the run directory. Light on purpose (no torch, no Ray Train): the entry point runs this
first, so a mistake is reported in well under a second, then starts Ray while torch loads.
The one exception is an --init-weights file: it is loaded (torch) here, as every train
worker will load it, so that a file they would refuse is reported before Ray starts.

Checking changes nothing on disk (the run directory is probed and left as it was): only
`start_fresh`, called once every input has passed, removes a --fresh run's old directory.
"""

from __future__ import annotations

import os

from augment.errors import check_preset_name
from augment.schedule import parse_resize, parse_schedule
from training import artifacts, storage
from training.config import ConfigError, TrainConfig, check_amp
from training.data import ImageTree, default_dataset_dir, scan_tree
from training.parquet import is_prepared, scan_prepared


def scan_data(root: str, val_fraction: float = 0.2) -> ImageTree:
    """An image tree, or the Parquet shards `python -m jobs.prepare` wrote (its split is the
    one fixed when preparing). DataError for anything unusable, storage.StorageError for
    object storage that refuses."""
    if is_prepared(root):
        return scan_prepared(root)
    return scan_tree(root, val_fraction)


def check_inputs(cfg: TrainConfig) -> tuple[TrainConfig, ImageTree]:
    """Resolve defaults, scan the tree, check the flags that name things; DataError, ConfigError,
    PresetError or storage.StorageError (exit 2) for anything wrong, and nothing written. A
    preset file is loaded and checked by augment.presets.load_preset."""
    cfg = cfg.with_defaults_resolved()
    root = cfg.data or str(default_dataset_dir())
    tree = scan_data(root, cfg.val_fraction)
    try:  # a bad schedule name is found before Ray starts
        parse_schedule(cfg.augment_schedule)
    except ValueError as e:
        raise ConfigError(f"--augment-schedule: {e}") from None
    try:
        parse_resize(cfg.progressive_resize, cfg.epochs)
    except ValueError as e:
        raise ConfigError(f"--progressive-resize: {e}") from None
    if cfg.device == "cpu":  # else the plan checks it, once it knows where training runs
        check_amp(cfg.amp, on_gpu=False)
    check_preset_name(cfg.preset)
    # Ray Train, rank 0 and the driver all write there; the probe leaves no directory behind
    storage.check_writable(run_directory(cfg), "--storage-path")
    if cfg.init_weights:  # last: it imports torch and torchvision
        check_init_weights(cfg.init_weights)
    return cfg, tree


def check_init_weights(path: str) -> None:
    """ConfigError unless `path` is a file that the train workers' loader takes into a
    ResNet18 (training.model.load_init_weights, the same code)."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"--init-weights {path}: no such file; give a torchvision ResNet18 state_dict saved with torch.save"
        )
    from training.model import load_init_weights, resnet18

    load_init_weights(resnet18(1, small_stem=False), path)  # the head and the stem are not what it checks


def start_fresh(cfg: TrainConfig) -> None:
    """With --fresh, remove the run directory NAME already has (Ray Train would otherwise
    resume from its checkpoints); nothing without it. Call it after every input, the preset
    file included, has been checked: a mistake must leave the old run as it was."""
    run_dir = run_directory(cfg)
    with storage.errors(run_dir, "writing"):
        if cfg.fresh and artifacts.exists(run_dir):
            artifacts.remove_tree(run_dir)


def run_directory(cfg: TrainConfig) -> str:
    """STORAGE_PATH/NAME, of a config whose defaults are resolved."""
    return artifacts.join(cfg.storage_path, cfg.name)
