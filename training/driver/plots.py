"""PNG plots of a run: learning curves and the confusion matrix (matplotlib, Agg, no display)."""

from __future__ import annotations

import io
import os

from training import storage
from training.records import EpochRecord


def _figure_bytes(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def curves_png(epochs: list[EpochRecord]) -> bytes:
    """Loss and accuracy per epoch, train beside validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [e.epoch for e in epochs]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_loss.plot(x, [e.train.loss for e in epochs], "o-", label="train")
    ax_loss.plot(x, [e.val.loss for e in epochs], "o-", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_acc.plot(x, [e.train.acc for e in epochs], "o-", label="train (augmented)")
    ax_acc.plot(x, [e.val.acc for e in epochs], "o-", label="validation top-1")
    if epochs[0].val.top5 is not None:
        ax_acc.plot(x, [e.val.top5 for e in epochs], "o--", label="validation top-5")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    return _figure_bytes(fig)


def confusion_png(confusion: list[list[int]], class_names: list[str]) -> bytes:
    """Rows: true class; columns: predicted; each cell the count, coloured by row share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    counts = np.asarray(confusion)
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    n = len(class_names)
    side = min(2 + 0.45 * n, 30)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    if n <= 40:  # beyond that the labels are unreadable; the colours still show the pattern
        ax.set_xticks(range(n), class_names, rotation=90)
        ax.set_yticks(range(n), class_names)
        for i in range(n):
            for j in range(n):
                if counts[i, j]:
                    ax.text(
                        j,
                        i,
                        str(counts[i, j]),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if share[i, j] > 0.5 else "black",
                    )
    ax.set(xlabel="predicted", ylabel="true", title="validation confusion matrix")
    return _figure_bytes(fig)


def scalar_tag(key: str) -> str:
    """A metrics.csv or timings.csv column's TensorBoard tag: train/..., val/..., or run/..."""
    groups = {"train_": "train/", "val_": "val/"}
    prefix = next((p for p in groups if key.startswith(p)), None)
    return groups[prefix] + key[len(prefix) :] if prefix else f"run/{key}"


def write_tensorboard(run_dir: str, epochs: list[EpochRecord]) -> str | None:
    """TensorBoard event files under RUN_DIR/tensorboard, one scalar per metrics.csv and timings.csv
    column per epoch, when torch's SummaryWriter (needs `tensorboard`) or `tensorboardX` imports.

    Written once, by the driver, after training: the workers' hot loop stays free of it.
    The events go to a local temporary directory first and are then copied, so RUN_DIR may
    be s3:// or gs://. Returns the directory written, or None when neither library is there.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
    with storage.staging_dir() as tmp:
        writer = SummaryWriter(log_dir=tmp)
        for record in sorted(epochs, key=lambda e: e.epoch):
            epoch = record.epoch
            for key, value in (record.metrics_row() | record.timings_row()).items():
                if key == "epoch" or not isinstance(value, (int, float)):
                    continue
                writer.add_scalar(scalar_tag(key), value, global_step=epoch)
        writer.close()
        out = storage.join(run_dir, "tensorboard")
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                storage.write_bytes(storage.join(out, name), f.read())
    return out


def sweep_png(rows: list[dict], params: list[str], metric: str) -> bytes:
    """A sweep's `metric` against each swept setting, one panel a setting (a log axis for a
    range over more than a decade; names and flags as categories)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(params), 1), figsize=(4 * max(len(params), 1), 3.4), squeeze=False)
    for ax, param in zip(axes[0], params, strict=False):
        values = [r[param] for r in rows]
        scores = [r[metric] for r in rows]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric:
            ax.scatter(values, scores)
            positive = [v for v in values if v > 0]
            if len(positive) == len(values) and max(values) > 10 * min(values):
                ax.set_xscale("log")
        else:
            names = sorted({str(v) for v in values})
            ax.scatter([names.index(str(v)) for v in values], scores)
            ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set(xlabel=param, ylabel=metric)
        ax.grid(alpha=0.3)
    return _figure_bytes(fig)
