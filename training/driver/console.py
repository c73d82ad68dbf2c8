"""What a run prints: the resolved config at start, one progress bar per epoch, the epoch
lines, a summary table at the end.

The driver owns the console, and this module only draws. Train workers post their progress and
rank 0 each finished epoch's line to the run's status (training/status.py RunStatus, a tiny
actor). On the driver a `ConsoleFollower` thread reads it while the trainer runs, draws one tqdm
bar per epoch on its own terminal (global images, img/s, running loss, ETA) and prints the
epoch lines, closing the bar first so the two never share a line; the driver's own lines (a
fault, a new plan) go straight to the follower's `say`. Why not Ray's `tqdm_ray`: its driver-side bar asks
the terminal for its width and draws nothing where the terminal reports 0 columns (a pseudo-
terminal without a window size, as `script` makes from a non-terminal), and a Ray Train
worker reaches it only through its internals (docs/design.md, "Console").

The bar is drawn only when the driver's stderr is a terminal: log files and `ray job logs`
(the driver's output) get the epoch lines alone.
"""

from __future__ import annotations

import json
import os
import threading

from training.status import PROGRESS_INTERVAL_S


def format_config(config: dict, sources: dict | None = None) -> str:
    """The resolved config, one setting a line; settings from a --config file or a flag are
    marked, the rest are defaults."""
    sources = sources or {}
    width = max(len(k) for k in config)
    lines = ["config:"]
    for key, value in config.items():
        shown = json.dumps(value) if isinstance(value, (bool, type(None))) or value == "" else str(value)
        mark = f"  ({sources[key]})" if key in sources else ""
        lines.append(f"  {key:<{width}}  {shown}{mark}")
    return "\n".join(lines)


def terminal_size(stream) -> tuple[int, int]:
    """(columns, lines) of the terminal; 80 x 24 where it reports none (0 x 0: a pseudo-terminal
    without a window size), on which tqdm's own detection would draw nothing at all."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 80, 24
    return size.columns or 80, size.lines or 24


class ConsoleFollower:
    """The driver's side, around trainer.fit(): a thread reads the run's status every interval_s, draws
    the current epoch's bar on `stream` (None: no bar) and hands rank 0's lines to `log`.

        read = lambda seen: ray.get(status.read.remote(seen))   # RunStatus.read, on its actor
        with ConsoleFollower(read, total=len(tree.train), epochs=cfg.epochs, log=log, stream=sys.stderr):
            result = trainer.fit()

    `sizes` (one per epoch), when given, puts each epoch's training resolution in the bar."""

    def __init__(self, read, *, total, epochs, log, stream=None, sizes=None, interval_s=PROGRESS_INTERVAL_S):
        self.read, self.total, self.epochs, self.log, self.stream = read, total, epochs, log, stream
        self.sizes, self.interval_s = sizes, interval_s
        self._lines_seen, self._done_epoch, self._bar, self._bar_epoch = 0, -1, None, None
        self._stop, self._lock = threading.Event(), threading.Lock()  # the lock: one writer on the terminal
        self._thread = threading.Thread(target=self._run, daemon=True, name="console")

    def __enter__(self) -> "ConsoleFollower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # lines posted between the thread's last read and the end of the run
        self._close_bar()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def say(self, line: str) -> None:
        """The driver's own line (a fault, a new plan): printed now, the bar closed first."""
        with self._lock:
            self._close_bar()
            self.log(line)

    def poll(self) -> None:
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        from ray.exceptions import RayError

        try:
            ranks, lines = self.read(self._lines_seen)
        except RayError:  # the run is ending; the last poll in __exit__ tries again
            return
        self._lines_seen += len(lines)
        if lines:  # the finished epochs' last counts first, then their lines, then what came after
            last = max(epoch for epoch, _ in lines)
            self._draw({rank: post for rank, post in ranks.items() if post[0] <= last})
        for epoch, line in lines:
            self._close_bar()
            self._done_epoch = max(self._done_epoch, epoch)
            self.log(line)
        self._draw(ranks)

    def _draw(self, ranks: dict) -> None:
        if self.stream is None or not ranks:
            return
        epoch = max(e for e, _, _ in ranks.values())
        if epoch <= self._done_epoch:  # a late post for an epoch whose line is out
            return
        images = sum(n for e, n, _ in ranks.values() if e == epoch)
        loss_sum = sum(s for e, _, s in ranks.values() if e == epoch)
        if self._bar is None or self._bar_epoch != epoch or images < self._bar.n:  # (a restart repeats an epoch)
            self._open_bar(epoch, images)  # from the first count: img/s counts what follows
        bar = self._bar
        bar.ncols, bar.nrows = terminal_size(self.stream)  # follows a resized window
        bar.set_postfix_str(f"loss {loss_sum / max(images, 1):.4f}", refresh=False)
        if images > bar.n:
            bar.update(images - bar.n)  # redraws
        else:
            bar.refresh()  # elapsed time and ETA move on

    def _open_bar(self, epoch: int, images: int) -> None:
        from tqdm import tqdm

        self._close_bar()
        desc = f"epoch {epoch + 1}/{self.epochs}"
        if self.sizes and epoch < len(self.sizes):
            desc += f" {self.sizes[epoch]}px"
        ncols, nrows = terminal_size(self.stream)
        self._bar = tqdm(
            total=self.total,
            initial=images,
            desc=desc,
            unit="img",
            unit_scale=True,
            file=self.stream,
            ncols=ncols,
            nrows=nrows,
            leave=False,  # the epoch line takes its place
            mininterval=0,
            miniters=1,  # every update the driver reads is drawn
        )
        self._bar_epoch = epoch

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar, self._bar_epoch = None, None


