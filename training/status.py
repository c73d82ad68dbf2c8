"""The run's status while the trainer runs: what the train workers tell the driver (RunStatus, an
actor on the driver's node), and a rank's side of it (EpochProgress, say). The driver reads it:
training/driver/console.py draws the bar and prints the lines, training/driver/job.py reads the progress and
the last checkpoint after a fault. Light: Ray only where a worker calls `say`."""

from __future__ import annotations

import time

from training.records import StepFigures

PROGRESS_INTERVAL_S = 0.5  # how often a rank posts its progress, and the driver redraws
STOP = "stop"  # an epoch callback's verdict (training/driver/epochs.py): end the run after this epoch
VERDICT_POLL_S = 0.05  # how often the ranks ask for the driver's verdict on an epoch


class RunStatus:
    """What the train workers tell the driver while the trainer runs, run as an actor with num_cpus=0
    beside the driver: each rank's progress in its epoch, rank 0's lines, and the last checkpoint
    Ray Train registered (where a restart or a rerun resumes)."""

    def __init__(self):
        self.ranks: dict[int, tuple[int, int, float]] = {}  # rank -> (epoch, images, loss sum) so far
        self.lines: list[tuple[int, str]] = []  # (epoch, line) in the order rank 0 finished them
        self.checkpoint: str | None = None  # the last checkpoint registered: where a restart resumes
        self.records: list = []  # rank 0's EpochRecords, for the driver's epoch callbacks (training/driver/epochs.py)
        self.verdicts: dict[int, str] = {}  # epoch (1-based) -> the callbacks' verdict: STOP or "go"
        self.steps: list[dict] = []  # rank 0's figures every --log-every steps (StepLog), for the trackers
        self.groups: dict = {}  # id -> the placement group an attempt's ranks trained in (`placed`)

    def post(self, rank: int, epoch: int, images: int, loss_sum: float) -> None:
        self.ranks[rank] = (epoch, images, loss_sum)

    def say(self, epoch: int, line: str) -> None:
        self.lines.append((epoch, line))

    def read(self, lines_seen: int) -> tuple[dict, list]:
        return self.ranks, self.lines[lines_seen:]

    def record(self, record) -> None:
        self.records.append(record)

    def records_since(self, seen: int) -> list:
        return self.records[seen:]

    def step(self, point: StepFigures) -> None:
        self.steps.append(point)

    def steps_since(self, seen: int) -> list:
        return self.steps[seen:]

    def decide(self, epoch: int, verdict: str) -> None:
        self.verdicts[epoch] = verdict

    def verdict(self, epoch: int) -> str | None:
        return self.verdicts.get(epoch)

    def placed(self, group) -> None:
        self.groups[group.id.hex()] = group

    def take_groups(self) -> list:
        """The placement groups the ranks said they trained in since the last call (the driver
        removes them after each attempt: training/driver/faults.py release_groups)."""
        groups, self.groups = list(self.groups.values()), {}
        return groups

    def new_attempt(self) -> None:
        """The trainer (re)starts: the ranks' counts so far belong to the attempt that failed."""
        self.ranks = {}

    def checkpointed(self, path: str) -> None:
        """Ray Train's controller registered this checkpoint (training/driver/faults.py, CheckpointNotice)."""
        self.checkpoint = path

    def last_checkpoint(self) -> str | None:
        return self.checkpoint


class EpochProgress:
    """One rank's side of an epoch's bar: counts its images and posts them with its running loss
    sum at most every interval_s, through `post` (RunStatus.post's actor method: a call
    whose reply nobody waits for).

        bar = EpochProgress(status.post.remote, rank=rank, epoch=epoch)
        for batch in batches:
            ...
            bar.update(y.shape[0], sums)   # sums[0]: this rank's loss x images so far, on the device
        bar.close()                        # the epoch's last count
    """

    def __init__(
        self, post, *, rank: int, epoch: int, enabled: bool = True, interval_s=PROGRESS_INTERVAL_S, steps=None
    ):
        self.post, self.rank, self.epoch, self.enabled, self.steps = post, rank, epoch, enabled, steps
        self.interval_s, self.images, self._sums, self._last = interval_s, 0, None, time.monotonic()
        if enabled:  # the epoch has begun: a fault from now on is this epoch's (training/driver/faults.py)
            self._post()

    def update(self, n_images: int, sums) -> None:
        if self.steps is not None:
            self.steps.update(self.epoch, n_images, sums)
        if not self.enabled:
            return
        self.images, self._sums = self.images + n_images, sums
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._post()

    def _post(self) -> None:
        loss_sum = float(self._sums[0]) if self._sums is not None else 0.0  # a host sync, once per interval
        self.post(self.rank, self.epoch, self.images, loss_sum)

    def close(self) -> None:
        if self.enabled:
            self._post()


