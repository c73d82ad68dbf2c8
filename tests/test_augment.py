"""Augment ops and the augment stage, without Ray unless a test says so.

`OP_CASES` is the shared parametrised base (Kornia's habit): every op is run through the
same checks, so a new op gets them by adding one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from augment.ops import OPS, Normalize
from augment.presets import PRESETS, Pipeline, PresetError, load_preset, preset_from_dict
from augment.rng import KeyedRng, reference_uniform
from augment.stage import AugmentStage, to_canvas

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
    "color_jitter": ({"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1, "p": 1.0}, {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "p": 0.0}),
}


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
    x = _float_batch()
    out = _run(name, OP_CASES[name][0], x=x)
    changed = (out - x).abs().flatten(1).amax(1) > 1e-4
    assert changed.all()


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_same_seed_epoch_key_gives_same_output_other_epoch_differs(name):
    params = {"p": 0.5} if name == "horizontal_flip" else OP_CASES[name][0]  # p=1 flips are not random
    a, b = _run(name, params, epoch=1), _run(name, params, epoch=1)
    assert torch.equal(a, b)
    if name != "center_crop":  # the only op without randomness
        assert not torch.equal(a, _run(name, params, epoch=2))


@pytest.mark.parametrize("name", sorted(n for n in OP_CASES if n != "center_crop"))
def test_an_images_augmentation_does_not_depend_on_its_batch(name):
    """Image i gets the same result alone, in a batch, or in another order."""
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
    u = KeyedRng(keys, seed=11, epoch=4).uniform(stream=9, n=3)
    for row, k in enumerate(keys.tolist()):
        for i in range(3):
            assert u[row, i].item() == pytest.approx(reference_uniform(k, 11, 4, 9, i), abs=0)


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


def test_stage_on_a_numpy_batch():
    stage = AugmentStage(PRESETS["cifar"].to_dict(), train=True, seed=0, device="cpu")
    batch = {"image": _batch(8).numpy(), "label": np.arange(8), "key": np.arange(8, dtype=np.int64)}
    out = stage(batch)
    assert out["image"].shape == (8, 32, 32, 3) and out["image"].dtype == np.uint8
    assert list(out["label"]) == list(range(8))


def test_preset_files_and_their_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("name: mine\ntrain:\n  - random_crop: {size: 16, padding: 2}\n  - horizontal_flip: {p: 0.3}\neval:\n  - center_crop: {size: 16}\n")
    p = load_preset(str(good))
    assert p.name == "mine" and p.image_size == 16 and p.train[1] == {"horizontal_flip": {"p": 0.3}}
    cases = {
        "unknown op": ("train: [{spin: {}}]\neval: [{center_crop: {size: 8}}]", "unknown op 'spin'; valid ops: "),
        "unknown param": ("train: [{random_crop: {size: 8, pad: 2}}]\neval: [{center_crop: {size: 8}}]", "unknown parameter(s) ['pad']; valid: ['size', 'padding', 'fill']"),
        "order": ("train: [{horizontal_flip: {}}]\neval: [{center_crop: {size: 8}}]", "the first op, and only the first, is a geometry op"),
        "unknown key": ("train: [{random_crop: {size: 8}}]\neval: [{center_crop: {size: 8}}]\nnormalise: 1", "unknown key(s) ['normalise']"),
    }
    for name, (text, message) in cases.items():
        f = tmp_path / f"{name.replace(' ', '_')}.yaml"
        f.write_text(text)
        with pytest.raises(PresetError) as err:
            load_preset(str(f))
        assert message in str(err.value), name
    with pytest.raises(PresetError, match="built-in presets: \\['cifar'"):
        load_preset("imagenett")


def test_preset_round_trips_through_dict():
    p = PRESETS["cifar"]
    assert preset_from_dict(p.to_dict()) == p
