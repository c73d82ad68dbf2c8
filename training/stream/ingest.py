"""The trainer's input: Ray Datasets that read, decode and augment each split, and how
they are split between the ranks.

    files or shards --(read task: a new order every epoch)--> {bytes, path, label, key, epoch}
        --(augment stage: decode + augment in one call)--> {image uint8 (B, S, S, 3), label, key, epoch}

Where decoding happens (`choose_decode`, printed in the plan line; docs/design.md,
"Decoding"): on a GPU, in the augment task (nvjpeg); on CPUs, in the augment call too,
each JPEG at the smallest scale its crop allows, when the train preset crops photos
(random_resized_crop) and the files are large enough for that to pay; otherwise (tiny
images such as 32 px PNGs) in the read task, at full size.

The file order is drawn from (seed, epoch) when each epoch's execution starts, in the
process that runs it: the same on every machine and for a run resumed at epoch k as for
one that ran straight through. (Ray Data's own per-execution reshuffling keys its seed on
a counter of executions, which restarts when a run resumes.) The local shuffle buffer of
the train loop mixes rows across read tasks on top. Every row carries the epoch it was read
for to the augment stage (EPOCH), which draws its augmentation for that epoch.

Constant per-task cost: the split's file table goes to the object store once; a read
task carries only its own rows of it (or its own units of a sharded split, whose rows get
label and key from the shard), so no map function or actor argument grows with the dataset.

Light on purpose (no torch at import): Ray Train's controller and dataset manager and, with
more than one worker, Ray Data's split coordinators unpickle what this module defines, and
each is a process of its own; importing torch there would slow the start of each on a small
machine (docs/design.md, "Choices and where they were measured").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np
import pyarrow.fs as pafs
import ray
import ray.data
import ray.train
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from augment import engines
from augment.decode import BadImage, decode_image, stack_images
from augment.streams import stream_rng
from training import ray_private, storage
from training.forms.data import DataError, Split, below, on_side
from training.forms.formats import read_units
from training.rows import BYTES, EPOCH, IMAGE, KEY, LABEL, PATH, READ_COST, REASON
from training.storage import filesystem
from training.stream.gone import DataGone, data_gone
from training.stream.stage import StageArgs, add_augment, seconds_per_row
from training.stream.stamp import current_epoch

ROWS_PER_TASK = 256  # at most this many files per read task (one augment call per block on CPUs)
# Thumbnails decoded in the read task (files averaging under THUMBNAIL_BYTES, e.g. CIFAR's 32 px
# PNGs of ~3 KB) go THUMBNAIL_ROWS to a task: a task of ROWS_PER_TASK of them is so short that
# Ray Data's round trip per task keeps fewer tasks running than the budget allows, and larger
# tasks spread that cost over more images (docs/design.md, "Choices and where they were
# measured"). DECODED_BLOCK_BYTES caps the pixels of one block, whatever the files hold (a small
# PNG may be a large flat image).
THUMBNAIL_BYTES, THUMBNAIL_ROWS = 8 * 1024, 1024
DECODED_BLOCK_BYTES = 64 * 2**20
# GPU: a block of 1,024 augmented images costs the hand-off to the trainer less host CPU per image
# than a block of 256, and a GPU decodes and augments a batch of 1,024 faster than one of 256
# (docs/benchmarks.md, "Hand-off" and "GPU"); files averaging over GPU_ROWS_MAX_FILE_BYTES
# (camera photos) keep ROWS_PER_TASK a call, as 1,024 of them decoded whole would fill GBs a task
GPU_ROWS, GPU_ROWS_MAX_FILE_BYTES = 1024, 256 * 1024
MIN_TASKS, MIN_ROWS_PER_TASK = 8, 16  # a small split still gets a few tasks, of 16 rows at least
MAX_TASKS = 4096  # Ray Data warns of "excessive task creation" from 5,000 read tasks on
TASK_BYTES = 64 * 2**20  # encoded bytes per read task at most (camera photos: a few files each)
# CPU, auto: decode in the augment call (JPEGs at reduced size) when the train preset crops
# photos and the files average at least this; below it the images are small, a reduced-size
# decode rarely applies, and the read task decodes them (docs/benchmark-log.md, "Ingest").
SHRINK_MIN_FILE_BYTES = 32 * 1024


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    where: str  # "read": in the read task, full size; "augment": in the augment call
    shrink: bool  # the CPU train path decodes each JPEG at the smallest scale its crop allows
    why: str

    def describe(self) -> str:
        how = "JPEGs at reduced size" if self.shrink else "full size"
        return f"decode in the {self.where} stage, {how} ({self.why})"


def gpu_decoder(setting: str = "auto") -> str:
    """What decodes on a GPU for --gpu-decoder `setting` (augment/batch.py default_decoder), as
    the plan line names it."""
    if setting == "nvjpeg":
        return "torchvision's nvjpeg (--gpu-decoder nvjpeg)"
    if setting == "nvimgcodec" or engines.available():
        forced = ", --gpu-decoder nvimgcodec" if setting == "nvimgcodec" else ""
        return f"nvImageCodec (hardware JPEG engines where the GPU has them, each crop region alone{forced})"
    return "torchvision's nvjpeg (nvImageCodec not installed: pip install -e '.[gpu]')"


def choose_decode(setting: str, split: Split, train_preset: tuple, use_gpu: bool, gpu: str = "auto") -> DecodePlan:
    """Where and how images are decoded: `setting` is --decode (auto, read, augment,
    augment-full); auto picks by device, preset and the split's mean file size; `gpu` is
    --gpu-decoder."""
    if setting == "read":
        return DecodePlan("read", False, "--decode read")
    if setting in ("augment", "augment-full"):
        shrink = setting == "augment" and not use_gpu
        return DecodePlan("augment", shrink, f"--decode {setting}" + (f", {gpu_decoder(gpu)}" if use_gpu else ""))
    if use_gpu:
        from augment.fused import plan_line  # torch: the driver has it loaded by now

        return DecodePlan("augment", False, f"GPU: {gpu_decoder(gpu)} in the augment call; {plan_line(train_preset)}")
    from augment.ops import can_shrink  # torch: the driver has it loaded by now

    mean_kb = split.mean_file_bytes / 1024
    crops = can_shrink(next(iter(train_preset[0])))
    if crops and mean_kb >= SHRINK_MIN_FILE_BYTES / 1024:
        return DecodePlan("augment", True, f"CPU, files average {mean_kb:.0f} KB")
    small = f"files average {mean_kb:.0f} KB" if crops else f"the preset's crop is {next(iter(train_preset[0]))}"
    return DecodePlan("read", False, f"CPU, {small}")


def augment_rows(setting: int, split: Split, decode: DecodePlan, use_gpu: bool = False) -> int:
    """Images per augment call and at most per read task: --augment-batch-size, or (0) 256,
    THUMBNAIL_ROWS for thumbnails decoded in the read task, and GPU_ROWS on a GPU for files
    averaging GPU_ROWS_MAX_FILE_BYTES or less."""
    if setting:
        return setting
    if use_gpu:
        return GPU_ROWS if split.mean_file_bytes <= GPU_ROWS_MAX_FILE_BYTES else ROWS_PER_TASK
    thumbnails = decode.where == "read" and split.mean_file_bytes < THUMBNAIL_BYTES
    return THUMBNAIL_ROWS if thumbnails else ROWS_PER_TASK


def _bad_schema():
    import pyarrow as pa

    return pa.schema([("path", pa.string()), ("reason", pa.string())])


def epoch_order(n: int, seed: int, epoch: int, labels: np.ndarray | None = None) -> np.ndarray:
    """The order of a split's units in one epoch: a permutation from the file-order stream of
    (seed, epoch) (augment/streams.py: the same numbers on every machine). With `labels` (--sampler
    balanced): n draws with replacement from that stream, each file's chance inversely proportional
    to its class's count; some files come twice, some not at all (training/driver/audit.py knows)."""
    rng = stream_rng("file_order", seed, epoch)
    if labels is None:
        return rng.permutation(n)
    p = 1.0 / np.bincount(labels)[labels]
    return rng.choice(n, size=n, replace=True, p=p / p.sum())


