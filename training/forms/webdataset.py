"""WebDataset tar shards -> the samples of each split, read in runs of consecutive samples.

    --data DIR                     every .tar below DIR (train-0000.tar, val/0000.tar, ...), and
                                   every gzipped one (.tar.gz, .tgz)
    --data DIR/train-{0000..0099}.tar   a brace pattern ({a..b} ranges keep their zero padding,
                                   {x,y} alternatives; they nest), or one shard

A sample is the run of consecutive members sharing a key: the member's path up to the first
dot of its file name (webdataset's rule), e.g. n01440764/img_0001.jpg + n01440764/img_0001.cls,
where a part between dots with no letter belongs to the key (cat.001.jpg: cat.001; member_key).
Its image is the member with an image extension (jpg, png, webp, ...); its label the .cls member
(a class index as text; any other text is refused), or else the `--label-key` field of its .json
member (an index or a class name); one kind for the whole set (training.forms.labels.index_labels).
The split is the shards' own where their names say it (train-*, val-*, validation/...); otherwise
the stable hash split of the samples' keys, applied inside each run by the read task. A sample
is named `<shard>/<image member>` and keyed by the stable hash of `<shard>/<key>` (the shard
relative to DIR).

Tar has no index, so the driver reads every shard's member headers once before training:
on local disk it seeks from header to header; on object storage each shard streams through
once (after one request for its size). The image bytes are never kept. Each run of samples is
then one ranged read: its (shard, byte offset, byte length, samples) is the unit of a read task.
A gzip stream cannot be read from the middle, so a gzipped shard is one run: its read task reads
the whole file and decompresses it (its offsets are the decompressed tar's).

Class indices (.cls) are the class names "0".."N-1" unless a names file names them: a classes.txt
beside the shards (line i names class i, as WebDataset exports of ImageNet ship it), or
--class-names (training.forms.labels.name_classes).

A damaged shard costs only what is damaged: past a member header that is not one (a broken
checksum, zeroed bytes), the scan and the read task alike read on from the next valid header
(members), and a shard cut off inside a member keeps the samples before it. Each sample that
lost a member, and damage that no such sample accounts for (named by the key its broken header
still gives, else by the shard and the byte offset), is listed as unreadable and counted as
lost for the epoch's coverage (ImageTree.lost_train); a file without one valid header is refused.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath

import numpy as np

from training import storage
from training.forms.data import (
    DataError,
    ImageTree,
    ShardFormat,
    check_classes,
    make_split,
    on_side,
    sharded,
    split_names,
    stable_hash,
)
from training.forms.labels import index_labels, is_index, label_text, read_class_names
from training.forms.tars import GZIPPED, Broken, Gunzipped, is_gzipped, member_key, members, open_tar, read_run
from training.forms.tree import check_utf8_names, list_images
from training.rows import BYTES, KEY, LABEL, PATH, read_types

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")
LABEL_EXTENSIONS = ("cls", "json")
RUN_SAMPLES = 256  # samples per read unit at most, as prepared shards' row groups
RUN_BYTES = 64 * 2**20  # and at most this many bytes of the shard
SHARD_SUFFIXES = (".tar", *GZIPPED)
CLASSES_FILE = "classes.txt"  # beside the shards: the names of the class indices, line i naming class i
HEADER_BYTES = 256 * 1024  # of an image, for its size (training.driver.inputs.typical_size reads a file's as much)
SCAN_BUFFER = 8 * 2**20  # object storage: the scan streams each shard in reads of this size


def expand_braces(pattern: str) -> list[str]:
    """Every name a brace pattern stands for, in order: a{0..2}b -> a0b a1b a2b (zero padding
    kept: {000..002}), {x,y} -> x y; braces nest ({train-{0..1},val-0})."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth, commas = 0, []
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 1 and pattern[end] == ",":
            commas.append(end)
        if depth == 0:
            break
    else:
        return [pattern]  # an unclosed brace is a plain character
    body, head, tail = pattern[start + 1 : end], pattern[:start], pattern[end + 1 :]
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        lo, hi = span.groups()
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1  # {3..1} counts down, as the shell does
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    elif commas:
        cuts = [start, *commas, end]
        choices = [pattern[a + 1 : b] for a, b in itertools.pairwise(cuts)]
    else:  # {name}: no alternatives, no range: plain characters, as the shell keeps them
        return [head + "{" + body + "}" + rest for rest in expand_braces(tail)]
    return [a + b for choice in choices for a in expand_braces(head + choice) for b in expand_braces(tail)]


