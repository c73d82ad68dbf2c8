"""Augment ops and the augment stage, without Ray unless a test says so.

`OP_CASES` is the shared parametrised base (Kornia's habit): every op is run through the
same checks, so a new op gets them by adding one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from augment.geometry import resample_boxes
from augment.ops import OPS, Normalize
from augment.pipeline import Pipeline, to_canvas
from augment.presets import PRESETS, PresetError, load_preset, preset_from_dict
from augment.rng import KeyedRng
from bench import fuzz_yaml
from tests.rng_twins import reference_seed, reference_uniform
from training.stream.stage import AugmentStage, StageArgs

B = 64


def _batch(b=B, h=32, w=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, h, w, 3), generator=g, dtype=torch.uint8)


def _keys(b=B):
    return torch.arange(1000, 1000 + b, dtype=torch.int64)


def _float_batch(b=B, size=32):
    return _batch(b, size, size).permute(0, 3, 1, 2).float() / 255.0


# op name -> (params with p=1 / always applying, params with p=0 or None if p does not apply)
OP_CASES = {
    "random_crop": ({"size": 32, "padding": 4}, None),
    "center_crop": ({"size": 24}, None),
    "horizontal_flip": ({"p": 1.0}, {"p": 0.0}),
    "color_jitter": (
        {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1, "p": 1.0},
        {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "p": 0.0},
    ),
    "random_resized_crop": ({"size": 24}, None),
    "resize_center_crop": ({"resize": 28, "size": 24}, None),
    "random_erasing": ({"p": 1.0, "value": [0.5, 0.5, 0.5]}, {"p": 0.0}),
    "trivial_augment": ({"p": 1.0}, {"p": 0.0}),
    "rand_augment": ({"n": 1, "m": 9, "p": 1.0}, {"p": 0.0}),  # n=2 may draw invert twice: the identity
}
RANDOM_FREE = {"center_crop", "resize_center_crop"}  # deterministic ops: nothing to reseed


def test_every_registered_op_has_a_case():
    assert set(OP_CASES) == set(OPS)


def _run(name, params, epoch=0, keys=None, x=None):
    op = OPS[name](**params)
    op.stream = 7
    keys = _keys() if keys is None else keys
    rng = KeyedRng(keys, seed=3, epoch=epoch)
    if op.geometry:
        canvas = _batch() if x is None else x
        sizes = torch.tensor([[canvas.shape[1], canvas.shape[2]]]).expand(canvas.shape[0], 2)
        return op(canvas, rng, sizes)
    return op(_float_batch() if x is None else x, rng)


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_shape_dtype_range(name):
    out = _run(name, OP_CASES[name][0])
    size = OP_CASES[name][0].get("size", 32)
    assert out.shape == (B, 3, size, size)
    assert out.dtype == torch.float32
    assert out.min() >= 0.0 and out.max() <= 1.0


@pytest.mark.parametrize("name", sorted(n for n, (_, p0) in OP_CASES.items() if p0 is not None))
def test_p0_is_identity(name):
    x = _float_batch()
    assert torch.equal(_run(name, OP_CASES[name][1], x=x), x)


@pytest.mark.parametrize("name", sorted(n for n in OP_CASES if not OPS[n].geometry))
def test_p1_changes_every_image(name):
    x = _float_batch() * 0.6 + 0.2  # not full range, or auto_contrast would be the identity
    out = _run(name, OP_CASES[name][0], x=x)
    changed = (out - x).abs().flatten(1).amax(1) > 1e-4
    assert changed.all()


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_same_seed_epoch_key_gives_same_output_other_epoch_differs(name):
    params = {"p": 0.5} if name == "horizontal_flip" else OP_CASES[name][0]  # p=1 flips are not random
    a, b = _run(name, params, epoch=1), _run(name, params, epoch=1)
    assert torch.equal(a, b)
    if name not in RANDOM_FREE:
        assert not torch.equal(a, _run(name, params, epoch=2))


@pytest.mark.parametrize("name", sorted(n for n in OP_CASES if n not in RANDOM_FREE))
def test_an_images_augmentation_does_not_depend_on_its_batch(name):
    """Image i gets the same result alone, in a batch, or in another order: every op, Kornia's
    policies included (tests/test_augment_kornia.py does the same for Kornia's ops by name)."""
    params = {"p": 0.5} if name == "horizontal_flip" else OP_CASES[name][0]
    keys = _keys()
    x = _batch() if OPS[name].geometry else _float_batch()
    full = _run(name, params, keys=keys, x=x)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(1))
    shuffled = _run(name, params, keys=keys[perm], x=x[perm])
    torch.testing.assert_close(shuffled, full[perm], rtol=0, atol=1e-6)
    half = _run(name, params, keys=keys[:5], x=x[:5])
    torch.testing.assert_close(half, full[:5], rtol=0, atol=1e-6)


