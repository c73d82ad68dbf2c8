"""A model.pt as a file other runtimes load: ONNX, TorchScript or safetensors, each with a JSON
sidecar (FILE + ".json") that says what goes in and what comes out.

    info = inference.load_model_file("runs/photos/model.pt")       # ModelFileError: exit 2
    data, sidecar = export_bytes(info, "onnx")                     # ExportError: exit 1
    diff = check_export(info, "onnx", data)                        # max |logit difference|

ONNX and TorchScript hold the model jobs.predict scores with *and* its normalisation: they take
the uint8 batch the eval transform makes, (B, S, S, 3) RGB (NHWC, as decoders give it), with a
dynamic batch axis B, and return float32 logits (B, classes); a caller only resizes and crops, as
the sidecar's `preprocess` says. Normalisation inside keeps mean and std from being applied twice
or not at all, and keeps the input a quarter of float32's bytes. safetensors holds plain
torchvision's state_dict: that model takes float NCHW, normalised by the caller.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import warnings

import numpy as np
import torch

from training.model import torchvision_model as spec
from training.modelfile import ModelFile
from training.predict.inference import Predictor

FORMATS = ("onnx", "torchscript", "safetensors")
NEEDS = {"onnx": ("onnx", "onnxruntime"), "torchscript": (), "safetensors": ("safetensors",)}
TOLERANCE = 1e-4  # the largest |logit difference| from jobs.predict's model (x the largest logit, above 1)
ONNX_OPSET = 17  # onnxruntime 1.18 (the `export` extra's floor) runs up to opset 21


class ExportError(RuntimeError):
    """An export that did not build, or whose logits differ from jobs.predict's model."""


class MissingLibrary(ImportError):
    """A format's library is not installed (the `export` extra)."""


def no_telemetry() -> None:
    """onnxruntime's telemetry writes a device id and a database under ~/.cache/Microsoft when it is
    imported, unless told not to: an export writes its --out and nothing else. Before its import."""
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def check_libraries(fmt: str) -> None:
    """MissingLibrary, one line naming the extra, when `fmt` needs a package that does not import."""
    no_telemetry()
    for name in NEEDS[fmt]:
        try:
            importlib.import_module(name)
        except ImportError:
            needed = " and ".join(NEEDS[fmt])
            raise MissingLibrary(
                f"--format {fmt} needs {needed}, and {name} is not installed; pip install -e .[export]"
            ) from None


class NormalizedModel(torch.nn.Module):
    """jobs.predict's model step as one module: uint8 (B, S, S, 3) RGB -> float32 logits (B, classes),
    the same affine map as augment.ops.Normalize (x / 255 - mean) / std, then the model."""

    def __init__(self, normalize: torch.nn.Module, model: torch.nn.Module):
        super().__init__()
        self.register_buffer("scale", normalize.scale.clone())  # (1, 3, 1, 1): 1 / (255 std)
        self.register_buffer("shift", normalize.shift.clone())  # (1, 3, 1, 1): -mean / std
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float()  # (B, 3, S, S), channels_last in memory
        return self.model(torch.addcmul(self.shift, x, self.scale)).float()


def reference_model(info: ModelFile) -> NormalizedModel:
    """The model and normalisation of training/predict/inference.py's Predictor, which jobs.predict runs."""
    predictor = Predictor(info)
    return NormalizedModel(predictor.normalize, predictor.model).eval()