class StepLog:
    """Rank 0's figures every `every` steps for the driver's trackers (--log-every, training/driver/tracking.py):
    the loss over those steps, the learning rate (`lr()`) and images/s, posted without waiting. Reading
    the loss is a host sync, once every `every` steps. `step` counts from `first_step`, the run's
    steps before this attempt's first epoch (`steps_per_epoch` each)."""

    def __init__(self, post, every: int, lr, *, steps_per_epoch: int, first_epoch: int):
        self.post, self.every, self.lr, self.steps_per_epoch = post, every, lr, steps_per_epoch
        self.epoch, self.in_epoch, self.images, self.loss_sum, self.at = first_epoch, 0, 0, 0.0, time.monotonic()

    def update(self, epoch: int, n_images: int, sums) -> None:
        if epoch != self.epoch:
            self.epoch, self.in_epoch, self.images, self.loss_sum = epoch, 0, 0, 0.0
        self.in_epoch += 1
        self.images += n_images
        if self.in_epoch % self.every:
            return
        loss_sum, now = float(sums[0]), time.monotonic()  # the host sync, once every `every` steps
        window = max(self.images, 1)
        self.post(
            StepFigures(
                step=self.epoch * self.steps_per_epoch + self.in_epoch,
                epoch=self.epoch + 1,
                loss=(loss_sum - self.loss_sum) / window,
                lr=float(self.lr()),
                images_per_s=self.images / max(now - self.at, 1e-9),
            )
        )
        self.images, self.loss_sum, self.at = 0, loss_sum, now


def tell_group(status) -> None:
    """A rank tells the run's status the placement group it runs in (Ray Train's, for the worker
    group), and waits for the status to have it: the driver removes it once the attempt has
    ended, however short the attempt. A status actor that is gone loses the group, not the run."""
    import ray

    group = ray.util.get_current_placement_group()
    if group is None:
        return
    try:
        ray.get(status.placed.remote(group))
    except ray.exceptions.RayActorError:
        pass


def say(status, line: str, epoch: int = -1) -> None:
    """A worker's line for the run's console, through `status` (the RunStatus actor): the driver
    prints it after closing the bar of `epoch` when the line ends one. A status actor that is gone
    loses the line, not the run."""
    import ray

    try:
        ray.get(status.say.remote(epoch, line))
    except ray.exceptions.RayActorError:
        pass


def driver_verdict(status, record, *, rank: int, timeout_s: float = 600.0) -> str:
    """After an epoch, where the driver has epoch callbacks: rank 0 hands it the epoch's record, and
    every rank waits for its verdict (STOP or "go"), so that all ranks end the run at the same epoch.
    A driver that does not answer within `timeout_s` is taken as "go"."""
    import ray

    if rank == 0:
        status.record.remote(record)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        verdict = ray.get(status.verdict.remote(record.epoch))
        if verdict is not None:
            return verdict
        time.sleep(VERDICT_POLL_S)
    return "go"


class BadFileLog:
    """Collects (path, reason) of files that failed to decode, from every decoder; run as an
    actor with num_cpus=0. Decoders call it only when a batch has a bad file."""

    def __init__(self):
        self.bad: dict[str, str] = {}

    def add(self, rows: list[tuple[str, str]]) -> None:
        for path, reason in rows:
            self.bad.setdefault(path, reason)  # a file fails every epoch; keep it once

    def get(self) -> dict[str, str]:
        return dict(self.bad)
