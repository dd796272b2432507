"""The README's, docs' and recorded reports' relative links name files that exist: a figure the README quotes is
only as good as the recorded result it links to (a cleanup once deleted a cited result because the README linked
a name that never existed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "bench" / "results").rglob("*.md"))]


def relative_targets(doc: Path) -> list[str]:
    targets = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same document
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda d: str(d.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    missing = [t for t in relative_targets(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"


def test_the_check_sees_links() -> None:
    """The pattern finds the README's links to recorded results, so an empty match cannot pass silently."""
    assert sum(t.startswith("bench/results/") for t in relative_targets(REPO / "README.md")) >= 10