def is_shard_pattern(root: str) -> bool:
    """One shard (.tar, .tar.gz, .tgz), or a name with a brace group that expands ({a,b} or {0..9});
    a folder's name such as {project} is none."""
    return is_shard(root) or expand_braces(root) != [root]


def is_shard(name: str) -> bool:
    return name.lower().endswith(SHARD_SUFFIXES)


def shard_names(root: str) -> tuple[str, list[str]]:
    """(the folder the shards are named relative to, their names) for a pattern or one shard."""
    head = root.split("{", 1)[0]
    folder = head.rsplit("/", 1)[0] if "/" in head else "."
    names = [p[len(folder) + 1 :] if folder != "." else p for p in expand_braces(root)]
    return folder, names


@dataclasses.dataclass
class Sample:
    key: str
    start: int  # byte offset of its first member's header in the shard
    end: int  # byte offset just past its last member's data
    image: str | None = None  # the image member's name
    image_bytes: int = 0
    data: bytes | None = None  # the image (when read)
    label: str | None = None  # as label_text gives it
    bad_label: str | None = None  # a .cls member's text that is no integer (the scan refuses it)

    @property
    def usable(self) -> bool:
        """Has an image and a label: trained on (the scan lists the rest as unreadable)."""
        return self.image is not None and self.label is not None


def samples(tar: tarfile.TarFile, label_key: str, *, images: bool, size: int, broken: list | None = None):
    """The samples of a tar from open_tar (`size` bytes), in order; with `images`, each image's
    bytes too (the label members are always read: a few bytes each). What holds no member goes to
    `broken` (members), and the samples after it are read on."""
    current = None
    for member in members(tar, [] if broken is None else broken, size):
        if not member.isfile():
            continue
        name = storage.shown_name(member.name)  # tarfile keeps a name's bytes that are not UTF-8 as surrogates
        name = name[2:] if name.startswith("./") else name
        folder, _, file = name.rpartition("/")
        stem, ext = member_key(file)
        key = f"{folder}/{stem}" if folder else stem
        if current is None or key != current.key:
            if current is not None:
                yield current
            current = Sample(key, member.offset, 0)
        current.end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        ext = ext.lower()
        if ext in IMAGE_EXTENSIONS and current.image is None:
            current.image, current.image_bytes = name, member.size
            if images:
                current.data = tar.extractfile(member).read()
        elif ext in LABEL_EXTENSIONS and current.label is None and current.bad_label is None:
            current.label, current.bad_label = _label(ext, tar.extractfile(member).read(), label_key)
    if current is not None:
        yield current


def _label(ext: str, raw: bytes, label_key: str) -> tuple[str | None, str | None]:
    """(the label as label_text gives it, else None; the text of a .cls member that is no integer,
    which the scan refuses: webdataset reads a .cls with int(), and would pass it as None)."""
    try:
        if ext == "cls":
            text = raw.decode(errors="replace").strip()
            return (str(int(text)), None) if re.fullmatch(r"-?[0-9]+", text) else (None, text[:40] or None)
        value = json.loads(raw).get(label_key) if label_key else None
        return (None if value is None else label_text(value) or None), None
    except (ValueError, AttributeError, UnicodeDecodeError):  # not text, not a JSON object
        return None, None


@dataclasses.dataclass
class Shard:
    name: str  # relative to the folder --data names
    samples: list[Sample]
    broken: list[Broken] = dataclasses.field(default_factory=list)  # what holds no member (members)


def scan_shard(folder: str, name: str, label_key: str) -> Shard:
    """A shard's samples from its member headers (and label members), read on past damage
    (members). DataError for a file that holds no valid tar header at all."""
    fs, base, prefix = storage.filesystem(folder)
    path, broken = f"{base}/{name}", []
    try:
        size = fs.get_file_info(path).size
        if is_gzipped(name):  # read through once, decompressed: a gzip stream has no places to seek to
            with (
                fs.open_input_stream(path, compression=None, buffer_size=SCAN_BUFFER) as stream,  # not by its name
                open_tar(fileobj=Gunzipped(stream), mode="r|") as tar,
            ):
                found = list(samples(tar, label_key, images=False, broken=broken, size=None))
        elif not prefix:
            with open_tar(name=path, mode="r:") as tar:
                found = list(samples(tar, label_key, images=False, broken=broken, size=size))
        else:
            # buffered: unbuffered, each of tarfile's 10 KiB reads would be a request of its own
            with (
                fs.open_input_stream(path, buffer_size=SCAN_BUFFER) as stream,
                open_tar(fileobj=stream, mode="r|") as tar,
            ):
                found = list(samples(tar, label_key, images=False, broken=broken, size=size))
    except (tarfile.TarError, EOFError) as e:
        raise DataError(f"{path}: not a readable tar archive ({e}); remove it from --data or write it again") from None
    if not found and broken and broken[0].offset == 0:
        raise DataError(f"{path}: not a tar archive (no valid tar header); remove it from --data or write it again")
    return Shard(name, found, broken)


