"""The whole job on the shared Ray cluster: tiny real PNG trees, CPU workers, DDP on gloo."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from tests.conftest import Terminal, bar_frames, event_scalars, prepare, split_coordinators, write_tree
from training.bounds import STAGES
from training.config import ConfigError, TrainConfig
from training.driver import audit, job, planning
from training.records import RunRecord, ShardRecord

REPO = Path(__file__).resolve().parents[1]


def _run(bar_stream=None, log=lambda *a: None, **overrides):
    cfg, tree, preset = prepare(TrainConfig(**overrides))
    return job.run(cfg, tree, preset, log=log, bar_stream=bar_stream, own_cluster=True), tree


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("data"), {"red": 24, "green": 24, "blue": 24, "cyan": 24, "gray": 24})
    red = os.fsencode(root / "red")  # names in Latin-1 bytes, as older cameras write them: read as any other
    os.mkdir(red + b"/\xe9t\xe9")
    for i in range(4):
        os.rename(red + b"/%03d.png" % i, red + (b"/r\xf6d-%d.png" if i % 2 else b"/\xe9t\xe9/%d.png") % i)
    return root


def _perturbed_resnet18() -> dict:
    """A torchvision ResNet18 state_dict (1000 classes, ImageNet stem) whose batch-norm scales
    and shifts are not torch's init of 1 and 0, which a fresh model has too."""
    torch.manual_seed(123)
    state = torchvision.models.resnet18(weights=None).state_dict()
    g = torch.Generator().manual_seed(1)
    for name, v in state.items():
        if v.ndim == 1 and v.is_floating_point() and name.endswith((".weight", ".bias")) and not name.startswith("fc"):
            v.copy_(torch.empty_like(v).uniform_(0.5, 1.5, generator=g) if name.endswith("weight") else v + 0.1)
    return state


@pytest.fixture(scope="module")
def two_worker_run(ray_cluster, data, tmp_path_factory):
    """Two CPU workers on the two nodes at 40 px (--image-size) from 32 px files, with the
    console's bar drawn on a fake terminal, fine-tuning from a torchvision ResNet18 state_dict
    (1000 classes, ImageNet stem) at a tiny lr, so the loaded weights can be recognised."""
    runs, screen, lines = tmp_path_factory.mktemp("runs"), Terminal(), []
    torch.save(_perturbed_resnet18(), runs / "r18.pt")
    summary, tree = _run(
        data=str(data),
        epochs=1,
        batch_size=16,
        num_workers=2,
        storage_path=str(runs),
        name="tiny",
        val_fraction=0.25,
        init_weights=str(runs / "r18.pt"),
        lr=1e-6,
        image_size=40,
        small_stem="on",  # auto takes the ImageNet stem above 32 px
        bar_stream=screen,
        log=lines.append,
    )
    return runs / "tiny", summary, tree, (screen.getvalue(), lines)


def _rows(path):
    return list(csv.DictReader(path.open()))


def _checkpoint(run_dir: Path) -> dict:
    (path,) = run_dir.glob("checkpoint_epoch_*/checkpoint.pt")  # num_to_keep=1
    return torch.load(path, weights_only=True)


def _records(run_dir: Path) -> RunRecord:
    """The run's records in its last checkpoint, as the driver reads them (training/records.py)."""
    return RunRecord.from_state(_checkpoint(run_dir)["records"])


def _head_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def test_bench_train_reads_the_timings_a_run_writes(two_worker_run):
    """bench.train (make bench-train) reads each run's timings.csv: its figures as numbers, its
    `bound` as the word it is (a reader that took every cell for a number broke on it)."""
    from bench.train import read_timings

    run_dir, summary, _, _ = two_worker_run
    timings = read_timings(str(run_dir / "timings.csv"))
    assert [t["epoch"] for t in timings] == [float(e) for e in range(1, summary["epochs"] + 1)]
    assert all(t["epoch_s"] > 0 and t["images_per_s"] > 0 and isinstance(t["bound"], str) for t in timings)


