"""The user's inputs, checked before any cluster or heavy import: settings, the image tree,
the run directory. Light on purpose (no torch, no Ray Train): the entry point runs this
first, so a mistake is reported in well under a second, then starts Ray while torch loads.
The one exception is an --init-weights file: it is loaded (torch) here, as every train
worker will load it, so that a file they would refuse is reported before Ray starts.

Checking changes nothing on disk (the run directory is probed and left as it was). Once every
input has passed, `prepare` takes the run folder's lease (training/driver/lease.py: one live run owns
it) and `start_fresh` clears a --fresh run's old files under it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from augment import engines
from augment.errors import PresetError
from augment.presets import PRESETS, check_preset_name
from augment.schedule import parse_resize, parse_schedule
from training import storage, userfiles
from training.config import ConfigError, TrainConfig, check_amp, check_sync_bn
from training.driver import lease
from training.driver.session import starts_local_cluster
from training.driver.tracking import parse_log_to
from training.forms.data import ImageTree
from training.forms.formats import header_size, sample_sizes, scan_data
from training.forms.parquet import read_manifest
from training.forms.tree import default_dataset_dir

SAMPLED_HEADERS = 16  # images whose headers give a tree's typical size
THUMBNAIL_SIDE = 64  # --preset auto: a shorter side of at most this (typically) is a thumbnail: the cifar recipe
THUMBNAIL_FILE_BYTES = 8 * 1024  # where no header could be read: files this small are thumbnails


def typical_size(split) -> tuple[int, int] | None:
    """Median (width, height) of up to SAMPLED_HEADERS of the split's images, evenly spaced, read
    from the first 256 KiB of each file (a header, EXIF included), or of a sharded split from inside
    its shards (training.forms.formats.sample_sizes: the first images of evenly spaced units); None for
    an empty split, or headers no decoder reads (those files fail later, in their own batch)."""
    from concurrent.futures import ThreadPoolExecutor

    if not len(split):
        return None
    if split.grouped:
        sizes = sample_sizes(split, SAMPLED_HEADERS)
        return tuple(int(v) for v in np.median(sizes, axis=0)) if sizes else None
    fs, base, _ = storage.filesystem(split.root)
    picks = np.unique(np.linspace(0, len(split) - 1, min(SAMPLED_HEADERS, len(split))).round().astype(int))
    with ThreadPoolExecutor(8) as pool:  # object storage: a request each
        sizes = [s for s in pool.map(lambda rel: _header_size(fs, f"{base}/{rel}"), split.rel_paths[picks]) if s]
    return tuple(int(v) for v in np.median(sizes, axis=0)) if sizes else None


def _header_size(fs, path: str) -> tuple[int, int] | None:
    """(width, height) from a file's first 256 KiB, read as decoding reads headers (augment/decode.py
    read_header); None for a file that cannot be read or whose header is bad (a decompression bomb
    among them): such a file is listed when training meets it, and the sample goes on without it."""
    try:
        return header_size(storage.read_file(fs, path, 256 * 1024))
    except OSError:
        return None


def auto_preset(tree: ImageTree) -> tuple[str, str]:
    """--preset auto: (the built-in preset for the tree, why). The CIFAR recipe (32 px crops of a
    4-px-padded image) for thumbnails; the ImageNet recipe (random resized crops to 224 px) for
    photos, where a 32 px crop would keep a sliver of each."""
    if tree.typical_size:
        w, h = tree.typical_size
        if min(w, h) <= THUMBNAIL_SIDE:
            return "cifar", f"thumbnails, typically {w} x {h} px"
        return "imagenet", f"photos, typically {w} x {h} px"
    kb = tree.train.mean_file_bytes / 1024
    return (
        ("cifar", f"files of {kb:.0f} KB on average")
        if kb * 1024 < THUMBNAIL_FILE_BYTES
        else (
            "imagenet",
            f"files of {kb:.0f} KB on average",
        )
    )


def check_resize_start(cfg: TrainConfig, train_size: int) -> None:
    """--progressive-resize must start below the training size."""
    resize = parse_resize(cfg.progressive_resize, cfg.epochs)
    if resize and resize[0] >= train_size:
        raise ConfigError(
            f"--progressive-resize {cfg.progressive_resize}: starts at {resize[0]} px, not below the training size "
            f"{train_size} px; give a smaller FROM or a larger --image-size"
        )


def local_gpus() -> int:
    """The GPUs of this machine that CUDA would show this process, without importing torch (Linux's
    NVIDIA driver lists them in /proc; nowhere else has CUDA)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        found = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    return found if visible is None else min(found, len(visible.split(",")))