class SplitSource(Datasource):
    """One split's files (or a sharded split's units) as a Ray Data source, read in a new
    order every epoch. Rows: {bytes, path, label, key}, or {image, label, key, path} when
    the read task decodes.

    The epoch comes from the run's EpochClock when each execution starts (rank 0 advances it
    before asking for the epoch's data), and every row carries it (EPOCH: the epoch the augment
    stage draws for); without a clock it is 0, and with shuffle off the order is the split's own.
    """

    def __init__(
        self,
        split: Split,
        *,
        seed: int = 0,
        shuffle: bool = False,
        clock=None,
        decode: bool = False,
        bad_log=None,
        relative_paths: bool = False,
        rows_per_task: int = ROWS_PER_TASK,
        balanced: bool = False,
    ):
        super().__init__()
        self._sharded = split.grouped
        if self._sharded:
            units = split.units
        else:
            import pyarrow as pa

            units = pa.table({PATH: list(split.rel_paths), LABEL: split.labels, KEY: split.keys})
        # the per-file table (or the units and shard names): once in the object store, not in any task
        self._units = ray.put((units, getattr(split, "shards", ())))
        self._n, self._rows, self._bytes = len(units), len(split), split.total_bytes
        self._read = dict(root=split.root, decode=decode, bad_log=bad_log, relative_paths=relative_paths)
        if self._sharded:
            self._read |= dict(form=split.form, side=split.side)
        self._seed, self._shuffle, self._clock = seed, shuffle, clock
        self._labels = np.asarray(split.labels) if balanced and not self._sharded else None  # --sampler balanced
        self._units_per_task, self._num_tasks = read_plan(split, rows_per_task)

    @property
    def num_tasks(self) -> int:
        """Read tasks per execution. read_split hands Ray Data this count: with fewer tasks than
        it asked for, it would split their blocks and no longer fuse the read with the augment call."""
        return self._num_tasks

    def get_name(self) -> str:
        return "ReadImages" if not self._sharded else "ReadShardedImages"

    def estimate_inmemory_data_size(self) -> int:
        return self._bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        ray_private.data_limits_from_the_start()  # this process is about to execute the dataset
        epoch = current_epoch(self._clock)  # once an execution: its rows carry it (EPOCH)
        units, shards = ray.get(self._units)
        order = epoch_order(self._n, self._seed, epoch, self._labels) if self._shuffle else np.arange(self._n)
        mean_bytes, per_task = self._bytes / max(1, self._rows), self._units_per_task
        tasks = []
        for start in range(0, self._n, per_task):
            chosen = order[start : start + per_task]
            if self._sharded:
                mine, local = np.unique(units[chosen, 0], return_inverse=True)  # the task's own shards only
                task_units = np.column_stack([local, units[chosen, 1:]])
                order_seed = (self._seed, epoch, start)
                fn = functools.partial(
                    _read_units, task_units, self._shuffle, order_seed, epoch, shards=[shards[i] for i in mine]
                )
                fn = functools.partial(fn, **self._read)
                n_rows = int(units[chosen, -1].sum())
            else:
                fn = functools.partial(_read_files, units.take(chosen), epoch, **self._read)
                n_rows = len(chosen)
            meta = BlockMetadata(
                num_rows=n_rows, size_bytes=int(n_rows * mean_bytes), input_files=None, exec_stats=None
            )
            tasks.append(ReadTask(fn, meta, per_task_row_limit=per_task_row_limit))
        return tasks


