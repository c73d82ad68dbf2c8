"""Byte-mutated files of every format the job reads, through the job's own functions: each
mutant must decode, or become a listed bad file (or a whole container the driver's scan
refuses with the job's one-line DataError), and never raise anything else (not a test;
tests/test_fuzz.py runs a few dozen mutants of each format).

    python -m bench.fuzz --fuzz 500                      # 500 mutants of each format, seed 0
    python -m bench.fuzz --fuzz 2000 --seed 7 --formats tiff,tar --json fuzz.json
    python -m bench.fuzz --fuzz 300 --formats names      # 300 trees of names in random bytes

Seeds, written with Pillow and pyarrow in the layouts the job reads:

  jpeg png gif webp bmp tiff   a 56 x 40 image each (JPEG baseline and progressive; TIFF plain,
  tiff-lzw tiff-pages          LZW-compressed, and two pages): augment.decode's decode_image
                               (full size and at 1/2, as the CPU train path decodes) and
                               read_header, and training.driver.inputs' header sampling (typical_size)
  tar                          a WebDataset shard (<class>/<key>.jpg + .cls, tarfile in
                               webdataset's layout): training.forms.webdataset's scan (scan_data),
                               then every unit through the read task's function
                               (training.forms.formats.read_units), then every image decoded
  parquet                      jobs.prepare's shards: its scan, then read_units, then decoding
  hf                           a Hugging Face export (an Image struct column, ClassLabel
                               metadata): the same
  names                        not a file's bytes but its name's: trees whose class, folder and
                               file names are random bytes (mostly not UTF-8), through the
                               tree's scan and reads, a manifest naming the files as the job shows
                               them, and jobs.prepare, its shards then scanned and read (fuzz_names)
  yaml                         --config files (bench/fuzz_yaml.py): the alias bomb, aliases,
                               tags, keys given twice, YAML 1.1's number forms, long values,
                               some mutated; each read as meant or refused in one line, in a
                               second (decoded: read; bad: refused)

A mutation is one to three of: bytes set to random or boundary values, the file cut short, a
chunk of it repeated somewhere else, random bytes inserted, a range zeroed. Half of them aim
at the parts that hold the structure (an image's first bytes and a TIFF's tag directory, tar
headers, Parquet page headers and the footer).

A container's mutant also counts as another exception where the read task hands on other
images than the scan found (a sample lost without a word, or one the scan did not count).

Columns: mutants; decoded (every image of it read and decoded, nothing listed); bad (listed,
or refused by the scan in one line); other (anything else: a bug). Exit 1 if other > 0.
"""

from __future__ import annotations

import argparse
import io
import random
import shutil
import sys
import tempfile
import traceback
import warnings
from functools import partial
from pathlib import Path

from bench import write_json

IMAGES = ("jpeg", "jpeg-progressive", "png", "gif", "webp", "bmp", "tiff", "tiff-lzw", "tiff-pages")
CONTAINERS = ("tar", "parquet", "hf")
FORMATS = IMAGES + CONTAINERS
NAMES = ("names",)  # trees whose file and folder names are random bytes (fuzz_names); --formats takes it too
BOUNDARY = (0, 1, 2, 3, 4, 0x7F, 0x80, 0xFF)  # values that break lengths, counts and type codes
SETTINGS = ("yaml",)  # --config files (bench/fuzz_yaml.py), read or refused in one line


def _picture():
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:40, 0:56]
    pixels = np.stack([x * 4, y * 6, (x + y) * 3], axis=-1) % 256
    return Image.fromarray(pixels.astype(np.uint8))


def image_seed(fmt: str) -> bytes:
    img, buf = _picture(), io.BytesIO()
    options = {
        "jpeg": ("JPEG", {"quality": 90}),
        "jpeg-progressive": ("JPEG", {"quality": 90, "progressive": True}),
        "png": ("PNG", {}),
        "gif": ("GIF", {}),
        "webp": ("WEBP", {"quality": 80}),
        "bmp": ("BMP", {}),
        "tiff": ("TIFF", {}),
        "tiff-lzw": ("TIFF", {"compression": "tiff_lzw"}),
        "tiff-pages": ("TIFF", {"save_all": True, "append_images": [img.rotate(90, expand=True)]}),
    }
    kind, kw = options[fmt]
    img.save(buf, format=kind, **kw)
    return buf.getvalue()


