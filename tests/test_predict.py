"""jobs.predict and jobs.evaluate on a model.pt in the trainer's format (freshly initialised,
not trained: the tests check the plumbing, the CSV and the arithmetic, not the accuracy)."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import pickle
import re
import warnings

import pytest
import torch

from augment.presets import PRESETS
from tests.conftest import write_tree
from training.config import TrainConfig
from training.forms.tree import scan_tree
from training.model import resnet18


@pytest.fixture(scope="module")
def model_and_tree(tmp_path_factory):
    from training.driver.results import model_bytes

    root = tmp_path_factory.mktemp("predict")
    data = write_tree(root / "data", {"cat": 6, "dog": 6, "eel": 6}, sizes=[(32, 32), (36, 30)])
    tree = scan_tree(str(data), 0.2)  # the model's classes: cat, dog, eel
    (data / "unsorted").mkdir()
    write_tree(root / "tmp", {"x": 2})
    for p in (root / "tmp" / "x").iterdir():  # images in a directory that is not a class
        p.rename(data / "unsorted" / p.name)
    torch.manual_seed(0)
    model = resnet18(tree.num_classes, small_stem=True)
    path = root / "model.pt"
    path.write_bytes(model_bytes(model.state_dict(), tree.class_names, PRESETS["cifar"], TrainConfig()))
    return path, data


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def predictions(ray_cluster, model_and_tree, tmp_path_factory):
    """jobs.predict on the tree three ways, 1 to 2 inference actors: into a folder of Parquet files, into
    FILE.parquet, and into FILE.csv (in 8-image batches, over an older file that --overwrite replaces).
    Returns ({kind: out}, {kind: what it printed}); the tests below check these three runs."""
    from jobs.predict import main

    model, data = model_and_tree
    root = tmp_path_factory.mktemp("predictions")
    outs = {"dir": root / "preds", "parquet": root / "p.parquet", "csv": root / "p.csv"}
    outs["csv"].write_text("an older result\n")  # replaced only because --overwrite says so (the refusal: below)
    printed = {}
    for kind, out in outs.items():
        argv = ["--model", str(model), "--data", str(data), "--out", str(out), "--actors", "1-2"]
        if kind == "csv":
            argv += ["--batch-size", "8", "--overwrite"]
        capture = io.StringIO()
        with contextlib.redirect_stdout(capture):
            assert main(argv) == 0
        printed[kind] = capture.getvalue()
    return outs, printed


def test_predict_writes_one_row_per_image_and_the_accuracy_of_the_csv(model_and_tree, predictions):
    _, data = model_and_tree
    outs, printed = predictions
    out, printed = outs["csv"], printed["csv"]
    rows = _csv(out)
    files = sorted(str(p.relative_to(data)) for p in data.rglob("*.png"))
    assert sorted(r["path"] for r in rows) == files  # 18 labelled + 2 unlabelled
    assert {r["predicted"] for r in rows} <= {"cat", "dog", "eel"}
    assert all(0 < float(r["confidence"]) <= 1 for r in rows)
    assert {r["label"] for r in rows if r["path"].startswith("unsorted/")} == {""}
    labelled = [r for r in rows if r["label"]]
    assert len(labelled) == 18
    correct = sum(r["label"] == r["predicted"] for r in labelled)
    m = re.search(r"accuracy (\d\.\d{4}) \((\d+)/(\d+) labelled images\)", printed)
    assert m, printed
    assert (int(m.group(2)), int(m.group(3))) == (correct, 18)
    assert float(m.group(1)) == round(correct / 18, 4)


def test_predict_matches_torchvisions_eval_transform_and_the_model(model_and_tree, predictions):
    """jobs.predict's CSV (its own read tasks, decode, eval transform and model) gives the
    classes and confidences of the model on torchvision's own eval transform for the cifar
    preset (CenterCrop(32) on the decoded file, then ToDtype and Normalize), not on this
    project's pipeline: a read, crop or normalisation that drifted from torchvision fails."""
    import torchvision.transforms.v2 as T
    from PIL import Image

    from training.predict import inference

    model_path, data = model_and_tree
    info = inference.load_model_file(str(model_path))
    t = info.eval_transform
    assert t["ops"] == [{"center_crop": {"size": 32}}]  # what the reference below reproduces
    reference = T.Compose(
        [T.PILToTensor(), T.CenterCrop(32), T.ToDtype(torch.float32, scale=True), T.Normalize(t["mean"], t["std"])]
    )
    model = resnet18(3, small_stem=True)
    model.load_state_dict(info.state_dict)
    model.eval()
    files = sorted(data.rglob("*.png"))  # every image jobs.predict scored into the CSV (in 8-image batches)
    assert {Image.open(f).size for f in files} == {(32, 32), (30, 36)}  # a crop and a pad of 2 px
    got = {r["path"]: r for r in _csv(predictions[0]["csv"])}
    assert sorted(got) == sorted(str(f.relative_to(data)) for f in files)
    with torch.no_grad():
        probs = model(torch.stack([reference(Image.open(f).convert("RGB")) for f in files])).softmax(1)
    for f, p in zip(files, probs, strict=True):
        row = got[str(f.relative_to(data))]
        assert row["predicted"] == info.class_names[int(p.argmax())], row
        assert float(row["confidence"]) == pytest.approx(float(p.max()), abs=1e-5), row  # the CSV has 6 decimals