def test_keyed_rng_matches_pure_python_reference():
    keys = torch.tensor([0, 1, 12345, 2**62 + 17, 2**63 - 1])
    rng = KeyedRng(keys, seed=11, epoch=4)
    u, seeds = rng.uniform(stream=9, n=3), rng.seeds(stream=9, n=3)
    for row, k in enumerate(keys.tolist()):
        for i in range(3):
            assert u[row, i].item() == pytest.approx(reference_uniform(k, 11, 4, 9, i), abs=0)
            assert seeds[row, i].item() == reference_seed(k, 11, 4, 9, i)
    assert (seeds >= 0).all() and len(set(seeds.flatten().tolist())) == seeds.numel()


def test_random_crop_pads_with_zeros_and_stays_inside_the_padded_image():
    ones = torch.full((B, 32, 32, 3), 255, dtype=torch.uint8)
    out = _run("random_crop", {"size": 32, "padding": 4}, x=ones)
    # every crop is 32x32 out of a 40x40 padded image: at most 4 zero rows/cols per side
    zero_rows = (out[:, 0, :, 16] == 0).sum(1)
    assert zero_rows.max() <= 4 and zero_rows.float().mean() > 0.5


def test_center_crop_matches_torchvision_on_odd_offsets():
    import torchvision.transforms.v2.functional as TF

    x = _batch(4, 37, 30)
    out = _run("center_crop", {"size": (24, 20)}, x=x)
    ref = TF.center_crop(x.permute(0, 3, 1, 2), [24, 20]).float() / 255
    torch.testing.assert_close(out, ref)


def test_normalize_matches_torchvision():
    import torchvision.transforms.v2.functional as TF

    x = _batch(4)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    ref = TF.normalize(x.permute(0, 3, 1, 2).float() / 255, mean, std)
    out = Normalize(mean, std)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="uint8"):
        Normalize(mean, std)(x.float())


def test_cifar_eval_is_identity_on_32px_and_train_is_uint8():
    x = _batch()
    canvas, sizes = to_canvas(x.numpy())
    ev = Pipeline(PRESETS["cifar"].eval, seed=0)(canvas, sizes, _keys(), epoch=0)
    assert torch.equal(ev, x)
    tr = Pipeline(PRESETS["cifar"].train, seed=0)(canvas, sizes, _keys(), epoch=0)
    assert tr.dtype == torch.uint8 and tr.shape == (B, 32, 32, 3)
    assert not torch.equal(tr, x)


def test_ragged_batch_equals_each_image_alone():
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(40, 36), (32, 32), (28, 50), (33, 31)]]
    ragged = np.empty(4, dtype=object)
    ragged[:] = images
    pipe = Pipeline(PRESETS["cifar"].train, seed=5)
    keys = _keys(4)
    together = pipe(*to_canvas(ragged), keys, epoch=2)
    for i, img in enumerate(images):
        alone = pipe(*to_canvas(img[None]), keys[i : i + 1], epoch=2)
        assert torch.equal(alone[0], together[i])


def test_stage_stamps_every_row_with_the_epoch_it_augmented_for(monkeypatch):
    """The epoch comes with the rows (the read task's EPOCH column): the stage asks no actor."""
    import ray

    monkeypatch.setattr(ray, "get", lambda *a, **k: pytest.fail("an augment call asked an actor (ray.get)"))
    batch = {"image": _batch(8).numpy(), "label": np.arange(8), "key": np.arange(8, dtype=np.int64)}
    stage = AugmentStage(StageArgs(PRESETS["cifar"], train=True, seed=0), device="cpu")
    outs = {}
    for epoch in (0, 3):
        outs[epoch] = stage(batch | {"epoch": np.full(8, epoch, dtype=np.int64)})
        assert outs[epoch]["image"].shape == (8, 32, 32, 3) and outs[epoch]["image"].dtype == np.uint8
        assert list(outs[epoch]["label"]) == list(range(8)) and list(outs[epoch]["key"]) == list(range(8))
        assert outs[epoch]["epoch"].tolist() == [epoch] * 8
    expected = Pipeline(PRESETS["cifar"].train, seed=0)(*to_canvas(batch["image"]), torch.arange(8), epoch=3)
    assert np.array_equal(outs[3]["image"], expected.numpy())  # the stamp names the epoch the views were drawn for
    assert not np.array_equal(outs[0]["image"], outs[3]["image"])
    again = stage(batch | {"epoch": np.full(8, 3, dtype=np.int64)})  # the epoch's pipeline, kept
    assert stage.pipeline.current.epoch == 3 and np.array_equal(again["image"], outs[3]["image"])
    with pytest.raises(ValueError, match="a training batch without its 'epoch' column"):
        stage(batch)  # augmented for epoch 0 in every epoch, unseen, were it taken
    evaluation = AugmentStage(StageArgs(PRESETS["cifar"], train=False, seed=0), device="cpu")
    assert evaluation(batch)["epoch"].tolist() == [0] * 8  # evaluation draws nothing: no epoch needed