def _tree(root: Path) -> None:
    """train/ and val/ of two classes, 6 + 2 small JPEGs each: what the containers hold."""
    for side, n in (("train", 6), ("val", 2)):
        for c in ("a", "b"):
            (root / side / c).mkdir(parents=True)
            for i in range(n):
                img = _picture().rotate(30 * i + (90 if c == "b" else 0)).resize((24, 20))
                img.save(root / side / c / f"{i:02d}.jpg", quality=85)


def container_seed(fmt: str, work: Path) -> Path:
    """The folder --data would name, holding the container to mutate (`target`)."""
    from training.forms.tree import scan_tree

    tree_root, out = work / "tree", work / fmt
    if not tree_root.exists():
        _tree(tree_root)
    tree = scan_tree(str(tree_root))
    if fmt == "tar":
        from bench.formats import write_webdataset

        write_webdataset(tree, str(out))
    elif fmt == "hf":
        from bench.formats import write_export

        write_export(tree, str(out), rows_per_file=1000)
    else:
        from training.forms.parquet import prepare_tree

        prepare_tree(str(tree_root), str(out), log=lambda *a: None)
        import pyarrow.parquet as pq

        table = pq.read_table(out / "train" / "part-00000.parquet")  # row groups of 4: several units
        pq.write_table(table, out / "train" / "part-00000.parquet", row_group_size=4)
    return out


def target(fmt: str, folder: Path) -> Path:
    return {
        "tar": folder / "train-0000.tar",
        "hf": folder / "data" / "train-00000-of-00001.parquet",
        "parquet": folder / "train" / "part-00000.parquet",
    }[fmt]


def hot_ranges(fmt: str, data: bytes) -> list[tuple[int, int]]:
    """The byte ranges that hold a file's structure."""
    if fmt == "tar":
        import tarfile

        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            return [(m.offset, m.offset_data) for m in tar.getmembers()]
    if fmt in ("parquet", "hf"):
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(io.BytesIO(data)).metadata
        pages = [
            (meta.row_group(g).column(c).data_page_offset, meta.row_group(g).column(c).data_page_offset + 40)
            for g in range(meta.num_row_groups)
            for c in range(meta.num_columns)
        ]
        return pages + [(max(0, len(data) - 2048), len(data))]
    if fmt.startswith("tiff"):
        ifd = int.from_bytes(data[4:8], "little")
        return [(0, 16), (ifd, ifd + 2 + 12 * int.from_bytes(data[ifd : ifd + 2], "little") + 4)]
    return [(0, min(len(data), 256))]


