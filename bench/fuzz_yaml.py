"""Settings files for the fuzzer (bench/fuzz.py, `--formats yaml`): --config files built from the
YAML that changes settings quietly or takes the machine (aliases and the alias bomb, anchors,
tags, keys given twice, YAML 1.1's number and text forms, long values, nesting), some of them
then mutated with YAML's own punctuation. Each goes through the job's reading
(training.driver.flags.load_config_file, then TrainConfig): it must be read as meant (where the case
says what it means) or refused with one line, never anything else, and within a second.

Columns in bench/fuzz.py's table: decoded (read, as meant where known); bad (refused in one line).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

# "billion laughs": 9 lists of 9 aliases of the list before, 9**9 items once expanded, as `data:` (about 300 bytes)
ALIAS_BOMB = (
    "data: [&a [x,x,x,x,x,x,x,x,x], "
    + ", ".join(f"&{c} [{','.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    + "]\n"
)
MAX_SECONDS = 1.0  # a settings file is read (or refused) within this
MAX_LINE = 1200  # characters of an error line, besides the file's path (the unknown key's lists every key)

# (text as written, the value meant) for fields of each type
MEANT = {
    "int": [("3", 3), ("010", 10), ("1_000", 1000), ("1e3", 1000), ("+7", 7), ("'12'", 12)],
    "float": [("1e-3", 0.001), ("1E5", 1e5), (".5", 0.5), ("5.", 5.0), ("0.1", 0.1), ("1_000.5", 1000.5), ("3", 3.0)],
    "bool": [("yes", True), ("no", False), ("on", True), ("Off", False), ("true", True), ("FALSE", False)],
    "str": [("0123", "0123"), ("1.10", "1.10"), ("007", "007"), ("1e3", "1e3"), ("'0123'", "0123"), ('"x y"', "x y")],
}
FIELDS = {
    "int": ["epochs", "batch_size", "seed", "stop_after", "augment_batch_size"],
    "float": ["lr", "momentum", "weight_decay", "warmup_epochs", "label_smoothing"],
    "bool": ["fresh", "strict", "deterministic", "compile"],
    "str": ["name", "data", "storage_path", "label_key"],
}
TROUBLE = [  # lines a settings file must refuse in one line, or read as text
    "base: &b 0.1\nlr: *b",
    "lr: !!float 1",
    "name: !!python/object/apply:os.system ['echo hi']",
    "data: !!binary aGVsbG8=",
    "epochs: 3\nepochs: 5",
    "batch_size: 8\nbatch-size: 16",
    "epochs: 1:30",
    "epochs: 0x1F",
    "epochs: [1, 2]",
    "lr: {a: 1}",
    "epochs:",
    "name: ~",
    "? [a, b]\n: 1",
    "<<: {epochs: 3}",
    "epochs: 1\n---\nepochs: 2",
    "%YAML 1.1\n---\nepochs: 2",
    "lr: .nan",
    "lr: -.inf",
    f"seed: {'9' * 5000}",
    "name: 'a\tb'",
]
PUNCTUATION = ":-?[]{}&*!|>'\"%@`#,\n\t "


def long_value(rng: random.Random) -> str:
    key = rng.choice(FIELDS["str"] + FIELDS["int"] + FIELDS["float"])
    return f"{key}: {rng.choice('x9.') * rng.choice([100, 10_000, 200_000])}"


def settings_case(rng: random.Random) -> tuple[str, dict | None]:
    """A settings file's text and what it means ({field: value}), or None where it need only be
    read or refused in one line."""
    if rng.random() < 0.5:  # every line one the reading must take as meant
        chosen = {}
        for kind in rng.sample(sorted(FIELDS), rng.randint(1, 4)):
            field = rng.choice(FIELDS[kind])
            text, value = rng.choice(MEANT[kind])
            if field in ("seed", "stop_after", "epochs", "batch_size", "augment_batch_size"):
                text, value = rng.choice([(t, v) for t, v in MEANT["int"] if v > 0])
            if field == "name":  # a run name is a folder name
                text, value = rng.choice([(t, v) for t, v in MEANT["str"] if " " not in v])
            if field in ("momentum", "label_smoothing"):
                text, value = rng.choice([(".5", 0.5), ("0.1", 0.1), ("1e-3", 0.001)])
            chosen[field] = (text, value)
        lines = [f"{k.replace('_', '-') if rng.random() < 0.3 else k}: {t}" for k, (t, _) in chosen.items()]
        return "\n".join(lines) + "\n", {k: v for k, (_, v) in chosen.items()}
    parts = [rng.choice(TROUBLE) if rng.random() < 0.7 else long_value(rng) for _ in range(rng.randint(1, 3))]
    text = "\n".join(parts) + "\n"
    for _ in range(rng.choice([0, 0, 1, 3])):  # YAML's punctuation put in, here and there
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(PUNCTUATION) + text[at:]
    return text, None


def check_settings(text: str, meant: dict | None, work: Path) -> str:
    """ "decoded" where the job reads `text` (as `meant`, where given), "bad" where it refuses it
    with one short line; AssertionError for anything else it does, or for taking too long."""
    from training.config import ConfigError, TrainConfig, error_line
    from training.driver.flags import load_config_file

    path = work / "run.yaml"
    path.write_text(text)
    start = time.monotonic()
    try:
        values = load_config_file(str(path))
        TrainConfig(**values)
    except ConfigError as e:
        assert meant is None, f"refused ({e}), meant {meant}"
        line = error_line(e)
        assert "\n" not in line and len(line) <= MAX_LINE + len(str(path)), f"not one short line: {line[:300]}"
        outcome = "bad"
    else:
        if meant is not None:
            typed = {k: (v, type(v)) for k, v in values.items()}
            assert typed == {k: (v, type(v)) for k, v in meant.items()}, f"read as {values}, meant {meant}"
        outcome = "decoded"
    assert time.monotonic() - start < MAX_SECONDS, f"took {time.monotonic() - start:.1f} s"
    return outcome


def settings_cases(n: int, seed: int) -> list[tuple[str, dict | None]]:
    """The alias bomb first, then `n - 1` cases drawn from `seed`."""
    return [(ALIAS_BOMB, None)] + [settings_case(random.Random(f"{seed}:yaml:{i}")) for i in range(n - 1)]
