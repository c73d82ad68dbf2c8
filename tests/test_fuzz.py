"""Seeded fuzzing (bench/fuzz.py, which takes `--fuzz N` for longer runs): byte-mutated files of
every format the job reads, through the job's own functions (decoding, header sampling, the
WebDataset and Parquet scans and read tasks), each either decoded or turned into a listed bad
file (or refused by the scan with the job's one-line DataError), never another exception, and
never an image the read task drops without a word. A few dozen mutants a format: seconds."""

from __future__ import annotations

import pytest

from bench import fuzz

MUTANTS = {"tar": 40, "parquet": 30, "hf": 30}  # containers cost a scan and a read each; images 60


@pytest.mark.parametrize("fmt", fuzz.FORMATS)
def test_every_mutant_decodes_or_is_a_listed_bad_file(fmt, tmp_path):
    n = MUTANTS.get(fmt, 60)
    result = fuzz.fuzz_format(fmt, n, seed=0, work=tmp_path)
    assert result["other"] == 0, result["examples"]
    assert result["decoded"] + result["bad"] == n
    assert result["bad"] > 0  # the mutations do break files: the outcome checked is not vacuous


def test_the_script_prints_its_table_writes_json_and_exits_1_on_another_exception(tmp_path, capsys, monkeypatch):
    import json

    assert fuzz.main(["--fuzz", "3", "--formats", "png,bmp", "--json", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["format", "mutants", "decoded", "bad", "other"] and len(out) == 3
    assert [r["format"] for r in json.loads((tmp_path / "f.json").read_text())["results"]] == ["png", "bmp"]
    monkeypatch.setattr(fuzz, "check_image", lambda *a: 1 / 0)
    assert fuzz.main(["--fuzz", "2", "--formats", "png"]) == 1
    assert "ZeroDivisionError" in capsys.readouterr().err


def test_trees_named_in_random_bytes_are_read_or_refused_in_one_line(tmp_path):
    """Names as bytes (bench.fuzz --formats names): a tree, a manifest of its files, jobs.prepare."""
    result = fuzz.fuzz_names(10, seed=0, work=tmp_path)
    assert result["other"] == 0, result["examples"]
    assert result["decoded"] > 0  # most trees are read whole: the check is not all refusals


def test_every_settings_file_is_read_as_meant_or_refused_in_one_line_within_a_second(tmp_path):
    """bench/fuzz_yaml.py: the alias bomb, aliases, anchors, tags, keys given twice, YAML 1.1's
    number forms and long values, some mutated; the job's reading of --config takes each as
    meant or refuses it in one line (issue 53)."""
    result = fuzz.fuzz_settings(150, seed=0, work=tmp_path)
    assert result["other"] == 0, result["examples"]
    assert result["decoded"] > 30 and result["bad"] > 30  # both outcomes reached: not vacuous
