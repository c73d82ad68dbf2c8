"""The small files a user names on the command line (--config, --init-weights, --class-names, a
preset file), read as written: what lies at a path that is not a file, said in words (a folder,
a pipe) instead of "no such file"; a --config given as a pipe of the shell's process
substitution (`--config <(...)`) read; and a settings file's YAML read as its text says.

YAML 1.1, which PyYAML reads, turns a setting's text into something else than the user wrote:
`name: 0123` is the octal 83, `name: 1.10` the float 1.1, `lr: 1e-3` a string (no dot, so not a
float), `epochs: 010` the number 8. read_settings hands back each value's source text instead,
and as_kind reads it by the field's type. Aliases, anchors and tags are refused: an alias bomb
(a 300-byte file of nested aliases, 9**9 items once expanded) is refused at its first alias,
and no error expands it; a key given twice is refused, not decided by the last one. libyaml
parses where it is installed (a 10 MB file in a fraction of a second; PyYAML's own takes 5 s).

Light: no torch, no Ray.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import select
import stat

SHOWN_CHARS = 80  # an error shows at most this much of a value the user gave
PIPE_WAIT_S = 10.0  # how long a pipe may stay silent before --config gives up on it
MAX_SETTINGS_BYTES = 64 << 20  # a settings file larger than this is not one


def shown(value) -> str:
    """repr(value), cut to SHOWN_CHARS with "..." where it is longer: for error messages."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def what_is_at(path: str) -> str | None:
    """None for a regular file (a link to one included); else what lies at `path`, in words
    that fit "PATH is ..." or "PATH: ...": "a folder", "a pipe", "a device or socket", or
    "no such file"."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "no such file"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    return "a device or socket"


def refusal(flag: str, path: str, what: str, give: str) -> str:
    """The line for a path that is not a file: "--flag PATH: no such file; give ..." or
    "--flag PATH is a folder, not a file; give ..."."""
    if what == "no such file":
        return f"{flag} {path}: no such file; give {give}"
    return f"{flag} {path} is {what}, not a file; give {give}"


def read_file(path: str) -> bytes:
    """The bytes of a file, or of a pipe (read_pipe)."""
    if what_is_at(path) == "a pipe":
        return read_pipe(path)
    with open(path, "rb") as f:
        return f.read()


def read_pipe(path: str, wait_s: float = PIPE_WAIT_S) -> bytes:
    """All a pipe holds until its writer closes it (`--config <(...)`: the shell's process
    substitution, whose writer holds the pipe open from the start). Opened without waiting for
    a writer, so a named pipe that nobody writes to ends at once, empty, instead of hanging the
    job; ValueError where it ends empty, or where nothing arrives for `wait_s`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        chunks, size = [], 0
        while True:
            try:
                chunk = os.read(fd, 1 << 16)  # b"": every writer closed it, or none ever opened it
            except BlockingIOError:  # a writer holds it open but has not written yet
                if not select.select([fd], [], [], wait_s)[0]:
                    raise ValueError(f"a pipe that sent nothing for {wait_s:g} s") from None
                continue
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_SETTINGS_BYTES:
                raise ValueError(f"a pipe that sent more than {MAX_SETTINGS_BYTES >> 20} MiB")
    finally:
        os.close(fd)
    if not size:
        raise ValueError("a pipe with nothing written to it")
    return b"".join(chunks)


