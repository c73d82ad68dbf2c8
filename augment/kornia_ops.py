"""Kornia's augmentations with every image's parameters drawn from the image's own key.

Kornia samples a whole batch's parameters from torch's global RNG in one call, so what an
image gets depends on its place in the batch and on the batch's size, which Ray Data
decides. Here each image's parameters come from Kornia's own sampler run for that image
alone, with the CPU RNG seeded from its key (`KeyedRng.seeds`), and the batch is then
transformed in one call with those parameters stacked:

    keyed = build_keyed("kornia.RandomGaussianBlur", {"kernel_size": [5, 5], "sigma": [0.1, 2.0]}, (3, 32, 32))
    x = keyed(x, seeds)    # x float (B, 3, H, W) on any device; seeds: B ints from KeyedRng.seeds

* Sampling always runs on the CPU, so an image's draws are the same on a CPU and a GPU.
* A few parameters are per call rather than per image (ColorJitter's order of the
  adjustments): images are grouped by those values and each group is one call, so every
  image gets its own draw, as with torchvision.
* Where stacking is not enough, a probe finds out when the op is built, on a small batch
  of the pipeline's size, and picks the cheapest way that reproduces every image's
  one-image result: groups that also share the integer parameters (RandomMotionBlur
  applies one kernel size per call), or one image at a time (RandomChannelDropout refers
  to images by their position in the batch).

Kornia itself is imported only when a preset uses one of its ops.
"""

from __future__ import annotations

import difflib
import inspect
import typing

import torch

PREFIX = "kornia."
# These set their own output size; in a preset the first op sets the size and the rest keep it.
_SIZED = {"CenterCrop", "RandomCrop", "RandomResizedCrop", "Resize", "LongestMaxSize", "SmallestMaxSize", "PadTo"}
_NORMALISE = {"Normalize", "Denormalize"}  # the preset's mean/std normalise, on the trainer
_REFUSED_PARAMS = ("same_on_batch", "p_batch")  # batch-level draws, which keyed draws replace


