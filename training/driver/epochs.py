"""The driver's epoch callbacks (training.fit's `callbacks`): a thread reads the epoch records rank 0
hands the run's RunStatus actor (training/status.py driver_verdict), calls each callback in epoch
order with the typed record, and answers the ranks, who wait for it: STOP from any callback ends the
run after that epoch. An epoch trained again after a fault is not handed on twice (its first verdict
stands). A callback that raises is said once, in one warning line, and left out from then on: a
tracker that fails costs a line, never the training.

    with EpochFollower(status, [tracker, stop_rule], warn=log):
        trainer.fit()
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Union

from training.records import EpochRecord
from training.status import PROGRESS_INTERVAL_S, STOP


class HasOnEpochEnd(Protocol):
    def on_epoch_end(self, record: EpochRecord) -> Any: ...


EpochCallback = Union[Callable[[EpochRecord], Any], HasOnEpochEnd]  # returns STOP to end the run


def call_name(callback) -> str:
    return getattr(callback, "__qualname__", None) or type(callback).__name__


class EpochFollower:
    """See the module's docstring. `read(seen)` gives the records after the first `seen`;
    `decide(epoch, verdict)` answers the ranks (RunStatus's actor methods)."""

    def __init__(self, read, decide, callbacks, *, warn, read_steps=None, interval_s: float = PROGRESS_INTERVAL_S / 5):
        self.read, self.decide, self.warn, self.interval_s = read, decide, warn, interval_s
        self.read_steps = read_steps  # RunStatus.steps_since: rank 0's --log-every figures, for on_step
        self.callbacks = list(callbacks)
        self.seen, self.done, self.steps_seen = 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="epoch-callbacks")

    def __enter__(self) -> "EpochFollower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        from ray.exceptions import RayError

        try:
            records = self.read(self.seen)
            steps = self.read_steps(self.steps_seen) if self.read_steps else []
        except RayError:  # the run is ending
            return
        self.steps_seen += len(steps)
        for point in steps:
            self.call(point, "on_step")
        self.seen += len(records)
        for record in records:
            if record.epoch <= self.done:  # trained again after a fault: its verdict stands
                continue
            self.done = record.epoch
            self.decide(record.epoch, self.call(record))

    def call(self, record, hook: str = "on_epoch_end") -> str:
        """Each callback's `hook` (a plain callable is an on_epoch_end) with `record`; STOP or "go"."""
        verdict = "go"
        for callback in list(self.callbacks):
            fn = getattr(callback, hook, callback if hook == "on_epoch_end" and callable(callback) else None)
            if fn is None:
                continue
            try:
                if fn(record) == STOP:
                    verdict = STOP
            except Exception as e:  # noqa: BLE001  (the user's code: whatever it raises)
                self.callbacks.remove(callback)
                self.warn(
                    f"warning: epoch callback {call_name(callback)} failed at epoch {getattr(record, 'epoch', '?')} "
                    f"({type(e).__name__}: {str(e)[:200]}); the run goes on without it"
                )
        return verdict
