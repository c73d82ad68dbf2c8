"""The seed's plain training script, and the synthetic-batch ceiling; baselines for bench.train.

    python -m bench.seed_train --epochs 3 --batch-size 64                  # the seed's script, digits
    python -m bench.seed_train --synthetic --steps 60 --batch-size 64      # model + optimizer only
    python -m bench.seed_train --device cuda --preset imagenet --amp bf16 --data /tmp/photos

The plain script is what the two articles the project started from write: torchvision.datasets.ImageFolder +
DataLoader(shuffle=True, num_workers=...) + a transforms.Compose per image + ResNet18 + SGD,
one process, no Ray. Defaults follow the seeds: `num_workers` "2-4x the CPU cores" (seed 0,
whose example uses 4), capped to the cores (on 2 cores: 2); pin_memory on a GPU.
The model is the project's (torchvision ResNet18 with the small-image stem at <= 64 px), built
in the seed's way (no channels_last).

`--synthetic` times the same model, optimizer and batch on random tensors that are already
on the device: the ceiling any input pipeline can reach on this machine. Its model is the
project's exact one (training.model.resnet18, channels_last), the one `jobs.train` trains.

Prints one JSON object on the last line (bench.train reads it): steady-state img/s over
epochs 2+ (or the steps after --warmup-steps; with --steady-steps, the plain script's too, in two
timed windows whose rates are kept as `runs`), and `t_first_step` (time.time() when the
first optimizer step finished) so the caller can compute start-up from its own launch time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

T_IMPORT = time.time()  # before torch: the caller compares its launch time with these

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def seed_num_workers(cores: int) -> int:
    """The seeds' advice: "2-4x the CPU cores" (seed 0; its example uses 4 and 4-8 in its
    table) or "0.7-0.8x the cores" (seed 1), capped to the cores: more loader processes than
    cores only add switching. On the 2-core build machine: 2."""
    return max(1, cores)


def seed_transforms(preset: str, train: bool):
    """The seeds' torchvision pipelines, per image, PIL in and a float tensor out."""
    import torchvision.transforms as T

    if preset == "cifar":
        head = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)] if train else []
        return T.Compose(head + [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    head = (
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)]
        if train
        else [T.Resize(256), T.CenterCrop(224)]
    )
    return T.Compose(head + [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def image_folder(root: str, split: str, transform, val_fraction: float = 0.2):
    """ImageFolder over the split jobs.train uses: DIR/train (or DIR/val) when it exists, else
    DIR/<class>/ filtered by the project's hash split (same files, same labels)."""
    from torchvision.datasets import ImageFolder

    if os.path.isdir(os.path.join(root, split)):
        return ImageFolder(os.path.join(root, split), transform=transform)
    from training.forms.tree import scan_tree

    tree = scan_tree(root, val_fraction)
    keep = {os.path.abspath(p) for p in (tree.train if split == "train" else tree.val).paths}
    return ImageFolder(root, transform=transform, is_valid_file=lambda p: os.path.abspath(p) in keep)


def plain_model(num_classes: int, small_stem: bool) -> torch.nn.Module:
    """torchvision ResNet18 with the same stem as training/model.py, built as the seed does."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_stem:
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
    return model


def sgd(model, batch_size: int, lr: float = 0.08) -> torch.optim.Optimizer:
    # jobs.train's defaults: lr per 256 images scaled to the batch, Nesterov momentum, decay
    return torch.optim.SGD(model.parameters(), lr=lr * batch_size / 256, momentum=0.9, nesterov=True, weight_decay=5e-4)


def autocast(device: torch.device, amp: str):
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def step(model, optimizer, x, y, amp_ctx) -> torch.Tensor:
    with amp_ctx:
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # a host-device sync point: only at timing boundaries


def run_plain(args, device: torch.device) -> dict:
    from torch.utils.data import DataLoader

    from training.forms.tree import default_dataset_dir

    root = args.data or str(default_dataset_dir())
    train_set = image_folder(root, "train", seed_transforms(args.preset, True))
    val_set = image_folder(root, "val", seed_transforms(args.preset, False))
    workers = args.loader_workers or seed_num_workers(os.cpu_count() or 1)
    pin = device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=workers, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=workers, pin_memory=pin)
    torch.manual_seed(0)
    model = plain_model(len(train_set.classes), small_stem=args.preset == "cifar").to(device)
    optimizer = sgd(model, args.batch_size)
    amp_ctx = autocast(device, args.amp)
    if args.steady_steps:
        found = {"loader_workers": workers, "train_images": len(train_set)}
        return run_steady(args, device, train_loader, model, optimizer, amp_ctx) | found
    epochs, t_first_step = [], None
    for epoch in range(args.epochs):
        model.train()
        sync(device)
        start, seen = time.perf_counter(), 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            step(model, optimizer, x, y, amp_ctx)
            seen += y.shape[0]
            if t_first_step is None:
                sync(device)
                t_first_step = time.time()
        sync(device)
        epoch_s = time.perf_counter() - start
        if not args.no_val:  # jobs.train validates every epoch too (outside its epoch_s)
            model.eval()
            with torch.no_grad(), amp_ctx:
                correct = sum(int((model(x.to(device)).argmax(1) == y.to(device)).sum()) for x, y in val_loader)
        epochs.append(
            {"epoch": epoch + 1, "images": seen, "epoch_s": round(epoch_s, 4), "images_per_s": round(seen / epoch_s, 1)}
        )
        print(
            f"plain epoch {epoch + 1}/{args.epochs}: {seen / epoch_s:.0f} img/s"
            + ("" if args.no_val else f"  val_acc {correct / len(val_set):.3f}"),
            flush=True,
        )
    steady = epochs[1:] or epochs  # as jobs.train's summary: epochs 2+ when there are several
    return {
        "kind": "plain",
        "steady_img_s": round(sum(e["images"] for e in steady) / sum(e["epoch_s"] for e in steady), 1),
        "epochs": epochs,
        "loader_workers": workers,
        "train_images": len(train_set),
        "t_first_step": t_first_step,
    }


def run_synthetic(args, device: torch.device) -> dict:
    from training.model import resnet18

    size = 32 if args.preset == "cifar" else 224
    torch.manual_seed(0)
    model = resnet18(10, small_stem=args.preset == "cifar").to(device)  # the project's model, channels_last
    optimizer = sgd(model, args.batch_size)
    amp_ctx = autocast(device, args.amp)
    # a few distinct batches, resident on the device: no input cost at all
    xs = [
        torch.randn(args.batch_size, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
        for _ in range(4)
    ]
    ys = [torch.randint(0, 10, (args.batch_size,), device=device) for _ in range(4)]
    model.train()
    t_first_step = None
    for i in range(args.warmup_steps):
        step(model, optimizer, xs[i % 4], ys[i % 4], amp_ctx)
        if t_first_step is None:
            sync(device)
            t_first_step = time.time()
    windows = []  # (steps, seconds): the timed steps in two halves, each rate kept
    for half in halves(args.steps):
        sync(device)
        start = time.perf_counter()
        for i in range(half):
            step(model, optimizer, xs[i % 4], ys[i % 4], amp_ctx)
        sync(device)
        windows.append((half, time.perf_counter() - start))
    return {
        "kind": "synthetic",
        "steady_img_s": round(args.steps * args.batch_size / sum(s for _, s in windows), 1),
        "runs": [round(n * args.batch_size / s, 1) for n, s in windows if n],
        "steps": args.steps,
        "t_first_step": t_first_step,
    }


def halves(steps: int) -> list[int]:
    """`steps` as two timed windows (the second one step longer where odd)."""
    return [steps // 2, steps - steps // 2]


def run_steady(args, device, loader, model, optimizer, amp_ctx) -> dict:
    """--steady-steps: --warmup-steps untimed, then the steady steps timed in two windows (each
    rate kept), or until --seconds of them have passed; the loader cycled over epochs as needed.
    A line per window, so that a run stopped at its cap still leaves what it timed."""
    model.train()
    batches, t_first_step, windows = cycle(loader), None, []
    for _ in range(args.warmup_steps):
        x, y = next(batches)
        step(model, optimizer, x.to(device, non_blocking=True), y.to(device, non_blocking=True), amp_ctx)
        if t_first_step is None:
            sync(device)
            t_first_step = time.time()
            print(f"plain first step at {t_first_step:.3f}", flush=True)
    deadline = time.perf_counter() + args.seconds
    for half in halves(args.steady_steps):
        sync(device)
        start, seen = time.perf_counter(), 0
        for _ in range(half):
            x, y = next(batches)
            step(model, optimizer, x.to(device, non_blocking=True), y.to(device, non_blocking=True), amp_ctx)
            seen += y.shape[0]
            if time.perf_counter() > deadline:
                break
        sync(device)
        windows.append((seen, time.perf_counter() - start))
        print(f"plain window {len(windows)}: {seen / windows[-1][1]:.1f} img/s over {seen} images", flush=True)
    return {
        "kind": "plain",
        "steady_img_s": round(sum(n for n, _ in windows) / sum(s for _, s in windows), 1),
        "runs": [round(n / s, 1) for n, s in windows if n],
        "steady_images": sum(n for n, _ in windows),
        "t_first_step": t_first_step,
    }


def cycle(loader):
    while True:
        yield from loader


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.seed_train", description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="image tree (DIR/train + DIR/val, or DIR/<class>/); default: the bundled digits")
    ap.add_argument(
        "--preset",
        default="cifar",
        choices=("cifar", "imagenet"),
        help="the seed's pipeline: cifar (32 px) or imagenet (224 px)",
    )
    ap.add_argument("--epochs", type=int, default=3, help="passes over the training set; img/s counts epochs 2+")
    ap.add_argument("--batch-size", type=int, default=64, help="images per step (global: one process)")
    ap.add_argument(
        "--loader-workers",
        type=int,
        default=0,
        help="DataLoader worker processes; 0 = the seeds' advice capped to the cores",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads in the main process; 0 = the CPU cores"
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model trains")
    ap.add_argument("--amp", default="off", choices=("off", "bf16", "fp16"), help="autocast dtype for the forward pass")
    ap.add_argument(
        "--no-val", action="store_true", help="skip the per-epoch validation pass (the seeds' script has none)"
    )
    ap.add_argument(
        "--synthetic", action="store_true", help="time the model on random batches already on the device (the ceiling)"
    )
    ap.add_argument("--steps", type=int, default=60, help="--synthetic: timed steps")
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=5,
        help="--synthetic, --steady-steps: untimed steps first (allocator, kernels)",
    )
    ap.add_argument(
        "--steady-steps",
        type=int,
        default=0,
        help="the plain script: time this many steps after the warm-up, not epochs",
    )
    ap.add_argument("--seconds", type=float, default=1e9, help="--steady-steps: stop timing after this many seconds")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = torch.device(args.device)
    result = run_synthetic(args, device) if args.synthetic else run_plain(args, device)
    result |= {
        "t_import": T_IMPORT,
        "t_end": time.time(),
        "threads": torch.get_num_threads(),
        "device": args.device,
        "batch_size": args.batch_size,
        "preset": args.preset,
        "amp": args.amp,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
