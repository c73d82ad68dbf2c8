"""Each built-in op against Kornia's nearest op: speed, and fidelity to torchvision.

    python -m bench.kornia_ops                          # CPU, 1 thread, 3 alternating rounds, ~2 minutes
    python -m bench.kornia_ops --rounds 5 --json out.json
    python -m bench.kornia_ops --device cuda --threads 4

Three variants of each op run on the same batch, alternating within every round:

* ours: the op as a preset runs it (parameters from KeyedRng, the whole batch at once);
* kornia keyed: Kornia's module as a preset has to run it to keep each image's draws its
  own, whatever batch it lands in (augment/kornia_ops.py: sampled per image, applied batched);
* kornia batch: Kornia's module called plainly, one draw for the whole batch from the
  global RNG: Kornia's own cost, for reference (its draws depend on the batch).

A second table times the sampling alone for some of Kornia's ops by name: Kornia's sampler
once per image (what keyed draws cost) against one call for the whole batch, in µs an image.

On a CPU every variant runs on chunks of the batch as the pipeline does (CPU_CHUNK_PIXELS
in augment/presets.py), on a GPU on the whole batch. Geometry ops get a uint8 canvas (ours,
as in the stage) and the same images as a float batch (Kornia), so Kornia's columns leave
out the uint8-to-float conversion that ours includes.

Fidelity: |difference| to torchvision's transform (v2 functionals) with the same parameters,
in uint8 levels (max over the batch, and the mean), for ours and for Kornia's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from bench.augment import synthetic_photo


def _photos(n: int, h: int, w: int) -> torch.Tensor:
    """(n, h, w, 3) uint8 smooth photos, cycling through a few distinct ones."""
    distinct = [torch.from_numpy(synthetic_photo(h, w, seed=i)) for i in range(min(n, 8))]
    return torch.stack([distinct[i % len(distinct)] for i in range(n)])


def _float(canvas: torch.Tensor) -> torch.Tensor:
    return canvas.permute(0, 3, 1, 2).float().div(255.0).contiguous()


def _levels(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - b.float()).abs() * 255
    return round(float(d.max()), 3), round(float(d.mean()), 4)


def _box(src: torch.Tensor) -> tuple[int, int, int, int]:
    """Kornia's crop corners (1, 4, 2) as (x, y) -> torchvision's (top, left, height, width)."""
    (x0, y0), _, (x1, y1), _ = src[0].round().long().tolist()
    return y0, x0, y1 - y0 + 1, x1 - x0 + 1


class Case:
    """One op: how ours and Kornia's are built and fed, and how each compares with torchvision."""

    def __init__(self, name, ours, kornia, canvas, tv, tv_kornia=None, *, geometry=False):
        self.name, self.ours_spec, self.kornia_fn, self.canvas = name, ours, kornia, canvas
        self.tv, self.tv_kornia, self.geometry = tv, tv_kornia, geometry


# torchvision's transform for one image (CHW) given ours' parameters (`p`, the image's row) or
# Kornia's (`t`, the image's parameter tree)


def _TF():
    import torchvision.transforms.v2.functional as TF

    return TF


def _tv_jitter(img, factors, order):
    TF = _TF()
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    for k in order:
        img = fns[k](img, float(factors[k]))
    return img


def _tv_flip(img, p):
    return _TF().horizontal_flip(img) if p["flip"] else img


def _tvk_flip(img, t):
    return _TF().horizontal_flip(img) if t["batch_prob"] > 0.5 else img


def _tv_jit(img, p):
    return _tv_jitter(img, p["factors"].tolist(), p["order"].tolist())


def _tvk_jit(img, t):
    return _tv_jitter(
        img, [t[f"{k}_factor"].item() for k in ("brightness", "contrast", "saturation", "hue")], t["order"].tolist()
    )


def _tv_crop(img, p):  # ours: top/left in image coordinates; v2's crop zero-pads outside the image
    return _TF().crop(img, p["top"], p["left"], 32, 32)