def test_evaluate_on_a_prepared_directory(ray_cluster, s3, model_and_tree, tmp_path, capsys):
    """jobs.evaluate reads a jobs.prepare directory: confusion.png, a per-class table that
    agrees with its predictions.csv, and the same predictions as from the image tree."""
    import shutil

    from jobs.evaluate import main
    from jobs.predict import main as predict
    from jobs.prepare import main as prepare

    model, data = model_and_tree
    labelled_only = shutil.copytree(data, tmp_path / "labelled", ignore=shutil.ignore_patterns("unsorted"))
    assert prepare([str(labelled_only), str(tmp_path / "prep")]) == 0
    out = tmp_path / "eval"
    out.mkdir()
    (out / "predictions.csv").write_text("an older evaluation\n")
    assert main(["--model", str(model), "--data", str(tmp_path / "prep"), "--out", str(out), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert (out / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = _csv(out / "predictions.csv")
    assert len(rows) == 18 and all(r["label"] for r in rows)
    per_class = {r["class"]: r for r in _csv(out / "per_class.csv")}
    assert set(per_class) == {"cat", "dog", "eel"}
    for name, stats in per_class.items():
        present = [r for r in rows if r["label"] == name]
        predicted = [r for r in rows if r["predicted"] == name]
        hits = sum(r["predicted"] == name for r in present)
        assert int(stats["images"]) == len(present) == 6
        assert float(stats["recall"]) == pytest.approx(hits / 6)
        if predicted:
            assert float(stats["precision"]) == pytest.approx(hits / len(predicted))
        else:  # undefined: nothing was predicted as this class
            assert stats["precision"] == ""
        assert re.search(rf"^{name}\s+6\s", printed, re.M)
    # the same images as files give the same predictions, here with the model, the files and
    # the CSV on object storage (tests/test_storage.py)
    s3.upload(labelled_only, "s3://data/predict/labelled")
    s3.client.upload_file(str(model), "runs", "predict/model.pt")
    argv = ["--model", "s3://runs/predict/model.pt", "--data", "s3://data/predict/labelled"]
    assert predict([*argv, "--out", "s3://runs/predict/p.csv"]) == 0
    from_s3 = list(csv.DictReader(io.StringIO(s3.read("s3://runs/predict/p.csv").decode())))
    assert sorted((r["path"], r["predicted"], r["label"]) for r in from_s3) == sorted(  # streamed: the input's order
        (r["path"], r["predicted"], r["label"]) for r in rows
    )


def test_predict_and_evaluate_read_names_that_are_not_utf8(ray_cluster, model_and_tree, tmp_path, capsys):
    """Two files and a folder that is no class named in Latin-1 bytes: read, scored, and
    written to predictions.csv by their escaped names (training/storage.py shown_name)."""
    import shutil

    from jobs.evaluate import main as evaluate
    from jobs.predict import main as predict

    model, data = model_and_tree
    tree = shutil.copytree(data, tmp_path / "d")
    raw = os.fsencode(tree)
    os.rename(raw + b"/cat/000.png", raw + b"/cat/caf\xe9.png")
    os.rename(raw + b"/dog/000.png", raw + b"/dog/\xe9t\xe9.png")
    os.rename(raw + b"/unsorted", raw + b"/\xff\xfeunsorted")
    out = tmp_path / "p.csv"
    assert predict(["--model", str(model), "--data", str(tree), "--out", str(out)]) == 0, capsys.readouterr().err
    rows = {r["path"]: r for r in _csv(out)}
    assert len(rows) == 20 and "skipped" not in capsys.readouterr().out
    assert rows["cat/caf\\xe9.png"]["label"] == "cat" and rows["dog/\\xe9t\\xe9.png"]["label"] == "dog"
    assert {r["label"] for p, r in rows.items() if p.startswith("\\xff\\xfeunsorted/")} == {""}
    shutil.rmtree(raw + b"/\xff\xfeunsorted")
    assert evaluate(["--model", str(model), "--data", str(tree), "--out", str(tmp_path / "eval")]) == 0
    assert len(_csv(tmp_path / "eval" / "predictions.csv")) == 18


class Reduced:
    """An object whose pickle names a function to call when loaded (here a harmless one), as a hostile file's does."""

    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.parametrize("module", ["jobs.predict", "jobs.evaluate"])
def test_bad_input_is_one_line_and_exit_2(module, model_and_tree, tmp_path, capsys):
    import importlib

    main = importlib.import_module(module).main
    model, data = model_and_tree
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "pickled.pt").write_bytes(pickle.dumps(Reduced(), protocol=4))  # a plain pickle, no torch zip
    cases = [
        (["--model", str(tmp_path / "pickled.pt"), "--data", str(data)], "error: --model", "not a model.pt"),
        (["--model", str(tmp_path / "missing.pt"), "--data", str(data)], "error: --model", "no such file"),
        (["--model", str(tmp_path / "junk.pt"), "--data", str(data)], "error: --model", "not a model.pt"),
        (["--model", str(model), "--data", str(tmp_path / "nowhere")], "error: ", "no such directory"),
        (["--model", str(model), "--data", ""], "error: --data is empty; ", "give the images' folder"),
    ]
    for args, start, reason in cases:
        with warnings.catch_warnings(record=True) as warned:  # what a console would show above the line
            warnings.simplefilter("always")
            assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(start) and reason in err, err
        assert not warned, [str(w.message) for w in warned]


def _edited(model_path, tmp_path, name, change) -> str:
    info = torch.load(model_path, weights_only=True)
    change(info)
    torch.save(info, tmp_path / name)
    return str(tmp_path / name)


@pytest.mark.parametrize("module", ["jobs.predict", "jobs.evaluate"])
def test_a_model_file_with_the_right_keys_and_bad_values_is_one_line_before_ray(
    module, model_and_tree, tmp_path, capsys, monkeypatch
):
    """Before this check such a file was found only by the inference actor, after Ray started,
    as a traceback. Each is one line naming what is wrong, exit 2, and Ray never starts."""
    import importlib

    from training.driver import session

    monkeypatch.setattr(session, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    main = importlib.import_module(module).main
    model, data = model_and_tree
    cases = {
        "names.pt": (lambda i: i.update(class_names="cat"), "class_names is not a list of names"),
        "size.pt": (lambda i: i.update(image_size="32"), "image_size is not a positive integer"),
        "stem.pt": (lambda i: i.update(small_stem=None), "small_stem is not true or false"),
        "weights.pt": (lambda i: i["state_dict"].pop("fc.weight"), "its weights or eval transform do not build"),
        "shapes.pt": (lambda i: i.update(class_names=["a", "b"]), "its weights or eval transform do not build"),
        "ops.pt": (lambda i: i["eval_transform"].update(ops=[{"warp": {}}]), "its weights or eval transform do not"),
        "transform.pt": (lambda i: i.update(eval_transform=[]), "eval_transform has no ops, mean and std"),
    }
    for name, (change, reason) in cases.items():
        path = _edited(model, tmp_path, name, change)
        assert main(["--model", path, "--data", str(data)]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: --model {path}: ") and reason in err, err


@pytest.mark.parametrize("module", ["jobs.predict", "jobs.evaluate", "jobs.export"])
def test_a_model_file_of_an_earlier_version_is_one_line_before_ray(
    module, model_and_tree, tmp_path, capsys, monkeypatch
):
    """A model.pt written before MODELFILE_VERSION (no `version`, and without the keys added since)
    or of another version is one line naming both versions, exit 2, not read field by field."""
    import importlib

    from training.driver import session
    from training.modelfile import MODELFILE_VERSION

    monkeypatch.setattr(session, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    main = importlib.import_module(module).main
    model, data = model_and_tree
    earlier = {"config", "version", "model_source", "torchvision_model", "torchvision_eval", "weights"}
    cases = {
        "v1.pt": (lambda i: [i.pop(k) for k in earlier], "version 1 of jobs.train"),
        "v9.pt": (lambda i: i.update(version=9), "version 9 of jobs.train"),
    }
    for name, (change, reason) in cases.items():
        path = _edited(model, tmp_path, name, change)
        args = ["--data", str(data)] if module != "jobs.export" else ["--format", "safetensors"]
        assert main(["--model", path, *args, "--out", str(tmp_path / f"{name}.out")]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: --model {path}: ") and reason in err, err
        assert f"this one reads version {MODELFILE_VERSION}" in err, err
    assert not list(tmp_path.glob("*.out*"))


def test_predict_out_naming_a_folder_is_one_line_before_ray(model_and_tree, tmp_path, capsys, monkeypatch):
    """A folder is where Parquet files go: one that holds the user's files is refused (as an existing
    file is); a folder named like a file is a mistake."""
    from jobs.predict import main
    from training.driver import session

    monkeypatch.setattr(session, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    model, data = model_and_tree
    results = tmp_path / "results"
    results.mkdir()
    (results / "notes.txt").write_text("mine")
    assert main(["--model", str(model), "--data", str(data), "--out", str(results)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --out {results} holds files already; nothing was written; give another --out, or --overwrite to "
        "replace it\n"
    )
    assert os.listdir(results) == ["notes.txt"]
    folder = tmp_path / "looks.csv"
    folder.mkdir()
    assert main(["--model", str(model), "--data", str(data), "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {folder}: a folder; give a file to write, e.g. {folder}/predictions.csv\n"


@pytest.mark.parametrize(
    "module, out, expected",
    [
        ("jobs.predict", "", "error: --out is empty; give FILE.csv, FILE.parquet or a folder for Parquet files"),
        ("jobs.evaluate", "", "error: --out is empty; give a folder for the evaluation's files, or drop --out"),
        (
            "jobs.predict",
            "preds.json",
            "error: --out {out}: jobs.predict writes CSV or Parquet, not .json; give {stem}",
        ),
    ],
    ids=["predict-empty", "evaluate-empty", "predict-json"],
)
def test_an_empty_out_or_one_of_another_format_is_one_line_before_ray(
    module, out, expected, model_and_tree, tmp_path, capsys, monkeypatch
):
    """An unset shell variable is not the working folder (evaluate wrote into eval/ beside the model),
    and preds.json is not a folder for Parquet files (predict made one by that name)."""
    import importlib

    from training.driver import session

    monkeypatch.setattr(session, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    model, data = model_and_tree
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir()), sorted(p.name for p in model.parent.iterdir())
    target = str(tmp_path / out) if out else out
    assert importlib.import_module(module).main(["--model", str(model), "--data", str(data), "--out", target]) == 2
    err = capsys.readouterr().err
    line = expected.format(out=target, stem=target.rsplit(".", 1)[0])
    assert err.count("\n") == 1 and err.startswith(line), err
    assert (sorted(p.name for p in tmp_path.iterdir()), sorted(p.name for p in model.parent.iterdir())) == before


@pytest.mark.parametrize("module", ["jobs.predict", "jobs.evaluate"])
def test_an_existing_output_is_kept_and_refused_in_one_line_before_ray(
    module, model_and_tree, tmp_path, capsys, monkeypatch
):
    """The user's files are never replaced without a word: an existing --out (predict's CSV, any of
    evaluate's three files) is refused before Ray unless --overwrite is given (the tests above)."""
    import importlib

    from training.driver import session

    monkeypatch.setattr(session, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    model, data = model_and_tree
    if module == "jobs.predict":
        out, mine = tmp_path / "mine.csv", tmp_path / "mine.csv"
        expected = f"error: --out {out} exists already; nothing was written; give another --out, or --overwrite"
    else:
        out, mine = tmp_path / "eval", tmp_path / "eval" / "per_class.csv"
        out.mkdir()
        expected = f"error: --out {out} holds per_class.csv already (an earlier evaluation's?); nothing was written"
    mine.write_text("my own results\n")
    assert importlib.import_module(module).main(["--model", str(model), "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(expected), err
    assert mine.read_text() == "my own results\n"


def test_predictions_stream_into_parquet_files_a_parquet_file_or_a_csv_with_counts_not_rows(predictions):
    """training/predict/scoring.py: the rows go from the pipeline into the output; the accuracy comes from a
    tally of counts. A folder gets Ray Data's Parquet files, FILE.parquet one file merged from them,
    FILE.csv one CSV; the same rows each way, in the input's order, and no parts left behind."""
    import pyarrow.parquet as pq

    outs, printed = predictions
    rows = {}
    for kind, out in outs.items():
        assert f"wrote {out}: 20 predictions" in printed[kind], printed[kind]
        if kind == "csv":
            rows[kind] = [(r["path"], r["predicted"], r["label"]) for r in _csv(out)]
        else:
            table = pq.read_table(str(out)).to_pylist()
            rows[kind] = [(r["path"], r["predicted"], r["label"]) for r in table]
    assert rows["dir"] == rows["parquet"] == rows["csv"]  # the same rows, in the same (the input's) order
    assert [p for p, _, _ in rows["csv"]] == sorted(p for p, _, _ in rows["csv"])
    assert sorted(os.listdir(outs["csv"].parent)) == ["p.csv", "p.parquet", "preds"]  # no .parts left
    labelled = [r for r in rows["csv"] if r[2]]
    correct = sum(p == lab for _, p, lab in labelled)
    assert f"accuracy {correct / 18:.4f} ({correct}/18 labelled images)" in printed["csv"]


# the variables the job sets to keep Ray's notices off its console (training/driver/session.py quiet_ray_env),
# which this process has set for its own cluster: a user's shell has none of them
QUIETING = ("RAY_AUTH_MODE", "RAY_DATA_LOGGING_CONFIG", "RAY_DEDUP_LOGS_SKIP_REGEX", "PYTHONWARNINGS", "RAY_ADDRESS")


@pytest.mark.ray
@pytest.mark.parametrize("module", ["jobs.predict", "jobs.evaluate"])
def test_the_command_prints_its_own_lines_and_not_rays(module, model_and_tree, tmp_path):
    """As a user runs it, with a cluster of its own: the job's lines, not Ray's warnings that token
    authentication is on and that progress bars are off, nor the error line Ray's C++ core logs in the
    driver for each actor of the pool (its constructor arguments in the object store)."""
    import subprocess
    import sys

    model, data = model_and_tree
    env = {k: v for k, v in os.environ.items() if k not in QUIETING}
    out = tmp_path / ("p.csv" if module == "jobs.predict" else "eval")
    args = [sys.executable, "-m", module, "--model", str(model), "--data", str(data), "--out", str(out)]
    done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = (done.stdout + done.stderr).splitlines()
    assert any(line.startswith("wrote " if module == "jobs.predict" else "accuracy ") for line in said), said
    noise = [
        line for line in said if re.search(r"WARNING|Warning|warn|Traceback|Progress bars|\(raylet\)|\] \S+\.cc:", line)
    ]
    assert not noise, said


@pytest.mark.ray
def test_sigterm_while_predict_writes_is_one_line_exit_143_and_leaves_nothing(model_and_tree, tmp_path):
    """What a scheduler or `kill` sends, once the output's parts are being written: Ray's own handler
    dumped the C++ stack and aborted (exit 134), and Ctrl-C gave a traceback; both left p.csv.parts,
    which refused the next run. Now one line, exit 143, nothing of the output left. The job runs with
    SIGINT ignored, as a shell script's background job (`cmd &`) does: SIGTERM, passed on as SIGINT,
    was then lost, and the job went on to write its output and exit 0."""
    import functools
    import signal
    import subprocess
    import sys
    import time

    model, _ = model_and_tree
    data = write_tree(tmp_path / "data", {"cat": 300, "dog": 300})  # a few seconds of scoring
    out = tmp_path / "p.csv"
    args = [sys.executable, "-m", "jobs.predict", "--model", str(model), "--data", str(data), "--out", str(out)]
    background = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)  # `cmd &` in a script
    job = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=background
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "p.csv.parts").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == 143, stdout[-2000:] + stderr[-3000:]
    assert stderr.strip().splitlines() == [
        f"stopped: terminated (SIGTERM); {out} was not written (its parts so far are removed); run the same command "
        "again"
    ], stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("module", ["jobs.train", "jobs.predict", "jobs.evaluate"])
def test_a_ray_address_where_nothing_answers_is_one_line_at_once(module, model_and_tree, tmp_path):
    """RAY_ADDRESS naming a port nothing listens on: ray.init would retry it for minutes, printing Ray's
    warnings; the job says so in one line, exit 1, within seconds (training/driver/session.py check_answers)."""
    import socket
    import subprocess
    import sys

    model, data = model_and_tree
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    args = ["--data", str(data)]
    args += ["--storage-path", str(tmp_path / "runs")] if module == "jobs.train" else ["--model", str(model)]
    args += ["--out", str(tmp_path / "out.csv")] if module == "jobs.predict" else []
    env = {**os.environ, "RAY_ADDRESS": address}
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr == (
        f"error: Ray did not start: joining RAY_ADDRESS={address}: nothing answers at {address} (Connection "
        "refused); check the address and that the cluster is up (ray status)\n"
    )
    assert not list((tmp_path / "runs").glob("*")) and not (tmp_path / "out.csv").exists()  # no run folder, no rows


def test_more_actors_than_the_cluster_holds_is_one_line_not_a_wait(ray_cluster, model_and_tree, tmp_path, capsys):
    """--actors whose minimum the cluster cannot hold beside the reads: Ray Data waited for room that never
    came, with no word, for as long as the user let it; now one line with the most it holds, exit 2."""
    import ray

    from jobs.predict import main

    model, data = model_and_tree
    cpus = int(ray.cluster_resources()["CPU"])
    out = tmp_path / "p.csv"
    assert main(["--model", str(model), "--data", str(data), "--out", str(out), "--actors", str(cpus)]) == 2
    assert capsys.readouterr().err == (
        f"error: --actors {cpus}: the cluster ({cpus} CPUs) holds at most {cpus - 1} inference actor(s) beside "
        f"the reads; give --actors {cpus - 1}, or a range 1-{cpus}\n"
    )
    assert not out.exists() and not list(tmp_path.iterdir())