def sample_batch(info: ModelFile, n: int, seed: int = 0) -> torch.Tensor:
    """n random uint8 images of the model's input, (n, S, S, 3)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, info.image_size, info.image_size, 3), dtype=torch.uint8, generator=g)


def export_bytes(info: ModelFile, fmt: str) -> tuple[bytes, dict]:
    """The exported file's bytes and its sidecar (sidecar()). ExportError where torch's exporter fails."""
    try:
        if fmt == "safetensors":
            data = safetensors_bytes(info)
        else:
            model, example = reference_model(info), sample_batch(info, 2)  # batch 2: the axis stays symbolic
            data = onnx_bytes(model, example) if fmt == "onnx" else torchscript_bytes(model, example)
    except Exception as e:  # noqa: BLE001 - an exporter's error on an architecture it cannot express
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        raise ExportError(f"{info.arch} does not export to {fmt} ({why}); try another --format") from None
    return data, sidecar(info, fmt)


def onnx_bytes(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    # with gradients on: under no_grad nn.MultiheadAttention (a ViT's) takes its fused fast path,
    # aten::_native_multi_head_attention, which has no ONNX form; the export runs the model once either way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation notice
        # dynamo=False: torch's default (torch.export-based) exporter needs onnxscript, which is not one of
        # the `export` extra's packages; the TorchScript-based one needs torch alone, and its files give
        # jobs.predict's logits (check_export below; tests/test_export.py on real images)
        torch.onnx.export(
            model,
            (example,),
            buf,
            dynamo=False,
            input_names=["images"],
            output_names=["logits"],
            dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=ONNX_OPSET,
        )
    import onnx

    onnx.checker.check_model(onnx.load_from_string(buf.getvalue()))
    return buf.getvalue()


def torchscript_bytes(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        # torch marks TorchScript deprecated in favour of torch.export, whose .pt2 files torch.jit.load does
        # not read; the issue asks for files that plain torch.jit.load runs, and torch 2.14 still writes them
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.trace(model, example), buf)
    return buf.getvalue()


def safetensors_bytes(info: ModelFile) -> bytes:
    from safetensors.torch import save

    # contiguous: the model trains channels_last, whose conv weights safetensors does not store as they are
    tensors = {k: v.detach().contiguous() for k, v in info.state_dict.items()}
    return save(tensors, metadata={"arch": info.arch, "class_names": json.dumps(list(info.class_names))})


def sidecar(info: ModelFile, fmt: str) -> dict:
    """What a caller needs to feed the exported file: the input, the preprocessing, the outputs."""
    size, t = info.image_size, info.eval_transform
    steps = info.torchvision_eval
    inside = fmt != "safetensors"
    return {
        "format": fmt,
        "arch": info.arch,
        "class_names": list(info.class_names),
        "input": {
            "name": "images" if inside else None,
            "shape": ["batch", size, size, 3] if inside else ["batch", 3, size, size],
            "layout": "NHWC" if inside else "NCHW",
            "dtype": "uint8" if inside else "float32",
            "channel_order": "RGB",
            "size": size,
            "mean": list(t["mean"]),
            "std": list(t["std"]),
            "normalization": "inside the model: (x / 255 - mean) / std per channel"
            if inside
            else "the caller's: (x / 255 - mean) / std per channel, on the RGB image in [0, 255]",
        },
        "preprocess": {
            # what the caller does to a decoded RGB image (uint8, H x W x 3) before stacking it into the batch
            "torchvision": [s for s in steps if s[0] not in ("ToDtype", "Normalize")] if steps else None,
            "eval_ops": t["ops"],  # the same, as the project's own eval ops (augment/ops.py)
        },
        "output": {
            "name": "logits" if inside else None,
            "shape": ["batch", info.num_classes],
            "dtype": "float32",
            "meaning": "logits; softmax over axis 1 gives jobs.predict's confidence, argmax its class",
        },
        "torchvision_model": model_spec(info),  # get_model's arguments and the small stem's layers
    }


def model_spec(info: ModelFile) -> dict:
    """model.pt's `torchvision_model`; for an older file without one, the same made from its values."""
    if info.torchvision_model:
        return info.torchvision_model
    width = info.state_dict["conv1.weight"].shape[0] if info.small_stem else 64
    return spec(info.arch, info.num_classes, small_stem=info.small_stem, image_size=info.image_size, width=width)


def torchvision_model(spec: dict) -> torch.nn.Module:
    """Plain torchvision's model from model.pt's `torchvision_model` (docs/guide.md shows the same)."""
    import torchvision

    model = torchvision.models.get_model(**spec["get_model"])
    for name, layer in spec["replace"].items():  # the small stem: a 3x3 conv1, no max-pool
        setattr(model, name, torch.nn.Identity() if layer == "identity" else torch.nn.Conv2d(**layer))
    return model.eval()


def run_export(fmt: str, data: bytes, images: torch.Tensor, info: ModelFile) -> np.ndarray:
    """The exported file's logits for uint8 (B, S, S, 3) `images`, each format by its own runtime."""
    if fmt == "onnx":
        no_telemetry()
        import onnxruntime

        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        return session.run(["logits"], {"images": images.numpy()})[0]
    if fmt == "torchscript":
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load's deprecation notice (above)
            return torch.jit.load(io.BytesIO(data), map_location="cpu")(images).numpy()
    from safetensors.torch import load

    model = torchvision_model(model_spec(info))
    model.load_state_dict(load(data))
    norm = reference_model(info)
    with torch.no_grad():
        return model(torch.addcmul(norm.shift, images.permute(0, 3, 1, 2).float(), norm.scale)).numpy()


def check_export(info: ModelFile, fmt: str, data: bytes, n: int = 3) -> float:
    """The largest |logit difference| between the exported file and jobs.predict's model on n random
    images (n other than the export's example batch: the batch axis must be dynamic). ExportError
    above TOLERANCE, or where the file does not run."""
    images = sample_batch(info, n, seed=1)
    with torch.no_grad():
        want = reference_model(info)(images).numpy()
    try:
        got = run_export(fmt, data, images, info)
    except Exception as e:  # noqa: BLE001 - the runtime refusing the file is the finding
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        raise ExportError(f"the {fmt} export of {info.arch} does not run on a batch of {n} ({why})") from None
    diff = float(np.abs(got - want).max())
    # float32 rounding grows with the logits' size: a ViT-B/32 with logits up to 55 differed by 6.7e-05 under
    # onnxruntime; above 1, the tolerance is relative to the largest logit
    allowed = TOLERANCE * max(1.0, float(np.abs(want).max()))
    if not diff <= allowed:
        raise ExportError(
            f"the {fmt} export of {info.arch} gives logits {diff:.2e} away from jobs.predict's model "
            f"(more than {allowed:.2g}); nothing was written; try another --format"
        )
    return diff
