"""A picture of what the model sees: originals beside their augmentations.

Rows are images (one class after another); the columns are the original photo, the eval
view, then the train view at epochs 0, 1, ... (each epoch draws new parameters, exactly
as training would for that image with that seed).
"""

from __future__ import annotations

import numpy as np
import torch

from augment.decode import BadImage, decode_image
from augment.pipeline import Pipeline, to_canvas
from augment.presets import Preset


def read_examples(
    split, *, classes: int, per_class: int, skipped: list | None = None, read=None
) -> tuple[list[np.ndarray], list[int], list[int]]:
    """The first `per_class` files (in path order) of each of the first `classes` labels that read
    and decode: decoded images, labels and keys, read the way training reads them (any pyarrow
    filesystem; `read(fs, path) -> bytes` where given: training.storage.read_file, which also opens a
    local name that is not UTF-8). A file that does not is passed over, and added to `skipped` as
    (path, reason)."""
    import pyarrow.fs as pafs

    def read_all(fs, path: str) -> bytes:
        with fs.open_input_file(path) as f:
            return f.read()

    chosen: dict[int, list[tuple[int, np.ndarray]]] = {}
    paths = split.paths
    for i in sorted(range(len(split)), key=lambda i: paths[i]):
        label = int(split.labels[i])
        if label >= classes or len(chosen.setdefault(label, [])) >= per_class:
            continue
        fs, path = pafs.FileSystem.from_uri(paths[i]) if "://" in paths[i] else (pafs.LocalFileSystem(), paths[i])
        try:
            chosen[label].append((i, decode_image((read or read_all)(fs, path))))
        except (OSError, BadImage) as e:
            if skipped is not None:
                skipped.append((paths[i], str(e) if isinstance(e, BadImage) else f"cannot read it: {e}"))
    picks = [pick for label in sorted(chosen) for pick in chosen[label]]
    return [im for _, im in picks], [int(split.labels[i]) for i, _ in picks], [int(split.keys[i]) for i, _ in picks]


def augment_views(
    images: list[np.ndarray], keys: list[int], preset: Preset, *, seed: int, augmentations: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(eval views (N, S, S, 3), [train views (N, S, S, 3) for epochs 0..augmentations-1])."""
    ragged = np.empty(len(images), dtype=object)
    ragged[:] = images
    canvas, sizes = to_canvas(ragged)
    k = torch.tensor(keys, dtype=torch.int64)
    eval_views = Pipeline(preset.eval, seed=seed)(canvas, sizes, k, epoch=0).numpy()
    train = Pipeline(preset.train, seed=seed)
    return eval_views, [train(canvas, sizes, k, epoch=e).numpy() for e in range(augmentations)]


def render_grid(
    images,
    labels,
    class_names,
    preset: Preset,
    out_path: str,
    *,
    keys=None,
    seed: int = 0,
    augmentations: int = 5,
    cell_inches: float = 1.3,
    dpi: int = 80,
) -> str:
    """Write the grid as a PNG to out_path; returns out_path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(range(len(images))) if keys is None else list(keys)
    eval_views, train_views = augment_views(images, keys, preset, seed=seed, augmentations=augmentations)
    cols = 2 + augmentations
    fig, axes = plt.subplots(
        len(images), cols, figsize=(cols * cell_inches, len(images) * cell_inches * 1.08), squeeze=False
    )
    headers = ["original", "eval"] + [f"train, epoch {e}" for e in range(augmentations)]
    for r, (img, label) in enumerate(zip(images, labels, strict=True)):
        row = [img, eval_views[r]] + [v[r] for v in train_views]
        for c, (ax, view) in enumerate(zip(axes[r], row, strict=True)):
            ax.imshow(view, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(headers[c], fontsize=8)
        h, w = img.shape[:2]
        axes[r][0].set_ylabel(f"{class_names[label]}\n{w}x{h}", fontsize=8)
    fig.suptitle(f"preset {preset.name!r}: what the model sees (seed {seed})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=dpi)
    plt.close(fig)
    return out_path
