"""Every relative link and image in the docs resolves (file and heading anchor); BENCHMARKS.md
carries no issue numbers and links every file of docs/bench-history/.

The docs read here: README.md, docs/*.md, docs/bench-history/*.md and tests/README.md. Only links
are checked, not commands: the commands in docs/bench-history/ are historical (flags and file
names of their day) and are never run; the README's walkthrough is run by
tests/test_doc_walkthroughs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HISTORY = DOCS / "bench-history"
PAGES = [
    ROOT / "README.md",
    ROOT / "tests" / "README.md",
    *sorted(DOCS.glob("*.md")),
    *sorted(HISTORY.glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#+ ", line):
            found.add(_slug(line.lstrip("#")))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == [], broken


def test_benchmarks_page_has_no_issue_numbers_and_links_its_history():
    text = (DOCS / "BENCHMARKS.md").read_text()
    assert re.findall(r"(?i)\bissue \d+|#\d+\b", text) == []
    linked = set(re.findall(r"\]\(bench-history/([\w.-]+\.md)\)", text))
    assert {p.name for p in HISTORY.glob("*.md")} - linked == set()
    for section in re.split(r"\n(?=## )", text)[2:]:  # past the preamble and the summary
        assert "bench-history/" in section or "No earlier runs." in section, section[:80]