def mutate(data: bytes, rng: random.Random, hot: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not out:
            break

        def where() -> int:
            if hot and rng.random() < 0.5:
                lo, hi = rng.choice(hot)
                return min(len(out) - 1, rng.randrange(lo, max(lo + 1, hi)))
            return rng.randrange(len(out))

        kind = rng.randrange(5)
        if kind == 0:  # bytes set
            for _ in range(rng.randint(1, 8)):
                out[where()] = rng.choice(BOUNDARY) if rng.random() < 0.5 else rng.randrange(256)
        elif kind == 1:  # cut short
            del out[rng.randrange(len(out)) :]
        elif kind == 2:  # a chunk repeated elsewhere
            a, n = rng.randrange(len(out)), rng.randint(1, 512)
            out[where() : where()] = out[a : a + n]
        elif kind == 3:  # random bytes inserted
            at = where()
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        else:  # a range zeroed
            at, n = where(), rng.randint(1, 1024)
            out[at : at + n] = bytes(len(out[at : at + n]))
    return bytes(out)


def check_image(fmt: str, data: bytes, work: Path) -> str:
    """A mutant image's outcome, "decoded" or "bad"; anything else raises."""
    from augment.decode import BadImage, decode_image, read_header
    from training.driver.inputs import typical_size
    from training.forms.data import make_split

    (work / "mutant").write_bytes(data)
    typical_size(make_split(str(work), ["mutant"], [0], [len(data)]))  # --preset auto's sample: a size or None
    try:
        read_header(data)
        decode_image(data)
        if fmt.startswith("jpeg"):
            decode_image(data, shrink=2)
    except BadImage:
        return "bad"
    return "decoded"


class SilentLoss(AssertionError):
    """The read task handed on other images than the scan found."""


def check_container(fmt: str, data: bytes, seed_folder: Path, work: Path) -> str:
    """A mutant container's outcome (a copy of the seed's folder, the container replaced): "bad"
    where the scan refused it, listed something or an image did not decode, else "decoded";
    anything else raises, SilentLoss among it."""
    from augment.decode import BadImage, decode_image
    from training.forms.data import DataError
    from training.forms.formats import read_units, scan_data

    folder = work / "mutant"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(seed_folder, folder)
    target(fmt, folder).write_bytes(data)
    try:
        tree = scan_data(str(folder), 0.25)
    except DataError:
        return "bad"
    listed = len(tree.unreadable)
    for split in (tree.train, tree.val):
        if not len(split.units):  # no read task
            continue
        bad: list = []
        table = read_units(split.units, split.root, split.shards, split.form, bad)
        listed += len(bad)
        keys = table.column("key").to_pylist()
        if split.side is not None:
            from training.forms.data import on_side

            keys = [k for k in keys if on_side(k, split.side)]
        unread = set(split.keys.tolist()) - set(keys)
        if not set(keys) <= set(split.keys.tolist()) or (unread and not bad):
            raise SilentLoss(f"{fmt}: the scan found {len(split)} images, the read task handed on {len(keys)}")
        for raw in table.column("bytes").to_pylist():
            try:
                decode_image(raw)
            except BadImage:
                listed += 1
    return "bad" if listed else "decoded"


def fuzz_format(fmt: str, mutants: int, seed: int, work: Path) -> dict:
    """{format, mutants, decoded, bad, other, examples}: `examples` holds the first few other
    exceptions (the mutation's seed and the traceback's last lines)."""
    work.mkdir(parents=True, exist_ok=True)
    if fmt in NAMES:
        return fuzz_names(mutants, seed, work)
    if fmt in IMAGES:
        seed_data, folder = image_seed(fmt), None
    else:
        folder = container_seed(fmt, work)
        seed_data = target(fmt, folder).read_bytes()
    hot = hot_ranges(fmt, seed_data)
    counts = {"decoded": 0, "bad": 0, "other": 0}
    examples = []
    for i in range(mutants):
        data = mutate(seed_data, random.Random(f"{seed}:{fmt}:{i}"), hot)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Pillow's about corrupt EXIF and TIFF tags: the outcome is what counts
                outcome = check_image(fmt, data, work) if folder is None else check_container(fmt, data, folder, work)
        except Exception as e:  # noqa: BLE001 - what this counts: anything but a decode or a listing
            outcome = "other"
            if len(examples) < 5:
                tail = traceback.format_exc().strip().splitlines()[-6:]
                examples.append({"mutant": i, "error": f"{type(e).__name__}: {e}"[:300], "traceback": tail})
        counts[outcome] += 1
    return {"format": fmt, "mutants": mutants, **counts, "examples": examples}


# --------------------------------------------------------------------------- names as bytes


def byte_name(rng: random.Random, suffix: bytes = b"") -> bytes:
    """A file or folder name of 1 to 12 random bytes (any but "/" and NUL, which no name holds),
    half of them at or above 0x80 (most such runs are not UTF-8), and `suffix`."""
    size = rng.randint(1, 12)
    raw = bytes(rng.choice((rng.randint(1, 0x7F), rng.randint(0x80, 0xFF))) for _ in range(size))
    return raw.replace(b"/", b"_") + suffix


def byte_tree(root: Path, rng: random.Random) -> None:
    """root/<class>/[<folder>/]<file>.png: 2 or 3 classes of 3 files, every name random bytes."""
    import os

    png = image_seed("png")
    top = os.fsencode(root)
    os.makedirs(top)
    for _ in range(rng.randint(2, 3)):
        folder = top + b"/" + byte_name(rng)
        if rng.random() < 0.5:
            folder += b"/" + byte_name(rng)
        os.makedirs(folder, exist_ok=True)
        for _ in range(3):
            with open(folder + b"/" + byte_name(rng, b".png"), "wb") as f:
                f.write(png)


def check_names(root: Path, work: Path) -> str:
    """A byte-named tree through the scan (--data a tree), a manifest naming its files by the names
    the job shows, and jobs.prepare, then the prepared shards' scan and read task: "decoded" where
    every file is read by each, "bad" where a scan refused in one line (the tree: a class folder
    that is hidden, one class; the manifest: labels that differ only in case, a name beside an
    index); anything else raises, SilentLoss among it."""
    import csv

    from training import storage
    from training.forms.data import DataError
    from training.forms.formats import read_units, scan_data
    from training.forms.parquet import prepare_tree

    try:
        tree = scan_data(str(root), 0.0)
    except DataError:
        return "bad"
    files = sorted(tree.train.rel_paths)
    fs = storage.filesystem(str(root))[0]
    for rel in files:  # as jobs.prepare and the header sampling read them
        storage.read_file(fs, f"{root}/{rel}")
    manifest = work / "names.csv"
    with open(manifest, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("path", "label"), *((f"{root.name}/{r}", r.split("/")[0]) for r in files)])
    refused = False
    try:
        listed = scan_data(str(manifest), 0.0)
    except DataError:  # by its labels: two that differ only in case, a name beside an index ("7")
        refused = True
    else:
        if sorted(listed.train.rel_paths) != files:
            raise SilentLoss("names: the manifest's scan lists other files than the tree's")
    out = work / "prepared"
    prepare_tree(str(root), str(out), val_fraction=0.0, log=lambda *a: None)
    prepared = scan_data(str(out), 0.0)
    table = read_units(prepared.train.units, prepared.train.root, prepared.train.shards, prepared.train.form)
    if sorted(table.column("path").to_pylist()) != files:
        raise SilentLoss(f"names: the prepared shards hold {table.num_rows} images, the tree {len(files)}")
    return "bad" if refused else "decoded"