def test_run_directory_has_sane_contents(two_worker_run):
    run_dir, summary, tree, _ = two_worker_run
    for name in (
        "config.json",
        "metrics.csv",
        "timings.csv",
        "summary.json",
        "model.pt",
        "curves.png",
        "confusion.png",
    ):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"

    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["num_workers"] == 2 and config["class_names"] == ["blue", "cyan", "gray", "green", "red"]
    assert config["git_commit"] == _head_commit()  # None only outside a git checkout
    # 32 px PNGs are thumbnails decoded in the read task: the plan says 1,024 per call at most
    assert config["plan"]["decode"]["where"] == "read" and config["plan"]["augment_batch_size"] == 1024
    _, lines = two_worker_run[3]
    (plan,) = [line for line in lines if line.startswith("plan: ")]
    # --preset auto, and why it chose cifar: the 32 px PNGs' headers
    assert plan.startswith("plan: preset cifar (--preset auto: thumbnails, typically 32 x 32 px); 2 train worker(s)")
    counts = two_worker_run[2].class_counts  # the training split's, which the plan line ends with
    balance = f"classes: 5, largest {max(counts)} / smallest {min(counts)} images ({max(counts) / min(counts):.1f}x)"
    assert plan.endswith(f"; at most 1024 images per augment call; {balance}")

    (row,) = _rows(run_dir / "metrics.csv")
    assert int(row["epoch"]) == 1 and {"val_top5", "val_loss", "lr", "train_loss"} <= set(row)
    (timing,) = _rows(run_dir / "timings.csv")
    assert 0.0 <= float(timing["data_wait_frac"]) <= 1.0 and float(timing["images_per_s"]) > 0
    # what bounded the epoch (training/bounds.py): the two ranks' rows carried the stages' seconds
    assert timing["bound"] in STAGES and float(timing["augment_busy"]) > 0 and float(timing["read_busy"]) > 0
    assert summary["bound"]["stage"] == timing["bound"] and summary["bound"]["hint"]
    # the CPUs a rank's process kept busy, measured: something, and no more than the machine has
    assert 0 < float(timing["trainer_cpus"]) <= os.cpu_count(), timing
    assert summary["bound"]["trainer_cpus_planned"] > 0
    # where each trained image was decoded (on CPUs: all of them there), and the rate within the epoch
    assert int(timing["decoded_cpu"]) == int(row["train_images"]) and int(timing["decoded_engines"]) == 0
    assert summary["decoded_on"] == {"engines": 0, "gpu_sms": 0, "cpu": int(row["train_images"])}
    assert float(timing["inner_images_per_s"]) > 0 and float(timing["start_s"]) >= 0

    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert not (run_dir / "bad_files.csv").exists()  # the names in bytes (the `data` fixture) were read
    assert sum("\\x" in p for p in [*tree.train.rel_paths, *tree.val.rel_paths]) == 4
    assert summary["world_size"] == 2 and summary["device"] == "cpu" and summary["num_classes"] == 5
    assert summary["epochs"] == 1 and summary["val_images"] == len(tree.val) > 0
    assert 0.0 <= summary["val_acc"] <= summary["val_top5"] <= 1.0
    assert summary["train_images_per_s"] > 0 and 0 < summary["startup_s"] < summary["wall_s"]
    assert set(summary["per_class_val_acc"]) == set(config["class_names"])

    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert model["class_names"] == config["class_names"] and model["small_stem"] is True
    assert model["state_dict"]["fc.weight"].shape == (5, 512)
    assert model["state_dict"]["conv1.weight"].shape == (64, 3, 3, 3)  # --small-stem on at 40 px


def test_a_run_writes_tensorboard_events_of_its_metrics(two_worker_run):
    """docs/guide.md, "Console": TensorBoard event files under runs/<name>/tensorboard/ when tensorboardX is installed
    (a test dependency), one scalar per metrics.csv and timings.csv column per epoch."""
    run_dir = two_worker_run[0]
    scalars = event_scalars(run_dir / "tensorboard")
    (row,) = _rows(run_dir / "metrics.csv")
    assert scalars["val/acc"] == [(1, pytest.approx(float(row["val_acc"]), rel=1e-4))]
    assert scalars["train/loss"] == [(1, pytest.approx(float(row["train_loss"]), rel=1e-4))]
    (timing,) = _rows(run_dir / "timings.csv")
    assert scalars["run/images_per_s"] == [(1, pytest.approx(float(timing["images_per_s"]), rel=1e-4))]


