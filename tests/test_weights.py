"""Pretrained weights and other models (training/weights.py, training/model.py): --weights from
torchvision's cache beats random init on another set, with a new head for its classes; the
weights' eval transform where the user set none; --init-weights from .safetensors and prefixed
checkpoints; the refusals, each one line before Ray; and a timm model and a model of the
user's each train on the cluster and are used by jobs.predict."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest
import torch

import jobs.predict
import jobs.train
from augment.presets import PRESETS, load_preset
from tests.conftest import exits_2, write_tree
from training.config import ConfigError, TrainConfig
from training.driver.inputs import sized_preset
from training.model import build_model, initial_model, load_init_weights
from training.weights import check_weights, torchvision_cache_file, torchvision_weights

# ---- fine-tuning from torchvision's cache ---------------------------------------------------------


COLOURS = {
    "r": (1, 0.2, 0.2),
    "g": (0.2, 1, 0.2),
    "b": (0.2, 0.2, 1),
    "y": (1, 1, 0.2),
    "m": (1, 0.2, 1),
    "c": (0.2, 1, 1),
}


def tinted(kinds: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n 32 px noise images of each tint of `kinds` (COLOURS), at random brightness and shift,
    normalised: ((N, 3, 32, 32), (N,))."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label, kind in enumerate(kinds):
        for _ in range(n):
            base = np.array(COLOURS[kind]) * rng.uniform(0.4, 1) + rng.uniform(-0.15, 0.15, 3)
            images.append(np.clip(base + rng.normal(0, 0.25, (32, 32, 3)), 0, 1).transpose(2, 0, 1))
            labels.append(label)
    x = torch.tensor(np.stack(images), dtype=torch.float32)
    return (x - 0.5) / 0.25, torch.tensor(labels)


def fit(model: torch.nn.Module, x, y, *, epochs: int, lr: float, batch: int = 16, seed: int = 0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()


@torch.no_grad()
def accuracy(model: torch.nn.Module, x, y) -> float:
    return (model.eval()(x).argmax(1) == y).float().mean().item()


def test_weights_from_torchvisions_cache_beat_random_init_with_a_new_head(tmp_path, monkeypatch):
    """resnet18 trained on four tints of noise, its state_dict saved where torchvision keeps
    IMAGENET1K_V1 ($TORCH_HOME/hub/checkpoints/resnet18-f37072fd.pth, offline); then --weights
    IMAGENET1K_V1 on three other tints, 2 epochs of 24 images: every tensor but the
    4-class head is the saved one, the head is new for 3 classes, and validation accuracy beats
    the same run from random init."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    source = build_model("resnet18", 4, small_stem=False, image_size=32)
    fit(source, *tinted("rgby", 30, seed=1), epochs=3, lr=0.02)
    cache = torchvision_cache_file(torchvision_weights("resnet18", "IMAGENET1K_V1"))
    assert cache == str(tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(source.state_dict(), cache)
    check_weights("resnet18", "IMAGENET1K_V1")  # found in the cache: no download tried, offline

    train, val = tinted("cmb", 8, seed=2), tinted("cmb", 30, seed=3)
    cfg = TrainConfig(model="resnet18", small_stem="off")
    results = {}
    for weights in ("IMAGENET1K_V1", ""):
        torch.manual_seed(0)
        model, report = initial_model(dataclasses.replace(cfg, weights=weights), 3, 32)
        fit(model, *train, epochs=2, lr=0.01, batch=8)
        results[weights] = accuracy(model, *val)
        if weights:
            assert report.new == ("fc.weight", "fc.bias") and report.classes == (4, 3)
            assert report.describe().startswith("weights: IMAGENET1K_V1, ") and "new: fc.weight, fc.bias (4 -> 3" in (
                report.describe()
            )
        else:
            assert report is None
    assert results["IMAGENET1K_V1"] >= results[""] + 0.2, results
    torch.manual_seed(0)
    fresh, _ = initial_model(dataclasses.replace(cfg, weights="IMAGENET1K_V1"), 3, 32)
    saved = source.state_dict()
    assert fresh.fc.weight.shape == (3, 512)  # the head is new
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items() if not k.startswith("fc."))


# ---- the weights' eval transform ------------------------------------------------------------------