def test_preset_files_and_their_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text(
        "name: mine\ntrain:\n  - random_crop: {size: 16, padding: 2}\n  - horizontal_flip: {p: 0.3}\neval:\n  - "
        "center_crop: {size: 16}\n"
    )
    p = load_preset(str(good))
    assert p.name == "mine" and p.image_size == 16 and p.train[1] == {"horizontal_flip": {"p": 0.3}}
    cases = {
        "unknown op": ("train: [{spin: {}}]\neval: [{center_crop: {size: 8}}]", "unknown op 'spin'; valid ops: "),
        "unknown param": (
            "train: [{random_crop: {size: 8, pad: 2}}]\neval: [{center_crop: {size: 8}}]",
            "unknown parameter(s) ['pad']; valid: ['size', 'padding', 'fill']",
        ),
        "order": (
            "train: [{horizontal_flip: {}}]\neval: [{center_crop: {size: 8}}]",
            "the first op, and only the first, is a geometry op",
        ),
        "unknown key": (
            "train: [{random_crop: {size: 8}}]\neval: [{center_crop: {size: 8}}]\nnormalise: 1",
            "unknown key(s) ['normalise']",
        ),
        # issue 53: an alias bomb as a name took the machine's memory; anchors, aliases and tags are refused
        "alias bomb": (
            fuzz_yaml.ALIAS_BOMB.replace("data:", "name:") + "train: []\neval: []",
            "line 1: an alias or anchor (a)",
        ),
        "tag": (
            "name: !!python/name:os.system\ntrain: []",
            "line 1: a tag (!!python/name:os.system); tags are not read",
        ),
    }
    for name, (text, message) in cases.items():
        f = tmp_path / f"{name.replace(' ', '_')}.yaml"
        f.write_text(text)
        with pytest.raises(PresetError) as err:
            load_preset(str(f))
        assert message in str(err.value), name
    with pytest.raises(PresetError, match="built-in presets: \\['cifar'"):
        load_preset("imagenett")


MINE = {
    "name": "mine",
    "mean": [0.5, 0.4, 0.3],
    "std": [0.2, 0.25, 0.3],
    "train": [{"random_crop": {"size": 16, "padding": 2}}, {"horizontal_flip": {"p": 0.3}}],
    "eval": [{"center_crop": {"size": 16}}],
    "mix": {"mixup_alpha": 0.2},
}


