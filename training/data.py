"""Image tree -> labelled Ray Datasets.

The one place that knows the on-disk layout (docs/design.md, "Contracts"):

    DIR/train/<class>/...  +  DIR/val/<class>/...      explicit split
    DIR/<class>/...                                    hash split by relative path

Scanning happens on the driver, before Ray starts work, so every problem with the
tree is reported as a `DataError` (exit 2) naming the path and the fix. Reading and
decoding happen in Ray Data: files -> Arrow blocks with columns

    image  uint8 HWC (a fixed-shape tensor column when a block's images agree in
           size, variable-shaped otherwise)
    label  int64, position of the class name in the sorted class list
    key    int64, stable hash of the path relative to DIR; seeds per-image augmentation
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from pathlib import Path, PurePosixPath

import numpy as np

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class DataError(ValueError):
    """A problem with the user's data that the user can fix; the message says how."""


def stable_hash(text: str) -> int:
    """63-bit hash of a string, identical on every machine and Python process."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def in_validation(rel_path: str, val_fraction: float) -> bool:
    """The hash split: a file is in validation iff its path hash falls below the fraction."""
    return stable_hash(rel_path) / 2**63 < val_fraction


@dataclasses.dataclass(frozen=True)
class Split:
    """One side of the split: files and their labels, all relative to the tree's root."""

    paths: tuple[str, ...]  # absolute paths or URIs, as Ray Data will read them
    labels: tuple[int, ...]
    keys: tuple[int, ...]  # stable_hash of the path relative to the root
    total_bytes: int  # encoded bytes on storage

    def __len__(self) -> int:
        return len(self.paths)


@dataclasses.dataclass(frozen=True)
class ImageTree:
    root: str
    layout: str  # "train/val" or "hash"
    class_names: tuple[str, ...]
    train: Split
    val: Split

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def describe(self) -> str:
        return (
            f"{self.root}: {self.num_classes} classes, {len(self.train)} train / "
            f"{len(self.val)} val images ({self.layout} split)"
        )


def _filesystem(root: str):
    """(pyarrow filesystem, path inside it, prefix that turns such a path into a URI)."""
    import pyarrow.fs as pafs

    if "://" in root:
        fs, path = pafs.FileSystem.from_uri(root)
        scheme = root.split("://", 1)[0]
        return fs, path.rstrip("/"), f"{scheme}://"
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(root)), ""


