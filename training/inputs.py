"""The user's inputs, checked before any cluster or heavy import: settings, the image tree,
the run directory. Light on purpose (no torch, no Ray Train): the entry point runs this
first, so a mistake is reported in well under a second, then starts Ray while torch loads.
"""

from __future__ import annotations

import os

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
    """Resolve defaults, scan the tree, check the flags that name things; DataError, ConfigError
    or storage.StorageError (exit 2) for anything wrong. The preset is checked by
    augment.presets.load_preset."""
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
    if cfg.init_weights and not os.path.isfile(cfg.init_weights):
        raise ConfigError(
            f"--init-weights {cfg.init_weights}: no such file; give a torchvision ResNet18 state_dict saved with "
            "torch.save"
        )
    run_dir = artifacts.join(cfg.storage_path, cfg.name)
    storage.check_writable(run_dir, "--storage-path")  # Ray Train, rank 0 and the driver all write there
    with storage.errors(run_dir, "writing"):
        if cfg.fresh and artifacts.exists(run_dir):
            artifacts.remove_tree(run_dir)  # Ray Train would otherwise resume from its checkpoints
    return cfg, tree
