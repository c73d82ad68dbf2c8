"""A sweep's search space (jobs.tune --space FILE): one TrainConfig setting a line, each a
distribution, read without eval into Ray Tune's own search-space objects.

    lr: loguniform(1e-4, 1e-1)        # log-uniform between the two bounds
    momentum: uniform(0.8, 0.99)      # uniform
    warmup_epochs: randint(0, 3)      # an integer, low included, high excluded (Tune's randint)
    weight_decay: choice([0, 1e-4])   # one of the values, drawn at random
    model: grid([resnet18, mobilenet_v3_small])   # every value, each with --trials samples

A line that is none of these is one value (`epochs: 3`), the same in every trial. Every value
(and a range's bounds) is checked as the flag would be, against the base config, before Ray starts.
"""

from __future__ import annotations

import dataclasses
import re

from training import userfiles
from training.config import ConfigError, TrainConfig
from training.storage import decode_text

KINDS = ("loguniform", "uniform", "randint", "choice", "grid")
# what a sweep may not vary: where each trial's run lies and how it starts (the sweep sets them)
NOT_SWEPT = ("name", "storage_path", "fresh", "stop_after", "config")
_CALL = re.compile(r"^([a-z_]+)\((.*)\)$", re.S)


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One setting's distribution: `kind` (one of KINDS, or "value") and its arguments."""

    key: str
    kind: str
    args: tuple  # (low, high) for a range; the values for choice/grid/value

    @property
    def swept(self) -> bool:
        return self.kind != "value" and not (self.kind in ("choice", "grid") and len(self.args) == 1)

    def tune_domain(self):
        """Ray Tune's object for it (imported here: the parser itself needs no Ray)."""
        from ray import tune

        if self.kind == "value":
            return self.args[0]
        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        if self.kind == "choice":
            return tune.choice(list(self.args))
        return getattr(tune, self.kind)(*self.args)


def scalar(text: str, where: str):
    """A number, true/false, or a string (quoted or bare)."""
    text = text.strip()
    if not text:
        raise ConfigError(f"{where}: an empty value; give a number or a name")
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if not re.fullmatch(r"[A-Za-z0-9_.:/+~-]+", text):
        raise ConfigError(f"{where}: {text[:60]!r} is not a number or a plain name; quote it")
    return text


def parse_dimension(key: str, text: str, where: str) -> Dimension:
    """`text` (what follows `key:`) as a Dimension; ConfigError naming the syntax on a mistake."""
    where = f"{where}: {key}"
    call = _CALL.match(text.strip())
    if not call:
        return Dimension(key, "value", (scalar(text, where),))
    kind, inner = call[1], call[2].strip()
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown distribution {kind}(); use one of {', '.join(k + '()' for k in KINDS)}")
    if kind in ("choice", "grid"):
        if not (inner.startswith("[") and inner.endswith("]")) or not inner[1:-1].strip():
            raise ConfigError(f"{where}: {kind}() takes a list of values, e.g. {kind}([0.1, 0.01])")
        return Dimension(key, kind, tuple(scalar(v, where) for v in inner[1:-1].split(",")))
    bounds = [scalar(v, where) for v in inner.split(",")] if inner else []
    if len(bounds) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
        raise ConfigError(f"{where}: {kind}() takes two numbers, low and high, e.g. {kind}(1, 10)")
    low, high = bounds
    if not low < high:
        raise ConfigError(f"{where}: {kind}({low}, {high}): low must be below high")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform({low}, {high}): both bounds must be above 0")
    if kind == "randint" and not (isinstance(low, int) and isinstance(high, int)):
        raise ConfigError(f"{where}: randint() takes two integers")
    return Dimension(key, kind, (low, high))


def read_space(path: str) -> list[Dimension]:
    """The --space file's dimensions, in file order; ConfigError for a mistake (unknown or
    repeated settings, syntax)."""
    where = f"--space {path}"
    what = userfiles.what_is_at(path)
    if what:
        raise ConfigError(userfiles.refusal("--space", path, what, "a YAML file such as `lr: loguniform(1e-4, 1e-1)`"))
    try:
        settings = userfiles.read_settings(decode_text(userfiles.read_file(path)))
    except (OSError, ValueError, userfiles.SettingsError) as e:
        raise ConfigError(f"{where}: {e}") from None
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    out: dict[str, Dimension] = {}
    for raw_key, value in (settings or {}).items():
        key = raw_key.replace("-", "_")
        if key not in fields:
            raise ConfigError(
                f"{where}: unknown setting {userfiles.shown(raw_key)}; valid: {', '.join(sorted(fields))}"
            )
        if key in NOT_SWEPT:
            raise ConfigError(f"{where}: {key} is set by the sweep for each trial; leave it out of the space")
        if key in out:
            raise ConfigError(f"{where}: {key} is given twice; give each setting once")
        text = value if isinstance(value, str) else value.text
        out[key] = parse_dimension(key, text, where)
    if not any(d.swept for d in out.values()):
        raise ConfigError(
            f"{where}: nothing to sweep; give at least one setting a distribution, e.g. lr: loguniform(1e-4, 1e-1)"
        )
    return list(out.values())


def check_space(dims: list[Dimension], base: dict, check) -> None:
    """Each value a dimension can take (a range's bounds) checked with the base config by `check`
    (training.driver.api.as_config: the flags' own checks); ConfigError naming the setting."""
    for dim in dims:
        values = dim.args if dim.kind != "randint" else (dim.args[0], dim.args[1] - 1)
        for value in values:
            try:
                check(base | {dim.key: value})
            except ConfigError as e:
                raise ConfigError(f"--space: {dim.key} = {value!r}: {str(e).removeprefix('error: ')}") from None
