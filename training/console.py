"""What a run prints: the resolved config at start, one progress bar per epoch, a summary
table at the end.

The bar runs on rank 0 inside a Ray Train worker. There it draws through Ray's driver-side
bar manager (`ray.experimental.tqdm_ray`), so the driver's console shows one bar, updated
in place, rather than lines forwarded from a worker; in a plain process it is an ordinary
tqdm bar on stderr. On a console that is not a terminal (a log file, `ray job logs`) the
caller passes enabled=False and the per-epoch lines alone remain.
"""

from __future__ import annotations

import json
import logging
import sys
import time


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


def quiet_train_reports() -> None:
    """Ray Train logs every ray.train.report (a whole TrainingReport) at INFO through a logger
    that LoggingConfig's level does not reach: it filters "ray.train.*" names, and the
    worker's root logger takes INFO. Call in the train worker."""
    from training import ray_private

    ray_private.train_report_logger().setLevel(logging.WARNING)


class _RayWorkerBar:
    """tqdm_ray's bar, writing its state lines with sys.stdout.write: tqdm_ray uses print(),
    which Ray Train redirects into its logger inside workers (dropped at level WARNING)."""

    def __init__(self, desc: str, total: int, unit: str):
        from ray.experimental import tqdm_ray

        self._bar = tqdm_ray.tqdm(desc=desc, total=total, unit=unit)

    def _emit(self) -> None:
        # the driver's log monitor recognises the state by its magic token and draws the bar
        sys.stdout.write(json.dumps(self._bar._get_state()) + "\n")
        sys.stdout.flush()

    def set_description(self, desc: str) -> None:
        self._bar._desc = desc

    def update(self, n: int) -> None:
        self._bar._x += n
        self._emit()

    def close(self) -> None:
        self._bar._closed = True
        self._emit()


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE
    except (ImportError, AttributeError):
        return False


class EpochProgress:
    """One bar for one epoch: global images, img/s, the running loss, ETA.

        bar = EpochProgress(train_size, epoch, epochs, world_size=world, enabled=master and progress)
        for batch in batches:
            ...
            bar.update(y.shape[0], loss)   # cheap: reads the loss (a host sync) at most every interval_s
        bar.close(row)                     # row: the epoch's metrics; the bar keeps its last state

    `n_images` is this rank's batch; the bar counts world_size times that (DDP ranks step
    together), so it shows global images and img/s.
    """

    def __init__(
        self,
        total_images: int,
        epoch: int,
        epochs: int,
        *,
        world_size: int = 1,
        enabled: bool = True,
        interval_s: float = 1.0,
    ):
        self.enabled = enabled
        if not enabled:
            return
        self.epoch, self.epochs, self.world = epoch, epochs, max(1, world_size)
        self.interval_s = interval_s
        self._pending, self._last = 0, time.monotonic()
        desc = self._desc(None)
        if _in_ray_worker():
            self._bar = _RayWorkerBar(desc, total_images, "img")
        else:
            from tqdm import tqdm

            self._bar = tqdm(
                desc=desc,
                total=total_images,
                unit="img",
                unit_scale=True,
                dynamic_ncols=True,
                file=sys.stderr,
                leave=True,
            )

    def _desc(self, loss) -> str:
        text = f"epoch {self.epoch + 1}/{self.epochs}"
        return text if loss is None else f"{text} loss {loss:.4f}"

    def update(self, n_images: int, loss=None) -> None:
        if not self.enabled:
            return
        self._pending += n_images * self.world
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        if loss is not None:
            self._bar.set_description(
                self._desc(float(loss))
            )  # float() of a device tensor: a host sync, once per interval
        self._bar.update(self._pending)
        self._pending = 0

    def close(self, row: dict | None = None) -> None:
        if not self.enabled:
            return
        if row and "train_loss" in row:
            self._bar.set_description(self._desc(row["train_loss"]))
        self._bar.update(self._pending)
        self._pending = 0
        self._bar.close()


def _fmt(value, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f} %"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def summary_table(summary: dict, *, max_classes: int = 20) -> str:
    """The end-of-run table from summary.json's figures (missing ones are left out)."""
    rows = [
        ("epochs", summary.get("epochs")),
        ("validation accuracy", _fmt(summary.get("val_acc"))),
        ("best validation accuracy", _fmt(summary.get("best_val_acc"))),
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
            f"{summary.get('num_classes')} / {summary.get('train_images')} / {summary.get('val_images')}"
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