def _tvk_crop(img, t):  # Kornia's: a box in the image padded by 4
    return _TF().crop(_TF().pad(img, [4]), *_box(t["src"]))


def _tv_rrc(img, p):
    return _TF().resized_crop(img, *p["box"].tolist(), [224, 224], antialias=True)


def _tvk_rrc(img, t):
    return _TF().resized_crop(img, *_box(t["src"]), [224, 224], antialias=True)


def _tv_erase(img, p):
    return _TF().erase(img, *p["box"].tolist(), torch.tensor(0.0)) if p["apply"] else img


def _tvk_erase(img, t):
    x, y, w, h = (int(t[k].item()) for k in ("xs", "ys", "widths", "heights"))
    return _TF().erase(img, y, x, h, w, torch.tensor(0.0)) if t["batch_prob"] > 0.5 else img


def _tv_eval(img, p=None):
    return _TF().center_crop(_TF().resize(img, [256], antialias=True), [224, 224])


_JIT = {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2}
_EVAL = [("Resize", {"size": 256, "side": "short", "antialias": True}), ("CenterCrop", {"size": 224})]
_SMALL, _PHOTO, _224 = (256, 32, 32), (16, 375, 500), (32, 224, 224)  # images: n, h, w
_FLIP, _JITTER = (_tv_flip, _tvk_flip), (_tv_jit, _tvk_jit)
# row name, ours (op, params), Kornia's (a class of kornia.augmentation and its arguments, or a
# list of them in sequence), images, torchvision given ours' parameters and given Kornia's
CASES = [
    ("horizontal_flip", ("horizontal_flip", {"p": 0.5}), ("RandomHorizontalFlip", {}), _SMALL, *_FLIP),
    ("color_jitter", ("color_jitter", _JIT), ("ColorJitter", _JIT), _SMALL, *_JITTER),
    ("color_jitter +hue", ("color_jitter", {**_JIT, "hue": 0.1}), ("ColorJitter", {**_JIT, "hue": 0.1}),
     _SMALL, *_JITTER),
    ("random_erasing", ("random_erasing", {"p": 0.5}), ("RandomErasing", {}), _SMALL, _tv_erase, _tvk_erase),
    ("random_crop", ("random_crop", {"size": 32, "padding": 4}), ("RandomCrop", {"size": (32, 32), "padding": 4}),
     _SMALL, _tv_crop, _tvk_crop),
    ("random_resized_crop", ("random_resized_crop", {"size": 224}), ("RandomResizedCrop", {"size": (224, 224)}),
     _PHOTO, _tv_rrc, _tvk_rrc),
    ("resize_center_crop", ("resize_center_crop", {"resize": 256, "size": 224}), _EVAL, _PHOTO, _tv_eval, None),
    ("horizontal_flip 224", ("horizontal_flip", {"p": 0.5}), ("RandomHorizontalFlip", {}), _224, *_FLIP),
    ("color_jitter 224", ("color_jitter", _JIT), ("ColorJitter", _JIT), _224, *_JITTER),
]  # fmt: skip


def _kornia(spec):
    import kornia.augmentation as K

    if isinstance(spec, list):
        return K.AugmentationSequential(*(_kornia(s) for s in spec))
    return getattr(K, spec[0])(**spec[1])


def cases() -> list[Case]:
    from augment.ops import OPS

    out = []
    for name, (op, params), kornia, nhw, tv, tv_kornia in CASES:
        ours = {op: params}
        out.append(
            Case(name, ours, lambda k=kornia: _kornia(k), _photos(*nhw), tv, tv_kornia, geometry=OPS[op].geometry)
        )
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rate(fn, images: int, device: str, min_s: float) -> float:
    """img/s of fn(epoch) over at least min_s and two calls, after one warm-up call."""
    fn(0)
    _sync(device)
    reps, start = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - start < min_s:
        reps += 1
        fn(reps)
        _sync(device)
    return images * reps / (time.perf_counter() - start)


