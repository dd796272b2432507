"""scripts/buf_breaking.py on a scratch git repository: a breaking change fails; a `Buf-Breaking: <reason>` line
exempts only the commit that carries it (a later break fails again, a reason in a commit that does not touch
proto/ exempts nothing); uncommitted edits are checked too; a shallow clone cannot be checked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scripts.buf_breaking import DEFAULT_BUF, main

pytestmark = pytest.mark.skipif(not DEFAULT_BUF.exists(), reason="needs buf from npm (make setup)")

ROOT = Path(__file__).resolve().parents[1]
V1 = """syntax = "proto3";
package demo.v1;
// A request.
message Request {
  // The name.
  string name = 1;
%s}
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def commit(repo: Path, message: str, fields: str | None = None, touch: str | None = None) -> None:
    """Commit the proto with `fields` added to Request (None: leave it), or another file (`touch`)."""
    if fields is not None:
        (repo / "proto/demo/v1/demo.proto").write_text(V1 % fields)
    if touch is not None:
        (repo / touch).write_text(message)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "proto/demo/v1").mkdir(parents=True)
    (repo / "buf.yaml").write_text((ROOT / "buf.yaml").read_text())
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    commit(repo, "first", "  // The age.\n  int32 age = 2;\n")
    return repo


def check(repo: Path) -> int:
    return main(["--repo", str(repo)])


def test_additions_pass_and_a_removal_fails(repo: Path) -> None:
    commit(repo, "add a field", "  // The age.\n  int32 age = 2;\n  // The city.\n  string city = 3;\n")
    assert check(repo) == 0
    commit(repo, "drop age", "  // The city.\n  string city = 3;\n")
    assert check(repo) == 1
    commit(repo, "unrelated", touch="README")  # still broken: the last proto change is compared, not HEAD~1
    assert check(repo) == 1


def test_a_reason_exempts_only_its_own_commit(repo: Path) -> None:
    commit(repo, "drop age\n\nBuf-Breaking: nobody uses age yet", "")
    assert check(repo) == 0
    commit(repo, "unrelated", touch="README")
    assert check(repo) == 0
    commit(repo, "add city", "  // The city.\n  string city = 3;\n")
    assert check(repo) == 0
    commit(repo, "drop city", "")  # no reason of its own: the earlier one does not cover it
    assert check(repo) == 1


def test_a_reason_outside_proto_exempts_nothing(repo: Path) -> None:
    commit(repo, "drop age", "")
    commit(repo, "readme\n\nBuf-Breaking: trying to silence the check", touch="README")
    assert check(repo) == 1


def test_uncommitted_edits_are_checked(repo: Path) -> None:
    (repo / "proto/demo/v1/demo.proto").write_text(V1 % "  // The age.\n  int64 age = 2;\n")
    assert check(repo) == 1


def test_a_shallow_clone_cannot_be_checked(repo: Path, tmp_path: Path) -> None:
    commit(repo, "add city", "  // The age.\n  int32 age = 2;\n  // The city.\n  string city = 3;\n")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    assert check(shallow) == 2