def test_image_size_is_trained_recorded_and_followed_by_inference(two_worker_run):
    """--image-size 40 on 32 px files: the batches, config.json, model.pt and jobs.predict agree."""
    import numpy as np

    from augment.decode import decode_image
    from training.predict.inference import Predictor, load_model_file

    run_dir, _, tree, _ = two_worker_run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["image_size"] == 40 and config["train_image_sizes"] == [40]
    assert config["preset"]["train"][0] == {"random_crop": {"size": 40, "padding": 5}}
    assert [int(r["image_size"]) for r in _rows(run_dir / "metrics.csv")] == [40]  # what the ranks trained on
    info = load_model_file(str(run_dir / "model.pt"))
    assert info.image_size == 40 and info.eval_transform["ops"] == [{"center_crop": {"size": 40}}]
    predictor, seen = Predictor(info), []
    predictor.model.conv1.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    images = np.empty(2, dtype=object)
    images[:] = [decode_image(open(p, "rb").read()) for p in tree.val.paths[:2]]
    predictor({"image": images, "label": np.zeros(2, np.int64), "path": np.array(["a", "b"], dtype=object)})
    assert seen == [(2, 3, 40, 40)]  # jobs.predict and jobs.evaluate score at the size model.pt names


def test_the_bar_counts_both_ranks_and_the_driver_prints_the_epoch_line(two_worker_run):
    _, summary, _, (screen, lines) = two_worker_run
    frames = bar_frames(screen)
    (cov,) = summary["coverage"]
    assert frames and max(n for _, n, _ in frames) == sum(cov["per_rank"]) > max(cov["per_rank"])
    assert sum(bool(re.match(r"epoch +1/1  loss", line)) for line in lines) == 1  # from the driver, once


def test_ranks_start_from_identical_weights_and_see_different_images(two_worker_run):
    run_dir, summary, tree, _ = two_worker_run
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["init_digest"] == ranks[1]["init_digest"]
    assert ranks[0]["node_id"] != ranks[1]["node_id"], "CPU workers should spread over the 2 nodes"
    (cov,) = summary["coverage"]
    # streaming_split(equal=True) drops len % world_size rows so both ranks take the same steps
    n, dropped = len(tree.train), len(tree.train) % 2
    assert (cov["expected"], cov["seen"], cov["distinct"]) == (n, n - dropped, n - dropped)
    assert cov["repeated"] == 0 and cov["missing"] == dropped and cov["per_rank"][0] == cov["per_rank"][1] > 0
    # no overlap, nothing else missing: the key sums agree, or differ by the key of one image of the split
    assert cov["as_expected"] is True and cov["exactly_once"] == (dropped == 0)


def test_every_rank_draws_from_its_own_random_stream(two_worker_run):
    """Identical initial weights (above), then a stream per rank, saved per rank."""
    run_dir, summary, _, _ = two_worker_run
    (fp,) = summary["fingerprints"]
    assert len(set(fp["rng_per_rank"])) == 2
    saved = _records(run_dir).rng
    assert len(saved) == 2 and not torch.equal(saved[0]["torch"], saved[1]["torch"])
    assert saved[0]["python"] != saved[1]["python"] and not torch.equal(
        saved[0]["numpy"]["keys"], saved[1]["numpy"]["keys"]
    )


def test_validation_scores_every_image_once(two_worker_run):
    """val is split across ranks without dropping rows: the confusion matrix counts each
    validation image once, in its own class's row."""
    run_dir, summary, tree, _ = two_worker_run
    confusion = torch.tensor(_records(run_dir).epochs[-1].val.confusion)
    per_class = torch.bincount(torch.as_tensor(np.asarray(tree.val.labels, dtype=np.int64)), minlength=tree.num_classes)
    assert int(confusion.sum()) == len(tree.val) and torch.equal(confusion.sum(1), per_class)
    assert summary["val_acc"] == pytest.approx(float(confusion.diag().sum()) / len(tree.val), abs=1e-6)
    assert split_coordinators(), "two workers split their datasets through coordinator actors"