def cuda_devices() -> int:
    """The CUDA devices torch sees here (seconds: it imports torch; for where local_gpus found none,
    on systems whose driver is not listed in /proc, such as WSL)."""
    import torch

    return torch.cuda.device_count()


def sized_preset(cfg: TrainConfig, preset):
    """The preset at --image-size, checked at every side the run trains and evaluates at
    (--progressive-resize's, epoch by epoch): ConfigError for one that does not fit."""
    if cfg.weights and preset == PRESETS.get(preset.name):  # a built-in preset: the weights' transform
        from training.weights import pretrained_transform, weights_preset

        preset = weights_preset(preset, pretrained_transform(cfg.model, cfg.weights), cfg.image_size)
    if cfg.image_size:
        preset = preset.at_size(cfg.image_size)
    check_resize_start(cfg, preset.train_size)
    from augment.pipeline import check_sides  # torch: loaded with the preset file or the job already

    try:
        check_sides(preset, preset.train_sides(cfg.progressive_resize, cfg.epochs))
    except PresetError as e:
        raise ConfigError(f"preset {preset.name!r}: {e}") from None
    return preset


def check_sizes_and_device(cfg: TrainConfig, name: str, preset=None) -> None:
    """The rest of the checks that need no cluster: --progressive-resize against the training
    size, the preset file's ops at the run's sizes (`preset`: loaded, None for a built-in one,
    whose ops fit any size), and --amp fp16 for a run that starts a cluster of this machine,
    where it would find no GPU."""
    check_resize_start(cfg, cfg.image_size or (preset or PRESETS[name]).train_size)
    if (preset is not None and (cfg.image_size or cfg.progressive_resize != "none")) or cfg.weights:
        sized_preset(cfg, preset or PRESETS[name])  # torch: loaded with the preset file or the weights already
    if cfg.model.startswith("vit_"):  # one input side, a multiple of its patches
        from training.model import check_model_sizes

        sized = sized_preset(cfg, preset or PRESETS[name])
        check_model_sizes(cfg.model, [*sized.train_sides(cfg.progressive_resize, cfg.epochs), sized.image_size])
    if starts_local_cluster():
        check_local_machine(cfg)
    check_gpu_decoder(cfg.gpu_decoder, cfg.device)


def check_local_machine(cfg: TrainConfig) -> None:
    """For a run that starts its cluster on this machine, what this machine cannot give: a GPU
    where none is (--device cuda, --augment-gpus, --amp fp16), or more CPUs per worker than it
    has. A joined cluster is checked once connected (training/driver/planning.py plan_resources)."""
    gpus = local_gpus()
    if cfg.device == "auto":
        check_amp(cfg.amp, on_gpu=gpus > 0)
        check_sync_bn(cfg.sync_bn, on_gpu=gpus > 0)
    asked = [f"--device {cfg.device}"] if cfg.device == "cuda" else []
    asked += [f"--augment-gpus {cfg.augment_gpus:g}"] if cfg.augment_gpus else []
    if asked and not gpus and not cuda_devices():
        fixes = ["use --device cpu or auto"] if cfg.device == "cuda" else []
        fixes += ["drop --augment-gpus"] if cfg.augment_gpus else []
        raise ConfigError(
            f"{' and '.join(asked)}: this machine has no GPU that CUDA shows, and a run without RAY_ADDRESS starts "
            f"its cluster here; {' and '.join(fixes)}, or set RAY_ADDRESS to join a cluster with GPUs"
        )
    cores = os.cpu_count() or 1
    if cfg.cpus_per_worker > cores:
        raise ConfigError(
            f"--cpus-per-worker {cfg.cpus_per_worker}: this machine has {cores} CPUs, and a run without RAY_ADDRESS "
            f"starts its cluster here; give {cores} or less, or 0 for the plan's share"
        )


