"""A train worker's input, watched: the batches of one epoch come through a feed thread and a
one-batch queue (BatchFeed), so that a wait for data that will never come (the train
workers leave Ray Data no room for a task, or Ray reports its tasks waiting for resources)
stops the run with IngestStalled and one line (IngestWatch, StallLimits) instead of hanging.
EpochData strings an epoch's iterator, its feed and the watch together."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import ray
import torch

from augment.streams import stream_seed
from training import ray_private
from training.rows import LABEL
from training.spec import IngestNeeds, StallLimits, WorkerSpec, left_over, tasks_fit
from training.stream.stamp import advance


class IngestStalled(RuntimeError):
    """No batch arrives, and Ray says the data tasks cannot run."""


class IngestWatch:
    """Why no batch arrives: asked by BatchFeed while the trainer waits.

    Starved: the nodes, less what the train workers hold on them, cannot run what Ray Data
    needs at once (one read/augment task, or an augment pool's actors): the condition Ray
    Data reports as "Cluster resources are not enough to run any task", which never clears
    on a cluster that cannot grow. Pending: Ray reports tasks of the data tasks' size that
    wait for a node with room, because other work holds the CPUs. An autoscaling cluster
    may add nodes for either, so there the watch only waits."""

    def __init__(self, ingest: IngestNeeds, worker_nodes: list[str], limits: StallLimits):
        self.worker, self.tasks = tuple(ingest.worker), [tuple(t) for t in ingest.tasks]
        self.autoscaling, self.worker_nodes, self.limits = ingest.autoscaling, worker_nodes, limits

    def check(self, waited_s: float) -> None:
        problem = None
        if not self.autoscaling and waited_s >= self.limits.starved_s:
            problem = self.starved()
        if problem is None and not self.autoscaling and waited_s >= self.limits.pending_s:
            problem = self.pending()
        if problem:
            raise IngestStalled(f"no batch for {waited_s:.0f} s: {problem}")

    def starved(self) -> str | None:
        alive = [n for n in ray.nodes() if n["Alive"]]
        nodes = [(n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0)) for n in alive]
        counts = [self.worker_nodes.count(n["NodeID"]) for n in alive]
        free = left_over(nodes, counts, self.worker)
        if tasks_fit(free, self.tasks):
            return None
        need = ", ".join(f"{c:g} CPU" + (f" + {g:g} GPU" if g else "") for c, g in self.tasks)
        return (
            f"the {len(self.worker_nodes)} train worker(s) hold {self.worker[0]:g} CPU each, which leaves Ray Data "
            f"{', '.join(f'{c:g}' for c, _ in free)} CPU on the node(s), and it needs {need} at once; "
            "lower --num-workers or --cpus-per-worker"
        )

    def pending(self) -> str | None:
        shapes = {(round(c, 4), round(g, 4)) for c, g in self.tasks}
        waiting = sum(
            count
            for bundle, count in ray_private.pending_demands()
            if (round(bundle.get("CPU", 0.0), 4), round(bundle.get("GPU", 0.0), 4)) in shapes
        )
        if not waiting:
            return None
        return (
            f"Ray reports {waiting} data task(s) waiting for a node with the CPUs they need; other work holds "
            "them (see `ray status`); free them or give this job a cluster of its own"
        )


class BatchFeed(contextlib.AbstractContextManager):
    """One epoch's batches, pulled in a thread from the moment the feed is made and handed
    over through a one-batch queue. The train loop makes the first epoch's feed before it
    builds the model, so Ray Data's start (read, decode and augment workers and their
    imports) overlaps the build. While the trainer waits for a batch, `watch` (set before
    iterating) is asked every StallLimits.poll_s whether the data can come at all.

    On a GPU (`device`) the thread also copies each pinned batch to the device, on a stream of
    its own, so that the copy overlaps the step before; the step's stream waits for the copy's
    event before it reads the batch. The thread stops when its consumer is done or fails:
    `close` (also at the end of iteration, and on leaving a `with` block) sets its stop event
    and joins it."""

    _END = object()

    def __init__(self, batches, watch: IngestWatch | None = None, device: torch.device | None = None):
        self.watch = watch
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._stalled = False  # the watch gave up on the source: its thread waits in it for good
        cuda = device is not None and device.type == "cuda"
        self._copy = (device, torch.cuda.Stream(device)) if cuda else None
        self._thread = threading.Thread(target=self._pull, args=(batches,), daemon=True, name="batch-feed")
        self._thread.start()

    def _pull(self, batches) -> None:
        try:
            for batch in batches:
                if not self._put(self._to_device(batch)):
                    return
            self._put(self._END)
        except BaseException as e:  # re-raised in the training thread
            self._put(e)

    def _put(self, item) -> bool:
        """Into the queue, unless the consumer stopped meanwhile (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _to_device(self, batch: dict):
        """On a GPU: (the batch on the device, the copy's event), copied on the feed's stream."""
        if self._copy is None:
            return batch
        device, stream = self._copy
        with torch.cuda.stream(stream):
            moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            event = torch.cuda.Event()
            event.record(stream)
        return moved, event

    def __iter__(self):
        try:
            while (item := self._next()) is not self._END:
                if isinstance(item, BaseException):
                    raise item
                yield self._ready(item)
        finally:
            self.close()

    def _ready(self, item) -> dict:
        if self._copy is None:
            return item
        batch, event = item
        step = torch.cuda.current_stream(self._copy[0])
        step.wait_event(event)  # the step's kernels start once the copy is done; the host does not wait
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                v.record_stream(step)  # the allocator keeps its memory until the step's stream is past it
        return batch

    def close(self, *exc) -> None:
        """Stop the thread (between two batches) and wait for it; also a `with` block's exit. Once
        the watch gave up on the source, the thread waits inside it for a batch that will not come:
        the run stops at once instead of waiting for it (it is a daemon thread)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            self._queue.get_nowait()  # a thread blocked on a full queue sees the stop at once
        if self._thread is not threading.current_thread() and not self._stalled:
            self._thread.join(timeout=10)

    __exit__ = close  # and AbstractContextManager's __enter__ returns the feed

    def _next(self):
        waited = 0.0
        while True:
            timeout = self.watch.limits.poll_s if self.watch else None
            t0 = time.monotonic()
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                waited += time.monotonic() - t0
                try:
                    self.watch.check(waited)
                except IngestStalled:
                    self._stalled = True
                    raise


def train_batches(shard, batch_size: int, device: torch.device, epoch: int, *, seed: int, rank: int, shuffle: bool):
    """One epoch of a rank's training batches from its shard (a Ray DataIterator): uint8 images
    and their columns as CPU tensors (pinned on a GPU, for BatchFeed's copy to `device`).

    - No local shuffle buffer where every epoch already reads the files in a permutation of its
      own (training/stream/ingest.py): consecutive files of a uniform permutation are already a uniform
      random partition into batches, as torch's RandomSampler makes. The buffer only mixes
      (`shuffle`) where the rows come in fixed groups: a prepared split's row groups, whose
      members would otherwise share a batch every epoch (docs/design.md, "Hand-off").
    - The first epoch also goes without block prefetch, so its first step starts on its first
      block; on a GPU, batches are pinned before their copy to the device.
    """
    first = epoch == 0
    return shard.iter_torch_batches(
        batch_size=batch_size,
        device="cpu",  # on a GPU, BatchFeed copies them, on a stream of its own
        local_shuffle_buffer_size=min(4 * batch_size, 2048) if shuffle and not first else None,
        local_shuffle_seed=stream_seed("local_shuffle", seed, epoch, rank),  # per epoch and rank
        prefetch_batches=0 if first else 2,
        pin_memory=device.type == "cuda",
    )


def fold_lone_last(batches, batch_size: int):
    """The batches, with a last batch of one image folded into the one before it: batch norm
    cannot train on one value per channel, which a lone image gives it wherever a feature map
    is 1 x 1 (torchvision's ResNet stem at 32 px). Every rank has the same number of rows (the
    equal split), so every rank folds alike and takes the same number of steps. Holds one batch
    back to see the end."""
    held = None
    for batch in batches:
        if held is not None and batch_size > 1 and len(batch[LABEL]) == 1:
            batch = {k: torch.cat([held[k], v]) for k, v in batch.items()}
        elif held is not None:
            yield held
        held = batch
    if held is not None:
        yield held


class EpochData:
    """This rank's batches: a feed per training epoch, the validation split at each evaluation."""

    def __init__(self, spec: WorkerSpec, rank: int, device: torch.device):
        cfg = spec.config
        self.clock, self.cfg, self.rank, self.device = spec.clock, cfg, rank, device
        self.per_worker = spec.batch_per_worker
        self.train = ray.train.get_dataset_shard("train")
        self.shuffle = spec.rows_grouped
        # "val" is asked for at the first validation: with several workers, its split
        # coordinator (one more process) starts after the first steps
        self.val = None
        self.watch: IngestWatch | None = None  # set once the ranks' nodes are known

    def feed(self, epoch: int) -> BatchFeed:
        if self.rank == 0:  # before this rank asks for the epoch's data: the split barrier holds the others
            advance(self.clock, epoch)
        batches = train_batches(
            self.train, self.per_worker, self.device, epoch, seed=self.cfg.seed, rank=self.rank, shuffle=self.shuffle
        )
        return BatchFeed(fold_lone_last(batches, self.per_worker), self.watch, self.device)

    def validation(self) -> BatchFeed:
        """The validation batches, through a feed watched for a stall as training's is."""
        if self.val is None:  # every rank asks at once: a barrier
            self.val = ray.train.get_dataset_shard("val")
        pinned = self.device.type == "cuda"
        batches = self.val.iter_torch_batches(batch_size=self.per_worker, device="cpu", pin_memory=pinned)
        return BatchFeed(batches, self.watch, self.device)