def test_deterministic_runs_repeat_and_resume_continues(ray_cluster, data, tmp_path):
    """Two runs of two workers, the second stopped after epoch 1 and resumed: identical metrics,
    identical augmented views, which differ between epochs (each batch carries the epoch its
    augmentation was drawn for), and the same random streams."""
    # the cifar preset plus two of Kornia's ops by name: they run in Ray Data's tasks and stay reproducible
    preset = tmp_path / "cifar-kornia.yaml"
    preset.write_text(
        "train:\n  - random_crop: {size: 32, padding: 4}\n  - horizontal_flip: {p: 0.5}\n"
        "  - kornia.RandomGaussianBlur: {kernel_size: [3, 3], sigma: [0.1, 1.5], p: 0.5}\n"
        "  - kornia.RandomAffine: {degrees: 10, translate: [0.1, 0.1], p: 0.5}\n"
        "eval:\n  - center_crop: {size: 32}\n"
    )
    common = dict(
        data=str(data),
        epochs=2,
        batch_size=16,
        num_workers=2,  # the ranks' shares of each epoch must repeat too
        deterministic=True,
        storage_path=str(tmp_path),
        val_fraction=0.25,
        preset=str(preset),
        progressive_resize="24",  # epoch 1 at 24 px, epoch 2 at 32: the resumed run must pick up the size
    )
    run_a, _ = _run(name="a", **common)
    assert [int(r["image_size"]) for r in _rows(tmp_path / "a" / "metrics.csv")] == [24, 32]
    a = (tmp_path / "a" / "metrics.csv").read_text()
    train_ops = json.loads((tmp_path / "a" / "config.json").read_text())["preset"]["train"]
    assert [next(iter(op)) for op in train_ops][2:] == ["kornia.RandomGaussianBlur", "kornia.RandomAffine"]
    views = [e["views"] for e in run_a["fingerprints"]]
    assert views[0] != views[1], "epoch 2 trained on epoch 1's augmented views"
    assert all(c["exactly_once"] for c in run_a["coverage"])
    # model_best.pt holds the weights of the epoch with the best validation accuracy, model.pt the last's
    accs = [float(r["val_acc"]) for r in _rows(tmp_path / "a" / "metrics.csv")]
    assert accs[run_a["best_epoch"] - 1] == max(accs) == run_a["best_val_acc"]
    for model_file, epoch in (("model_best.pt", run_a["best_epoch"]), ("model.pt", 2)):
        weights = torch.load(tmp_path / "a" / model_file, weights_only=True)["state_dict"]
        saved = torch.load(tmp_path / "a" / f"checkpoint_epoch_{epoch:04d}" / "checkpoint.pt", weights_only=True)
        model = saved["learner"]["model"]
        assert weights.keys() == model.keys()
        assert all(torch.equal(weights[k], model[k]) for k in weights), model_file

    first, _ = _run(name="c", stop_after=1, **common)
    assert first["epochs"] == 1
    second, _ = _run(name="c", **common)  # same name: resumes at epoch 2, not from scratch
    assert second["resumed_at_epochs"] == [2]
    rows = _rows(tmp_path / "c" / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert (tmp_path / "c" / "metrics.csv").read_text() == a, "same seed and world size must give identical metrics"
    assert second["val_acc"] == run_a["val_acc"]
    # the resumed attempt put the random stream back where epoch 1 left it, and saw the same views
    assert second["fingerprints"] == run_a["fingerprints"]


def test_init_weights_from_a_torchvision_state_dict(two_worker_run):
    run_dir, _, _, _ = two_worker_run
    source = torch.load(run_dir.parent / "r18.pt", weights_only=True)
    model = torch.load(run_dir / "model.pt", weights_only=True)["state_dict"]
    assert model["fc.weight"].shape == (5, 512)  # a new head for the 5 classes
    # a tiny lr barely moves the loaded weights away from the source's, which a fresh init is far from
    for name in ("layer3.0.conv1.weight", "layer1.0.bn1.weight", "layer4.1.bn2.bias", "layer2.0.downsample.1.weight"):
        assert torch.allclose(model[name], source[name], atol=1e-4), name
        assert not torch.allclose(source[name], torch.ones_like(source[name]), atol=0.05), name
        assert not torch.allclose(source[name], torch.zeros_like(source[name]), atol=0.05), name
    # the 3x3 small-image stem cannot take the 7x7 ImageNet stem's weights: it keeps its fresh init
    assert model["conv1.weight"].shape == (64, 3, 3, 3) and source["conv1.weight"].shape == (64, 3, 7, 7)


def test_init_weights_load_every_matching_tensor_and_report_what_stays_fresh(tmp_path):
    """The workers' loader, without Ray: every ResNet18 tensor of the source, batch norms
    included, except the head and the 7x7 stem that the 3x3 small-image stem cannot take."""
    from training.model import load_init_weights, resnet18

    source = _perturbed_resnet18()
    torch.manual_seed(0)
    model = resnet18(5, small_stem=True)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(source, tmp_path / "r18.pt")
    skipped = sorted(load_init_weights(model, str(tmp_path / "r18.pt")).new)
    assert skipped == ["conv1.weight", "fc.bias", "fc.weight"]
    for name, value in model.state_dict().items():
        expected = fresh[name] if name in skipped else source[name]
        assert torch.equal(value, expected), name


def test_missing_init_weights_is_a_config_error(data, tmp_path):
    with pytest.raises(ConfigError, match="--init-weights .*no such file"):
        prepare(TrainConfig(data=str(data), init_weights=str(tmp_path / "nope.pt"), storage_path=str(tmp_path)))


def test_asking_for_gpus_on_a_cpu_cluster_is_a_config_error(ray_cluster):
    capacity = planning.cluster_capacity()
    assert (capacity.cpus, capacity.gpus, capacity.hosts) == (4, 0, 1)  # 2 nodes, one machine
    assert capacity.nodes == ((2.0, 0.0), (2.0, 0.0))
    with pytest.raises(ConfigError, match="no GPUs"):
        planning.plan_resources(TrainConfig(device="cuda"), capacity)


def test_fp16_autocast_on_cpu_is_a_config_error(data, tmp_path):
    with pytest.raises(ConfigError, match="--amp fp16 on CPU.*--amp bf16"):  # before Ray starts
        prepare(TrainConfig(data=str(data), device="cpu", amp="fp16", storage_path=str(tmp_path)))
    with pytest.raises(ConfigError, match="--amp fp16 on CPU"):  # --device auto on a cluster without GPUs
        planning.plan_resources(TrainConfig(amp="fp16"), planning.Capacity(cpus=2, gpus=0, hosts=1))
    assert planning.plan_resources(TrainConfig(amp="fp16"), planning.Capacity(cpus=8, gpus=1, hosts=1)).use_gpu


def test_coverage_tells_repeats_drops_and_swaps_apart():
    from training.forms.data import ImageTree, make_split

    keys = (11, 22, 33, 44, 55)
    split = make_split("/d", [f"a/{k}.png" for k in keys], [0] * 5, [0] * 5, keys=np.array(keys, dtype=np.int64))
    tree = ImageTree("/d", "hash", ("a", "b"), split, make_split("/d", [], [], []))

    def rank(*ks):
        return ShardRecord(count=len(ks), distinct=len(set(ks)), key_sum=sum(set(ks)), views=0, rng="")

    def cov(*ranks, bad=None):
        (c,) = audit.coverage([list(ranks)], tree, bad or {})
        return {k: c[k] for k in ("exactly_once", "every_image", "as_expected", "repeated", "missing")}

    once = cov(rank(11, 22), rank(33, 44, 55))
    assert once == {"exactly_once": True, "every_image": True, "as_expected": True, "repeated": 0, "missing": 0}
    dropped = cov(rank(11, 22), rank(33, 44))  # an equal split dropped 55
    assert dropped == {"exactly_once": False, "every_image": False, "as_expected": True, "repeated": 0, "missing": 1}
    # 44 and 55 missing, 99 (not an image of the split) seen: one short by count, but no key is the difference
    assert cov(rank(11, 22), rank(33, 44 + 55))["as_expected"] is False
    repeated = cov(rank(11, 22, 22), rank(33, 44, 55))  # a redelivered batch
    assert repeated["every_image"] and not repeated["exactly_once"] and repeated["repeated"] == 1
    assert repeated["as_expected"] is False
    swapped = cov(rank(11, 22, 33), rank(33, 44))  # 33 on both ranks, 55 on none: counts alone agree
    assert not swapped["every_image"] and swapped["as_expected"] is False
    skipped = cov(rank(11, 22), rank(33, 44), bad={"/d/a/55.png": "corrupt"})  # a bad file is not expected
    assert skipped["exactly_once"]


@pytest.mark.parametrize(
    "setting, side, small",
    [("auto", 32, True), ("auto", 24, True), ("auto", 33, False), ("auto", 48, False), ("auto", 64, False)]
    + [("on", 224, True), ("off", 32, False)],
)
def test_small_stem_auto_takes_the_small_stem_at_32_px_or_less(setting, side, small):
    """The threshold docs/benchmarks.md's "Small-image stem" measured: at 32 px the small stem
    scored as well as the ImageNet one at 0.14x its speed; at 48 and 64 px it scored worse."""
    from training.model import uses_small_stem

    assert uses_small_stem(setting, side) is small