def check_gpu_decoder(setting: str, device: str = "auto") -> None:
    """--gpu-decoder nvimgcodec where this machine has no nvImageCodec, unless the run is on CPUs
    (the nodes' environment is taken to be the driver's, as the project's venv or a runtime
    environment makes it)."""
    if setting == "nvimgcodec" and device != "cpu" and not engines.available():
        raise ConfigError(
            "--gpu-decoder nvimgcodec: nvImageCodec is not installed here; install it with "
            "pip install -e '.[gpu]', or use --gpu-decoder auto (nvjpeg where it is missing)"
        )


MIN_STEPS_PER_EPOCH = 4  # fewer, and batch norm's statistics and the warm-up have too little to go on


def few_steps_warning(cfg: TrainConfig, tree: ImageTree) -> str | None:
    """A warning line where an epoch is fewer than MIN_STEPS_PER_EPOCH steps: on 360 photos,
    --batch-size 256 (1 step an epoch) sat at chance for 7 of 30 epochs with a validation loss
    up to 131,177, where 64 (5 steps) trained from the first epochs (the first-hour trial of
    docs/benchmark-log.md, "Small datasets")."""
    steps = len(tree.train) // cfg.batch_size
    if steps >= MIN_STEPS_PER_EPOCH:
        return None
    fits = max(8, len(tree.train) // MIN_STEPS_PER_EPOCH // 8 * 8)
    said = (
        f"warning: {len(tree.train)} training images at --batch-size {cfg.batch_size} are {steps or 1} step(s) an "
        "epoch, too few for batch norm and the warm-up"
    )
    if fits < cfg.batch_size:
        return f"{said}; --batch-size {fits} gives {len(tree.train) // fits}"
    return f"{said}; a batch smaller than 8 is too few for batch norm itself: more training images would help"


def preset_name(cfg: TrainConfig, tree: ImageTree) -> str:
    """The preset the run uses: --preset, or auto_preset's choice for `auto`."""
    return auto_preset(tree)[0] if cfg.preset == "auto" else cfg.preset


def check_inputs(cfg: TrainConfig) -> tuple[TrainConfig, ImageTree]:
    """Resolve defaults, scan the tree, check the flags that name things; DataError, ConfigError,
    PresetError or storage.StorageError (exit 2) for anything wrong, and nothing written. A
    preset file is loaded and checked by augment.presets.load_preset."""
    cfg = cfg.with_defaults_resolved()
    root = cfg.data or str(default_dataset_dir())
    tree = scan_data(root, cfg.val_fraction, cfg.label_key, cfg.class_names)
    if tree.train.grouped and tree.train.form.kind == "prepared":
        cfg = prepared_val_fraction(cfg, root)
    tree = dataclasses.replace(tree, typical_size=typical_size(tree.train))
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
        check_sync_bn(cfg.sync_bn, on_gpu=False)
    check_sampler(cfg, tree)
    if cfg.preset != "auto":
        check_preset_name(cfg.preset)
    parse_log_to(cfg.log_to)  # a tracker's library missing: said before Ray
    # Ray Train, rank 0 and the driver all write there; the probe leaves no directory behind
    check_run_dir(cfg)  # first: the write probe below must not write through a link or into someone's folder
    storage.check_writable(cfg.run_dir, "--storage-path")
    lease.check_free(cfg.run_dir, cfg.name)  # a live run's folder: say so before anything about its settings
    if not cfg.fresh:
        check_same_run(cfg, tree)
    if cfg.model != "resnet18":  # it imports torchvision (seconds), which the default needs not
        from training.model import check_model

        check_model(cfg.model, small_stem=cfg.small_stem)
    if cfg.weights:  # the name, then the file in the library's cache (fetched there where it may be)
        from training.weights import check_weights

        check_weights(cfg.model, cfg.weights)
    if cfg.init_weights:  # last: it imports torch and torchvision
        check_init_weights(cfg.init_weights, cfg.model)
    return cfg, tree


def check_sampler(cfg: TrainConfig, tree: ImageTree) -> None:
    """--sampler balanced draws files: a sharded split is read in whole row groups or runs of tar
    members, whose images cannot be drawn one by one."""
    if cfg.sampler == "balanced" and tree.train.grouped:
        raise ConfigError(
            f"--sampler balanced: {tree.root} is read in shards, whose images cannot be drawn one by one; use "
            "--class-weights balanced instead (the same correction, in the loss)"
        )


def prepared_val_fraction(cfg: TrainConfig, root: str) -> TrainConfig:
    """`cfg` with the --val-fraction that jobs.prepare split `root` by (its manifest's), which the
    run then uses and records; a ConfigError where --val-fraction asks for another one than that
    and the default. Shards of a train/ + val/ tree have no fraction: `cfg` as it is."""
    manifest = read_manifest(root)
    used = manifest.get("val_fraction") if manifest.get("layout") == "hash" else None
    if used is None or cfg.val_fraction == used:
        return cfg
    if cfg.val_fraction != TrainConfig.val_fraction:
        raise ConfigError(
            f"--val-fraction {cfg.val_fraction:g}: {root} was prepared with --val-fraction {used:g}, which fixed "
            f"its split; drop --val-fraction, or prepare the tree again with jobs.prepare --val-fraction "
            f"{cfg.val_fraction:g}"
        )
    return dataclasses.replace(cfg, val_fraction=used)


def check_init_weights(path: str, model: str = "resnet18") -> None:
    """ConfigError unless `path` is a file that the train workers' loader takes into a
    `model` (training.model.load_init_weights, the same code)."""
    if storage.is_uri(path):
        raise ConfigError(
            f"--init-weights {path}: read from local disk only, not object storage; copy the file to this machine "
            "and give its path"
        )
    what = userfiles.what_is_at(path)  # a pipe too: torch.load seeks, and a resume reads the file again
    if what:
        raise ConfigError(
            userfiles.refusal("--init-weights", path, what, f"a torchvision {model} state_dict saved with torch.save")
        )
    from training.model import build_model, load_init_weights

    # the head and the stem are not what it checks
    load_init_weights(build_model(model, 2, small_stem=False, image_size=224), path, model)


# What a run directory's records and checkpoints are of: a rerun of NAME that changes one of these
# would resume one run's checkpoint as another's, or mix two runs' rows in metrics.csv. The rest
# (--epochs, --stop-after, resources, the device, the console) a rerun may change.
SAME_RUN_SETTINGS = (
    "model",
    "weights",
    "val_fraction",
    "image_size",
    "small_stem",
    "progressive_resize",
    "augment_schedule",
    "batch_size",
    "lr",
    "optimizer",
    "schedule",
    "warmup_epochs",
    "weight_decay",
    "momentum",
    "label_smoothing",
    "seed",
    "deterministic",
    "freeze_epochs",
    "backbone_lr_scale",
    "model_ema",
    "grad_accum",
    "clip_grad_norm",
    "class_weights",
    "sampler",
)


def data_place(root: str) -> str:
    """A data root as config.json records it: a URI as given, a local path made absolute (photos,
    ./photos and ~/photos from the home directory are one place)."""
    return root if storage.is_uri(root) else os.path.realpath(os.path.expanduser(root))


def check_same_run(cfg: TrainConfig, tree: ImageTree) -> None:
    """ConfigError where NAME already holds a run (one epoch at least: metrics.csv) of other data,
    classes, preset or SAME_RUN_SETTINGS than `cfg` would resume: one line naming what differs and
    the two ways out. Nothing is written."""
    run_dir = cfg.run_dir
    with storage.errors(run_dir, "reading"):
        if not storage.exists(storage.join(run_dir, "metrics.csv")):
            return
        done = storage.read_bytes(storage.join(run_dir, "metrics.csv")).decode().count("\n") - 1  # epochs
        try:
            old = json.loads(storage.read_bytes(storage.join(run_dir, "config.json")))
        except (OSError, ValueError):  # no config.json, or not one of ours: nothing to compare
            return
    if cfg.epochs < done:
        raise ConfigError(
            f"--epochs {cfg.epochs}: --name {cfg.name} has trained {done} epochs already; give --epochs {done} or "
            "more to go on with it, --fresh to start it over, or another --name"
        )
    was, now = old.get("config", {}), cfg.to_dict()
    differs = []
    if data_place(old.get("data_root", tree.root)) != data_place(tree.root):
        differs.append(f"--data {old['data_root']} there, {tree.root} here")
    elif list(old.get("class_names", tree.class_names)) != list(tree.class_names):
        differs.append(f"classes {', '.join(old['class_names'])} there, {', '.join(tree.class_names)} here")
    preset = preset_name(cfg, tree)
    # a built-in preset by the name config.json's preset has (a run of `auto` chose one), a file by its path
    old_preset = was.get("preset") if check_preset_name(preset) else (old.get("preset") or {}).get("name")
    if old_preset is not None and old_preset != preset:
        differs.append(f"--preset {old_preset} there, {preset} here")
    differs += [
        f"--{k.replace('_', '-')} {was[k]} there, {now[k]} here"
        for k in SAME_RUN_SETTINGS
        if k in was and was[k] != now[k]
    ]
    if differs:
        raise ConfigError(
            f"--name {cfg.name} already holds a run with other settings ({'; '.join(differs[:3])}"
            f"{'; ...' if len(differs) > 3 else ''}); pass --fresh to start it over, or another --name"
        )


def prepare(cfg: TrainConfig):
    """Every check that needs no cluster, in the order the entry point runs them, then
    start_fresh: (cfg with defaults resolved, the tree, the preset's name, the preset where
    it is a file, loaded and checked; None for a built-in one, which the caller loads while
    Ray starts). DataError, ConfigError, PresetError or StorageError for any mistake (exit 2)."""
    cfg, tree = check_inputs(cfg)  # light: a mistake is reported before anything heavy starts
    name, preset = preset_name(cfg, tree), None  # --preset auto: the tree's header sizes chose it
    if check_preset_name(name):  # a file: loaded and checked before Ray starts too
        from augment.presets import load_preset

        preset = load_preset(name)
    check_sizes_and_device(cfg, name, preset)
    if ":" in cfg.model:  # a model of the user's: its output for the run's classes and size
        from training.model import check_model_output

        check_model_output(cfg.model, len(tree.class_names), sized_preset(cfg, preset or PRESETS[name]).image_size)
    lease.acquire(cfg.run_dir, cfg.name)  # held until the run ends (training.driver.job.run) or this process does
    start_fresh(cfg)  # --fresh: the old run goes only once every input has passed, and under the lease
    return cfg, tree, name, preset


def check_run_dir(cfg: TrainConfig) -> None:
    """ConfigError where STORAGE_PATH/NAME is something this job must not write into or remove: a
    file, a symbolic link (its target may lie anywhere), or a folder holding files that this job
    did not write as a run directory (training.storage.is_run_dir). An empty folder is taken."""
    run_dir, flag = cfg.run_dir, f"--name {cfg.name}"
    if not storage.is_uri(run_dir):
        if os.path.islink(run_dir):
            raise ConfigError(
                f"{flag}: {run_dir} is a symbolic link; a run directory must be a folder of its own inside "
                "--storage-path; give another --name"
            )
        storage_dir = os.path.realpath(cfg.storage_path)
        if os.path.dirname(os.path.realpath(run_dir)) != storage_dir:  # the name rule makes this hold
            raise ConfigError(f"{flag}: {run_dir} does not lie inside --storage-path {storage_dir}")
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):
            raise ConfigError(f"{flag}: {run_dir} is a file, not a run directory; give another --name")
    with storage.errors(run_dir, "reading"):
        if not storage.exists(run_dir) or storage.is_empty_dir(run_dir) or storage.is_run_dir(run_dir):
            return
        earlier = storage.is_earlier_run_dir(run_dir)
    if earlier:
        raise ConfigError(
            f"{flag}: {run_dir} is a run of an earlier version of jobs.train (no {storage.RUN_MARKER}); "
            "nothing there was touched; resume it with the version that wrote it, or give another --name"
        )
    raise ConfigError(
        f"{flag}: {run_dir} holds files that jobs.train did not write (no {storage.RUN_MARKER}); nothing there "
        "was touched; give another --name or --storage-path"
    )


def start_fresh(cfg: TrainConfig) -> None:
    """With --fresh, remove the run directory NAME already has (Ray Train would otherwise
    resume from its checkpoints); nothing without it. Call it after every input, the preset
    file included, has been checked: a mistake must leave the old run as it was. Only a run
    directory of this job's, strictly inside --storage-path, is removed (check_run_dir again,
    right before the removal); an empty folder is left as it is."""
    if not cfg.fresh:
        return
    check_run_dir(cfg)
    run_dir = cfg.run_dir
    with storage.errors(run_dir, "writing"):
        if storage.exists(run_dir) and storage.is_run_dir(run_dir):
            storage.clear_dir(run_dir, keep=(lease.LEASE_FILE, storage.RUN_MARKER))
