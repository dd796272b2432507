"""`buf breaking` for proto/: the working tree's contract must break no version of proto/ committed since the
last deliberate break.

A deliberate break is a commit that changes proto/ and says why in its message with a line
`Buf-Breaking: <reason>`. It exempts only the change that commit itself makes: the working tree is compared
with that commit's proto/ and with every later committed version of proto/, so a later commit that breaks the
contract fails here unless it carries its own reason (which then stands in the log for review). A reason in a
commit that does not touch proto/ exempts nothing. Without any such commit, every committed version counts.

    python scripts/buf_breaking.py [--buf PATH] [--repo DIR]

Exit status: 0 compatible, 1 a breaking change (buf prints it), 2 the check could not run (e.g. a shallow
clone, whose history is cut, or no buf binary).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = "proto"
TRAILER = re.compile(r"^Buf-Breaking:[ \t]*(\S.*)$", re.MULTILINE)
DEFAULT_BUF = ROOT / "tests" / "clients" / "node" / "node_modules" / ".bin" / "buf"


@dataclass(frozen=True)
class Version:
    commit: str
    subject: str
    reason: str | None  # the Buf-Breaking reason, when this commit is a deliberate break


class CannotCheck(Exception):
    pass


def git(repo: Path, *args: str) -> bytes:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True)
    if done.returncode != 0:
        raise CannotCheck(f"git {' '.join(args)}: {done.stderr.decode().strip()}")
    return done.stdout


def proto_versions(repo: Path) -> list[Version]:
    """Commits that changed proto/, newest first, back to and including the latest deliberate break."""
    if git(repo, "rev-parse", "--is-shallow-repository").strip() == b"true":
        raise CannotCheck("this clone is shallow, so earlier versions of proto/ are missing: git fetch --unshallow")
    log = git(repo, "log", "--format=%H%x1f%s%x1f%B%x1e", "--", PROTO_DIR).decode()
    versions = []
    for entry in filter(None, (e.strip("\n") for e in log.split("\x1e"))):
        commit, subject, body = entry.split("\x1f", 2)
        found = TRAILER.search(body)
        versions.append(Version(commit, subject, found.group(1).strip() if found else None))
        if found:
            break
    return versions


def extract(repo: Path, commit: str, into: Path) -> Path:
    """proto/ as of `commit`, written under `into` (returns the folder holding its .proto tree)."""
    archive = git(repo, "archive", "--format=tar", commit, "--", PROTO_DIR)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / PROTO_DIR


def breaks(buf: Path, repo: Path, against: Path) -> bool:
    """True when the working tree's module breaks the one in `against` (buf prints why)."""
    done = subprocess.run([str(buf), "breaking", "--against", str(against)], cwd=repo)
    if done.returncode not in (0, 100):  # 100: breaking changes found
        raise CannotCheck(f"buf breaking exited {done.returncode}")
    return done.returncode != 0


def check(repo: Path, buf: Path) -> int:
    if not buf.exists():
        raise CannotCheck(f"no buf at {buf} (make setup installs it from npm: @bufbuild/buf)")
    versions = proto_versions(repo)
    if not versions:
        print("buf breaking: no committed version of proto/ yet: nothing to compare with")
        return 0
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for v in versions:
            against = extract(repo, v.commit, Path(tmp) / v.commit)
            if breaks(buf, repo, against):
                print(f"buf breaking: the working tree breaks proto/ of {v.commit[:12]} ({v.subject})", file=sys.stderr)
                failed = True
    oldest = versions[-1]
    since = (f"the deliberate break {oldest.commit[:12]} ({oldest.subject}; Buf-Breaking: {oldest.reason})"
             if oldest.reason else "the first committed version")
    print(f"buf breaking: compared with {len(versions)} committed version(s) of proto/ back to {since}: "
          f"{'BREAKING' if failed else 'compatible'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--buf", type=Path, default=DEFAULT_BUF)
    p.add_argument("--repo", type=Path, default=ROOT)
    args = p.parse_args(argv)
    try:
        return check(args.repo.resolve(), args.buf.resolve())
    except CannotCheck as e:
        print(f"buf breaking: cannot check: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
