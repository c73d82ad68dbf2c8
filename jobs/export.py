"""Export a trained model.pt to ONNX, TorchScript or safetensors, with a JSON sidecar (FILE.json).

    python -m jobs.export --model runs/photos/model.pt --format onnx --out photos.onnx
    python -m jobs.export --model runs/photos/model.pt --format torchscript --out photos.ts
    python -m jobs.export --model runs/photos/model.pt --format safetensors --out photos.safetensors

ONNX and TorchScript take uint8 (batch, S, S, 3) RGB images, resized and cropped as the sidecar
says, normalise them inside and return logits; safetensors is plain torchvision's state_dict.
Before writing, the export is run by its own runtime (onnxruntime, torch.jit.load, torchvision)
on random images and compared with jobs.predict's model. No Ray. Exit codes: 0 written; 1 the
export failed or differs from jobs.predict's model; 2 bad input (model file, format, --out, a
missing library), one line on stderr. docs/guide.md, "Export".
"""

from __future__ import annotations

import os
import sys

from training import storage
from training.config import error_line
from training.driver.flags import FlagParser

FORMATS = ("onnx", "torchscript", "safetensors")  # training/predict/export.py's, without importing torch for --help


def parse(argv=None):
    ap = FlagParser(prog="python -m jobs.export", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model.pt of a training run (runs/<name>/model.pt)")
    ap.add_argument("--format", required=True, choices=FORMATS, help="onnx, torchscript or safetensors")
    ap.add_argument(
        "--out", required=True, help="file to write (local path or s3://, gs://); its sidecar is the same name + .json"
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace FILE and FILE.json if they exist (default: an existing one is refused, nothing written)",
    )
    return ap.parse_args(argv)


def check_out(out: str, model: str, overwrite: bool) -> None:
    """StorageError unless `out` and its sidecar can be written: a writable place, not a folder, not the
    model itself, and not there already without --overwrite."""
    if not out.strip():  # an unset shell variable
        raise storage.StorageError("--out is empty; give the file to write, e.g. model.onnx")
    storage.check_writable(storage.parent(out), "--out")
    if storage.is_dir(out):
        raise storage.StorageError(f"--out {out.rstrip('/')}: a folder; give a file to write, e.g. {out}/model.onnx")
    if out == model or not storage.is_uri(out) and os.path.realpath(out) == os.path.realpath(model):
        raise storage.StorageError(f"--out {out}: the --model file itself; give another --out")
    there = [p for p in (out, out + ".json") if storage.exists(p)]
    if there and not overwrite:
        raise storage.StorageError(
            f"--out {out}: {' and '.join(there)} exist{'s' if len(there) == 1 else ''} already; nothing was "
            "written; give another --out, or --overwrite to replace them"
        )


def main(argv=None) -> int:
    args = parse(argv)
    from training.predict import export, inference

    try:  # bad --model, --out or a missing library: exit 2 before anything is built
        export.check_libraries(args.format)
        info = inference.load_model_file(args.model)
        check_out(args.out, args.model, args.overwrite)
    except (export.MissingLibrary, inference.ModelFileError, storage.StorageError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    from training.driver.session import stop_on_sigterm, stopped

    terminated = stop_on_sigterm()  # as Ctrl-C: what this run wrote is removed
    there = {p for p in (args.out, args.out + ".json") if storage.exists(p)}  # --overwrite's earlier export
    try:
        data, sidecar = export.export_bytes(info, args.format)
        diff = export.check_export(info, args.format, data)
        storage.write_bytes(args.out, data)
        storage.write_json(args.out + ".json", sidecar | {"file": args.out.rstrip("/").rsplit("/", 1)[-1]})
    except export.ExportError as e:
        print(error_line(e), file=sys.stderr)
        return 1
    except OSError as e:
        print(error_line(f"--out {args.out}: writing failed ({e}); choose a writable path"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        for path in {args.out, args.out + ".json"} - there:
            if storage.exists(path):
                storage.remove_file(path)
        return stopped(args.out, terminated=terminated)
    print(f"wrote {args.out} ({args.format}, {len(data) / 1e6:.1f} MB) and {args.out}.json")
    print(f"checked: logits within {diff:.1e} of jobs.predict's model on random images (batch of 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