def test_the_eval_transform_follows_the_weights_where_the_user_set_none(tmp_path):
    """timm's test_resnet weights were made at 160 px, crop_pct 0.95 (resize 168), mean and std
    0.5: a built-in photo preset takes all of it; --image-size keeps its side and takes the
    ratio; the thumbnail preset takes only the normalisation; a preset file keeps its own."""
    cfg = TrainConfig(model="timm/test_resnet", weights="DEFAULT", epochs=1)
    photo = sized_preset(cfg, PRESETS["imagenet"])
    assert photo.eval[0] == {"resize_center_crop": {"resize": 168, "size": 160}}
    assert photo.train_size == 160 and photo.mean == (0.5, 0.5, 0.5) and photo.std == (0.5, 0.5, 0.5)
    sized = sized_preset(dataclasses.replace(cfg, image_size=128), PRESETS["imagenet"])
    assert sized.eval[0] == {"resize_center_crop": {"resize": 134, "size": 128}} and sized.mean == (0.5, 0.5, 0.5)
    thumbs = sized_preset(cfg, PRESETS["cifar"])
    assert thumbs.eval == PRESETS["cifar"].eval and thumbs.mean == (0.5, 0.5, 0.5)
    assert sized_preset(dataclasses.replace(cfg, weights=""), PRESETS["imagenet"]) == PRESETS["imagenet"]
    own = tmp_path / "mine.yaml"
    own.write_text(
        "mean: [0.1, 0.2, 0.3]\nstd: [1, 1, 1]\ntrain: [{random_crop: {size: 48}}]\neval: [{center_crop: {size: 48}}]\n"
    )
    mine = load_preset(str(own))
    assert sized_preset(cfg, mine) == mine  # the user's file sets the transform: the weights' do not win


# ---- --init-weights files -------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["ddp", "lightning", "timm_checkpoint", "safetensors"])
def test_init_weights_read_safetensors_and_prefixed_checkpoints(form, tmp_path):
    """The same resnet18 weights as DDP saves them (module.), as a Lightning checkpoint
    ({"state_dict": {"model.": ...}}), as timm's train.py checkpoint ({"state_dict", "epoch"}),
    and as .safetensors: every tensor but the head's lands."""
    torch.manual_seed(1)
    source = {
        k: v + 0.5 if v.is_floating_point() else v
        for k, v in build_model("resnet18", 10, small_stem=False, image_size=32).state_dict().items()
    }
    path = tmp_path / ("w.safetensors" if form == "safetensors" else "w.pt")
    if form == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in source.items()}, str(path))
    else:
        wrapped = {
            "ddp": {f"module.{k}": v for k, v in source.items()},
            "lightning": {"state_dict": {f"model.{k}": v for k, v in source.items()}, "epoch": 3},
            "timm_checkpoint": {"state_dict": source, "epoch": 3, "arch": "resnet18"},
        }[form]
        torch.save(wrapped, path)
    torch.manual_seed(2)
    model = build_model("resnet18", 3, small_stem=False, image_size=32)
    report = load_init_weights(model, str(path), "resnet18")
    assert report.new == ("fc.weight", "fc.bias") and report.loaded == report.total - 2
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], source[k]) for k in loaded if not k.startswith("fc."))


# ---- refusals, before Ray -------------------------------------------------------------------------


def test_weight_names_and_a_missing_cache_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError,
        match=r"^--weights IMAGENET: not a weights name of torchvision's resnet18; valid: DEFAULT, IMAGENET1K_V1$",
    ):
        check_weights("resnet18", "IMAGENET")
    with pytest.raises(ConfigError, match=r"not a pretrained tag of timm's test_resnet; valid: DEFAULT, r160_in1k$"):
        check_weights("timm/test_resnet", "in1k")
    with pytest.raises(ConfigError) as err:
        check_weights("resnet18", "DEFAULT")
    path = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert f"--weights DEFAULT: {path} is not in torchvision's cache and this machine is offline" in str(err.value)
    assert "weights='IMAGENET1K_V1'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="a model of your own .* loads its own weights"):
        check_weights("tests.user_model:build", "DEFAULT")