def is_kornia(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def _classes() -> dict[str, type]:
    import kornia.augmentation as K

    return {n: c for n in dir(K) if not n.startswith("_") and isinstance(c := getattr(K, n), type)}


def _refusal(short: str, cls: type) -> str | None:
    """Why kornia.augmentation.<short> cannot be a preset op, or None if it can."""
    import kornia.augmentation as K

    if issubclass(cls, K.MixAugmentationBaseV2):
        return "mixes images across the batch; MixUp/CutMix are the preset's top-level `mix:` key"
    if issubclass(cls, K.AugmentationBase3D):
        return "is a 3D (volume) augmentation; a preset's images are 2D"
    if not issubclass(cls, K.AugmentationBase2D) or short.endswith("Base2D"):
        return "is not an augmentation op (list Kornia's ops one by one)"
    if short in _SIZED:
        return "sets its own output size; in a preset the first op sets the size and the ops after it keep it"
    if short in _NORMALISE:
        return "normalises; the preset's mean/std do that on the trainer"
    return None


def kornia_choices() -> list[str]:
    """Every Kornia op a preset can name: 2D, taking and returning a (B, 3, H, W) float batch."""
    return sorted(PREFIX + n for n, c in _classes().items() if _refusal(n, c) is None)


def kornia_class(name: str) -> type:
    """kornia.augmentation's class for `kornia.<Name>`; ValueError naming the valid choices."""
    short = name[len(PREFIX) :]
    classes = _classes()
    cls = classes.get(short)
    if cls is None:
        close = difflib.get_close_matches(short, list(classes), n=3)
        hint = f" (did you mean {', '.join(PREFIX + c for c in close)}?)" if close else ""
        raise ValueError(f"unknown Kornia augmentation {name!r}{hint}; valid: {kornia_choices()}")
    why = _refusal(short, cls)
    if why:
        raise ValueError(f"{name} {why}; valid Kornia ops: {kornia_choices()}")
    return cls


def check_kornia_params(name: str, params: dict) -> None:
    """ValueError for a keyword the class does not take (naming those it does) or a refused one."""
    sig = inspect.signature(kornia_class(name).__init__).parameters
    valid = [p for p, v in sig.items() if p != "self" and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
    refused = sorted(set(params) & set(_REFUSED_PARAMS))
    if refused:
        raise ValueError(
            f"{name}: {refused} not supported: every image draws its own parameters from its key (docs/guide.md, "
            "'Kornia ops by name')"
        )
    unknown = sorted(set(params) - set(valid))
    if unknown and not any(v.kind == v.VAR_KEYWORD for v in sig.values()):
        raise ValueError(
            f"{name}: unknown parameter(s) {unknown}; valid: {[p for p in valid if p not in _REFUSED_PARAMS]}"
        )


def _kornia_args(cls: type, params: dict) -> dict:
    """YAML and JSON give lists: Kornia's signatures ask for tuples, or for a tensor where that is
    the only type a parameter takes (RandomFisheye's center_x)."""
    sig = inspect.signature(cls.__init__).parameters

    def convert(v, annotation):
        if not isinstance(v, (list, tuple)):
            return v
        if {a for a in typing.get_args(annotation) or (annotation,) if a is not type(None)} == {torch.Tensor}:
            return torch.tensor(v, dtype=torch.float32)
        return tuple(convert(e, None) for e in v)

    return {k: convert(v, sig[k].annotation if k in sig else None) for k, v in params.items()}


def build_keyed(name: str, params: dict, chw: tuple[int, int, int]) -> KeyedKornia:
    """`kornia.<Name>` built with Kornia's own keyword arguments and probed on a batch of shape
    chw; ValueError with Kornia's own message for a bad argument."""
    cls = kornia_class(name)
    check_kornia_params(name, params)
    try:
        module = cls(**_kornia_args(cls, params))
    except Exception as e:  # Kornia raises several types for a bad argument; each is the user's to fix
        raise ValueError(f"{name}({_show(params)}): {type(e).__name__}: {e}") from None
    keyed = KeyedKornia(module, f"{name}({_show(params)})")
    keyed.probe(chw)
    return keyed


def _show(params: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())


# --------------------------------------------------------------------------- parameter trees
#
# Kornia's parameters are a dict of tensors for an op, and a list of ParamItem(name, dict or
# list) for a policy. A leaf's path is the tuple of keys and indices that lead to it.


def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _map(fn, trees: list, path=()):
    """One tree of the same structure as each of `trees`, leaf = fn(the trees' leaves there, path)."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: _map(fn, [t[k] for t in trees], (*path, k)) for k in first}
    if isinstance(first, (list, tuple)):
        items = [_map(fn, [t[i] for t in trees], (*path, i)) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)  # NamedTuple or list
    return fn([t for t in trees], path)


def _batch_len(v) -> int | None:
    return v.shape[0] if isinstance(v, torch.Tensor) and v.ndim > 0 else None


def _fingerprint(v):
    return (tuple(v.shape), tuple(v.flatten().tolist())) if isinstance(v, torch.Tensor) else repr(v)


class KeyedKornia(torch.nn.Module):
    """A Kornia augmentation (or policy) whose parameters are drawn per image from given seeds."""

    def __init__(self, module: torch.nn.Module, label: str):
        super().__init__()
        self.module, self.label = module, label
        self.modes: dict[tuple, str] = {}  # (C, H, W) -> "stack", "group" or "one": see probe()
        self._per_image: dict[tuple, frozenset] = {}  # (C, H, W) -> paths of the per-image leaves
        _sample_on_cpu(module)

    def _apply(self, fn, *args, **kwargs):
        # .to(device) moves Kornia's samplers with the module; sampling stays on the CPU (see the top)
        out = super()._apply(fn, *args, **kwargs)
        _sample_on_cpu(self.module)
        return out

    def sample(self, seeds: list[int], chw: tuple) -> list:
        """One parameter tree per image, each drawn alone from its seed; the caller's RNG is left as it was."""
        trees = []
        with torch.random.fork_rng(devices=[]):
            for s in seeds:
                torch.random.default_generator.manual_seed(s)
                trees.append(self.module.forward_parameters(torch.Size((1, *chw))))
        return trees

    def per_image_paths(self, chw: tuple) -> frozenset:
        """The leaves with one row per image: their leading size follows the batch's (2, then 5)."""
        if chw not in self._per_image:
            with torch.random.fork_rng(devices=[]):
                torch.random.default_generator.manual_seed(0)
                two, five = (dict(_leaves(self.module.forward_parameters(torch.Size((n, *chw))))) for n in (2, 5))
            self._per_image[chw] = frozenset(
                p for p, v in two.items() if _batch_len(v) == 2 and _batch_len(five.get(p)) == 5
            )
        return self._per_image[chw]

    def _call(self, x: torch.Tensor, trees: list) -> torch.Tensor:
        """Kornia on x with the trees' per-image leaves stacked (the others are equal across trees)."""
        rows = self.per_image_paths(tuple(x.shape[1:]))

        def leaf(values, path):
            if path and path[-1] == "forward_input_shape":
                return torch.tensor(tuple(x.shape), dtype=torch.long)
            v = torch.cat(values) if path in rows else values[0]
            return v.to(x.device, non_blocking=True) if isinstance(v, torch.Tensor) else v

        return self.module(x, params=_map(leaf, trees)).clamp(0.0, 1.0)

    def _groups(self, trees: list, chw: tuple, mode: str) -> list[list[int]]:
        """Images whose per-call leaves are equal and whose per-image leaves stack: one Kornia call
        each. In mode "group", small integer per-image leaves (kernel sizes, bits) must match too."""
        rows = self.per_image_paths(chw)
        groups: dict = {}
        for i, tree in enumerate(trees):
            key = tuple(
                (p, _fingerprint(v) if p not in rows or (mode == "group" and _small_int(v)) else v.shape[1:])
                for p, v in _leaves(tree)
            )
            groups.setdefault(key, []).append(i)
        return list(groups.values())

    def _run(self, x: torch.Tensor, trees: list, mode: str) -> torch.Tensor:
        if mode == "one":
            return torch.cat([self._call(x[i : i + 1], [t]) for i, t in enumerate(trees)])
        groups = self._groups(trees, tuple(x.shape[1:]), mode)
        if len(groups) == 1:
            return self._call(x, trees)
        out = torch.empty_like(x)
        for idx in groups:  # a loop over distinct per-call values (at most 24 orders for ColorJitter)
            i = torch.tensor(idx, device=x.device)
            out.index_copy_(0, i, self._call(x.index_select(0, i), [trees[j] for j in idx]).to(x.dtype))
        return out

    def forward(self, x: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """x float (B, C, H, W) in [0, 1] -> the same shape, clamped to [0, 1]."""
        chw = tuple(x.shape[1:])
        if chw not in self.modes:  # a size not probed yet (a policy's candidates are probed here)
            self.probe(chw)
        return self._run(x, self.sample(seeds, chw), self.modes[chw])

    def probe(self, chw: tuple, n: int = 8) -> None:
        """Run on a small random batch of shape chw, every image transformed, once per process
        for each op and size. Kornia's errors for a bad argument surface when the preset loads,
        not in a Ray task; the op must keep the batch's shape and apply without drawing random
        numbers of its own; and the mode is the first of stack / group / one whose batched
        result reproduces the one-image results."""
        if (self.label, chw) in _PROBED:
            self.modes[chw] = _PROBED[self.label, chw]
            return
        x = torch.rand((n, *chw), generator=torch.Generator().manual_seed(0))
        trees = [_map(_always, [t]) for t in self.sample(list(range(1, n + 1)), chw)]
        try:
            with torch.random.fork_rng(devices=[]):
                alone = torch.cat([self._call(x[i : i + 1], [t]) for i, t in enumerate(trees)])
                if alone.shape != x.shape:
                    raise ValueError(
                        f"returns {tuple(alone.shape[1:])} images from {chw} ones; ops after the first keep the size"
                    )
                torch.manual_seed(1)  # another global RNG state must not change the result
                if not torch.equal(self._call(x[:1], trees[:1]), alone[:1]):
                    raise ValueError(
                        "draws random numbers while it applies, so its result cannot follow the image's key"
                    )
                mode = next(m for m in ("stack", "group", "one") if self._reproduces(m, x, trees, alone))
        except Exception as e:  # Kornia's own message names what is wrong with the arguments
            raise ValueError(f"{self.label} fails on a {n} x {chw} batch: {type(e).__name__}: {e}") from None
        self.modes[chw] = _PROBED[self.label, chw] = mode

    def _reproduces(self, mode: str, x: torch.Tensor, trees: list, alone: torch.Tensor) -> bool:
        try:
            return torch.allclose(self._run(x, trees, mode), alone, rtol=0.0, atol=1e-4)
        except Exception:  # stacked parameters Kornia cannot take: the next mode
            return mode == "one"


_PROBED: dict[tuple[str, tuple], str] = {}  # (label, chw) -> mode, per process


def _small_int(v) -> bool:
    """An integer leaf of a few values per image: a discrete choice such as a kernel size."""
    return isinstance(v, torch.Tensor) and v.dtype in _INTS and v[0].numel() <= 4


_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _always(values, path):
    """A parameter leaf with every image's apply flag set (for the probe)."""
    v = values[0]
    return torch.ones_like(v) if path and path[-1] == "batch_prob" else v


def _sample_on_cpu(module: torch.nn.Module) -> None:
    for m in module.modules():
        if hasattr(m, "set_rng_device_and_dtype"):  # Kornia's augmentations (and their samplers)
            m.set_rng_device_and_dtype(torch.device("cpu"), torch.float32)
