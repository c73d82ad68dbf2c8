"""The one config object of a training job.

Every field has a default and a one-line help text with its unit; `jobs.train` turns the
fields into command-line flags, so the help, the defaults and the saved `config.json`
can never disagree. Quantities say whether they are global or per worker.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Optional

from augment.schedule import MIN_IMAGE_SIZE
from training.storage import local_path


class ConfigError(ValueError):
    """A setting the user gave is unusable; the message names the flag and the fix."""


def check_amp(amp: str, on_gpu: bool) -> None:
    """fp16 autocast on a CPU runs, but torch's float16 CPU kernels are many times slower than
    float32 and bf16 (docs/benchmark-log.md, "Mixed precision on the CPU")."""
    if amp == "fp16" and not on_gpu:
        raise ConfigError(
            "--amp fp16 on CPU: torch's float16 kernels there are many times slower than float32; "
            "use --amp bf16 (fast on CPUs with AVX512-BF16 or AMX) or --amp off"
        )


def check_sync_bn(sync_bn: bool, on_gpu: bool) -> None:
    """SyncBatchNorm has no CPU kernel: --sync-bn on CPUs would fail in the first step."""
    if sync_bn and not on_gpu:
        raise ConfigError(
            "--sync-bn: SyncBatchNorm runs on CUDA GPUs only and this run trains on CPUs; drop --sync-bn "
            "(one CPU rank's BatchNorm is already the whole batch's)"
        )


RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def check_run_name(name: str) -> None:
    """A run name is one path component, so STORAGE_PATH/NAME lies strictly inside STORAGE_PATH:
    `--name ..` with --fresh would otherwise remove the storage path's parent, `--name .` every
    run beside it, and `--name ../x` write outside it."""
    if not RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"--name {name!r}: a run name is one folder name of letters, digits and . _ - (not '.' or '..', "
            "no '/', at most 200 characters), e.g. --name photos-r18; --storage-path says where it goes"
        )


# The most each setting may be: far beyond any real run, so that a slip (a few zeros too many, a size
# in bytes) is refused before Ray starts instead of failing on the workers or running for ever.
LIMITS = {
    "epochs": 100_000,  # passes over the training set (--stop-after and --warmup-epochs too)
    "batch_size": 1 << 20,  # images per step, summed over the workers
    "image_size": 8192,  # px, the side the model sees
    "num_workers": 4096,  # train workers
    "threads_per_worker": 1024,  # torch threads
    "cpus_per_worker": 1024,  # CPUs (and no more than the biggest node has: training/driver/inputs.py, planning.py)
    "augment_actors": 4096,  # per split
    "augment_batch_size": 1 << 16,  # images per augment call
    "augment_gpus": 64,  # GPUs per augment task or actor
    "max_failures": 100_000,  # restarts
    "node_wait_s": 7 * 24 * 3600.0,  # s: a week
    "log_every": 1 << 30,  # steps
}
SEED_RANGE = 2**64  # torch.manual_seed takes 0 .. 2**64 - 1 (and negatives, which NumPy refuses)
DETERMINISTIC_SEED_RANGE = 2**32  # --deterministic: Ray Train's enable_reproducibility seeds NumPy with it too


def check_limits(cfg) -> None:
    """ConfigError for a setting of `cfg` beyond LIMITS, or a --seed outside what the workers'
    generators take."""
    limits = {**LIMITS, "stop_after": LIMITS["epochs"], "warmup_epochs": LIMITS["epochs"]}
    for name, limit in limits.items():
        if getattr(cfg, name) > limit:
            raise ConfigError(
                f"--{name.replace('_', '-')} {number(getattr(cfg, name))}: more than {number(limit)}, the most this "
                "job takes (training/config.py LIMITS); give a smaller value"
            )
    top = DETERMINISTIC_SEED_RANGE if cfg.deterministic else SEED_RANGE
    if not 0 <= cfg.seed < top:
        why = " with --deterministic (NumPy's seeds)" if cfg.deterministic else " (torch.manual_seed's range)"
        raise ConfigError(
            f"--seed {number(cfg.seed)}: must be 0 .. 2**{top.bit_length() - 1} - 1{why}; give another seed"
        )


def number(value) -> str:
    """A setting's number for a message: an int as it is (cut short where it is very long), a float by :g."""
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


