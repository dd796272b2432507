"""bench/results/ is an archive: bench/results/INDEX.md is what `python -m bench.index` makes now, it lists every file
there, every record's header names its command, commit and CPU, every record is cited (by the docs, the tier table,
a kernel's comment, a test or another record), every record a document names by path exists, and no record rests on
a script outside the repository (/tmp)."""

from __future__ import annotations

import re
from pathlib import Path

from bench import index

REPO = Path(__file__).resolve().parent.parent
RESULTS = index.RESULTS
TMP_SCRIPT = re.compile(r"/tmp/[\w./-]*\.py")


def citing_texts() -> dict[Path, str]:
    """Everything that may cite a record: the docs, the code, the tests, bench/, and the records themselves."""
    docs = [p for p in (REPO / "docs").glob("*.md") if not p.is_symlink()]
    paths = [REPO / "README.md", REPO / "CHANGELOG.md", *docs]
    for folder in ("csrc", "pyscore", "server", "tests", "bench", "deploy", "scripts"):
        paths += [p for p in (REPO / folder).rglob("*") if p.is_file() and "_proto" not in p.parts
                  and p.suffix in (".py", ".h", ".cpp", ".cu", ".cuh", ".md", ".sh", ".txt", ".yaml")]
    return {p: p.read_text(errors="replace") for p in paths if p != index.INDEX}


def test_the_index_is_current() -> None:
    assert index.INDEX.read_text() == index.index_text(), "bench/results/INDEX.md is stale: run python -m bench.index"


def test_the_index_lists_every_file() -> None:
    text = index.INDEX.read_text()
    files = index.all_files()
    assert len(files) > 100
    missing = [str(p.relative_to(RESULTS)) for p in files
               if f"]({p.relative_to(RESULTS)})" not in text and p.name not in text]
    assert not missing, missing


def test_every_record_names_its_command_commit_and_cpu() -> None:
    records = index.records()
    incomplete = [r.path for r in records if not (r.command and r.commit and r.cpu and r.purpose)]
    assert not incomplete, incomplete


def test_every_record_is_cited() -> None:
    texts = citing_texts()
    uncited = []
    for path in index.all_files():
        if path.suffix not in index.RECORDS and path.suffix != ".json":
            continue  # a plot or raw samples: part of the record beside it
        if not any(path.name in text for p, text in texts.items() if p != path):
            owner = index.owner(path, {p: True for p in index.all_files() if p.suffix in index.RECORDS})
            if owner is None and not any((path.parent / n).exists() for n in ("report.md",)):
                uncited.append(str(path.relative_to(RESULTS)))
    assert not uncited, f"cite these records or delete them: {uncited}"


CITED_PATH = re.compile(r"\bbench/results/([\w./-]+\.(?:txt|md|json|png|gz))")
# a path that names no record: history (`git log -- PATH`) or where a recorded command wrote (`--out PATH`)
NOT_A_CITATION = re.compile(r"(git log --|--out)\s*$")


def cited_paths(text: str) -> list[str]:
    text = re.sub(r"^### Removed\n.*?(?=^##)", "", text, flags=re.MULTILINE | re.DOTALL)  # the changelog's removals
    return [m.group(1) for m in CITED_PATH.finditer(text)
            if "latest/" not in m.group(1) and not NOT_A_CITATION.search(text[max(0, m.start() - 30):m.start()])]


def test_every_cited_record_exists() -> None:
    """A record named by its path in the docs, tests, bench/ or another record is there (code in csrc/ and pyscore/
    is checked by tests/test_doc_links.py)."""
    missing = []
    for path, text in citing_texts().items():
        if any(path.is_relative_to(REPO / folder) for folder in ("csrc", "pyscore", "server")):
            continue
        missing += [f"{path.relative_to(REPO)}: {m}" for m in cited_paths(text) if not (RESULTS / m).exists()]
    assert not missing, missing


def test_no_record_rests_on_a_tmp_script() -> None:
    resting = {str(p.relative_to(RESULTS)) for p in index.all_files()
               if p.suffix in index.RECORDS and TMP_SCRIPT.search(p.read_text(errors="replace"))}
    assert not resting, f"these records name a script that is not in the repository: {sorted(resting)}"
