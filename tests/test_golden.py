"""Golden values: the split, the file order and the keyed random numbers, pinned as literals.

Every user's validation set is `in_validation` of `stable_hash` of each path, and every
augmentation is drawn from `KeyedRng` (augment/rng.py). Other tests hold these functions to
their pure-Python twins and to themselves across runs; only literals catch a change to
both sides at once. A change here moves every validation set (a resumed run would then
train on former validation images) and every augmentation across an upgrade: make it on
purpose, and say so where users will read it.
"""

from __future__ import annotations

import numpy as np
import torch

from augment.mix import mix_generator
from augment.pipeline import Pipeline
from augment.presets import PRESETS
from augment.rng import KeyedRng, mix64, salt
from augment.streams import STREAMS, stream_seed
from tests.rng_twins import reference_seed, reference_uniform
from training.forms.data import in_validation, stable_hash
from training.stream.ingest import epoch_order
from training.worker.learner import rank_seed

HASHES = {
    "cat/001.png": 6470101607939607530,
    "dog/0042.jpg": 1239499441195318951,
    "train/eel/x.JPEG": 2732858610064678113,
    "café/ü.png": 3716418344525466210,  # UTF-8 bytes, the same on every platform
    "a/b/c/d.webp": 8661367266453737965,
}
PATHS = [f"class{c}/{i:03d}.png" for c in range(2) for i in range(8)]


def test_stable_hash_of_a_path_is_pinned():
    assert {p: stable_hash(p) for p in HASHES} == HASHES


def test_the_validation_split_is_pinned():
    assert [p for p in PATHS if in_validation(p, 0.2)] == [
        "class0/000.png",
        "class0/003.png",
        "class1/003.png",
        "class1/007.png",
    ]
    assert [p for p in PATHS if in_validation(p, 0.5)] == [
        "class0/000.png",
        "class0/003.png",
        "class1/001.png",
        "class1/003.png",
        "class1/007.png",
    ]
    # the threshold is the hash as a fraction of 2**63: cat/001.png sits at 0.70149
    assert in_validation("cat/001.png", 0.7015) and not in_validation("cat/001.png", 0.7014)


def test_the_keyed_generator_is_pinned():
    keys = torch.tensor([0, 1, HASHES["cat/001.png"]])
    rng = KeyedRng(keys, seed=7, epoch=3)
    uniform = [[5649715, 733783, 16482676], [10504366, 10726764, 14717333], [7432239, 11446590, 3741185]]
    assert (rng.uniform(2, 3) * 2**24).to(torch.int64).tolist() == uniform  # 24-bit draws: exact in float32
    seeds = [
        [1141317979317431107, 1236658437459003582],
        [2417287078185263489, 1531936318791646709],
        [5163225615496946222, 101216170348449514],
    ]
    assert rng.seeds(3, 2).tolist() == seeds
    assert (mix64(0), mix64(1), salt(7, 3, 2)) == (0, 6238072747940578789, 17219123202084646147)
    # the pure-Python twins give the same literals
    assert [[reference_uniform(int(k), 7, 3, 2, i) * 2**24 for i in range(3)] for k in keys] == uniform
    assert [[reference_seed(int(k), 7, 3, 3, i) for i in range(2)] for k in keys] == seeds
    assert mix_generator(0, 1, 2, 3).initial_seed() == 1891491348718390794  # MixUp/CutMix per step (augment/streams.py)


def test_the_file_order_of_an_epoch_is_pinned():
    assert epoch_order(10, 0, 1).tolist() == [9, 3, 5, 1, 4, 2, 7, 0, 6, 8]
    assert epoch_order(10, 0, 2).tolist() == [1, 6, 9, 5, 0, 7, 8, 4, 3, 2]


def test_every_random_stream_of_a_run_is_pinned():
    """augment/streams.py: the one hash from --seed to each stream (file order, a read task's unit
    order, the trainer's local shuffle, each rank's generators, MixUp, jobs.prepare's order)."""
    assert {name: stream_seed(name, 0, 1, 2) for name in STREAMS} == {
        "file_order": 1803388250365489468,
        "unit_order": 8197969866438148584,
        "local_shuffle": 2184181333719630905,
        "rank": 3196510693154536718,
        "mix": 6035814864756897952,
        "prepare_order": 5680409769404714844,
    }
    assert (rank_seed(7, 1), rank_seed(7, 1, after=3)) == (7363776140713025019, 1441060312594319371)
    assert len(set(STREAMS.values())) == len(STREAMS)  # a number is never shared


def test_an_images_imagenet_parameters_are_pinned():
    """The draws become parameters: the crop boxes, the flips and the jitter factors of three
    images at seed 7, epoch 3 (imagenet preset)."""
    pipe = Pipeline(PRESETS["imagenet"].train, seed=7)
    keys = torch.tensor([0, 1, HASHES["cat/001.png"]])
    draws = pipe.at_epoch(3).sample(torch.tensor([[300, 400], [500, 333], [224, 224]]), keys)
    crop = draws.first
    assert crop["box"].tolist() == [[40, 56, 237, 285], [270, 51, 168, 154], [65, 31, 98, 122]]
    flip, jitter = draws.rest
    assert flip["flip"].tolist() == [True, False, True]
    assert jitter["order"].tolist() == [[1, 0, 2], [2, 1, 0], [1, 0, 2]]
    factors = [[0.9536637, 1.1325842, 0.9495115], [0.9434044, 1.0455383, 1.0016810], [1.1920675, 0.8101664, 0.9146600]]
    np.testing.assert_allclose(jitter["factors"][:, :3].numpy(), factors, rtol=0, atol=1e-6)
