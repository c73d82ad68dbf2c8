"""--model NAME: any classification model of torchvision.models, built at random init with the
run's class count; the small stem stays a ResNet's; --init-weights loads a matching torchvision
state dict into any of them; a bad name exits 2 with close matches before Ray starts; and a
run of another model trains, saves the name in model.pt, and jobs.predict rebuilds from it."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torchvision

import jobs.predict
import jobs.train
from tests.conftest import exits_2
from training.config import ConfigError
from training.model import build_model, check_model, check_model_sizes, head_prefix, load_init_weights

HEADS = {
    "resnet18": "fc.",
    "efficientnet_b0": "classifier.1.",
    "mobilenet_v3_small": "classifier.3.",
    "squeezenet1_0": "classifier.1.",  # a 1x1 convolution, not a linear layer
    "vit_b_16": "heads.head.",
}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_model_by_name_has_the_runs_classes_and_trains_at_32_px(name):
    torch.manual_seed(0)
    model = build_model(name, 5, small_stem=False, image_size=32)
    assert head_prefix(model) == HEADS[name]
    head = {k: v for k, v in model.state_dict().items() if k.startswith(HEADS[name])}
    assert head[HEADS[name] + "weight"].shape[0] == 5  # a head for the run's 5 classes
    x = torch.rand(2, 3, 32, 32).to(memory_format=torch.channels_last)
    logits = model.train()(x)
    assert logits.shape == (2, 5)
    logits.sum().backward()  # it trains: every parameter of the head gets a gradient
    assert all(p.grad is not None for k, p in model.named_parameters() if k.startswith(HEADS[name]))


def test_the_small_stem_is_a_resnets_and_keeps_its_width():
    wide = build_model("resnet50", 3, small_stem=True, image_size=32)
    assert wide.conv1.kernel_size == (3, 3) and wide.conv1.stride == (1, 1) and wide.conv1.out_channels == 64
    assert isinstance(wide.maxpool, torch.nn.Identity)
    with pytest.raises(ConfigError, match=r"--small-stem on: the small stem is a ResNet's, and efficientnet_b0"):
        check_model("efficientnet_b0", small_stem="on")
    check_model("efficientnet_b0", small_stem="auto")  # auto: efficientnet keeps its own stem


def test_an_unknown_name_lists_the_close_ones():
    with pytest.raises(ConfigError) as err:
        check_model("resnet5O", small_stem="auto")
    assert "--model resnet5O: not a classification model of torchvision" in str(err.value)
    assert "did you mean resnet50" in str(err.value)
    with pytest.raises(ConfigError, match="a ViT takes one input side, a multiple of its 16 px patches"):
        check_model_sizes("vit_b_16", [24, 32])
    with pytest.raises(ConfigError, match="at 40 px"):
        check_model_sizes("vit_b_16", [40])
    check_model_sizes("vit_b_16", [32, 32])


def test_init_weights_load_a_torchvision_state_dict_into_another_model(tmp_path):
    """A torchvision efficientnet_b0's weights, perturbed so that a fresh init cannot look like
    them: every tensor but the head's lands; the head stays fresh, for the run's classes."""
    torch.manual_seed(1)
    source = torchvision.models.efficientnet_b0(weights=None).state_dict()
    source = {k: v + 0.5 if v.is_floating_point() else v for k, v in source.items()}
    torch.save(source, tmp_path / "b0.pt")
    model = build_model("efficientnet_b0", 4, small_stem=False, image_size=32)
    report = load_init_weights(model, str(tmp_path / "b0.pt"), "efficientnet_b0")
    assert sorted(report.new) == ["classifier.1.bias", "classifier.1.weight"]
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], source[k]) for k in loaded if not k.startswith("classifier.1."))
    with pytest.raises(ConfigError, match=r"no mobilenet_v3_small weights found \(1 of its 242 tensors"):
        load_init_weights(
            build_model("mobilenet_v3_small", 4, small_stem=False, image_size=32),
            str(tmp_path / "b0.pt"),
            "mobilenet_v3_small",
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "efficentnet_b0"], "--model efficentnet_b0: not a classification model of torchvision"),
        (["--model", "mobilenet_v3_small", "--small-stem", "on"], "the small stem is a ResNet's"),
        (["--model", "vit_b_16", "--progressive-resize", "16"], "a ViT takes one input side"),
    ],
)
def test_a_model_that_cannot_run_exits_2_before_ray_starts(flags, message, tree, tmp_path, no_ray, capsys):
    runs = tmp_path / "runs"
    err = exits_2(["--data", str(tree), *flags, "--storage-path", str(runs)], capsys)
    assert message in err, err
    assert not runs.exists()


def test_another_model_trains_and_predict_follows_the_saved_one(ray_cluster, tmp_path, capsys):
    """One epoch of efficientnet_b0 at 32 px on the test cluster (every model of HEADS trains a
    step in this process above): model.pt names the model, and jobs.predict rebuilds it from
    there and scores every image."""
    from tests.conftest import write_tree

    data = write_tree(tmp_path / "data", {"a": 20, "b": 20})
    runs = tmp_path / "runs"
    name = "efficientnet_b0"
    args = ["--data", str(data), "--model", name, "--epochs", "1", "--batch-size", "8", "--val-fraction", "0.25"]
    assert jobs.train.main([*args, "--storage-path", str(runs), "--name", name, "--quiet"]) == 0, (
        capsys.readouterr().err[-3000:]
    )
    saved = torch.load(runs / name / "model.pt", weights_only=True)
    assert saved["arch"] == name and saved["small_stem"] is False and saved["class_names"] == ["a", "b"]
    assert head_prefix(build_model(name, 2, small_stem=False, image_size=32)) + "weight" in saved["state_dict"]
    summary = json.loads((runs / name / "summary.json").read_text())
    assert summary["epochs"] == 1 and summary["coverage"][0]["exactly_once"], summary["coverage"]
    assert json.loads((runs / name / "config.json").read_text())["config"]["model"] == name
    out = tmp_path / "predictions.csv"
    model = str(runs / name / "model.pt")
    assert jobs.predict.main(["--model", model, "--data", str(data), "--out", str(out)]) == 0, capsys.readouterr().err
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 40 and {r["label"] for r in rows} == {"a", "b"}