def test_a_json_preset_file_is_the_preset_its_yaml_twin_is_and_is_checked_alike(tmp_path):
    import json

    import yaml

    (tmp_path / "mine.json").write_text(json.dumps(MINE))
    (tmp_path / "mine.yml").write_text(yaml.safe_dump(MINE))
    p = load_preset(str(tmp_path / "mine.json"))
    assert p == load_preset(str(tmp_path / "mine.yml")) and p.to_dict() == MINE
    assert (p.mean, p.std, p.image_size) == ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), 16)
    for change, message in (
        ({"train": [{"spin": {}}]}, "bad.json: train[0]: unknown op 'spin'; valid ops: "),
        ({"eval": []}, "bad.json: eval: expected a non-empty list of ops"),
        ({"mean": [0.5, 0.5]}, "bad.json: mean: expected three numbers, one per RGB channel"),
        ({"std": [0.2, 0.0, 0.2]}, "bad.json: std: expected three numbers above 0"),
        ({"extra": 1}, "bad.json: unknown key(s) ['extra']"),
    ):
        (tmp_path / "bad.json").write_text(json.dumps(MINE | change))
        with pytest.raises(PresetError) as err:
            load_preset(str(tmp_path / "bad.json"))
        assert message in str(err.value) and "\n" not in str(err.value), err.value
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(PresetError, match="list.json: expected a mapping with keys train, eval"):
        load_preset(str(tmp_path / "list.json"))


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.yaml", "train: [", "a.yaml: not valid YAML (expected the node content, but found '<stream end>' at line 1"),
        ("b.yaml", "a: &x 1\nb: *y\n", "b.yaml: line 1: an alias or anchor (x); they are not read, write the value"),
        ("c.json", '{"train": [', "c.json: not valid JSON (Expecting value at line 1, column 12)"),
        ("d.json", "{'train': []}", "d.json: not valid JSON (Expecting property name enclosed in double quotes"),
    ],
)
def test_a_preset_file_that_does_not_parse_is_a_preset_error_naming_the_file(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(PresetError) as err:
        load_preset(str(tmp_path / name))
    assert message in str(err.value) and str(tmp_path / name) in str(err.value) and "\n" not in str(err.value)


def test_preset_round_trips_through_dict():
    p = PRESETS["cifar"]
    assert preset_from_dict(p.to_dict()) == p


# --------------------------------------------------------------------------- variable-size photos


def _photos(sizes=((30, 40), (37, 50), (50, 33), (41, 41)), seed=0):
    rng = np.random.default_rng(seed)
    images = []
    for h, w in sizes:  # smooth: a gradient plus a little noise
        yy, xx = np.meshgrid(np.linspace(0, 255, h), np.linspace(0, 255, w), indexing="ij")
        img = np.stack([yy, xx, (yy + xx) / 2], -1) + rng.normal(0, 8, (h, w, 3))
        images.append(np.clip(img, 0, 255).astype(np.uint8))
    ragged = np.empty(len(images), dtype=object)
    ragged[:] = images
    return ragged


@pytest.mark.parametrize(
    "name,params", [("random_resized_crop", {"size": 24}), ("resize_center_crop", {"resize": 28, "size": 24})]
)
def test_cpu_loop_and_batched_matmul_resampling_agree(name, params):
    """The CPU formulation (per-image antialiased interpolate, uint8) and the GPU one (two
    batched matmuls, float) of the same op on a ragged batch: within one uint8 level (torch's
    uint8 kernel rounds its weights to 16-bit fixed point), and well under it on average."""
    canvas, sizes = to_canvas(_photos())
    rng = KeyedRng(_keys(4), seed=1, epoch=0)
    loop, matmul = OPS[name](**params, method="loop"), OPS[name](**params, method="matmul")
    p = loop.sample(rng, sizes)
    a, b = loop.apply(canvas, p, sizes), matmul.apply(canvas, p, sizes)
    assert a.shape == b.shape == (4, 3, 24, 24)
    assert (a - b).abs().max() <= 1 / 255 + 1e-5 and (a - b).abs().mean() < 0.35 / 255


def test_float16_resampling_stays_within_a_third_of_a_level():
    """The GPU resamples in float16: against float64, on ImageNet-size photos cropped and
    resized to 224 px (torch's CPU float16 kernels), at most 0.3 of a level off, and at most
    one uint8 level after rounding, for under 8 % of the pixels."""
    canvas, sizes = to_canvas(_photos([(375, 500), (500, 333), (400, 400), (333, 500)] * 4))
    op = OPS["random_resized_crop"](size=224, method="matmul")
    p = op.sample(KeyedRng(_keys(16), seed=3, epoch=0), sizes)
    args = (canvas, p["box"], p["resized"], p["offset"], (224, 224), "matmul")
    half, exact = (resample_boxes(*args, dtype=d).double() * 255 for d in (torch.float16, torch.float64))
    assert (half - exact).abs().max() <= 0.3
    rounded = (half.round() - exact.round()).abs()
    assert rounded.max() <= 1 and 0 < (rounded > 0).double().mean() < 0.08


def test_uninitialised_canvas_memory_never_reaches_the_output():
    """to_canvas leaves the canvas outside each image uninitialised: fill it with 255 and
    with 0 and check every geometry op gives the same result."""
    canvas, sizes = to_canvas(_photos())
    outs = []
    for fill in (0, 255):
        c = torch.full_like(canvas, fill)
        for i, (h, w) in enumerate(sizes.tolist()):
            c[i, :h, :w] = canvas[i, :h, :w]
        rng = KeyedRng(_keys(4), seed=0, epoch=0)
        outs.append(
            [
                OPS[n](**OP_CASES[n][0], **m)(c, rng, sizes)
                for n in sorted(OPS)
                if OPS[n].geometry
                for m in ([{}] if n in ("random_crop", "center_crop") else [{"method": "loop"}, {"method": "matmul"}])
            ]
        )
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["cifar", "imagenet"])
def test_ragged_photos_batched_equal_each_photo_alone_and_chunking_changes_nothing(preset, monkeypatch):
    import augment.pipeline

    images = _photos(((300, 400), (375, 500), (500, 333))) if preset == "imagenet" else _photos()
    pipe = Pipeline(PRESETS[preset].train, seed=5)
    keys = _keys(len(images))
    together = pipe(*to_canvas(images), keys, epoch=2)
    size = PRESETS[preset].image_size
    assert together.shape == (len(images), size, size, 3) and together.dtype == torch.uint8
    for i in range(len(images)):
        alone = pipe(*to_canvas(images[i : i + 1]), keys[i : i + 1], epoch=2)
        assert torch.equal(alone[0], together[i])
    monkeypatch.setattr(augment.pipeline, "CPU_CHUNK_PIXELS", 1)  # one image per chunk
    assert torch.equal(pipe(*to_canvas(images), keys, epoch=2), together)


