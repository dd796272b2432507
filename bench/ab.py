"""Before/after in one run: the same benchmark command run alternately in two source trees (each with its own
built extension), `--rounds` times, so both see the same machine state. Prints every output under its tree's
label and the machine once; the comparison is read from the alternating outputs.

    python -m bench.ab --before /tmp/old-tree --rounds 2 -- -m bench.kernels --only attention --dtypes bf16

The before tree runs with this interpreter; copy any benchmark script it lacks into it first."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.common import REPO, machine


def git_describe(tree: Path) -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the source tree to compare against")
    ap.add_argument("--after", type=Path, default=REPO, help="default: this tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the python arguments, e.g. -m bench.engine")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    print(f"# {machine()}\n# command: python {' '.join(command)}")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for label, tree in trees.items():
        print(f"# {label}: {tree} ({git_describe(tree)})")
    for r in range(args.rounds):
        for label, tree in trees.items():
            out = subprocess.run([sys.executable, *command], cwd=tree, capture_output=True, text=True)
            print(f"\n## round {r + 1} {label} (exit {out.returncode})\n{out.stdout.rstrip()}", flush=True)
            if out.returncode:
                print(out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
