"""The columns of the rows Ray Data carries, named once (docs/design.md, "Contracts").

    a split's units       PATH, LABEL, KEY                 (training/ingest.py, one row a file)
    a read task's rows    BYTES, PATH, LABEL, KEY          (every form's read_units; IMAGE for BYTES
                                                            where the read task decodes)
    the augment stage's   IMAGE, LABEL, KEY, EPOCH         (training/stage.py: what the trainer gets)
    a bad file's row      PATH, REASON                     (the read task's second output)
    a prepared shard's    BYTES, PATH, LABEL, KEY, WIDTH, HEIGHT   (jobs.prepare)

Light (no pyarrow, no Ray): the worker's side reads it too.
"""

from __future__ import annotations

PATH = "path"  # the file, as the user's data names it (relative below a split's root in units)
LABEL = "label"  # int64 class index
KEY = "key"  # int64 stable hash of the relative path: keys each image's augmentation
BYTES = "bytes"  # the encoded file
IMAGE = "image"  # decoded or augmented pixels, (B, H, W, C) uint8
EPOCH = "epoch"  # the epoch the augment stage drew the row's parameters for (training/stamp.py)
REASON = "reason"  # why a file is bad
WIDTH, HEIGHT = "width", "height"  # a prepared shard's image size, read before any decode

READ_COLUMNS = (BYTES, PATH, LABEL, KEY)  # a read task's table, in this order


def read_types() -> dict:
    """The pyarrow type of each of READ_COLUMNS."""
    import pyarrow as pa

    return {BYTES: pa.binary(), PATH: pa.string(), LABEL: pa.int64(), KEY: pa.int64()}
