"""jobs.export on a model.pt in the trainer's format (freshly initialised, as in tests/test_predict.py):
each format, run by its own runtime and nothing of this project, gives the logits of jobs.predict's
model (training/predict/inference.py's Predictor) on the same images within 1e-4, at batch 1 and 5, fed as
its sidecar says; and each bad input is one line and exit 2. No Ray: export needs the file alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from augment.presets import PRESETS
from tests.conftest import write_tree
from training.config import TrainConfig
from training.forms.tree import scan_tree
from training.model import resnet18

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_and_images(tmp_path_factory):
    from training.driver.results import model_bytes

    root = tmp_path_factory.mktemp("export")
    data = write_tree(root / "data", {"cat": 3, "dog": 3, "eel": 3}, sizes=[(32, 32), (36, 30)])
    tree = scan_tree(str(data), 0.2)
    torch.manual_seed(0)
    model = resnet18(tree.num_classes, small_stem=True)
    path = root / "model.pt"
    path.write_bytes(model_bytes(model.state_dict(), tree.class_names, PRESETS["cifar"], TrainConfig()))
    return path, sorted(data.rglob("*.png"))[:5]  # sizes 32x32 and 36x30: a crop and a pad


@pytest.fixture(scope="module")
def exported(model_and_images, tmp_path_factory):
    """{format: its file}, each written by jobs.export."""
    from jobs.export import main

    model, _ = model_and_images
    out = tmp_path_factory.mktemp("exported")
    files = {}
    for fmt in ("onnx", "torchscript", "safetensors"):
        files[fmt] = out / f"model.{fmt}"
        assert main(["--model", str(model), "--format", fmt, "--out", str(files[fmt])]) == 0
    return files


def predict_logits(model_path, files) -> tuple[torch.Tensor, np.ndarray]:
    """jobs.predict's own path: its Predictor's eval transform on the decoded files (uint8 (B, S, S, 3)),
    then its normalisation and model; returns that batch and the logits."""
    from PIL import Image

    from augment.batch import augment_batch
    from training.predict.inference import Predictor

    predictor = Predictor(str(model_path))
    images = np.empty(len(files), dtype=object)
    images[:] = [np.asarray(Image.open(f).convert("RGB")) for f in files]
    batch = augment_batch(predictor.pipeline, images, torch.zeros(len(files), dtype=torch.int64), 0, "cpu")
    with torch.no_grad():
        return batch, predictor.model(predictor.normalize(batch)).float().numpy()


def sidecar_batch(sidecar: dict, files) -> torch.Tensor:
    """The batch a caller makes from the sidecar alone: its torchvision steps on each decoded RGB file,
    stacked as uint8 NHWC."""
    import torchvision.transforms.v2 as T
    from PIL import Image

    steps = [getattr(T, name)(**args) for name, args in sidecar["preprocess"]["torchvision"]]  # CenterCrop here
    prep = T.Compose([T.PILToTensor(), *steps])
    return torch.stack([prep(Image.open(f).convert("RGB")) for f in files]).permute(0, 2, 3, 1).contiguous()


@pytest.mark.parametrize("n", [1, 5])
def test_onnx_under_onnxruntime_gives_jobs_predicts_logits(model_and_images, exported, n):
    import onnxruntime

    model, files = model_and_images
    sidecar = json.loads((exported["onnx"].parent / "model.onnx.json").read_text())
    batch = sidecar_batch(sidecar, files[:n])
    reference, want = predict_logits(model, files[:n])
    assert torch.equal(batch, reference)  # the sidecar's preprocessing is the eval transform's
    session = onnxruntime.InferenceSession(str(exported["onnx"]), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    assert (inp.name, inp.type, inp.shape) == ("images", "tensor(uint8)", ["batch", 32, 32, 3])
    (got,) = session.run(["logits"], {"images": batch.numpy()})
    assert got.shape == (n, 3)
    assert np.abs(got - want).max() <= TOLERANCE


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.parametrize("n", [1, 5])
def test_torchscript_under_plain_jit_load_gives_jobs_predicts_logits(model_and_images, exported, n):
    model, files = model_and_images
    sidecar = json.loads((exported["torchscript"].parent / "model.torchscript.json").read_text())
    batch = sidecar_batch(sidecar, files[:n])
    _, want = predict_logits(model, files[:n])
    scripted = torch.jit.load(str(exported["torchscript"]), map_location="cpu")
    with torch.no_grad():
        got = scripted(batch).numpy()
    assert got.shape == (n, 3)
    assert np.abs(got - want).max() <= TOLERANCE


@pytest.mark.parametrize("n", [1, 5])
def test_safetensors_in_plain_torchvision_gives_jobs_predicts_logits(model_and_images, exported, n):
    import torchvision
    from safetensors.torch import load_file

    model, files = model_and_images
    sidecar = json.loads((exported["safetensors"].parent / "model.safetensors.json").read_text())
    spec = sidecar["torchvision_model"]
    net = torchvision.models.get_model(spec["get_model"]["name"], num_classes=len(sidecar["class_names"]))
    for name, layer in spec["replace"].items():  # the small stem
        setattr(net, name, torch.nn.Identity() if layer == "identity" else torch.nn.Conv2d(**layer))
    net.load_state_dict(load_file(str(exported["safetensors"])))
    net.eval()
    inp = sidecar["input"]
    mean, std = (torch.tensor(inp[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    x = (sidecar_batch(sidecar, files[:n]).permute(0, 3, 1, 2).float() / 255 - mean) / std  # float NCHW
    _, want = predict_logits(model, files[:n])
    with torch.no_grad():
        got = net(x).numpy()
    assert got.shape == (n, 3)
    assert np.abs(got - want).max() <= TOLERANCE


def test_sidecar_says_the_input_the_preprocessing_and_the_classes(model_and_images, exported):
    from training.predict.inference import load_model_file

    model, _ = model_and_images
    info = load_model_file(str(model))
    for fmt, path in exported.items():
        sidecar = json.loads(path.with_name(path.name + ".json").read_text())
        assert (sidecar["format"], sidecar["file"], sidecar["arch"]) == (fmt, path.name, "resnet18")
        assert sidecar["class_names"] == ["cat", "dog", "eel"]
        inp = sidecar["input"]
        assert (inp["size"], inp["channel_order"]) == (32, "RGB")
        assert (inp["mean"], inp["std"]) == (info.eval_transform["mean"], info.eval_transform["std"])
        if fmt == "safetensors":
            assert (inp["dtype"], inp["layout"], inp["shape"]) == ("float32", "NCHW", ["batch", 3, 32, 32])
            assert inp["normalization"].startswith("the caller's")
        else:
            assert (inp["dtype"], inp["layout"], inp["shape"]) == ("uint8", "NHWC", ["batch", 32, 32, 3])
            assert inp["normalization"].startswith("inside the model")
        assert sidecar["preprocess"]["torchvision"] == [["CenterCrop", {"size": 32}]]
        assert sidecar["preprocess"]["eval_ops"] == [{"center_crop": {"size": 32}}]
        assert sidecar["output"]["shape"] == ["batch", 3]


def run_main(argv, capsys) -> tuple[int, str]:
    """jobs.export's exit code (the parser's SystemExit too) and what it printed on stderr."""
    from jobs.export import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(model_and_images, tmp_path, capsys, monkeypatch):
    model, _ = model_and_images
    out = tmp_path / "m.onnx"
    not_a_model = tmp_path / "notes.pt"
    not_a_model.write_text("not a model\n")
    taken = tmp_path / "taken.ts"
    taken.write_bytes(b"an earlier export")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = {
        "no such file": (["--model", str(tmp_path / "none.pt"), "--format", "onnx", "--out", str(out)], "no such file"),
        "not a model.pt": (["--model", str(not_a_model), "--format", "onnx", "--out", str(out)], "not a model.pt"),
        "unknown format": (["--model", str(model), "--format", "tflite", "--out", str(out)], "invalid choice"),
        "exists": (["--model", str(model), "--format", "torchscript", "--out", str(taken)], "--overwrite"),
        "a folder": (["--model", str(model), "--format", "onnx", "--out", str(tmp_path)], "a folder"),
        "empty": (["--model", str(model), "--format", "safetensors", "--out", ""], "--out is empty; give the file"),
        "unwritable": (["--model", str(model), "--format", "onnx", "--out", str(a_file / "m.onnx")], "cannot write"),
        "the model": (["--model", str(model), "--format", "torchscript", "--out", str(model), "--overwrite"], "itself"),
    }
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for case, (argv, said) in cases.items():
        code, err = run_main(argv, capsys)
        assert code == 2, case
        assert err.count("\n") == 1 and err.startswith("error: ") and said in err, (case, err)
        assert "Traceback" not in err
    assert taken.read_bytes() == b"an earlier export"
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing written or touched

    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)  # import onnxruntime: ImportError
    code, err = run_main(["--model", str(model), "--format", "onnx", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "onnxruntime is not installed" in err and "pip install -e .[export]" in err
    assert not out.exists()


def test_overwrite_replaces_an_earlier_export(model_and_images, tmp_path, capsys):
    model, _ = model_and_images
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"old")
    (tmp_path / "m.safetensors.json").write_text("{}")
    code, _ = run_main(["--model", str(model), "--format", "safetensors", "--out", str(out), "--overwrite"], capsys)
    assert code == 0
    assert out.read_bytes() != b"old"
    assert json.loads((tmp_path / "m.safetensors.json").read_text())["format"] == "safetensors"


def test_jobs_formats_are_the_librarys():
    from jobs import export as job
    from training.predict import export

    assert job.FORMATS == export.FORMATS


def guide_examples() -> dict[str, str]:
    """docs/guide.md's "Export" examples: {"onnxruntime": code, "torchscript": code}."""
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    section = guide.split("### Export", 1)[1].split("\n## ", 1)[0]
    onnx_code, ts_code = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return {"onnxruntime": onnx_code, "torchscript": ts_code}


