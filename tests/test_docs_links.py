"""Every relative link in README.md and docs/*.md points at a file that exists, and every
#anchor at a heading of that file, as GitHub spells heading anchors."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path) -> list[str]:
    """The links of one file that point at no file or at no heading."""
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.relative_to(REPO)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    return bad


def test_slug_follows_github():
    assert slug("Start-up: the floor, and where the time goes") == "start-up-the-floor-and-where-the-time-goes"
    assert slug("Built-in ops against Kornia's, CPU") == "built-in-ops-against-kornias-cpu"
    assert slug("Decode + augment in one call (`bench.decode`)") == "decode--augment-in-one-call-benchdecode"


def test_every_relative_link_resolves():
    bad = [line for path in DOCS for line in broken_links(path)]
    assert not bad, "broken links:\n" + "\n".join(bad)
