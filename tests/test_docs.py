"""The docs site (mkdocs.yml, docs/) stays true to the code: the generated pages (server flags, gRPC API) are what
their generator makes now, the API page names every RPC, message, field and value of the compiled contract, the
flags page every flag of the real parser, every test a page cites exists, every page is in the nav, and the README
stays short. `make test` also builds the site with `mkdocs build --strict` (broken links and anchors fail it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from scripts import gen_docs

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES), ids=lambda p: p.name)
def test_generated_pages_are_current(page: Path) -> None:
    assert page.read_text() == gen_docs.PAGES[page](), f"{page.name} is stale: run python -m scripts.gen_docs"


def test_the_api_page_names_every_rpc_message_field_and_value() -> None:
    """Checked against the compiled descriptor (pyscore._proto), not the generator's own reading of the .proto."""
    from pyscore._proto.pyscore.v1 import scorer_pb2

    page = (DOCS / "grpc-api.md").read_text()
    file = scorer_pb2.DESCRIPTOR
    names = [m.name for s in file.services_by_name.values() for m in s.methods]
    for message in file.message_types_by_name.values():
        names += [message.name, *(f.name for f in message.fields)]
        assert not [t for t in message.nested_types if not t.GetOptions().map_entry], message.name
    for enum in file.enum_types_by_name.values():
        names += [enum.name, *(v.name for v in enum.values)]
    missing = [n for n in names if f"`{n}`" not in page]
    assert not missing, missing
    assert len(names) > 100, len(names)


def test_the_flags_page_names_every_flag_of_the_parser() -> None:
    parser = gen_docs.server_parser()
    page = (DOCS / "flags.md").read_text()
    flags = [s for a in parser._actions if a.help != "==SUPPRESS==" for s in a.option_strings]
    assert "--kv-cache-mb" in flags and "--http-port" in flags
    missing = [f for f in flags if f"`{f}`" not in page]
    assert not missing, missing


CITED_TEST = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?")


def test_cited_tests_exist() -> None:
    """A page that says "proved by tests/x.py::test_y" names a test that exists (the Guarantees page lists many)."""
    cited = [(page.name, *m.groups()) for page in sorted(DOCS.glob("*.md")) for m in
             CITED_TEST.finditer(page.read_text())]
    assert len(cited) >= 15, len(cited)
    missing = []
    for page, path, name in cited:
        source = REPO / path
        if not source.exists() or (name and not re.search(rf"def {name}\b", source.read_text())):
            missing.append(f"{page}: {path}::{name}")
    assert not missing, missing


def test_guarantees_follow_a_short_module_chain() -> None:
    """`::test_b` after `tests/x.py::test_a` on the Guarantees page names a test of the same module."""
    text = (DOCS / "guarantees.md").read_text()
    missing = []
    for row in text.splitlines():
        module = None
        for m in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)`", row):
            module = m.group(1) or module
            if module and not re.search(rf"def {m.group(2)}\b", (REPO / module).read_text()):
                missing.append(f"{module}::{m.group(2)}")
    assert not missing, missing


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = nav_pages(config["nav"])
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name not in nav]
    assert not missing, missing
    assert all((DOCS / p).exists() for p in nav), [p for p in nav if not (DOCS / p).exists()]


def test_the_readme_is_short_and_points_to_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 320
    for page in ("quickstart", "guarantees", "grpc-api", "http", "flags"):
        assert f"(docs/{page}.md" in readme, page


RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def test_the_changelog_has_dated_releases_and_the_package_is_the_latest() -> None:
    """Keep a Changelog: `## [Unreleased]` first, then `## [x.y.z] - YYYY-MM-DD`, newest first, each with Added /
    Changed / ... sections; the latest release is pyscore.__version__ (GetModelInfo.server_version reports it)."""
    import pyscore

    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## .*$", text, re.MULTILINE)
    assert headings[0] == "## [Unreleased]", headings[0]
    releases = RELEASE.findall(text)
    assert len(releases) == len(headings) - 1 >= 5, [h for h in headings[1:] if not RELEASE.match(h)]
    versions = [tuple(map(int, v.split("."))) for v, _ in releases]
    assert versions == sorted(versions, reverse=True) and [d for _, d in releases] == sorted(
        (d for _, d in releases), reverse=True)
    assert releases[0][0] == pyscore.__version__, (releases[0], pyscore.__version__)
    kinds = set(re.findall(r"^### (.*)$", text, re.MULTILINE))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security", "Breaking (contract)"}, kinds