# the Python types a field may hold, by its annotation: a TrainConfig built in Python (training.fit) is
# checked as the flags' parser checks the command line's (a bool is no number here)
FIELD_TYPES = {
    "int": ((int,), "a whole number"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "True or False"),
    "str": ((str,), "a string"),
    "Optional[str]": ((str, type(None)), "a string or None"),
}


def _f(default, help: str, **meta):
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # data
    data: Optional[str] = _f(
        None,
        "an image tree (DIR/<class>/<img>, DIR/{train,val}/<class>/<img>), WebDataset shards (a folder of .tar, "
        "a pattern such as train-{0000..0099}.tar), a Hugging Face Parquet export (a folder of .parquet), a "
        "path,label manifest (.csv, .jsonl) or jobs.prepare shards; local path or s3://, gs://. Default: the "
        "bundled digits dataset",
    )
    val_fraction: float = _f(
        0.2,
        "fraction of the images held out for validation by the hash of their path (ignored where the data has "
        "its own split: train/ + val/, train-/val- shards or files, a validation manifest)",
    )
    label_key: str = _f(
        "label",
        "where the label is: WebDataset, the field of a sample's .json member (used without a .cls member); Hugging "
        "Face Parquet, the column (default: a `label` column, else the first ClassLabel); a manifest, the column or "
        "JSON key (default: label, class, target, ...)",
    )
    class_names: str = _f(
        "",
        "a text file naming the classes of labels that are class indices (WebDataset .cls members, a manifest's or "
        "an export's integer labels), line i naming class i; model.pt and predictions.csv then use the names. "
        "WebDataset shards without it take a classes.txt beside them. Default: the indices are the names",
    )
    preset: str = _f(
        "auto",
        "augmentation preset: cifar, imagenet, a .yaml/.json preset file, or auto (cifar for thumbnails, whose "
        "shorter side is typically 64 px or less, imagenet for photos; the plan line says which)",
    )
    # optimisation
    epochs: int = _f(5, "number of passes over the training set")
    batch_size: int = _f(64, "global batch size (images per step, summed over all workers)")
    lr: float = _f(
        0.08, "peak learning rate for a global batch of 256; scaled linearly with --batch-size (Goyal et al. 2017)"
    )
    optimizer: str = _f("sgd", "sgd (momentum, Nesterov) or adamw", choices=("sgd", "adamw"))
    schedule: str = _f(
        "cosine",
        "cosine: linear warm-up then cosine to 0; onecycle: torch's OneCycleLR",
        choices=("cosine", "onecycle"),
    )
    warmup_epochs: float = _f(1.0, "epochs of linear warm-up (cosine schedule; onecycle uses it as its rising phase)")
    momentum: float = _f(0.9, "SGD momentum (Nesterov)")
    weight_decay: float = _f(5e-4, "weight decay on conv and linear weights; none on BatchNorm and biases")
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss, in [0, 1)")
    seed: int = _f(0, "drives model init, file order, per-epoch shuffle and augmentation")
    deterministic: bool = _f(
        False, "torch deterministic algorithms and ordered data: same seed + world size -> identical metrics.csv"
    )
    # model
    model: str = _f(
        "resnet18",
        "any classification model of torchvision.models by name (resnet50, convnext_tiny, efficientnet_b0, "
        "vit_b_16, ...), timm/NAME for any timm model (pip install -e '.[timm]'), or module.path:function for "
        "your own (function(num_classes=N) returns an nn.Module; importable from the job's working directory); "
        "with a head for the run's classes, at random init unless --weights or --init-weights",
    )
    small_stem: str = _f(
        "auto",
        "a ResNet's 3x3 stride-1 stem without max-pool: auto (images <= 32 px), on, off; other models keep theirs",
        choices=("auto", "on", "off"),
    )
    amp: str = _f(
        "off",
        "mixed precision: off; bf16 (GPUs, and CPUs with AVX512-BF16 or AMX); fp16 (GPUs only, with a GradScaler)",
        choices=("off", "bf16", "fp16"),
    )
    compile: bool = _f(False, "torch.compile the model (first steps are slower while it compiles)")
    weights: str = _f(
        "",
        "pretrained weights of --model by name: torchvision's (DEFAULT, IMAGENET1K_V1, ...) or, for timm/NAME, "
        "DEFAULT or a pretrained tag (a1_in1k, ...); fetched by the library into its cache (TORCH_HOME, "
        "Hugging Face's HF_HUB_CACHE), read from there offline. The head is new where the class count differs; "
        "the eval resize, crop, mean and std follow the weights' unless a preset file or --image-size sets them",
    )
    init_weights: str = _f(
        "",
        "fine-tune from a local state_dict file of --model (torch.save'd or .safetensors; DDP's module. and "
        "Lightning's model. prefixes are stripped); the head is replaced",
    )
    # resources
    num_workers: int = _f(0, "Ray Train workers (DDP ranks); 0 = one per GPU, or 1 on a CPU-only cluster")
    device: str = _f(
        "auto", "where training runs: auto (cuda if the cluster has GPUs), cpu or cuda", choices=("auto", "cpu", "cuda")
    )
    threads_per_worker: int = _f(
        0, "torch intra-op threads per CPU worker; 0 = its machine's CPUs shared among the workers there"
    )
    cpus_per_worker: int = _f(
        0, "CPUs reserved per train worker; 0 = half the cluster's CPUs / workers (the rest feeds Ray Data)"
    )
    augment_actors: int = _f(
        0,
        "augment actors per split (train, val); 0 = Ray Data tasks, whose worker processes outlive the epoch "
        "(an actor pool restarts every epoch)",
    )
    augment_gpus: float = _f(
        0.0,
        "GPU per augment task or actor; 0 = a quarter of a trainer's GPU for augmentation (4 tasks of 0.0625, "
        "or an actor of 0.25). Tasks: as many as fit in a quarter run beside each trainer, at least one "
        "(0.125: 2; 0.03125: 8); 1 = a dedicated GPU each",
    )
    augment_batch_size: int = _f(
        0,
        "images per augment call, and at most per read task on CPUs (larger is faster on a GPU); 0 = 256, or "
        "1024 on a GPU for files averaging 256 KB or less and for thumbnails decoded in the read task (files "
        "averaging under 8 KB)",
    )
    decode: str = _f(
        "auto",
        "where images are decoded: auto (by device, preset and file size; the plan line says which), read (Ray "
        "Data's read tasks, full size), augment (the augment call: --gpu-decoder's on a GPU, JPEGs at the "
        "smallest scale their crop allows on CPUs), augment-full (the augment call, always full size)",
        choices=("auto", "read", "augment", "augment-full"),
    )
    gpu_decoder: str = _f(
        "auto",
        "the GPU's JPEG decoder: auto (nvimgcodec where it is installed, else nvjpeg; the plan line says which), "
        "nvimgcodec (NVIDIA's nvImageCodec: the GPU's hardware JPEG engines, each crop region alone; "
        "pip install -e '.[gpu]'), nvjpeg (torchvision's, whole images)",
        choices=("auto", "nvimgcodec", "nvjpeg"),
    )
    # output
    storage_path: str = _f("runs", "where run directories go (local path, or s3://, gs:// for multi-node)")
    name: str = _f(
        "", "run name; the run directory is STORAGE_PATH/NAME. Default: run-<timestamp>. Rerunning a name resumes it"
    )
    max_failures: int = _f(
        2,
        "times the run restarts its train workers from the last checkpoint after a fault (a lost node, a dead "
        "worker, an out-of-memory kill); -1 = always",
    )
    node_wait_s: float = _f(
        120.0,
        "after a fault, how long to wait for nodes to join when the train workers no longer fit the cluster (s)",
    )
    strict: bool = _f(
        False,
        "stop with exit 2 if any image in the tree cannot be decoded (default: skip it and list it in bad_files.csv)",
    )
    fresh: bool = _f(False, "start NAME over instead of resuming from its last checkpoint")
    stop_after: int = _f(0, "stop after this many epochs in this invocation (0 = run to --epochs); rerun to resume")
    log_to: str = _f(
        "",
        "trackers to log to as the run goes, comma-separated: tensorboard, mlflow, wandb (training/driver/tracking.py: "
        "MLFLOW_TRACKING_URI, else a store in the run directory; W&B online where logged in, else offline)",
        comma_list=True,
    )
    log_every: int = _f(0, "with --log-to: also log loss, learning rate and images/s every this many steps (0 = off)")
    quiet: bool = _f(False, "print only errors and the final summary")
    verbose: bool = _f(False, "also print Ray's own INFO logs and Ray Data's progress bars")
    dashboard: bool = _f(
        False,
        "a plain local run starts Ray's dashboard too (http://127.0.0.1:8265); off by default: it adds seconds of "
        "start-up on a small machine (docs/benchmark-log.md). A cluster keeps its own",
    )
    # resolution
    image_size: int = _f(
        0,
        "side of the images the model sees, px; 0 = the preset's (cifar 32, imagenet 224). The preset's crops "
        "scale with it and its eval resize keeps its ratio (imagenet: 256/224)",
    )
    progressive_resize: str = _f(
        "none",
        "train at a lower resolution first (FFCV's progressive resizing): FROM px growing to --image-size over the "
        "run, or FROM:FIRST-LAST to grow over epochs FIRST..LAST (1-based), e.g. 160:11-13; sizes in between are "
        "multiples of 8; evaluation runs at --image-size",
    )
    # augmentation (issue 3)
    augment_schedule: str = _f(
        "none",
        "strength of the train augmentation over epochs: none, linear-decay, cosine-decay, linear-ramp or "
        "cosine-ramp, optionally :LEVEL (the far end, 0..1, default 0), e.g. cosine-decay:0.3",
    )

    # fine-tuning and the recipe staples (issue 56; docs/guide.md, "Fine-tuning recipe")
    freeze_epochs: int = _f(
        0, "epochs at the start that train the head (the classifier layer) alone, the backbone frozen; 0 = none"
    )
    backbone_lr_scale: float = _f(
        1.0, "the backbone's learning rate as a fraction of the head's (the schedule's), in (0, 1]; 1 = the same"
    )
    model_ema: float = _f(
        0.0,
        "keep an exponential moving average of the weights with this decay per optimiser step, e.g. 0.999; "
        "validated each epoch (val_acc_ema) and saved as model_ema.pt; 0 = off",
    )
    grad_accum: int = _f(
        1,
        "micro-batches of --batch-size per optimiser step: the step's batch is --batch-size x N images (--lr "
        "scales with it; the schedule counts optimiser steps)",
    )
    clip_grad_norm: float = _f(0.0, "clip the gradients' global L2 norm to this before each step; 0 = off")
    sync_bn: bool = _f(False, "BatchNorm statistics synchronised across the DDP ranks (SyncBatchNorm); CUDA only")
    early_stop: int = _f(
        0, "stop after this many epochs without a better val_acc (model_best.pt keeps the best); 0 = off"
    )
    class_weights: str = _f(
        "none",
        "balanced: weight the loss per class by n / (classes x the class's training images) (sklearn's "
        "'balanced'); none",
        choices=("none", "balanced"),
    )
    sampler: str = _f(
        "shuffle",
        "shuffle: every training image once an epoch; balanced: each epoch draws as many images, with replacement, "
        "each with probability inversely proportional to its class's count (image trees and manifests only)",
        choices=("shuffle", "balanced"),
    )

    def __post_init__(self):
        for field in dataclasses.fields(self):  # nan passes every comparison below, inf most
            value, (allowed, words) = getattr(self, field.name), FIELD_TYPES[str(field.type)]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                flag, shown = "--" + field.name.replace("_", "-"), repr(value)[:80]
                raise ConfigError(f"{flag} must be {words}, got {shown} (a {type(value).__name__})")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"--{field.name.replace('_', '-')} must be a finite number, got {value}")
            if isinstance(value, str) and value != local_path(value):  # file:///data: the local /data
                object.__setattr__(self, field.name, local_path(value))
        # an empty path is an unset shell variable more often than a choice: it would train on the bundled
        # digits, or write the runs into the working folder itself
        if self.data is not None and not self.data.strip():
            raise ConfigError("--data is empty; give the data's path, or leave --data out for the bundled digits")
        if not self.storage_path.strip():
            raise ConfigError("--storage-path is empty; give a folder or bucket, or leave it out for ./runs")
        positive = ["epochs", "batch_size"]
        for field in positive:
            if getattr(self, field) <= 0:
                raise ConfigError(f"--{field.replace('_', '-')} must be positive, got {getattr(self, field)}")
        automatic = ("num_workers", "threads_per_worker", "cpus_per_worker", "augment_actors", "augment_gpus")
        for field in (*automatic, "augment_batch_size"):
            if getattr(self, field) < 0:
                raise ConfigError(
                    f"--{field.replace('_', '-')} must be 0 (automatic) or positive, got {getattr(self, field)}"
                )
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be 0 or more, got {self.weight_decay}")
        if not 0 <= self.momentum <= 1:
            raise ConfigError(f"--momentum must be in [0, 1], got {self.momentum}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.max_failures < -1:
            raise ConfigError(f"--max-failures must be -1 (unlimited) or more, got {self.max_failures}")
        if self.node_wait_s < 0:
            raise ConfigError(f"--node-wait-s must be 0 or more, got {self.node_wait_s}")
        if self.stop_after < 0:
            raise ConfigError(f"--stop-after must be 0 or positive, got {self.stop_after}")
        if self.log_every < 0:
            raise ConfigError(f"--log-every must be 0 (off) or positive, got {self.log_every}")
        if self.warmup_epochs < 0:
            raise ConfigError(f"--warmup-epochs must be 0 or more, got {self.warmup_epochs}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.image_size and self.image_size < MIN_IMAGE_SIZE:
            raise ConfigError(
                f"--image-size must be 0 (the preset's) or at least {MIN_IMAGE_SIZE} px, got {self.image_size}"
            )
        check_limits(self)
        if self.augment_gpus and self.device == "cpu":
            raise ConfigError(
                f"--augment-gpus {self.augment_gpus:g} with --device cpu: augmenting on GPUs needs training on them; "
                "drop --augment-gpus, or use --device cuda or auto"
            )
        self.check_recipe()
        if self.weights and self.init_weights:
            raise ConfigError("--weights and --init-weights both set the first weights; give one")
        if self.quiet and self.verbose:
            raise ConfigError("--quiet and --verbose contradict each other; give one")
        if self.name:
            check_run_name(self.name)
        if self.num_workers and self.batch_size < self.num_workers:
            raise ConfigError(
                f"--batch-size {self.batch_size} is smaller than --num-workers {self.num_workers}; each worker "
                "needs at least one image per step"
            )

    def check_recipe(self) -> None:
        """The fine-tuning and recipe flags' ranges (one line each, before Ray)."""
        for field in ("freeze_epochs", "early_stop", "clip_grad_norm"):
            if getattr(self, field) < 0:
                raise ConfigError(
                    f"--{field.replace('_', '-')} must be 0 (off) or positive, got {getattr(self, field)}"
                )
        if self.freeze_epochs >= self.epochs:
            raise ConfigError(
                f"--freeze-epochs {self.freeze_epochs} leaves no epoch of --epochs {self.epochs} to train the whole "
                "model; give fewer frozen epochs or more --epochs"
            )
        if not 0 < self.backbone_lr_scale <= 1:
            raise ConfigError(f"--backbone-lr-scale must be in (0, 1], got {self.backbone_lr_scale}")
        if not (self.model_ema == 0 or 0 < self.model_ema < 1):
            raise ConfigError(f"--model-ema must be 0 (off) or a decay in (0, 1) such as 0.999, got {self.model_ema}")
        if self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be 1 or more micro-batches per step, got {self.grad_accum}")
        if self.class_weights != "none" and self.sampler != "shuffle":
            raise ConfigError(
                "--class-weights balanced and --sampler balanced each correct the imbalance; together they "
                "over-correct it: give one"
            )

    @property
    def peak_lr(self) -> float:
        """The linear scaling rule: lr is quoted per 256 images of a step's global batch (--batch-size
        times --grad-accum's micro-batches)."""
        return self.lr * self.batch_size * self.grad_accum / 256

    @property
    def run_dir(self) -> str:
        """STORAGE_PATH/NAME: where the run's records and checkpoints go (resolve the defaults first)."""
        return "/".join([self.storage_path.rstrip("/"), self.name])

    def with_defaults_resolved(self) -> "TrainConfig":
        """Fill in the run name; paths made absolute so every process agrees on them."""
        name = self.name or time.strftime("run-%Y%m%d-%H%M%S")
        storage = self.storage_path if "://" in self.storage_path else os.path.abspath(self.storage_path)
        return dataclasses.replace(self, name=name, storage_path=storage)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def error_line(error) -> str:
    """The one line an entry point prints for `error` (an exception or a message): "error: " once
    (a message that quotes another's keeps one), and a newline or other control character (a
    file's name may hold one) written as an escape, so the line stays one line."""
    text = str(error)
    while text.startswith("error: "):
        text = text[len("error: ") :]
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return f"error: {text}"