class Variants:
    """The three variants of one case on one device, and their fidelity to torchvision."""

    def __init__(self, case: Case, device: str):
        from augment.kornia_ops import KeyedKornia
        from augment.ops import OPS

        ((name, params),) = case.ours_spec.items()
        self.case, self.device = case, device
        self.op = OPS[name](**params).to(device)
        self.op.stream = 1
        self.canvas = case.canvas.to(device)
        b = self.canvas.shape[0]
        self.sizes = torch.tensor(self.canvas.shape[1:3], device=device).expand(b, 2)
        self.keys = torch.arange(b, device=device) * 7919 + 1
        self.x = _float(self.canvas)
        self.kornia = case.kornia_fn().to(device)
        self.keyed = KeyedKornia(self.kornia, case.name).to(device)
        if case.geometry:  # Kornia's sized ops change the size, which a preset refuses and the probe checks
            self.keyed.modes[tuple(self.x.shape[1:])] = "stack"

    def _rng(self, epoch):
        from augment.rng import KeyedRng

        return KeyedRng(self.keys, 0, epoch)

    def _chunks(self):
        """Slices of the batch as the pipeline runs them: on a CPU, chunks of CPU_CHUNK_PIXELS."""
        from augment.presets import CPU_CHUNK_PIXELS

        b, (h, w) = self.canvas.shape[0], self.canvas.shape[1:3]
        step = b if self.device == "cuda" else max(1, CPU_CHUNK_PIXELS // (h * w))
        return [slice(i, i + step) for i in range(0, b, step)]

    def ours(self, epoch):
        rng = self._rng(epoch)
        for s in self._chunks():
            sub = type(rng)(rng.keys[s], rng.seed, rng.epoch)
            if self.op.geometry:
                self.op(self.canvas[s], sub, self.sizes[s])
            else:
                self.op(self.x[s], sub)

    def kornia_keyed(self, epoch):
        seeds = self._rng(epoch).seeds(1)[:, 0].tolist()
        for s in self._chunks():
            self.keyed(self.x[s], seeds[s])

    def kornia_batch(self, epoch):
        for s in self._chunks():
            self.kornia(self.x[s])

    def _reference(self, i: int, params) -> torch.Tensor:
        img = self.canvas[i].permute(2, 0, 1).cpu()
        if not self.case.geometry:
            img = img.float() / 255
        ref = params(img)
        return ref.float() / 255 if ref.dtype == torch.uint8 else ref

    def fidelity(self, n: int = 16) -> dict:
        """Ours and Kornia's results against torchvision's with the same parameters (first n images)."""
        rng = self._rng(0)
        p = self.op.sample(rng, self.sizes)
        out = self.op.apply(self.canvas if self.op.geometry else self.x, p, self.sizes).cpu()[:n]
        refs = [
            self._reference(i, lambda img, i=i: self.case.tv(img, {k: v[i] for k, v in p.items()}))
            for i in range(len(out))
        ]
        row = {"ours_vs_tv": _levels(out, torch.stack(refs))}
        seeds = rng.seeds(1)[:, 0].tolist()[:n]
        kout = torch.cat([self.keyed(self.x[i : i + 1], [s]) for i, s in enumerate(seeds)]).cpu()
        if self.case.tv_kornia is None:  # deterministic: no parameters to translate
            krefs = [self._reference(i, self.case.tv) for i in range(len(kout))]
        else:
            trees = self.keyed.sample(seeds, tuple(self.x.shape[1:]))
            krefs = [self._reference(i, lambda img, t=t: self.case.tv_kornia(img, t)) for i, t in enumerate(trees)]
        row["kornia_vs_tv"] = _levels(kout, torch.stack(krefs))
        return row


def run(device: str, rounds: int, min_s: float, only: list[str] | None) -> list[dict]:
    rows = []
    for case in cases():
        if only and case.name not in only:
            continue
        v = Variants(case, device)
        b = v.canvas.shape[0]
        rates = {"ours": [], "kornia_keyed": [], "kornia_batch": []}
        for r in range(rounds):
            order = list(rates) if r % 2 == 0 else list(reversed(rates))  # alternate who goes first
            for name in order:
                rates[name].append(round(_rate(getattr(v, name), b, device, min_s), 1))
        ratio = [round(k / o, 3) for k, o in zip(rates["kornia_keyed"], rates["ours"], strict=True)]
        row = {
            "op": case.name,
            "batch": f"{b}x{v.canvas.shape[1]}x{v.canvas.shape[2]}",
            **rates,
            "keyed_over_ours": ratio,
        }
        rows.append(row | v.fidelity())
        print(_line(rows[-1]), flush=True)
    return rows


SAMPLED = {  # Kornia ops by name whose sampling the second table times
    "kornia.RandomHorizontalFlip": {"p": 0.5},
    "kornia.RandomGaussianBlur": {"kernel_size": [5, 5], "sigma": [0.1, 2.0], "p": 0.5},
    "kornia.RandomMotionBlur": {"kernel_size": [3, 7], "angle": 35.0, "direction": 0.5, "p": 0.5},
    "kornia.RandomPerspective": {"distortion_scale": 0.3, "p": 0.5},
    "kornia.RandomAffine": {"degrees": 15.0, "translate": [0.1, 0.1], "scale": [0.9, 1.1], "p": 0.5},
    "kornia.ColorJitter": {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2, "hue": 0.1},
    "kornia.RandomElasticTransform": {"p": 0.5},
}


def sampling(rounds: int, n: int = 256, chw=(3, 224, 224)) -> list[dict]:
    """µs per image: Kornia's sampler once per image from its seed, against once for the batch."""
    from augment.kornia_ops import build_keyed

    rows = []
    for name, params in SAMPLED.items():
        keyed = build_keyed(name, params, chw)
        keyed.sample(list(range(8)), chw)  # warm-up
        per_image, per_batch = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            keyed.sample(list(range(n)), chw)
            per_image.append(round((time.perf_counter() - t) / n * 1e6, 1))
            t = time.perf_counter()
            keyed.module.forward_parameters(torch.Size((n, *chw)))
            per_batch.append(round((time.perf_counter() - t) / n * 1e6, 1))
        rows.append({"op": name, "keyed_us": per_image, "batch_us": per_batch})
        print(
            f"| {name} | {statistics.median(per_image):g} ({', '.join(map(str, per_image))}) "
            f"| {statistics.median(per_batch):g} |",
            flush=True,
        )
    return rows


def _line(row: dict) -> str:
    def rounds(k, fmt):
        return f"{statistics.median(row[k]):{fmt}} ({', '.join(f'{v:{fmt}}' for v in row[k])})"

    cells = [
        row["op"],
        row["batch"],
        rounds("ours", ",.0f"),
        rounds("kornia_keyed", ",.0f"),
        f"{statistics.median(row['kornia_batch']):,.0f}",
        rounds("keyed_over_ours", ".2f"),
        "{:g} / {:g}".format(*row["ours_vs_tv"]),
        "{:g} / {:g}".format(*row["kornia_vs_tv"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.kornia_ops", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the ops run (default: cpu)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: an augment task's CPU)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; every round is printed (default: 3)")
    ap.add_argument("--min-seconds", type=float, default=0.4, help="time per measurement at least (default: 0.4)")
    ap.add_argument("--ops", nargs="+", help="only these rows (names as printed)")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# {platform.machine()}, torch {torch.__version__}, {args.device}, {args.threads} thread(s)")
    print(
        "| op | batch | ours img/s (rounds) | Kornia keyed img/s (rounds) | Kornia batch img/s | keyed / ours (rounds) "
        "| ours vs torchvision, max / mean levels | Kornia vs torchvision, max / mean levels |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = run(args.device, args.rounds, args.min_seconds, args.ops)
    print("\n| Kornia op | sampled per image, µs an image (rounds) | one batch call, µs an image |")
    print("| --- | ---: | ---: |")
    sampled = sampling(args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "threads": args.threads, "rows": rows, "sampling": sampled}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