def _list_images(fs, directory: str) -> list[tuple[str, int]]:
    """(path, size) of every image below `directory`, hidden files and folders skipped."""
    import pyarrow.fs as pafs

    out = []
    for info in fs.get_file_info(pafs.FileSelector(directory, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = PurePosixPath(info.path).relative_to(directory)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if rel.suffix.lower() in IMAGE_EXTENSIONS:
            out.append((info.path, info.size or 0))
    out.sort()
    return out


def _class_dirs(fs, directory: str) -> list[str]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(directory, recursive=False))
    return sorted(
        PurePosixPath(i.path).name
        for i in infos
        if i.type == pafs.FileType.Directory and not PurePosixPath(i.path).name.startswith(".")
    )


def _is_dir(fs, path: str) -> bool:
    import pyarrow.fs as pafs

    return fs.get_file_info(path).type == pafs.FileType.Directory


def scan_tree(root: str, val_fraction: float = 0.2) -> ImageTree:
    """Find classes and files and split them. Raises DataError for anything unusable."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    from training import parquet  # local import: parquet imports this module

    if parquet.is_prepared(root):  # the Parquet form written by `python -m jobs.prepare`
        return parquet.scan_prepared(root)
    fs, base, uri_prefix = _filesystem(root)
    if not _is_dir(fs, base):
        raise DataError(f"{root}: no such directory; pass --data with a folder laid out as <class>/<image>")

    layout = "train/val" if _is_dir(fs, f"{base}/train") and _is_dir(fs, f"{base}/val") else "hash"
    train_root = f"{base}/train" if layout == "train/val" else base
    class_names = _class_dirs(fs, train_root)
    if not class_names:
        raise DataError(
            f"{train_root}: no class directories; put each class's images in its own "
            "sub-directory (<root>/<class>/<image>)"
        )
    if len(class_names) < 2:
        raise DataError(
            f"{train_root}: only one class directory ({class_names[0]!r}); a classifier needs "
            "at least 2 classes, one sub-directory each"
        )
    class_index = {name: i for i, name in enumerate(class_names)}

    def collect(split_root: str, keep) -> Split:
        paths, labels, keys, total = [], [], [], 0
        for path, size in _list_images(fs, split_root):
            cls = PurePosixPath(path).relative_to(split_root).parts[0]
            rel = str(PurePosixPath(path).relative_to(base))
            if cls not in class_index or not keep(rel):
                continue  # files directly under the root have no class
            paths.append(uri_prefix + path)
            labels.append(class_index[cls])
            keys.append(stable_hash(rel))
            total += size
        return Split(tuple(paths), tuple(labels), tuple(keys), total)

    if layout == "train/val":
        val_root = f"{base}/val"
        unknown = sorted(set(_class_dirs(fs, val_root)) - set(class_names))
        if unknown:
            raise DataError(
                f"{val_root}: validation classes {unknown} are not among the training classes "
                f"{list(class_names)}; rename them or add them under {train_root}"
            )
        train = collect(train_root, lambda rel: True)
        val = collect(val_root, lambda rel: True)
    else:
        train = collect(base, lambda rel: not in_validation(rel, val_fraction))
        val = collect(base, lambda rel: in_validation(rel, val_fraction))

    if len(train) == 0:
        raise DataError(
            f"{train_root}: no images in the class directories (looked for "
            f"{', '.join(IMAGE_EXTENSIONS)}); add images or point --data elsewhere"
        )
    return ImageTree(root=root, layout=layout, class_names=tuple(class_names), train=train, val=val)


# --------------------------------------------------------------------------- decoding


def decode_image(data: bytes) -> np.ndarray:
    """Encoded bytes -> uint8 HWC RGB. Grayscale, RGBA, palette, CMYK and 16-bit become RGB;
    an animated image gives its first frame. Raises BadImage, with the reason, for anything
    that is not a whole, sane image."""
    import warnings

    from PIL import Image

    if not data:
        raise BadImage("empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that; either way we refuse
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                return _to_rgb(img)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise BadImage(f"decompression bomb: {e}") from None
    except Image.UnidentifiedImageError:
        raise BadImage("not an image Pillow can read (wrong extension or corrupt header)") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated data, broken chunks, bad palettes
        raise BadImage(f"corrupt image: {e}") from None


def _to_rgb(img) -> np.ndarray:
    from PIL import Image

    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(img, dtype=np.float32)
        scale = 255.0 / 65535.0 if arr.max() > 255 else 1.0
        gray = np.clip(arr * scale + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        img = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img.convert("RGBA"))
    return np.asarray(img.convert("RGB"))


class BadImage(ValueError):
    """A file in the tree that cannot be used as an image; the message is the reason."""


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


def stack_images(images: list[np.ndarray]) -> np.ndarray:
    """One (N, H, W, 3) array when the sizes agree, else an object array of HWC arrays."""
    if not images:
        return np.zeros((0, 1, 1, 3), dtype=np.uint8)
    if all(im.shape == images[0].shape for im in images):
        return np.stack(images)
    out = np.empty(len(images), dtype=object)
    out[:] = images
    return out


class Decoder:
    """map_batches function: {bytes, path} -> {image, label, key}.

    A file that fails to decode is dropped on its own (its good neighbours in the block
    stay) and reported to `bad_log`: Ray Data's max_errored_blocks would drop whole blocks.
    """

    def __init__(self, split: Split, bad_log=None):
        # read_binary_files gives paths without the URI scheme
        self._meta = {
            p.split("://", 1)[-1]: (p, lab, key)
            for p, lab, key in zip(split.paths, split.labels, split.keys, strict=True)
        }
        self._bad_log = bad_log

    def __call__(self, batch: dict) -> dict:
        images, labels, keys, bad = [], [], [], []
        for path, data in zip(batch["path"], batch["bytes"], strict=True):
            full, label, key = self._meta[path]
            try:
                images.append(decode_image(data))
            except BadImage as e:
                bad.append((full, str(e)))
                continue
            labels.append(label)
            keys.append(key)
        if bad and self._bad_log is not None:
            self._bad_log.add.remote(bad)  # fire and forget: the driver reads the log later
        return {
            "image": stack_images(images),
            "label": np.array(labels, dtype=np.int64),
            "key": np.array(keys, dtype=np.int64),
        }


def read_split(split: Split, *, seed: int, shuffle: bool, bad_log=None, num_cpus: float = 1.0):
    """Ray Dataset of decoded images for one split.

    Files are read in an order shuffled once by `seed` so that blocks mix classes (epoch 0
    takes them in that order); later epochs reshuffle in the trainer's local shuffle buffer.
    `num_cpus` is what each read and decode task reserves: below 1 when trainers hold most
    of a small machine's CPUs.
    """
    import ray.data

    from training.parquet import PreparedSplit, read_prepared_split

    if isinstance(split, PreparedSplit):
        return read_prepared_split(split, seed=seed, shuffle=shuffle, bad_log=bad_log, num_cpus=num_cpus)
    paths = list(split.paths)
    if shuffle:
        paths = [paths[i] for i in np.random.default_rng(seed).permutation(len(paths))]
    ds = ray.data.read_binary_files(paths, include_paths=True, num_cpus=num_cpus)
    return ds.map_batches(Decoder(split, bad_log), batch_format="numpy", batch_size=64, num_cpus=num_cpus)


# --------------------------------------------------------------------------- default data


def default_dataset_dir() -> Path:
    """scikit-learn's 1,797 handwritten digit scans as 32x32 RGB PNGs, written once.

    The scans ship inside scikit-learn (no download). They are 8x8 with 17 grey levels;
    we upscale to 32x32 with bicubic resampling so the CIFAR preset applies unchanged.
    """
    cache = Path(os.environ.get("RGA_CACHE", Path.home() / ".cache" / "ray-gpu-augment"))
    root = cache / "digits"
    done = root / ".complete"
    if done.exists():
        return root
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    tmp = cache / f"digits.tmp{os.getpid()}"
    for i, (img, target) in enumerate(zip(digits.images, digits.target, strict=True)):
        side = "val" if in_validation(f"{i:04d}", 0.2) else "train"
        folder = tmp / side / str(target)
        folder.mkdir(parents=True, exist_ok=True)
        gray = Image.fromarray(np.uint8(np.round(img * (255.0 / 16.0))), mode="L")
        gray.resize((32, 32), Image.BICUBIC).convert("RGB").save(folder / f"{i:04d}.png")
    (tmp / ".complete").touch()
    if root.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.rename(root)
    return root
