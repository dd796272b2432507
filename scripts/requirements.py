"""Prints pyproject.toml's requirements, one per line, for `pip install -r`: the base dependencies, the named
extras' and, with --build-system, the build system's (setup.py build_ext --inplace runs without isolation).
`make setup` installs .venv from this, so pyproject.toml stays the one list of what pyscore needs.

    python scripts/requirements.py --build-system server bench dev > reqs.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip carries a copy of tomli, which tomllib came from
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], build_system: bool = False, pyproject: Path = PYPROJECT) -> list[str]:
    """The requirement strings, in pyproject.toml's order; an unknown extra is a KeyError naming it."""
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise KeyError(f"no extra {', '.join(unknown)} in {pyproject.name} (it has: {', '.join(optional)})")
    lines = list(data["build-system"]["requires"]) if build_system else []
    lines += project.get("dependencies", [])
    for extra in extras:
        lines += optional[extra]
    return list(dict.fromkeys(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("extras", nargs="*", help="extras whose dependencies to add (server, bench, dev)")
    p.add_argument("--build-system", action="store_true", help="add [build-system].requires")
    a = p.parse_args(argv)
    try:
        print("\n".join(requirements(a.extras, a.build_system)))
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