def scan_shards(folder: str, names: list[str], label_key: str) -> list[Shard]:
    """Every shard's samples, in threads (object storage: a stream each; on disk tarfile's
    parsing holds the GIL, so its rate is one core's: benchmarks.md, "Data formats")."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(scan_shard, [folder] * len(names), names, [label_key] * len(names)))


def list_shards(fs, base: str) -> list[str]:
    """The shards (.tar, .tar.gz, .tgz) below `base`, relative to it, sorted; hidden files and folders
    skipped."""
    found = list_images(fs, base, (".tar", ".gz", ".tgz"))  # by the last suffix, then the whole name
    check_utf8_names([p for p, _ in found], "shard")
    return [str(PurePosixPath(p).relative_to(base)) for p, _ in found if is_shard(p)]


def scan_webdataset(root: str, val_fraction: float, label_key: str = "label") -> ImageTree:
    """The ImageTree of the shards `root` names (a folder, a pattern, one shard). DataError for
    a missing shard, a shard that is no tar, a shard set without labels, a .cls that is no
    integer, labels of two kinds (index_labels), a validation label that is no training class, or
    a class without training samples; samples without an image or a label go to `unreadable`."""
    top, names = _shard_set(root)
    sides = split_names(names, root, "train-*.tar")
    order = sides["train"] + sides["val"]  # test shards are not read
    shards = dict(zip(order, scan_shards(top, order, label_key), strict=True))
    class_names = _class_names(root, top, sides, shards, label_key)
    form = ShardFormat("webdataset", label=label_key, class_names=class_names)
    index, uris = {n: i for i, n in enumerate(order)}, [f"{top}/{n}" for n in order]

    def split(side_names, side):
        return _split(top, [(index[n], shards[n]) for n in side_names], uris, form, side)

    if sides["val"]:
        train, val, layout = split(sides["train"], None), split(sides["val"], None), "the train/val shards' own"
    else:
        train, val = split(sides["train"], (val_fraction, False)), split(sides["train"], (val_fraction, True))
        layout = f"hash by val_fraction {val_fraction}"
    unreadable, lost = _lost(top, sides, shards, label_key, None if sides["val"] else val_fraction)
    tree = ImageTree(root, f"WebDataset, {layout}", class_names, train, val, unreadable=unreadable, lost_train=lost)
    return check_classes(tree, None if sides["val"] else val_fraction)


def _lost(top: str, sides: dict, shards: dict, label_key: str, hashed: float | None) -> tuple[tuple, int]:
    """(path, reason) of each sample the shards lost (without an image or a label, and the damage
    that cost it a member named) and of damage no such sample accounts for (by the key its broken
    header still names, else by the shard and the byte offset); and how many of the lost samples
    are training ones (`hashed`: the hash split's val_fraction; None: the shards' own split)."""
    out, lost_train = [], 0

    def training(side: str, shard: str, key: str | None) -> bool:
        if side != "train" or hashed is None or key is None:  # an unknown key: it was in the training pool
            return side == "train"
        return bool(on_side(stable_hash(f"{shard}/{key}"), (hashed, False)))

    for side in ("train", "val"):
        for n in sides[side]:
            regions, keys = list(shards[n].broken), {s.key for s in shards[n].samples}
            for s in (s for s in shards[n].samples if not s.usable):
                reason = "no image member" if s.image is None else f"no label (.cls, or .json {label_key!r})"
                causes = [b for b in regions if b.key == s.key or s.start == b.offset + b.length or b.offset == s.end]
                regions = [b for b in regions if b not in causes]
                out.append((f"{top}/{n}/{s.key}", f"{reason}: {causes[0].describe()}" if causes else reason))
                lost_train += training(side, n, s.key)
            for b in regions:
                whole = b.key is None or b.key not in keys
                where = f"{top}/{n}/{b.key}" if b.key else f"{top}/{n}@{b.offset}"
                out.append((where, b.describe() + ("" if whole else "; its sample was read without that member")))
                lost_train += whole and training(side, n, b.key)
    return tuple(out), lost_train


def _class_names(root: str, top: str, sides: dict, shards: dict, label_key: str) -> tuple[str, ...]:
    """The class names of the labelled samples of the train and val shards (index_labels: one kind);
    DataError for a .cls member that is no integer, or no label at all."""
    bad = next(((n, s) for n in shards for s in shards[n].samples if s.bad_label is not None), None)
    if bad:
        raise DataError(
            f"{top}/{bad[0]}/{bad[1].key}.cls: {bad[1].bad_label!r} is not a class index; a .cls member holds an "
            "integer (class names go in a .json member's --label-key field)"
        )
    labelled = {side: [s.label for n in sides[side] for s in shards[n].samples if s.usable] for side in sides}
    if not labelled["train"]:
        raise DataError(
            f"{root}: no sample has a label (a .cls member, or a .json member with {label_key!r}); add them, or "
            "name the JSON field with --label-key"
        )

    def sample(i: int) -> str:  # the i-th labelled sample, train then val: only a refusal asks
        usable = (
            f"{n}/{s.key}" for side in ("train", "val") for n in sides[side] for s in shards[n].samples if s.usable
        )
        return next(itertools.islice(usable, i, None))

    return index_labels(labelled["train"], labelled["val"], root, sample)[0]


def _shard_set(root: str) -> tuple[str, list[str]]:
    """(the folder's URI or path, the shards' names relative to it) of a folder, a pattern or one
    shard; DataError for a shard that is not there, or a folder without any."""
    import pyarrow.fs as pafs

    folder, names = shard_names(root) if is_shard_pattern(root) else (root.rstrip("/"), None)
    fs, base, prefix = storage.filesystem(folder)
    names = list_shards(fs, base) if names is None else names
    infos = fs.get_file_info([f"{base}/{n}" for n in names])
    missing = [n for n, i in zip(names, infos, strict=True) if i.type != pafs.FileType.File]
    if missing or not names:
        raise DataError(f"{root}: no shard {missing[0] if missing else '*.tar'}; check the folder or the pattern")
    return f"{prefix}{base}", names


def runs(shard: Shard) -> list[list[Sample]]:
    """A shard's samples cut into runs of at most RUN_SAMPLES samples and RUN_BYTES bytes (one at least);
    a gzipped shard's in one run, which its read task decompresses whole."""
    if is_gzipped(shard.name):
        return [shard.samples] if shard.samples else []
    out, current = [], []
    for s in shard.samples:
        if current and (len(current) == RUN_SAMPLES or s.end - current[0].start > RUN_BYTES):
            out.append(current)
            current = []
        current.append(s)
    return out + ([current] if current else [])