def fuzz_names(cases: int, seed: int, work: Path) -> dict:
    """fuzz_format's figures for `cases` trees of random byte names (byte_tree, check_names)."""
    counts, examples = {"decoded": 0, "bad": 0, "other": 0}, []
    for i in range(cases):
        case = work / f"names-{i}"
        try:
            byte_tree(case / "data", random.Random(f"{seed}:names:{i}"))
            outcome = check_names(case / "data", case)
        except Exception as e:  # noqa: BLE001 - what this counts: anything but a read or a one-line refusal
            outcome = "other"
            if len(examples) < 5:
                tail = traceback.format_exc().strip().splitlines()[-6:]
                examples.append({"mutant": i, "error": f"{type(e).__name__}: {e}"[:300], "traceback": tail})
        finally:
            shutil.rmtree(case, ignore_errors=True)
        counts[outcome] += 1
    return {"format": "names", "mutants": cases, **counts, "examples": examples}


def fuzz_settings(cases: int, seed: int, work: Path) -> dict:
    """fuzz_format's figures for --config files (bench/fuzz_yaml.py): the alias bomb, then cases
    drawn from `seed`; decoded: read (as meant, where the case says), bad: refused in one line."""
    from bench.fuzz_yaml import check_settings, settings_cases

    work.mkdir(parents=True, exist_ok=True)
    counts = {"decoded": 0, "bad": 0, "other": 0}
    examples = []
    for i, (text, meant) in enumerate(settings_cases(cases, seed)):
        try:
            outcome = check_settings(text, meant, work)
        except Exception as e:  # noqa: BLE001 - what this counts: anything but a reading or a one-line refusal
            outcome = "other"
            if len(examples) < 5:
                tail = traceback.format_exc().strip().splitlines()[-6:]
                examples.append({"mutant": i, "error": f"{type(e).__name__}: {e}"[:300], "traceback": tail})
        counts[outcome] += 1
    return {"format": "yaml", "mutants": cases, **counts, "examples": examples}


def run(formats, mutants: int, seed: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return [
            (fuzz_settings if f in SETTINGS else partial(fuzz_format, f))(mutants, seed, Path(tmp) / f) for f in formats
        ]


def table(results: list[dict]) -> str:
    lines = [f"{'format':<17} {'mutants':>8} {'decoded':>8} {'bad':>8} {'other':>6}"]
    lines += [f"{r['format']:<17} {r['mutants']:>8} {r['decoded']:>8} {r['bad']:>8} {r['other']:>6}" for r in results]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--fuzz", type=int, default=200, metavar="N", help="mutants of each format (default: 200)")
    ap.add_argument("--seed", type=int, default=0, help="the mutations' seed (default: 0)")
    known = FORMATS + NAMES + SETTINGS
    ap.add_argument("--formats", default=",".join(known), help=f"comma-separated, of {', '.join(known)}")
    ap.add_argument("--json", metavar="FILE", help="write the figures, and the other exceptions' tracebacks")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(known))
    if unknown:
        ap.error(f"--formats: unknown {', '.join(unknown)}; choose among {', '.join(known)}")
    results = run(formats, args.fuzz, args.seed)
    print(table(results))
    for r in results:
        for e in r["examples"]:
            print(f"{r['format']} mutant {e['mutant']}: {e['error']}", file=sys.stderr)
    write_json(args.json, {"seed": args.seed, "mutants": args.fuzz, "results": results})
    return 1 if any(r["other"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
