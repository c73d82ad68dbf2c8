"""Tar archives as shards hold them: read on past a damaged member header, or decompressed from
gzip (training/forms/webdataset.py reads WebDataset's samples out of them).

A damaged archive costs only what is damaged: past a member header that is not one (a broken
checksum, zeroed bytes), reading goes on from the next valid header, and each run of bytes that
held no member is a Broken. A gzip stream cannot be read from its middle, nor on past damage: a
gzipped shard is read whole (read_run), and where its stream breaks off, so does the archive.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import tarfile
import zlib

from training import storage

GZIPPED = (".tar.gz", ".tgz")


def is_gzipped(name: str) -> bool:
    return name.lower().endswith(GZIPPED)


@dataclasses.dataclass(frozen=True)
class Broken:
    """Bytes of a shard that hold no member: a header that is not one, and what follows it up to
    the next valid header (the lost member's data), or an end cut off inside a member."""

    offset: int  # in the shard (or the unit read)
    length: int
    name: str | None  # the lost member's name, where its broken header still gives it
    why: str = "broken tar header"

    @property
    def key(self) -> str | None:
        """The sample key of the lost member's name (None: not known)."""
        if not self.name:
            return None
        folder, _, file = self.name.rpartition("/")
        stem = member_key(file)[0]
        return f"{folder}/{stem}" if folder else stem

    def describe(self) -> str:
        member = f" (member {self.name})" if self.name else ""
        skipped = f", {self.length} bytes skipped" if self.length else ""  # 0: a gzip stream's end, unknown
        return f"{self.why} at byte {self.offset}{member}{skipped}"


def open_tar(**kwargs) -> tarfile.TarFile:
    """tarfile.open for a shard that may be damaged: reading goes on at the next valid header
    after one that is not (ignore_zeros), and every block tried as a header and refused is kept
    in `tar.refused` (its bytes; None for zeros) for `members` to tell damage from padding."""
    refused: list[bytes | None] = []

    class Header(tarfile.TarInfo):
        @classmethod
        def frombuf(cls, buf, encoding, errors):
            try:
                return super().frombuf(buf, encoding, errors)
            except tarfile.HeaderError:
                refused.append(bytes(buf) if buf.strip(b"\0") else None)
                raise

    tar = tarfile.open(ignore_zeros=True, tarinfo=Header, **kwargs)
    tar.refused = refused
    return tar


def members(tar: tarfile.TarFile, broken: list, size: int | None):
    """The members of a tar from open_tar, in order. Bytes between two members that are not all
    zeros (end-of-archive blocks, as between concatenated tars, are) go to `broken` as a Broken;
    so do a member cut off by the end of the data (`size` bytes) and an end that is no member.
    `size` None: a decompressing stream, of a size not known before its end, and not to be read
    on past damage (a gzip stream does not resume): what follows it is one Broken."""
    end = 0  # where the next header should start: just past the last member's data
    while True:
        try:
            member = tar.next()
        except OSError:  # the storage's error, not the shard's: the caller's to handle
            raise
        except Exception as e:  # tarfile's ReadError (a broken header after an extended one's), or its parsing's
            if size is None:  # a damaged or cut gzip stream (Gunzipped): nothing after it can be read
                broken.append(Broken(end, 0, None, storage.first_line(e)))
                return
            if tar.offset >= size:  # the data ends where a header would start: nothing lost
                return
            # TarFile.offset is where it reads the next header: on from the block after the one that
            # failed, as ignore_zeros goes on past a header that is not one
            tar.refused.append(b"")  # the block that failed: not zeros, no name
            tar.offset += tarfile.BLOCKSIZE
            continue
        tried, tar.refused[:] = list(tar.refused), []
        if member is None:
            if any(b is not None for b in tried):  # the end: not a member, not zeros
                broken.append(Broken(end, (tar.offset if size is None else size) - end, _header_name(tried[0])))
            return
        if member.offset > end and any(b is not None for b in tried):
            broken.append(Broken(end, member.offset - end, _header_name(tried[0])))
        if size is not None and member.offset_data + member.size > size:
            cut = "a member cut off by the end of the shard"
            broken.append(Broken(member.offset, size - member.offset, storage.shown_name(member.name), cut))
            return
        end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        yield member


def _header_name(block: bytes | None) -> str | None:
    """The member name a refused header block still holds, where it is a ustar header's (its
    checksum or a field broke): the name field, after the prefix field."""
    if not block or len(block) < 512 or block[257:262] != b"ustar":
        return None
    try:
        name, prefix = (block[a:b].split(b"\0", 1)[0].decode() for a, b in ((0, 100), (345, 500)))
    except UnicodeDecodeError:
        return None
    name = f"{prefix}/{name}" if prefix and name else name
    return name if name.isprintable() and name.strip() else None


def member_key(file: str) -> tuple[str, str]:
    """(sample key, extension) of a member's file name: split at the first dot, as webdataset does,
    unless a part between dots has no letter: that part is the key's (cat.train.001.jpg is the sample
    cat.train.001, whose image is a jpg; webdataset's rule would make it cat, with no image), while
    img.seg.png stays the sample img's seg.png."""
    parts = file.split(".")
    cut = len(parts)
    while cut > 1 and re.search("[A-Za-z]", parts[cut - 1]):
        cut -= 1
    cut = 1 if cut == len(parts) else cut  # no extension with a letter (x.001): webdataset's first dot
    return ".".join(parts[:cut]), ".".join(parts[cut:])


class Gunzipped:
    """A gzip stream's decompressed bytes for tarfile's stream mode; a damaged or cut stream raises
    tarfile.ReadError, the shard's error (the storage's own errors stay OSErrors)."""

    def __init__(self, stream):
        self._gzip = gzip.GzipFile(fileobj=stream)

    def read(self, size: int = -1) -> bytes:
        try:
            return self._gzip.read(size)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise tarfile.ReadError(f"the gzip stream breaks off: {e}") from None


def read_run(fs, path: str, start: int, length: int) -> bytes:
    """`length` bytes of a shard's tar from `start`: one ranged read, or of a gzipped shard (whose
    offsets are the decompressed tar's) the whole file, decompressed."""
    with fs.open_input_file(path) as f:
        if not is_gzipped(path):
            return f.read_at(length, start)
        packed = f.read()
    return gzip.decompress(packed)[start : start + length]
