"""Labels as the sources give them -> class names and indices: one kind of label for a whole
source (indices or names), indices without gaps, and names for indices from a file (--class-names,
or a classes.txt beside WebDataset shards), line i naming class i, for model.pt, predictions.csv
and jobs.predict's labels."""

from __future__ import annotations

import dataclasses

import numpy as np

from training import storage, userfiles
from training.forms.data import DataError, ImageTree


def label_text(value) -> str:
    """A label as a source gives it, as text: an index (7, "7", "007", 7.0, "7.0": pandas writes an
    integer column with a gap as floats) as its digits, a negative one with its sign, a name as it
    is; "" for none (None, blank)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    whole, dot, fraction = text.partition(".")
    digits = whole[1:] if whole.startswith("-") else whole
    if digits.isascii() and digits.isdigit() and (not dot or not fraction.strip("0")):
        return str(int(whole))
    return text


def is_index(text: str) -> bool:
    return text.isascii() and text.lstrip("-").isdigit()


def index_labels(train_labels, val_labels, where: str, at=None) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """(class names, train labels, val labels as positions) from labels as a source gives them, whose
    kind is decided once for the whole source: all class indices (names "0".."N-1", N the largest
    + 1) or all class names (sorted). `at(i)` names the i-th label (train, then val: FILE:LINE, a
    sample) in a DataError: for a mix of indices and names, a negative index, two names that differ
    only in case, indices that leave a class without training labels (0, 1, 999), a validation label
    that is no training class, or fewer than 2 classes."""
    known: dict = {}  # a source repeats a few labels many times; each is made text once

    def text(value) -> str:
        key = (type(value), value)  # True is no 1
        try:
            return known[key]
        except KeyError:
            known[key] = label_text(value)
            return known[key]
        except TypeError:  # unhashable: a JSON list
            return label_text(value)

    texts = [text(v) for v in (*train_labels, *val_labels)]
    at = at or (lambda i: f"label {i + 1}")
    _check_kind(texts, where, at)
    train, val = texts[: len(train_labels)], texts[len(train_labels) :]
    names = _index_names(train, where, at) if train and is_index(train[0]) else tuple(sorted(set(train)))
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(val) - set(index))
    if unknown:
        raise DataError(
            f"{where}: validation label(s) {unknown[:5]} are not among the training labels; fix those labels "
            "or add training images of the classes"
        )
    if len(names) < 2:
        raise DataError(f"{where}: {len(names)} class(es) in the training labels; a classifier needs at least 2")
    return names, np.array([index[t] for t in train], np.int32), np.array([index[t] for t in val], np.int32)


def _check_kind(texts: list[str], where: str, at) -> None:
    """DataError for labels of more than one kind (indices beside names, a negative index, names
    that differ only in case); the labels are looked at one by one only once one is found."""
    kinds = {t: is_index(t) for t in set(texts)}
    negative = next((t for t, indexed in kinds.items() if indexed and t.startswith("-")), None)
    if negative is not None:
        raise DataError(
            f"{where}: label {negative} ({at(texts.index(negative))}) is a negative class index; give indices "
            "0..N-1 or class names, and leave unlabelled images out"
        )
    if len(set(kinds.values())) > 1:
        i = next(i for i, t in enumerate(texts) if kinds[t])
        j = next(j for j, t in enumerate(texts) if not kinds[t])
        raise DataError(
            f"{where}: the labels mix class indices ({at(i)}: {texts[i]!r}) and class names ({at(j)}: "
            f"{texts[j]!r}); give every label as an index 0..N-1, or every one as a name"
        )
    folded: dict[str, str] = {}
    for name in kinds:
        other = folded.setdefault(name.casefold(), name)
        if other != name:
            i, j = sorted((texts.index(other), texts.index(name)))
            raise DataError(
                f"{where}: labels {texts[i]!r} ({at(i)}) and {texts[j]!r} ({at(j)}) differ only in case; write "
                "each class's name one way"
            )


def _index_names(train: list[str], where: str, at) -> tuple[str, ...]:
    """The names "0".."N-1" of training labels that are indices; DataError where one of them has no label."""
    used = set(train)
    top = max(int(t) for t in used)
    empty = [str(i) for i in range(top + 1) if str(i) not in used]
    if empty:
        raise DataError(
            f"{where}: class indices run to {top} ({at(train.index(str(top)))}) but {len(empty)} of those {top + 1} "
            f"classes have no training image ({', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}); number "
            "the classes 0..N-1 without gaps, or give class names"
        )
    return tuple(str(i) for i in range(top + 1))


def read_class_names(path: str, flag: str = "") -> tuple[str, ...]:
    """The names of a class names file (--class-names, a WebDataset's classes.txt): one a line, line i
    naming class i (`flag`: the flag that named it, for the message). DataError for a file that is
    not there or not text, a blank line before the last name, or a name given twice."""
    import pyarrow.fs as pafs

    what = None if storage.is_uri(path) else userfiles.what_is_at(path)
    if what and what != "no such file":  # a pipe too: a resume reads the file again
        raise DataError(
            f"{flag} {path}".strip() + f" is {what}, not a file; give a text file with one class name a line"
        )
    fs, inner, _ = storage.filesystem(path)
    with storage.errors(path):
        if fs.get_file_info(inner).type != pafs.FileType.File:
            raise DataError(f"{path}: no such class names file; give a text file with one class name a line")
        with fs.open_input_file(inner) as f:
            raw = f.read()
    try:
        lines = storage.decode_text(raw).rstrip().splitlines()
    except ValueError as e:
        raise DataError(f"{path}: {e}; save it as UTF-8") from None
    names = tuple(line.strip() for line in lines)
    if "" in names or not names:
        raise DataError(f"{path}:{names.index('') + 1 if names else 1}: no class name; write one name a line")
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise DataError(f"{path}:{names.index(twice, names.index(twice) + 1) + 1}: {twice!r} is named twice")
    return names


def by_index(names) -> bool:
    """Are the class names the class indices "0".."N-1" (of labels that are indices)?"""
    return tuple(names) == tuple(str(i) for i in range(len(names)))


def name_classes(tree: ImageTree, names: tuple[str, ...], where: str) -> ImageTree:
    """`tree` with its class indices "0".."N-1" named by `names` (line i names class i; more names
    than indices: classes without training images, which describe() counts, as a ClassLabel's).
    Only the names change: a shard's labels stay indices (ShardFormat.class_names). DataError where
    the classes have names already, or where `names` are fewer than the indices."""
    n = tree.num_classes
    if not by_index(tree.class_names):
        raise DataError(
            f"{where}: the data names its classes already ({', '.join(tree.class_names[:3])}, ...); a class names "
            "file names class indices only: drop it"
        )
    if len(names) < n:
        raise DataError(
            f"{where}: {len(names)} class names for the class indices 0..{n - 1} the labels hold; give one name a "
            "line for each, line i naming class i"
        )
    return dataclasses.replace(tree, class_names=tuple(names))
