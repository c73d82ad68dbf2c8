"""Prediction that streams (jobs.predict, jobs.evaluate): rows go from the Ray Data pipeline to the
output as they are scored, and the accuracy and the confusion matrix are reduced by a tally of
per-batch counts, so no process holds every row, whatever the number of images.

    report = score_to(info, splits, "preds/", actors=(1, 8))   # Parquet files in preds/
    report = score_to(info, splits, "predictions.csv")           # one CSV, merged from parts

- A folder (`--out DIR`, or a name without .csv/.parquet) gets Parquet files written by Ray Data's
  tasks (`write_parquet`); `*.parquet` one Parquet file and `*.csv` one CSV file, each merged from
  those parts a row group or a line at a time, the parts then removed.
- Rows keep the order of the input (sorted paths): Ray Data's preserve_order for this job.
- The scoring actors form an autoscaling pool (`actors`: (min, max)), a GPU share each on a cluster
  with GPUs; the files that do not read or decode are listed by the read tasks (BadFileLog).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import ray

from training import storage
from training.driver.faults import driver_actor
from training.forms.data import Split
from training.modelfile import ModelFile
from training.rows import LABEL, PATH
from training.status import BadFileLog

COLUMNS = ("path", "predicted", "confidence", "label")  # the output's columns, in order
PARTS_RECORD = ".predictions.json"  # in a --out folder: the Parquet files this job wrote there


def earlier_parts(folder: str) -> list[str] | None:
    """The Parquet files an earlier jobs.predict wrote into `folder` (PARTS_RECORD), those still there;
    None where no record says so: then the folder's Parquet files are someone else's."""
    record = storage.join(folder, PARTS_RECORD)
    if not storage.exists(record):
        return None
    try:
        names = json.loads(storage.read_bytes(record))["parts"]
    except (ValueError, KeyError, TypeError):
        return None
    return [f for f in part_files(folder, ".parquet") if f.rsplit("/", 1)[-1] in set(names)]


class Tally:
    """Per-batch counts from the scoring actors, summed (an actor beside the driver): images scored
    and the confusion matrix of the labelled ones (rows: true class, columns: predicted)."""

    def __init__(self, num_classes: int):
        self.scored, self.confusion = 0, np.zeros(num_classes * num_classes, dtype=np.int64)

    def add(self, scored: int, confusion: np.ndarray) -> None:
        self.scored += scored
        self.confusion += confusion

    def get(self) -> tuple[int, list]:
        k = int(round(len(self.confusion) ** 0.5))
        return self.scored, self.confusion.reshape(k, k).tolist()


@dataclasses.dataclass(frozen=True)
class ScoreReport:
    """What a streamed prediction leaves on the driver: counts, never rows."""

    out: str
    scored: int
    confusion: list  # [true][predicted] over the labelled images
    unread: dict  # path -> reason, of the files that did not read or decode

    @property
    def labelled(self) -> int:
        return int(np.asarray(self.confusion).sum())

    @property
    def correct(self) -> int:
        return int(np.trace(np.asarray(self.confusion)))


def parse_actors(text: str) -> tuple[int, int]:
    """--actors: "N" (a fixed pool) or "MIN-MAX" (an autoscaling one); ValueError for anything else."""
    lo, _, hi = str(text).partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--actors {text}: give a count (4) or a range (1-8)") from None
    if not 1 <= low <= high:
        raise ValueError(f"--actors {text}: at least 1, and MIN no more than MAX")
    return low, high


def out_kind(out: str) -> str:
    """ "csv", "parquet" (one file) or "dir" (Parquet files in a folder)."""
    name = out.rstrip("/").lower()
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".parquet") and not out.endswith("/"):
        return "parquet"
    return "dir"


def score_to(
    info: ModelFile,
    splits: list[Split],
    out: str,
    *,
    batch_size: int = 256,
    actors: tuple[int, int] = (1, 1),
    device: str = "auto",
    gpus_per_actor: float = 1.0,
) -> ScoreReport:
    """Score every image of `splits` into `out` (see the module's docstring)."""
    from training.predict.inference import scoring_dataset

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    tally, bad_log = driver_actor(Tally, len(info.class_names)), driver_actor(BadFileLog)
    try:
        ds = scoring_dataset(
            info,
            splits,
            batch_size=batch_size,
            actors=actors,
            device=device,
            tally=tally,
            bad_log=bad_log,
            gpus_per_actor=gpus_per_actor,
        )
        names = list(info.class_names)
        ds = ds.map_batches(lambda b: as_rows(b, names), batch_format="numpy", batch_size=None, num_cpus=0.25)
        write(ds, out)
        scored, confusion = ray.get(tally.get.remote())
        unread = ray.get(bad_log.get.remote())
    finally:
        for actor in (tally, bad_log):
            ray.kill(actor)
    return ScoreReport(out, scored, confusion, unread)


def as_rows(batch: dict, names: list[str]) -> dict:
    """The scorer's {path, label, pred, prob} as the output's columns: class names, not indices."""
    labels, named = np.asarray(batch[LABEL]), np.asarray(names, dtype=object)
    return {
        "path": batch[PATH],
        "predicted": named[np.asarray(batch["pred"])],
        "confidence": np.round(batch["prob"].astype(np.float64), 6),
        "label": np.where(labels >= 0, named[np.maximum(labels, 0)], ""),  # -1: no label
    }


def write(ds, out: str) -> None:
    """Ray Data's tasks write the parts; a one-file output is merged from them, then they go.
    Stopped on the way (Ctrl-C, SIGTERM, a failed task), it removes what it wrote, and only
    that: the parts, a half-merged file, a folder's new Parquet files (and the folder, made
    here); an output an earlier run wrote stays until the merge begins to replace it."""
    kind = out_kind(out)
    if kind == "dir":
        made = not storage.exists(out)
        before = set() if made else set(part_files(out, ".parquet"))
        try:
            ds.write_parquet(out)
        except BaseException:
            if storage.exists(out):
                for part in set(part_files(out, ".parquet")) - before:
                    storage.remove_file(part)
                if made and storage.is_empty_dir(out):
                    storage.remove_tree(out)
            raise
        ours = [f.rsplit("/", 1)[-1] for f in part_files(out, ".parquet") if f not in before]
        storage.write_json(storage.join(out, PARTS_RECORD), {"parts": ours})
        return
    parts, merging = f"{out}.parts", False
    try:
        if kind == "csv":
            ds.write_csv(parts)
        else:
            ds.write_parquet(parts)
        merging = True
        (merge_csv if kind == "csv" else merge_parquet)(parts, out)
    except BaseException:
        if merging and storage.exists(out):
            storage.remove_file(out)
        raise
    finally:
        if storage.exists(parts):
            storage.remove_tree(parts)


def part_files(folder: str, suffix: str) -> list[str]:
    import pyarrow.fs as pafs

    fs, path, prefix = storage.filesystem(folder)
    infos = fs.get_file_info(pafs.FileSelector(path))
    return sorted(prefix + i.path for i in infos if i.path.endswith(suffix))  # Ray's names: in task order


def merge_csv(parts: str, out: str) -> None:
    """One CSV from Ray Data's parts, a line at a time: the header once."""
    fs, path, _ = storage.filesystem(out)
    with fs.open_output_stream(path) as sink:
        sink.write((",".join(COLUMNS) + "\n").encode())
        for part in part_files(parts, ".csv"):
            pfs, ppath, _ = storage.filesystem(part)
            with pfs.open_input_stream(ppath) as src:
                header = True
                for line in _lines(src):
                    if header:
                        header = False
                        continue
                    sink.write(line)


def _lines(stream, block: int = 1 << 20):
    rest = b""
    while True:
        chunk = stream.read(block)
        if not chunk:
            break
        rest += chunk
        *whole, rest = rest.split(b"\n")
        for line in whole:
            yield line + b"\n"
    if rest:
        yield rest + b"\n"


def merge_parquet(parts: str, out: str) -> None:
    """One Parquet file from Ray Data's parts, a row group at a time."""
    import pyarrow.parquet as pq

    fs, path, _ = storage.filesystem(out)
    writer = None
    try:
        for part in part_files(parts, ".parquet"):
            pfs, ppath, _ = storage.filesystem(part)
            with pfs.open_input_file(ppath) as f:
                pf = pq.ParquetFile(f)
                for i in range(pf.num_row_groups):
                    table = pf.read_row_group(i)
                    if writer is None:
                        writer = pq.ParquetWriter(fs.open_output_stream(path), table.schema)
                    writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