def test_timm_missing_is_refused_with_how_to_install(monkeypatch, tree, tmp_path, no_ray, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    err = exits_2(["--data", str(tree), "--model", "timm/test_resnet", "--storage-path", str(tmp_path / "r")], capsys)
    assert "--model timm/...: timm is not installed; pip install -e '.[timm]'" in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--weights", "V9"],
            "--weights V9: not a weights name of torchvision's resnet18; valid: DEFAULT, IMAGENET1K_V1",
        ),
        (["--model", "timm/test_resnett"], "--model timm/test_resnett: not a model of timm"),
        (["--model", "timm/test_resnett"], "did you mean timm/test_resnet"),
        (["--model", "tests.nothere:build"], "--model tests.nothere:build: cannot import tests.nothere"),
        (["--model", "tests.user_model:nope"], "tests.user_model has no function nope"),
        (["--model", "tests.user_model:wrong_head"], "a batch of 2 images gave (2, 7), not (2, 3) logits"),
        (["--weights", "DEFAULT", "--init-weights", "w.pt"], "--weights and --init-weights both set the first"),
    ],
)
def test_a_model_or_weights_that_cannot_be_had_exit_2_before_ray(flags, message, tree, tmp_path, no_ray, capsys):
    runs = tmp_path / "runs"
    err = exits_2(["--data", str(tree), *flags, "--storage-path", str(runs)], capsys)
    assert message in err, err
    assert not runs.exists()


# ---- on the cluster: a timm model and a model of the user's, then jobs.predict ------------------


@pytest.mark.parametrize("model, kind", [("timm/test_resnet", "timm"), ("tests.user_model:build", "callable")])
def test_a_timm_model_and_one_of_the_users_train_and_predict(model, kind, ray_cluster, tmp_path, capsys):
    """One epoch of each on the test cluster (the user's module reaches the workers from the
    driver's working directory, as Ray puts it on their path); model.pt says how to rebuild it,
    and jobs.predict does and scores every image."""
    data = write_tree(tmp_path / "data", {"a": 12, "b": 12})
    runs = tmp_path / "runs"
    args = ["--data", str(data), "--model", model, "--epochs", "1", "--batch-size", "8", "--val-fraction", "0.25"]
    if kind == "callable":  # and from weights of the user's model, saved as DDP saves them
        from tests.user_model import build

        torch.save({f"module.{k}": v for k, v in build(5).state_dict().items()}, tmp_path / "mine.pt")
        args += ["--init-weights", str(tmp_path / "mine.pt")]
    assert jobs.train.main([*args, "--storage-path", str(runs), "--name", kind]) == 0, capsys.readouterr().err[-3000:]
    said = capsys.readouterr().out
    if kind == "callable":  # the line before the plan: the head (the last Linear, "5.") is new
        loaded = f"weights: {tmp_path / 'mine.pt'}, 7 of 9 tensors loaded; new: 5.weight, 5.bias\nplan: "
        assert loaded in said, said[-3000:]
    saved = torch.load(runs / kind / "model.pt", weights_only=True)
    assert saved["arch"] == model and saved["model_source"]["kind"] == kind and saved["torchvision_model"] is None
    if kind == "timm":
        assert saved["model_source"]["create_model"] == {"model_name": "test_resnet", "num_classes": 2}
    else:
        assert saved["model_source"]["callable"] == model and saved["model_source"]["kwargs"] == {"num_classes": 2}
    out = tmp_path / "predictions.csv"
    assert jobs.predict.main(["--model", str(runs / kind / "model.pt"), "--data", str(data), "--out", str(out)]) == 0, (
        capsys.readouterr().err
    )
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 24 and {r["predicted"] for r in rows} <= {"a", "b"}
    assert json.loads((runs / kind / "config.json").read_text())["config"]["model"] == model


def test_a_model_file_of_each_kind_rebuilds_or_is_refused_in_one_line(tmp_path):
    """jobs.predict's reader (training.predict.inference.load_model_file) rebuilds a timm model and a
    user's model from model.pt's arch; one whose module does not import here is refused."""
    from training.modelfile import ModelFile
    from training.predict.inference import ModelFileError, load_model_file

    def saved(arch: str, state: dict) -> str:
        transform = {"ops": [{"center_crop": {"size": 32}}], "mean": [0.5] * 3, "std": [0.5] * 3}
        info = ModelFile(arch, state, ("a", "b"), 32, False, transform)
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.pt"
        torch.save(info.to_state(), path)
        return str(path)

    from tests.user_model import build

    assert load_model_file(saved("tests.user_model:build", build(2).state_dict())).arch == "tests.user_model:build"
    timm_state = build_model("timm/test_resnet", 2, small_stem=False, image_size=32).state_dict()
    assert load_model_file(saved("timm/test_resnet", timm_state)).num_classes == 2
    with pytest.raises(ModelFileError, match=r"trained as --model tests.gone:build: cannot import tests.gone"):
        load_model_file(saved("tests.gone:build", build(2).state_dict()))
