"""Before/after in one run: the same benchmark command run alternately in two source trees (each with its own
built extension), `--rounds` times, so both see the same machine state. Prints every output under its tree's
label and the machine once, then a table: for every output line that starts with text and holds a decimal number
(a kernel or engine row: `op dtype ours torch ...`), the median over rounds of that line's first decimal number in
each tree, and after / before (below 1: the after tree is faster, for a time).

    python -m bench.ab --before /tmp/old-tree --rounds 2 -- -m bench.kernels --only attention --dtypes bf16

The before tree runs with this interpreter; copy any benchmark script it lacks into it first."""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from bench.common import REPO, machine


def git_describe(tree: Path) -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


_NUMBER = re.compile(r"^-?\d+\.\d+$")


def first_numbers(stdout: str) -> dict[str, float]:
    """Each line's text before its first decimal number -> that number, for lines that start with text."""
    rows: dict[str, float] = {}
    for line in stdout.splitlines():
        words = line.split()
        at = next((i for i, w in enumerate(words) if _NUMBER.match(w)), None)
        if at and not line.startswith(("#", " ")) and ":" not in words[0]:
            rows.setdefault(" ".join(words[:at]), float(words[at]))
    return rows


def summary(samples: dict[str, dict[str, list[float]]]) -> list[str]:
    """The median of each row per tree and after / before, for rows both trees printed."""
    before, after = samples["before"], samples["after"]
    names = [n for n in after if n in before]
    if not names:
        return []
    width = max(len(n) for n in names)
    lines = [f"\n## medians over rounds (first number of each row)\n{'row':<{width}}  {'before':>10} {'after':>10}"
             f"  after/before"]
    for n in names:
        b, a = statistics.median(before[n]), statistics.median(after[n])
        ratio = f"{a / b:.3f}" if b else "-"
        lines.append(f"{n:<{width}}  {b:>10.4g} {a:>10.4g}  {ratio:>12}")
    return lines


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
    samples: dict[str, dict[str, list[float]]] = {label: defaultdict(list) for label in trees}
    for r in range(args.rounds):
        for label, tree in trees.items():
            out = subprocess.run([sys.executable, *command], cwd=tree, capture_output=True, text=True)
            print(f"\n## round {r + 1} {label} (exit {out.returncode})\n{out.stdout.rstrip()}", flush=True)
            if out.returncode:
                print(out.stderr[-2000:], flush=True)
            for name, value in first_numbers(out.stdout).items():
                samples[label][name].append(value)
    print("\n".join(summary(samples)))


if __name__ == "__main__":
    main()