@pytest.mark.parametrize("runtime", ["onnxruntime", "torchscript"])
def test_the_guides_examples_print_jobs_predicts_classes_and_confidences(model_and_images, exported, runtime, tmp_path):
    """Each example of the guide, run in a process that imports nothing of the project, on the files
    (a crop and a pad), prints the classes and confidences of jobs.predict's model within 1e-4."""
    import subprocess
    import sys

    model, files = model_and_images
    fmt = {"onnxruntime": "onnx", "torchscript": "torchscript"}[runtime]
    (tmp_path / "example.py").write_text(guide_examples()[runtime])
    run = (
        "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
        "assert not {'training', 'augment', 'jobs'} & {m.split('.')[0] for m in sys.modules}, 'imported the project'"
    )
    args = [str(tmp_path / "example.py"), str(exported[fmt]), *map(str, files)]
    out = subprocess.run(
        [sys.executable, "-I", "-W", "ignore::FutureWarning", "-c", run, *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    _, logits = predict_logits(model, files)
    probs = torch.from_numpy(logits).softmax(1)
    printed = [line.split() for line in out.stdout.splitlines()]
    assert [p for p, _, _ in printed] == [str(f) for f in files]
    assert [c for _, c, _ in printed] == [["cat", "dog", "eel"][i] for i in probs.argmax(1)]
    assert np.abs(np.array([float(p) for _, _, p in printed]) - probs.max(1).values.numpy()).max() < TOLERANCE


def test_an_onnx_export_writes_its_out_and_nothing_in_the_users_home(model_and_images, tmp_path):
    """onnxruntime's telemetry wrote ~/.cache/Microsoft/DeveloperTools/.onnxruntime/{deviceid,
    onnxruntime.db} when the export ran its file: a file outside --out that the user did not ask for."""
    import os
    import subprocess
    import sys

    model, _ = model_and_images
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "ORT_DISABLE_TELEMETRY")}
    out = tmp_path / "model.onnx"
    run = subprocess.run(
        [sys.executable, "-m", "jobs.export", "--model", str(model), "--format", "onnx", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env | {"HOME": str(home)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "model.onnx", "model.onnx.json"]
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []


def test_an_export_that_differs_from_jobs_predict_is_not_written(model_and_images, tmp_path, capsys, monkeypatch):
    """The check before writing: logits 1e-3 away (a stand-in for an exporter's error) are exit 1, one
    line, and no file."""
    from training.predict import export

    model, _ = model_and_images
    run = export.run_export
    monkeypatch.setattr(export, "run_export", lambda *a: run(*a) + 1e-3)
    out = tmp_path / "m.safetensors"
    code, err = run_main(["--model", str(model), "--format", "safetensors", "--out", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "away from jobs.predict's model (more than 0.0001); nothing was written" in err, err
    assert list(tmp_path.iterdir()) == []


def test_model_and_out_on_object_storage(s3, model_and_images, capsys):
    """--model and --out as s3:// URIs (a local S3 server, tests/s3server.py): the file and its sidecar
    land there, and a second export to the same --out is refused."""
    from safetensors.torch import load

    from training.predict.inference import load_model_file

    model, _ = model_and_images
    s3.client.upload_file(str(model), "runs", "export/model.pt")
    argv = ["--model", "s3://runs/export/model.pt", "--format", "safetensors", "--out", "s3://runs/export/m.st"]
    assert run_main(argv, capsys)[0] == 0
    weights = load(s3.read("s3://runs/export/m.st"))
    want = load_model_file(str(model)).state_dict
    assert weights.keys() == want.keys() and all(torch.equal(weights[k], want[k]) for k in want)
    assert json.loads(s3.read("s3://runs/export/m.st.json"))["class_names"] == ["cat", "dog", "eel"]
    code, err = run_main(argv, capsys)
    assert code == 2 and "s3://runs/export/m.st and s3://runs/export/m.st.json exist already" in err, err


@pytest.mark.parametrize("where", ["export", "sidecar"])
def test_ctrl_c_while_exporting_is_one_line_and_leaves_nothing(model_and_images, tmp_path, capsys, monkeypatch, where):
    """Ctrl-C (or SIGTERM, taken as Ctrl-C) while the model is exported and checked, or between the
    file and its sidecar: a traceback, and in the second case a file without its sidecar, which the
    same command then refused ("exists already"). Now one line, exit 130, nothing of this run's left;
    the same command then writes both."""
    from training import storage
    from training.predict import export

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    model, _ = model_and_images
    out = tmp_path / "m.safetensors"
    argv = ["--model", str(model), "--format", "safetensors", "--out", str(out)]
    with monkeypatch.context() as patched:
        patched.setattr(*((export, "check_export") if where == "export" else (storage, "write_json")), stop)
        code, err = run_main(argv, capsys)
    assert code == 130, err
    said = f"stopped: interrupted; {out} was not written (its parts so far are removed); run the same command again"
    assert err == said + "\n"
    assert list(tmp_path.iterdir()) == []
    assert run_main(argv, capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, f"{out.name}.json"]