def test_imagenet_preset_is_the_seeds():
    p = PRESETS["imagenet"]
    assert p.image_size == 224 and p.mean == (0.485, 0.456, 0.406)
    assert [next(iter(s)) for s in p.train] == ["random_resized_crop", "horizontal_flip", "color_jitter"]
    assert p.train[0]["random_resized_crop"] == {"size": 224, "scale": [0.08, 1.0], "ratio": [0.75, 4 / 3]}
    assert p.eval == ({"resize_center_crop": {"resize": 256, "size": 224}},)
    assert preset_from_dict(p.to_dict()) == p and p.mix is None


# --------------------------------------------------------------------------- strength schedule


def test_schedule_strengths():
    from augment.schedule import strength

    assert [strength("none", e, 5) for e in range(5)] == [1.0] * 5
    assert [strength("linear-decay", e, 5) for e in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [strength("linear-ramp:0.5", e, 3) for e in range(3)] == [0.5, 0.75, 1.0]
    cos = [strength("cosine-decay:0.2", e, 5) for e in range(5)]
    assert (
        cos[0] == 1.0 and cos[-1] == pytest.approx(0.2) and cos[1] > 0.75 * 1.0 + 0.25 * 0.2
    )  # slower start than linear
    assert strength("cosine-ramp", 0, 1) == 0.0  # one epoch: the first is the start


@pytest.mark.parametrize("bad", ["linear", "cosine-decay:2", "none:0.5", "linear-ramp:x"])
def test_bad_schedule_is_a_preset_error_listing_the_valid_ones(bad):
    with pytest.raises(PresetError, match="valid: none, linear-decay|must be a number in"):
        Pipeline(PRESETS["cifar"].train, seed=0, schedule=bad, epochs=3)


def test_schedule_scales_jitter_erasing_and_crop_range():
    x = _batch()
    canvas, sizes = to_canvas(x.numpy())
    specs = (
        {"random_resized_crop": {"size": 32}},
        {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}},
        {"random_erasing": {"p": 1.0}},
    )
    pipe = Pipeline(specs, seed=0, schedule="linear-decay", epochs=3)
    first = pipe(canvas, sizes, _keys(), epoch=0)
    assert not torch.equal(first, x)
    assert torch.equal(pipe(canvas, sizes, _keys(), epoch=2), x)  # strength 0: whole image, no jitter, nothing erased
    mid = pipe(canvas, sizes, _keys(), epoch=1)  # strength 0.5: crop area >= 54 %, factors within 0.8..1.2
    ops = pipe.at_epoch(1).ops
    assert ops[0].scale == pytest.approx((0.54, 1.0)) and ops[1].brightness == pytest.approx(0.2)
    assert ops[2].scale == pytest.approx((0.01, 0.165))
    assert pipe.at_epoch(0).ops[0].scale == pytest.approx((0.08, 1.0))  # an epoch's ops are its own
    assert (mid.float() - x.float()).abs().mean() < (first.float() - x.float()).abs().mean()
    assert torch.equal(pipe(canvas, sizes, _keys(), epoch=0), first)  # back to epoch 0: same as before


