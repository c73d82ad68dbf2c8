"""Every citation of a docs section, `docs/X.md, "Section"`, in the project's *.py, *.sh, *.md
and Makefile names a heading of that file, or a bold-named entry of one of its lists
(`- **Section** ...`): the heading's text begins with the cited name."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", "node_modules", "__pycache__"}
CITATION = re.compile(r"\b((?:docs/)?(?:design|benchmark-log|benchmarks|guide)\.md),\s+[\"'“]([^\"'”]{1,200}?)[\"'”]")
# a line break inside a citation, with a comment's or a docstring's lead-in on the next line
WRAP = re.compile(r"\s*\n\s*(?:#+ |\*\s|//\s?)?\s*")
# Python's implicit concatenation of string literals across a line break
JOIN = re.compile(r"[\"']\s*\n\s*[rf]?[\"']")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
ENTRY = re.compile(r"^\s*[-*]\s+\*\*(.+?)\*\*", re.M)


def sources() -> list[Path]:
    """The files whose citations are checked."""
    out = []
    for path in REPO.rglob("*"):
        if SKIP & set(path.relative_to(REPO).parts) or not path.is_file() or path == Path(__file__):
            continue
        if path.suffix in {".py", ".sh", ".md"} or path.name == "Makefile":
            out.append(path)
    return sorted(out)


def names(doc: Path) -> list[str]:
    """A doc's headings and bold-named list entries, markup dropped."""
    text = doc.read_text()
    found = HEADING.findall(text) + ENTRY.findall(text)
    return [re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", name).replace("`", "").strip() for name in found]


def cited(name: str, headings: list[str]) -> bool:
    """Whether some heading begins with the cited name, at a word's end."""
    name = name.replace("`", "").strip().rstrip(".,;")
    return any(h == name or (h.startswith(name) and not h[len(name)].isalnum()) for h in headings)


def citations(path: Path) -> list[tuple[str, str]]:
    """Each (doc, section) one file cites, line breaks inside a citation joined."""
    text = WRAP.sub(" ", JOIN.sub("", path.read_text(errors="replace")))
    return [(doc.removeprefix("docs/"), section) for doc, section in CITATION.findall(text)]


def test_citation_pattern_reads_wrapped_comments():
    text = 'x  # as measured (docs/benchmark-log.md, "GPU: one\n    # H200") and'
    assert CITATION.findall(WRAP.sub(" ", text)) == [("docs/benchmark-log.md", "GPU: one H200")]
    text = 'raise ValueError(f"refused (docs/guide.md, "\n        "\'Kornia ops by name\')")'
    assert CITATION.findall(JOIN.sub("", text)) == [("docs/guide.md", "Kornia ops by name")]
    assert cited("GPU: one H200", ["GPU: one H200, 2026-11-30 (the first GPU runs)"])
    assert not cited("GPU: one", ["GPU: oneself"])
    assert not cited("Gone section", ["GPU path"])


def test_every_cited_section_exists():
    docs = {path.name: names(path) for path in (REPO / "docs").glob("*.md")}
    bad = []
    for path in sources():
        for doc, section in citations(path):
            if doc in docs and not cited(section, docs[doc]):
                bad.append(f'{path.relative_to(REPO)}: {doc}, "{section}"')
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(sorted(set(bad)))


NAMED_FILE = re.compile(r"\b(?:augment|training|bench|jobs|tests)/[\w/.-]*\.(?:py|sh|txt|yaml|json)\b")


def test_every_file_the_docs_name_exists():
    """A module, test or result file a doc names by its path is there (a renamed one is renamed in
    the docs too)."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = [f"{doc.relative_to(REPO)}: {name}" for doc in docs for name in NAMED_FILE.findall(doc.read_text())]
    bad = [line for line in bad if not (REPO / line.split(": ", 1)[1]).exists()]
    assert not bad, "files the docs name that do not exist:\n" + "\n".join(sorted(set(bad)))