class SettingsError(ValueError):
    """A settings file that is not a flat mapping of setting: value as this job reads it."""


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A setting's value as the file wrote it: its text (quotes removed), whether it was plain
    (unquoted, where YAML's null, true/false and number forms apply) and its line (1-based)."""

    text: str
    plain: bool
    line: int


def refuse_aliases_and_tags(text: str, loader) -> None:
    """SettingsError at the first alias, anchor or tag of `text`, from the parser's events:
    before any node is built, so nothing is expanded."""
    import yaml

    for event in yaml.parse(text, Loader=loader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise SettingsError(f"line {line}: an alias (*{event.anchor}); aliases are not read, write the value")
        if getattr(event, "anchor", None) is not None:
            raise SettingsError(f"line {line}: an anchor (&{event.anchor}); anchors are not read, write the value")
        tag = getattr(event, "tag", None)
        if tag is not None:
            tag = tag.replace("tag:yaml.org,2002:", "!!")
            raise SettingsError(f"line {line}: a tag ({shown(tag)[1:-1]}); tags are not read, write a plain value")


def read_settings(text: str) -> dict[str, Scalar | str] | None:
    """A settings file's text -> {key: Scalar, or "a list" / "a mapping" for a value that is
    not one}, in the file's order; None for an empty file. SettingsError for YAML that does not
    parse, aliases, anchors, tags, a document that is not a mapping, a key that is not text, or
    a key given twice (JSON is YAML too)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a 10 MB file in 0.1 s, not 5 s
    try:
        refuse_aliases_and_tags(text, loader)
        root = yaml.compose(text, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        kind = "JSON" if text.lstrip()[:1] == "{" else "YAML"  # a JSON file is read as the YAML it also is
        raise SettingsError(f"not valid {kind} ({shown(problem)[1:-1]}{where})") from None
    if root is None:
        return None
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
        raise SettingsError(f"expected a mapping of setting: value, got {kind}")
    out: dict[str, Scalar | str] = {}
    for key, value in root.value:
        line = key.start_mark.line + 1
        if not isinstance(key, yaml.ScalarNode):
            raise SettingsError(f"line {line}: a key that is not a setting's name")
        if key.value in out:
            raise SettingsError(f"line {line}: {key.value} is given twice; give each setting once")
        if isinstance(value, yaml.ScalarNode):
            plain = not value.style  # libyaml's style of a plain scalar is "", PyYAML's None
            out[key.value] = Scalar(value.value, plain, value.start_mark.line + 1)
        else:
            out[key.value] = "a list" if isinstance(value, yaml.SequenceNode) else "a mapping"
    return out


YAML_NULL = ("", "~", "null", "Null", "NULL")
YAML_BOOL = {w: b for b, words in ((True, "yes on true y"), (False, "no off false n")) for w in words.split()}
WHOLE = re.compile(r"[-+]?[0-9][0-9_]*")
RULES = {
    int: "a whole number such as 30",
    float: "a number such as 0.1 or 1e-3",
    bool: "true or false",
    str: "a text value (quoted where it looks like something else)",
}


def is_null(value: Scalar) -> bool:
    """An unquoted null (`key:`, `~`, `null`)."""
    return value.plain and value.text in YAML_NULL


def as_kind(kind: type, value: Scalar):
    """The setting `value` as a `kind` (str, int, float or bool), read as users mean it rather
    than by YAML 1.1's rules: text kept as written; whole numbers in decimal (`010` is ten, not
    YAML 1.1's octal eight; `1e3` is a thousand); any decimal number form for a float (`1e-3`,
    `1E5`, `.5`, `5.`, `1_000.5`, YAML's `.inf`); true/false, yes/no, on/off for a bool.
    ValueError naming the rule (RULES) for text that is none of these."""
    if kind is str:
        return value.text
    text = value.text.strip()
    if kind is bool and text.lower() in YAML_BOOL:
        return YAML_BOOL[text.lower()]
    if kind in (int, float):
        number = re.sub(r"^([-+]?)\.(?=(inf|nan)$)", r"\1", text.replace("_", ""), flags=re.IGNORECASE)
        try:
            if kind is int and WHOLE.fullmatch(text) and len(number) < 1000:
                return int(number)
            number = float(number)
        except ValueError:
            pass
        else:
            if kind is float:
                return number
            if math.isfinite(number) and number == int(number):
                return int(number)
    raise ValueError(f"must be {RULES[kind]}, got {shown(value.text)}")