def _fmt(value, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f} %"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _trained(summary: dict) -> str:
    """The training images: those trained on, and the files found that did not decode."""
    found, trained = summary.get("train_images"), summary.get("train_images_trained", summary.get("train_images"))
    return f"{trained} (+{found - trained} unreadable)" if found != trained else str(trained)


def summary_table(summary: dict, *, max_classes: int = 20) -> str:
    """The end-of-run table from summary.json's figures (missing ones are left out)."""
    rows = [
        ("epochs", summary.get("epochs")),
        (
            "validation accuracy",
            f"{_fmt(summary.get('val_acc'))} (epoch {summary['epochs']}: model.pt)"
            if "best_epoch" in summary
            else _fmt(summary.get("val_acc")),
        ),
        (
            "best validation accuracy",
            f"{_fmt(summary.get('best_val_acc'))} (epoch {summary['best_epoch']}: model_best.pt)"
            if "best_epoch" in summary
            else _fmt(summary.get("best_val_acc")),
        ),
        ("validation top-5", _fmt(summary.get("val_top5")) if "val_top5" in summary else None),
        ("validation loss", _fmt(summary.get("val_loss"))),
        (
            "train loss / accuracy",
            f"{_fmt(summary.get('train_loss'))} / {_fmt(summary.get('train_acc'))}"
            if "train_loss" in summary
            else None,
        ),
        ("train images/s", f"{summary['train_images_per_s']:,.1f}" if "train_images_per_s" in summary else None),
        ("waiting for data", _fmt(summary.get("data_wait_frac"), pct=True) if "data_wait_frac" in summary else None),
        ("wall time", f"{summary['wall_s']:,.1f} s" if "wall_s" in summary else None),
        (
            "start-up (to first step)",
            f"{summary['startup_s']:,.1f} s" if summary.get("startup_s") is not None else None,
        ),
        (
            "workers x device",
            f"{summary.get('world_size')} x {summary.get('device')}" if "world_size" in summary else None,
        ),
        (
            "classes / train / val images",
            f"{summary.get('num_classes')} / {_trained(summary)} / {summary.get('val_images')}"
            if "num_classes" in summary
            else None,
        ),
    ]
    rows = [(k, v) for k, v in rows if v is not None]
    per_class = summary.get("per_class_val_acc") or {}
    if per_class:
        ranked = sorted(per_class.items(), key=lambda kv: (kv[1] is None, kv[1] if kv[1] is not None else 0))
        shown = ranked if len(ranked) <= max_classes else ranked[:max_classes]
        title = "per-class val acc" if len(ranked) <= max_classes else f"worst {max_classes} classes, val acc"
        for i, (name, acc) in enumerate(shown):
            rows.append((title if i == 0 else "", f"{name}: {_fmt(acc)}"))
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(str(v)) for _, v in rows)
    rule = f"+-{'-' * width}-+-{'-' * vwidth}-+"
    body = [f"| {k:<{width}} | {str(v):<{vwidth}} |" for k, v in rows]
    return "\n".join([rule, *body, rule])