def _split(root: str, shards: list, uris: list[str], form: ShardFormat, side):
    """One side of the split: its samples of `shards` [(shard index, Shard)], and the runs holding
    them, (shard, byte offset, byte length, samples on this side)."""
    index = {name: i for i, name in enumerate(form.class_names)}
    rel, labels, keys, sizes, units = [], [], [], [], []
    for i, shard in shards:
        for run in runs(shard):
            run_keys = np.array([stable_hash(f"{shard.name}/{s.key}") for s in run], dtype=np.int64)
            chosen = [
                (s, key)
                for s, key, side_ok in zip(run, run_keys, on_side(run_keys, side), strict=True)
                if side_ok and _read(s, form)
            ]
            for s, key in chosen:
                rel.append(f"{shard.name}/{s.image}")
                labels.append(index.get(s.label, -1))
                keys.append(int(key))
                sizes.append(s.image_bytes)
            if chosen:
                units.append((i, run[0].start, run[-1].end - run[0].start, len(chosen)))
    split = make_split(root, rel, labels, sizes, keys=keys)
    return sharded(split, uris, np.asarray(units, dtype=np.int64).reshape(-1, 4), form, side)


def _read(sample: Sample, form: ShardFormat) -> bool:
    """Is the sample read: it has an image and a label, or (scoring) an image."""
    return sample.usable or (form.scoring and sample.image is not None)


