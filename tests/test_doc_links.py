"""The README's, docs' and recorded reports' relative links name files that exist: a figure the README quotes is
only as good as the recorded result it links to (a cleanup once deleted a cited result because the README linked
a name that never existed). So do the recorded results the code cites (the tier table, the kernels' comments)."""

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


CITED = re.compile(r"\b(?:bench/results/)?[\w./-]*?([A-Za-z0-9_-]+\.(?:txt|json|md|png))\b")
# a file name cited without its folder that is a bench record's (not a file the code reads or writes)
RECORD_NAME = re.compile(r"_(ab|probes?)\.txt$|^(kernels|linear|engine|labels|decode|attention)_")
CODE = [*sorted((REPO / "pyscore").rglob("*.py")), *sorted((REPO / "server").rglob("*.py")),
        *sorted(p for p in (REPO / "csrc").rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh"))]


def test_code_cites_recorded_results_that_exist() -> None:
    """The tier table (pyscore/ops/tiers.py) and the kernels' comments justify a choice by a recorded result, by
    path (bench/results/...) or by file name: each names a file under bench/results/."""
    recorded = {p.name for p in (REPO / "bench" / "results").rglob("*") if p.is_file()}
    cited = [(path, match.group(1)) for path in CODE for match in CITED.finditer(path.read_text(errors="replace"))
             if "bench/results/" in match.group(0) or RECORD_NAME.search(match.group(1))]
    assert len(cited) >= 40, len(cited)  # the pattern still finds the table's citations
    missing = [f"{path.relative_to(REPO)}: {name}" for path, name in cited if name not in recorded]
    assert not missing, missing


def test_code_cites_records_by_a_path_that_exists() -> None:
    """A citation with its folder (bench/results/<folder>/<record>) names where the record is, not only a file of
    that name somewhere: a record moved into a sub-folder must be re-cited by its new path."""
    stale = [f"{path.relative_to(REPO)}: {match.group(0)}" for path in CODE
             for match in re.finditer(r"bench/results/[\w./-]+\.(?:txt|json|md|png)", path.read_text(errors="replace"))
             if not (REPO / match.group(0)).exists()]
    assert not stale, stale