def test_an_epochs_pipeline_is_built_at_its_first_batch_and_kept(monkeypatch):
    """Every batch of an epoch gets the pipeline its first batch built: the schedule strings are
    read once an epoch, not once a batch."""
    import augment.pipeline

    pipe = Pipeline(PRESETS["cifar"].train, seed=0, schedule="linear-decay", epochs=4)
    reads, strength = [], augment.pipeline.strength
    monkeypatch.setattr(augment.pipeline, "strength", lambda *a: reads.append(a[1]) or strength(*a))
    canvas, sizes = to_canvas(_batch(8).numpy())
    outs = [pipe(canvas, sizes, _keys(8), epoch) for epoch in (1, 1, 1, 2, 2)]
    assert reads == [1, 2] and pipe.at_epoch(2) is pipe.at_epoch(2)
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[2], outs[3])


def test_stage_schedules_train_only():
    stage = AugmentStage(
        StageArgs(PRESETS["cifar"], train=False, seed=0, schedule="linear-decay", epochs=4), device="cpu"
    )
    assert stage.pipeline.schedule == "none"
    stage = AugmentStage(
        StageArgs(PRESETS["cifar"], train=True, seed=0, schedule="linear-decay", epochs=4), device="cpu"
    )
    assert stage.pipeline.schedule == "linear-decay" and stage.pipeline.epochs == 4


# --------------------------------------------------------------------------- MixUp / CutMix