def scan_for_scoring(root: str, class_names, label_key: str = "label"):
    """Every sample with an image in the shards `root` names, test and unlabelled ones too, as
    one split labelled by `class_names` (a model's: -1 for a sample without a label or with
    another), for jobs.predict and jobs.evaluate."""
    top, names = _shard_set(root)
    shards = scan_shards(top, names, label_key)
    named = classes_file(root)
    beside = read_class_names(named) if named else tuple(class_names)
    if beside != tuple(class_names):
        raise DataError(f"{named}: names the classes {list(beside)[:10]}, the model has {list(class_names)[:10]}")
    labels = {s.label for shard in shards for s in shard.samples if s.label is not None}
    if labels and all(is_index(t) for t in labels):  # indices (.cls): the model's class at that place, however named
        class_names = [str(i) for i in range(len(class_names))]
    form = ShardFormat("webdataset", label=label_key, class_names=tuple(class_names), scoring=True)
    return _split(top, list(enumerate(shards)), [f"{top}/{n}" for n in names], form, None)


def classes_file(root: str) -> str | None:
    """The classes.txt in the folder of the shards `root` names, where there is one."""
    import pyarrow.fs as pafs

    folder = shard_names(root)[0] if is_shard_pattern(root) else root.rstrip("/")
    fs, base, prefix = storage.filesystem(folder)
    there = fs.get_file_info(f"{base}/{CLASSES_FILE}").type == pafs.FileType.File
    return f"{prefix}{base}/{CLASSES_FILE}" if there else None


def first_images(unit, shards, form: ShardFormat, count: int, mean_bytes: float) -> list[bytes]:
    """The first HEADER_BYTES of each of the first `count` images of a unit (a run of samples), for
    their sizes (training.driver.inputs.typical_size): one ranged read of the run's start, as far as those
    samples' members go by the split's mean image size (a gzipped shard: its decompressed stream's
    start). An image the read cut off still gives its header."""
    shard, start, length, _ = (int(v) for v in unit)
    fs, path, _ = storage.filesystem(shards[shard])
    want = min(length, count * (int(mean_bytes) + 4 * tarfile.BLOCKSIZE) + HEADER_BYTES)  # a label member or two
    if is_gzipped(path):
        with fs.open_input_stream(path, compression=None) as stream:
            data = Gunzipped(stream).read(start + want)[start:]
    else:
        with fs.open_input_file(path) as f:
            data = f.read_at(want, start)
    found = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", ignore_zeros=True) as tar:
            while len(found) < count and (member := tar.next()) is not None:
                if member.isfile() and member_key(member.name.rpartition("/")[2])[1].lower() in IMAGE_EXTENSIONS:
                    found.append(data[member.offset_data : member.offset_data + min(member.size, HEADER_BYTES)])
    except (tarfile.TarError, EOFError):  # the read's end, inside a member: the images before it count
        pass
    return found


def read_tar_units(units, root: str, shards, form: ShardFormat, bad: list | None = None):
    """A read task's runs of samples: one ranged read each (a gzipped shard's: the whole file,
    read_run); {bytes, path, label, key} of the samples with an image and a label (the scan
    listed the others, and the damage it read past, which this reads past alike). A run that
    cannot be read at all goes to `bad` as (path, reason), its samples with it; without `bad`,
    its error is raised."""
    import pyarrow as pa

    index = {name: i for i, name in enumerate(form.class_names)}
    top = storage.filesystem(root)[1]
    rows = {BYTES: [], PATH: [], LABEL: [], KEY: []}
    for shard, start, length, count in units:
        fs, path, _ = storage.filesystem(shards[shard])
        name = str(PurePosixPath(path).relative_to(top))
        try:
            data = read_run(fs, path, int(start), int(length))
            with open_tar(fileobj=io.BytesIO(data), mode="r:") as tar:
                found = list(samples(tar, form.label, images=True, size=len(data)))
        except Exception as e:  # the storage's error or the run's bytes': the caller tells them apart
            if bad is None:
                raise
            why = f"cannot read its {int(count)} sample(s) there: {storage.first_line(e)}"
            bad.append((f"{root}/{name}@{int(start)}", why))
            continue
        for s in found:
            if _read(s, form):
                rows[BYTES].append(s.data)
                rows[PATH].append(f"{name}/{s.image}")
                rows[LABEL].append(index.get(s.label, -1))
                rows[KEY].append(stable_hash(f"{name}/{s.key}"))
    types = read_types()
    return pa.table({k: pa.array(v, type=types[k]) for k, v in rows.items()})