def read_plan(split: Split, rows_per_task: int) -> tuple[int, int]:
    """(files or row groups per read task, read tasks) of an execution of `split`: at most
    rows_per_task rows and TASK_BYTES a task, and a few tasks at least."""
    units = len(split.units) if split.grouped else len(split)
    mean_bytes = split.total_bytes / max(1, len(split))
    rows = min(rows_per_task, max(MIN_ROWS_PER_TASK, math.ceil(len(split) / MIN_TASKS)))
    rows = max(1, min(rows, int(TASK_BYTES // max(1.0, mean_bytes))), math.ceil(len(split) / MAX_TASKS))
    per_task = max(1, round(rows / max(1.0, len(split) / max(1, units))))
    return per_task, max(1, math.ceil(units / per_task))


def _check_there(where: str, failed: str, reason: str) -> None:
    """DataGone where `where` (a split's root, a shard's folder) cannot be listed any more: then
    reading `failed` went wrong for a reason that is not the file's, and so would every read."""
    try:
        fs, base, prefix = filesystem(where)
        missing = fs.get_file_info(base).type == pafs.FileType.NotFound
        why = f"{where}: no such {'prefix' if prefix else 'directory'} any more" if missing else None
    except storage.StorageError as e:
        why = str(e)
    except OSError as e:
        why = storage.explain(where, e) if storage.is_uri(where) else f"{where}: {e.strerror or e}"
    if why:
        raise DataGone(
            f"{why}; reading {failed} failed ({reason}), as every image there would; rerun the same command once "
            "the data is back, to resume from the last checkpoint"
        )


def _read_all(fs, paths: list[str], *, threads: bool) -> list:
    """Each file's bytes, or the OSError that reading it raised. Object storage is latency-bound,
    so threads there; and input files: one ranged request for a whole file, a stream one per 256 KiB."""

    def read(path):
        try:
            if threads:
                with fs.open_input_file(path) as f:
                    return f.read()
            with open(storage.disk_path(path), "rb") as f:  # a name that is not UTF-8 comes escaped
                return f.read()
        except OSError as e:  # a bad sector, a stale NFS handle, a file gone: this file's; _read_files sorts it out
            return e

    if not threads:
        return [read(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(read, paths))


def _read_files(rows, epoch: int = 0, *, root, decode, bad_log, relative_paths):
    """A read task: its files' bytes, path, label and key (`rows`: their Arrow table), read for
    `epoch`. A file whose read fails is left out and reported as a bad file with the error;
    DataGone where the split's root itself went (_check_there)."""
    started = time.perf_counter()
    rel = rows.column(PATH).to_pylist()
    fs, base, prefix = filesystem(root)
    top = base.rstrip("/")
    full = [f"{top}/{r}" for r in rel]  # forms/data.py below(base, r), joined here for a task's files at once
    datas = _read_all(fs, full, threads=bool(prefix))
    shown = rel if relative_paths else [prefix + p for p in full]
    failed = [i for i, d in enumerate(datas) if isinstance(d, OSError)]
    unread = [(shown[i], f"cannot read it: {storage.first_line(datas[i])}") for i in failed]
    if failed:
        _check_there(root, prefix + full[failed[0]], unread[0][1])
        keep = np.setdiff1d(np.arange(len(rel)), failed)
        rows, datas, shown = rows.take(keep), [datas[i] for i in keep], [shown[i] for i in keep]
    columns = {
        BYTES: datas,
        PATH: shown,
        LABEL: rows.column(LABEL).to_numpy().astype(np.int64),
        KEY: rows.column(KEY).to_numpy(),
    }
    yield from _blocks(columns, epoch, decode, bad_log, started, unread)


def _read_units(units, shuffle, order_seed, epoch, *, root, shards, form, side, decode, bad_log, relative_paths):
    """A read task of a sharded split: its units (row groups, runs of tar members), their rows
    (those of its side of a hash split) in an order drawn from (seed, epoch, task) so that
    consecutive epochs pair different neighbours."""
    started = time.perf_counter()
    unread: list = []  # what could not be read of the units: (path, reason)
    table = read_units(units, root, shards, form, unread)  # {bytes, path (below root), label, key}
    if unread:
        _check_there(storage.parent(shards[0]), unread[0][0], unread[0][1])
    if side is not None:
        table = table.filter(on_side(table.column(KEY).to_numpy(), side))
    if shuffle:
        table = table.take(stream_rng("unit_order", *order_seed).permutation(table.num_rows))
    rel = table.column(PATH).to_pylist()
    columns = {
        BYTES: table.column(BYTES),  # stays Arrow unless this task decodes (_block)
        PATH: rel if relative_paths else [below(root, r) for r in rel],
        LABEL: table.column(LABEL).to_numpy(),
        KEY: table.column(KEY).to_numpy(),
    }
    yield from _blocks(columns, epoch, decode, bad_log, started, unread)


def _blocks(columns: dict, epoch: int, decode: bool | str, bad_log, started: float, unread=()):
    """The Arrow blocks of a read task for `epoch` (EPOCH): the encoded files, or (decode) the decoded images of
    those that decode, a block per DECODED_BLOCK_BYTES of pixels at most, the rest reported to
    the bad-file log with `unread` (path, reason: what the task could not read); decode="check"
    yields only the bad files, {path, reason}, for the caller to record. Each block's rows carry
    their share of the task's time since `started` (READ_COST; training/bounds.py), the time a
    fused augment call took in between left out."""
    import pyarrow as pa

    datas = columns[BYTES]  # a list of bytes (files), or a prepared shard's Arrow column
    if not decode:
        if not isinstance(datas, pa.ChunkedArray):
            datas = pa.array(datas, type=pa.binary())
        if unread and bad_log is not None:
            bad_log.add.remote(list(unread))  # fire and forget, as below
        cost = seconds_per_row(started, len(datas))
        rows = {BYTES: datas} | {k: columns[k] for k in (PATH, LABEL, KEY)} | {READ_COST: cost}
        yield pa.table(rows | {EPOCH: np.full(len(datas), epoch, dtype=np.int64)})
        return
    images, keep, bad, held, blocks = [], [], list(unread), 0, 0
    for i, data in enumerate(datas.to_pylist() if isinstance(datas, pa.ChunkedArray) else datas):
        try:
            image = decode_image(data)
        except BadImage as e:
            bad.append((str(columns[PATH][i]), str(e)))
            continue
        if decode != "check":
            images.append(image)
            keep.append(i)
            held += image.nbytes
        if held >= DECODED_BLOCK_BYTES:
            yield _decoded_block(columns, images, keep, started, epoch)
            images, keep, held, blocks, started = [], [], 0, blocks + 1, time.perf_counter()
    if decode == "check":
        yield pa.table({PATH: [p for p, _ in bad], REASON: [r for _, r in bad]}, schema=_bad_schema())
        return
    if bad and bad_log is not None:
        bad_log.add.remote(bad)  # fire and forget: the driver reads the log after training
    if images or not blocks:
        yield _decoded_block(columns, images, keep, started, epoch)


def _decoded_block(columns: dict, images: list, keep: list[int], started: float, epoch: int):
    out = {
        IMAGE: stack_images(images),
        LABEL: np.asarray(columns[LABEL])[keep],
        KEY: np.asarray(columns[KEY])[keep],
    }
    out[PATH] = np.asarray(columns[PATH], dtype=object)[keep]
    out[READ_COST] = seconds_per_row(started, len(keep))
    out[EPOCH] = np.full(len(keep), epoch, dtype=np.int64)
    return BlockAccessor.batch_to_block(out)


def read_split(
    split: Split,
    *,
    seed: int = 0,
    shuffle: bool = False,
    clock=None,
    decode=False,
    bad_log=None,
    num_cpus: float = 1.0,
    rows_per_task: int = ROWS_PER_TASK,
    **source_args,
):
    """Ray Dataset of one split's rows (see SplitSource), read by tasks of `num_cpus`."""
    source = SplitSource(
        split,
        seed=seed,
        shuffle=shuffle,
        clock=clock,
        decode=decode,
        bad_log=bad_log,
        rows_per_task=rows_per_task,
        **source_args,
    )
    return ray.data.read_datasource(source, num_cpus=num_cpus, override_num_blocks=source.num_tasks)


def check_decodes(split: Split, *, num_cpus: float) -> dict[str, str]:
    """--strict: decode every file of the split once, now; {path: reason} of those that fail."""
    ds = read_split(split, decode="check", num_cpus=num_cpus)
    bad = {}
    try:
        for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
            bad.update(zip(b[PATH].tolist(), b[REASON].tolist(), strict=True))
    except Exception as e:  # Ray's error of a read task: DataGone's one line, where it is that
        gone = data_gone(str(e))
        if gone:
            raise DataError(gone) from None
        raise
    return bad


def build_datasets(cfg, tree, preset, plan, clock, bad_log=None, decode: DecodePlan | None = None) -> dict:
    """{"train", "val"}: read -> decode -> augment, lazily; each epoch streams them anew.

    Where the augmentation runs (plan.augment_gpus, plan.augment_actors):
    - The default, CPU or GPU: Ray Data tasks. Ray starts a fresh actor pool for every epoch's
      execution (process start and imports each epoch, and on a GPU the CUDA and nvjpeg
      loading again in each actor's first block; docs/design.md, "Choices and where they were
      measured"); task worker processes stay alive between epochs and keep their pipeline
      (augment_task). On CPUs the augment call is fused with the read (one task reads, decodes
      and augments its files). On a GPU each augment task holds a share of it
      (training/stream/stage.py task_resources) and decodes a batch of JPEGs with nvjpeg.
    - --augment-actors N: an actor pool of N per split, on a GPU share each where there is one.
    Nothing is decoded up front (but with --strict): the first step waits for the first batch.
    """
    decode = decode or choose_decode(cfg.decode, tree.train, preset.train, plan.use_gpu, cfg.gpu_decoder)
    out = {}
    for split_name, split in (("train", tree.train), ("val", tree.val)):
        train, rows = split_name == "train", augment_rows(cfg.augment_batch_size, split, decode, plan.use_gpu)
        if cfg.strict:  # decode every file once now, so a bad one stops the run before training
            bad = check_decodes(split, num_cpus=plan.augment_cpus)
            if bad and bad_log is not None:
                ray.get(bad_log.add.remote(sorted(bad.items())))  # recorded before the driver reads the log
        ds = read_split(
            split,
            seed=cfg.seed,
            shuffle=train,
            clock=clock if train else None,
            decode=decode.where == "read",
            bad_log=bad_log,
            num_cpus=plan.augment_cpus,
            rows_per_task=rows,
            balanced=train and cfg.sampler == "balanced",
        )
        args = StageArgs(
            preset,
            train=train,
            seed=cfg.seed,
            schedule=cfg.augment_schedule,  # the stage applies both schedules to train only
            resize=cfg.progressive_resize,
            epochs=cfg.epochs,
            shrink=decode.shrink and train,
            gpu_decoder=cfg.gpu_decoder,
        )
        inputs = read_plan(split, rows)[1] if len(split) else 0
        out[split_name] = add_augment(ds, plan, args, bad_log=bad_log, rows=rows, inputs=inputs)
    return out


class SplitValUnequally(ray.train.DataConfig):
    """Train is split equally (every DDP rank takes the same number of steps); validation is
    split without dropping rows, so every validation image is scored exactly once.

    A single worker gets each dataset whole: it runs the dataset's execution itself, and no
    split coordinator starts (an actor process of its own per split, before the first step)."""

    def __init__(self, world_size: int):
        super().__init__(datasets_to_split=[] if world_size == 1 else "all")
        self.splits = world_size > 1  # ours, not DataConfig's private attribute

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        # Ray Train 2.60 configures one dataset per call
        if set(datasets) != {"val"} or not self.splits:
            return super().configure(datasets, world_size, worker_handles, worker_node_ids, **kwargs)
        splits = datasets["val"].streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
        return [{"val": split} for split in splits]