def _mix_batch(b=16):
    x = torch.randn(b, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    return x, torch.arange(b)  # distinct labels: each pair mixes two classes


def test_mixup_mixes_images_and_labels_with_one_weight():
    from augment.mix import MixUpCutMix, mix_generator

    mix = MixUpCutMix(num_classes=16, mixup_alpha=0.4)
    x, y = _mix_batch()
    out, target = mix(x, y, mix_generator(0, 1, 2, 0))
    lam = float(target[0, y[0]])  # image 0 keeps lam of its own class
    assert 0 < lam < 1
    torch.testing.assert_close(out, lam * x + (1 - lam) * x.roll(1, 0))
    torch.testing.assert_close(target.sum(1), torch.ones(16))
    assert torch.equal(target.argmax(1), y if lam >= 0.5 else y.roll(1))


def test_cutmix_label_weight_is_the_share_of_pixels_kept():
    from augment.mix import MixUpCutMix, mix_generator

    mix = MixUpCutMix(num_classes=16, cutmix_alpha=1.0)
    x, y = _mix_batch()
    seen = 0
    for step in range(20):
        out, target = mix(x, y, mix_generator(0, 0, step, 0))
        kept = (out == x).all(1).float().mean((1, 2))  # share of each image's pixels left alone
        torch.testing.assert_close(target[torch.arange(16), y], kept)
        assert ((out == x) | (out == x.roll(1, 0))).all()
        seen += bool((kept < 1).any())
    assert seen >= 15  # a box was pasted in most steps


def test_mix_is_replayable_and_prob_zero_only_one_hots():
    from augment.mix import MixUpCutMix, mix_generator

    mix = MixUpCutMix(num_classes=16, mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=0.1)
    x, y = _mix_batch()
    a, b = mix(x, y, mix_generator(3, 1, 7, 1)), mix(x, y, mix_generator(3, 1, 7, 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = mix(x, y, mix_generator(3, 1, 7, 0))  # another rank: other parameters
    assert not torch.equal(a[1], c[1])
    off = MixUpCutMix(num_classes=16, mixup_alpha=0.2, prob=0.0)
    out, target = off(x, y, mix_generator(0, 0, 0, 0))
    assert torch.equal(out, x) and torch.equal(target, torch.nn.functional.one_hot(y, 16).float())
    assert target.dtype == torch.float32


def test_preset_mix_key_round_trips_and_rejects_unknown_settings(tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text(
        "train: [{random_resized_crop: {size: 16}}]\neval: [{resize_center_crop: {resize: 18, size: 16}}]\nmix: "
        "{mixup_alpha: 0.2, cutmix_alpha: 1.0}\n"
    )
    p = load_preset(str(f))
    assert p.mix == {"mixup_alpha": 0.2, "cutmix_alpha": 1.0} and preset_from_dict(p.to_dict()) == p
    f.write_text("train: [{random_crop: {size: 8}}]\neval: [{center_crop: {size: 8}}]\nmix: {mixup: 0.2}\n")
    with pytest.raises(PresetError, match=r"mix: unknown key\(s\) \['mixup'\]; valid: \['mixup_alpha', 'cutmix_alpha'"):
        load_preset(str(f))


# --------------------------------------------------------------------------- preview


def test_preview_writes_a_grid_and_rejects_a_bad_preset(tree, tmp_path, capsys):
    from PIL import Image

    from jobs.preview import main

    out = tmp_path / "grid.png"
    assert (
        main(["--data", str(tree), "--preset", "cifar", "--out", str(out), "--classes", "2", "--augmentations", "2"])
        == 0
    )
    with Image.open(out) as img:
        assert img.size[0] > img.size[1] > 100  # 2 rows, 4 columns
    assert main(["--data", str(tree), "--preset", "imagenett", "--out", str(tmp_path / "other.png")]) == 2
    assert "built-in presets" in capsys.readouterr().err


def test_preview_refuses_bad_numbers_and_outs_in_one_line_and_keeps_the_users_files(tree, tmp_path, capsys):
    """Numbers a grid cannot be drawn with, and an --out that is a folder, of no image kind, or there
    already: one line, exit 2, nothing written or replaced. --overwrite replaces; a missing folder is made."""
    from jobs.preview import main

    base = ["--data", str(tree), "--preset", "cifar", "--classes", "2", "--augmentations", "2"]
    place = tmp_path / "place"
    for flags, line in (
        (["--classes", "0"], "error: --classes 0: give a whole number from 1 to 100"),
        (["--per-class", "-1"], "error: --per-class -1: give a whole number from 1 to 20"),
        (["--augmentations", "0"], "error: --augmentations 0: give a whole number from 1 to 30"),
        (["--dpi", "100000"], "error: --dpi 100000: give a whole number from 10 to 600"),
        (["--data", ""], "error: --data is empty; give the data's path, or leave --data out for the bundled digits"),
    ):
        with pytest.raises(SystemExit) as stop:
            main([*base, "--out", str(place / "never.png"), *flags])
        assert stop.value.code == 2 and capsys.readouterr().err.strip().startswith(line)
    folder, kept = place / "grids", place / "notes.txt"
    folder.mkdir(parents=True)
    kept.write_text("the user's own notes\n")
    for out, line in (
        (folder, f"error: --out {folder}: a folder; give a file to write, e.g. {folder}/grid.png"),
        (kept, f"error: --out {kept}: give a file name ending in .png, .jpg, .jpeg, .pdf, .svg, e.g. grid.png"),
    ):
        assert main([*base, "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == line
    assert sorted(p.name for p in place.iterdir()) == ["grids", "notes.txt"] and not list(folder.iterdir())
    assert kept.read_text() == "the user's own notes\n"
    assert main(["--data", str(tmp_path / "nowhere"), "--out", str(place / "never" / "grid.png")]) == 2
    assert "no such directory" in capsys.readouterr().err and not (place / "never").exists()  # no folder left
    grid = place / "new" / "grid.png"  # its folder is made
    assert main([*base, "--out", str(grid)]) == 0 and grid.stat().st_size > 0
    first = grid.read_bytes()
    grid.write_bytes(b"the user's")
    assert main([*base, "--out", str(grid)]) == 2 and grid.read_bytes() == b"the user's"
    assert "exists already; nothing was written; give another --out, or --overwrite" in capsys.readouterr().err
    assert main([*base, "--out", str(grid), "--overwrite"]) == 0 and grid.read_bytes() == first


def _photo_tree(root):
    """train/ and val/ of two classes: JPEG photos of several sizes, and a PNG in each."""
    import io

    from PIL import Image

    from bench.augment import synthetic_photo

    sizes = {"owl": [(300, 400), (260, 250), (200, 210)], "wren": [(333, 500), (240, 320), (180, 200)]}
    for c, (name, shapes) in enumerate(sizes.items()):
        for i, (h, w) in enumerate(shapes):
            folder = root / ("val" if i == 2 else "train") / name
            folder.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            Image.fromarray(synthetic_photo(h, w, 10 * c + i)).save(buf, format="PNG" if i == 1 else "JPEG")
            (folder / f"{i}.{'png' if i == 1 else 'jpg'}").write_bytes(buf.getvalue())
    return root


@pytest.mark.parametrize("preset", ["imagenet", "cifar"])
def test_preview_shows_the_views_the_training_stage_makes(preset, tmp_path, monkeypatch):
    """What jobs.preview draws in each train column is, to the bit, what the augment stage
    makes for that image in that epoch, from a training batch of other rows in another order,
    whether the read task decoded the files or the augment call did at full size. (On CPUs
    the augment call may decode a large JPEG at a reduced scale where its crop allows: the
    same parameters, pixels within a few levels; tests/test_decode.py holds that bound.)"""
    import matplotlib.axes

    from augment.decode import decode_image
    from jobs.preview import main
    from training.forms.data import stable_hash
    from training.forms.tree import scan_tree

    shown = []  # every picture the grid draws, row by row
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", lambda ax, view, **kw: shown.append(np.array(view)))
    tree = _photo_tree(tmp_path / "photos")
    args = ["--data", str(tree), "--preset", preset, "--classes", "2", "--per-class", "2", "--augmentations", "3"]
    assert main([*args, "--seed", "4", "--out", str(tmp_path / "grid.png"), "--dpi", "20"]) == 0
    rel = sorted(scan_tree(str(tree)).train.rel_paths)  # train/owl/0.jpg, ...: the keys' paths
    assert len(rel) == 4 and len(shown) == 4 * 5  # every train file shown (original, eval, 3 epochs)
    previewed = {stable_hash(r): shown[5 * i + 2 : 5 * i + 5] for i, r in enumerate(rel)}

    order = [rel[i] for i in (2, 0, 3, 1)]  # a training batch: all four, in another order
    datas = [(tree / r).read_bytes() for r in order]
    batch = {"label": np.zeros(4, np.int64), "key": np.array([stable_hash(r) for r in order], np.int64)}
    by_bytes = batch | {"bytes": np.array(datas, dtype=object), "path": np.array(order, dtype=object)}
    decoded = np.empty(4, dtype=object)
    decoded[:] = [decode_image(d) for d in datas]
    for rows in (by_bytes, batch | {"image": decoded}):  # decoded in the augment call, or in the read task
        stage = AugmentStage(StageArgs(PRESETS[preset], train=True, seed=4), device="cpu")
        for epoch in range(3):
            out = stage(rows | {"epoch": np.full(4, epoch, dtype=np.int64)})  # the read task's column
            assert list(out["epoch"]) == [epoch] * 4
            for key, view in zip(out["key"], out["image"], strict=True):
                np.testing.assert_array_equal(previewed[int(key)][epoch], view)


def test_read_examples_takes_the_first_of_each_class(tree):
    from augment.preview import read_examples
    from training.forms.tree import scan_tree

    t = scan_tree(str(tree), 0.2)
    images, labels, keys = read_examples(t.train, classes=2, per_class=2)
    assert labels == [0, 0, 1, 1] and all(im.shape == (32, 32, 3) and im.dtype == np.uint8 for im in images)
    assert len(set(keys)) == 4


def test_a_bad_augment_schedule_is_a_config_error_before_ray_starts(tree, tmp_path):
    from training.config import ConfigError, TrainConfig
    from training.driver.inputs import prepare

    with pytest.raises(
        ConfigError, match="--augment-schedule: unknown augmentation schedule 'fast'; valid: none, linear-decay"
    ):
        prepare(TrainConfig(data=str(tree), augment_schedule="fast", storage_path=str(tmp_path)))


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("train", [True, False])
def test_an_empty_batch_goes_through_every_preset_and_op(name, train):
    """A batch whose every file failed to decode: no image in, none out, through a whole
    pipeline and through each of its ops on its own (the pipeline skips empty chunks)."""
    from augment.batch import augment_batch

    ops = PRESETS[name].train if train else PRESETS[name].eval
    pipeline = Pipeline(ops, seed=0)
    empty = np.zeros((0, 96, 96, 3), np.uint8)
    out = augment_batch(pipeline, empty, torch.zeros(0, dtype=torch.int64), 0, torch.device("cpu"))
    assert out.shape[0] == 0 and out.dtype == torch.uint8 and out.shape[-1] == 3
    x, sizes = torch.zeros((0, 3, 96, 96)), torch.zeros((0, 2), dtype=torch.int64)
    for op in pipeline.at_epoch(0).ops:
        if op.name not in ("random_resized_crop", "resize_center_crop", "random_crop", "center_crop"):
            params = op.sample(KeyedRng(_keys(0), seed=0, epoch=0), sizes)
            assert op.apply(x, params, sizes).shape[0] == 0, op.name
