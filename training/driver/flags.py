"""The entry points' flags and config files, from TrainConfig's fields: FlagParser (no abbreviations,
the closest valid flags on a mistake), one flag per field, a YAML --config file read as written
(training/userfiles.py) and checked like the flags, and the two merged (parse_config)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re

from training import userfiles
from training.config import ConfigError, TrainConfig
from training.storage import decode_text, local_path


class FlagParser(argparse.ArgumentParser):
    """The entry points' parser: no abbreviations (argparse takes `--epoch 1` for `--epochs`, and
    the abbreviation breaks when a flag that shares the prefix is added), and a mistake is one
    line naming the closest valid flags instead of the whole usage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, with each file:// URI given as the local path it names (storage.local_path)."""
        parsed, rest = super().parse_known_args(args, namespace)
        for key, value in vars(parsed).items():
            if isinstance(value, str):
                setattr(parsed, key, local_path(value))
        return parsed, rest

    def error(self, message: str):
        hints = []
        flags = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        for word in re.findall(r"(--?[\w-]+)", message.split(":", 1)[-1]):
            word = word.split("=")[0]
            prefixed = [f for f in flags if f.startswith(word)]  # what an abbreviation would have meant
            close = list(dict.fromkeys(prefixed + difflib.get_close_matches(word, flags, n=2, cutoff=0.75)))[:3]
            if close and word not in flags:
                hints.append(f"{word}: did you mean {' or '.join(close)}?")
        hint = f" ({'; '.join(hints)})" if hints else ""
        self.exit(2, f"error: {message}{hint}; see {self.prog} --help\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, help and default from the field."""
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{field.metadata['help']} (default: {field.default})"
        if field.type in ("bool", bool):  # --no-X turns off what a --config file turned on
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=field.metadata["help"]
            )
            continue
        kind = {"int": int, "float": float}.get(field.type if isinstance(field.type, str) else field.type.__name__, str)
        parser.add_argument(
            flag, type=kind, default=field.default, choices=field.metadata.get("choices"), help=help_text
        )


def from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def _field_kind(field) -> type:
    name = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "str")
    return {"int": int, "float": float, "bool": bool}.get(name, str)


def load_config_file(path: str) -> dict:
    """A YAML (or JSON) file of TrainConfig fields -> {field: value}, checked like the flags.

    Keys are field names, with `_` or `-` (`batch_size` or `batch-size`), each given once. Values
    are read as written (training.userfiles: `name: 0123` stays "0123", `lr: 1e-3` is 0.001), with
    no aliases, anchors or tags. Anything else is a ConfigError naming the file and the rule.
    `path` may be a pipe (`--config <(...)`), read once.
    """
    if "://" in path:
        raise ConfigError(
            f"--config {path}: read from local disk only, not object storage; copy the file to this machine and "
            "give its path"
        )
    what = userfiles.what_is_at(path)
    if what not in (None, "a pipe"):
        raise ConfigError(
            userfiles.refusal("--config", path, what, "a YAML file of settings such as configs/cifar-local.yaml")
        )
    try:
        raw = userfiles.read_file(path)
    except ValueError as e:  # a pipe that sent nothing
        raise ConfigError(f"--config {path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})") from None
    try:
        text = decode_text(raw)
    except ValueError as e:  # not UTF-8, nor UTF-16 with its byte order mark
        raise ConfigError(f"--config {path}: {e}; save it as UTF-8") from None
    try:
        settings = userfiles.read_settings(text)  # JSON is YAML too
    except userfiles.SettingsError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    out = {}
    for raw_key, value in (settings or {}).items():
        key = raw_key.replace("-", "_")
        if key not in fields:
            raise ConfigError(
                f"--config {path}: unknown key {userfiles.shown(raw_key)}; valid keys: {', '.join(sorted(fields))}"
            )
        if key in out:
            raise ConfigError(f"--config {path}: {key} is given twice (as {raw_key} too); give each setting once")
        out[key] = setting_value(fields[key], raw_key, value, f"--config {path}")
    return out


def _from_the_file(error: ConfigError, path, from_file: dict, args) -> ConfigError:
    """TrainConfig's refusal of a value (`--lr must be ...`) as the file's where the file gave it and no
    flag overrode it (`--config f.yaml: lr must be ...`): the user looks in the file, not the command."""
    for key, value in from_file.items():
        flag = "--" + key.replace("_", "-") + " "
        if str(error).startswith(flag) and (getattr(args, key) is value or getattr(args, key) == value):
            return ConfigError(f"--config {path}: {key} {str(error)[len(flag) :]}")
    return error


def setting_value(field, raw_key: str, value, where: str):
    """A settings file's `value` (training.userfiles.Scalar, or what else it was) of `field`."""
    if isinstance(value, str):  # a list or a mapping
        raise ConfigError(f"{where}: {raw_key} must be one value, got {value}")
    if userfiles.is_null(value) and field.default is None:
        return None
    kind = _field_kind(field)
    if userfiles.is_null(value):
        raise ConfigError(f"{where}: {raw_key} has no value; give {userfiles.RULES[kind]}, or leave the key out")
    try:
        out = userfiles.as_kind(kind, value)
    except ValueError as e:
        raise ConfigError(f"{where}: {raw_key} {e}") from None
    choices = field.metadata.get("choices")
    if choices and out not in choices:
        raise ConfigError(f"{where}: {raw_key} must be one of {', '.join(choices)}; got {userfiles.shown(out)}")
    return out


def parse_config(parser: argparse.ArgumentParser, argv=None) -> tuple[TrainConfig, dict]:
    """Flags on top of an optional --config file on top of the defaults.

    The file's values become the parser's defaults, so any flag given on the command line
    wins over the file. Returns the config and where each non-default setting came from
    ({field: "file" | "flag"}), for printing. `parser` must have --config (a path or None).
    """
    first, _ = parser.parse_known_args(argv)
    from_file = load_config_file(first.config) if first.config else {}
    parser.set_defaults(**from_file)
    args = parser.parse_args(argv)
    try:
        cfg = from_args(args)
    except ConfigError as e:
        raise _from_the_file(e, first.config, from_file, args) from None
    defaults = TrainConfig.__dataclass_fields__
    sources = {}
    for name, field in defaults.items():
        value = getattr(cfg, name)
        if name in from_file and value == from_file[name]:
            sources[name] = "file"
        elif value != field.default:
            sources[name] = "flag"
    return cfg, sources
