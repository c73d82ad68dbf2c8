"""The columns of the rows Ray Data carries, named once (docs/design.md, "Contracts").

    a split's units       PATH, LABEL, KEY                 (training/stream/ingest.py, one row a file)
    a read task's rows    BYTES, PATH, LABEL, KEY, EPOCH   (every form's read_units; IMAGE for BYTES
                                                            where the read task decodes)
    the augment stage's   IMAGE, LABEL, KEY, EPOCH         (training/stream/stage.py: what the trainer gets)
    a bad file's row      PATH, REASON                     (the read task's second output)
    a prepared shard's    BYTES, PATH, LABEL, KEY, WIDTH, HEIGHT   (jobs.prepare)

    the stages' costs     READ_COST, AUGMENT_COST, AUGMENT_GPU_COST, DECODED_ON  (each stage stamps the
                                                            rows it makes, training/stream/stage.py
                                                            seconds_per_row; judged in training/bounds.py)

Light (no pyarrow, no Ray): the worker's side reads it too.
"""

from __future__ import annotations

PATH = "path"  # the file, as the user's data names it (relative below a split's root in units)
LABEL = "label"  # int64 class index
KEY = "key"  # int64 stable hash of the relative path: keys each image's augmentation
BYTES = "bytes"  # the encoded file
IMAGE = "image"  # decoded or augmented pixels, (B, H, W, C) uint8
EPOCH = "epoch"  # the epoch the read read the row for, and the augment stage drew for (training/stream/stamp.py)
REASON = "reason"  # why a file is bad
WIDTH, HEIGHT = "width", "height"  # a prepared shard's image size, read before any decode

READ_COLUMNS = (BYTES, PATH, LABEL, KEY)  # a read task's table, in this order


def read_types() -> dict:
    """The pyarrow type of each of READ_COLUMNS."""
    import pyarrow as pa

    return {BYTES: pa.binary(), PATH: pa.string(), LABEL: pa.int64(), KEY: pa.int64()}


READ_COST, AUGMENT_COST = "read_s", "augment_s"  # the row columns: seconds of that stage per image
# the augment call's time on its CUDA stream per image, first operation to last (0 off a GPU): an upper
# bound on the SMs' time, as the stream may idle in between (the kit's profile gives the SMs' own)
AUGMENT_GPU_COST = "augment_gpu_s"
COSTS = (READ_COST, AUGMENT_COST, AUGMENT_GPU_COST)
DECODED_ON = "decoded_on"  # the row column: where its image was decoded (its index in augment.decode.DECODE_PLACES)
