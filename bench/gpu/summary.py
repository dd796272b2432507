"""The short table gpu_check.sh prints last: each benchmark's own table (with its verdicts against the targets and
the LMSYS study's SGLang numbers) from the JSON files of one run.

    python -m bench.gpu.summary OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.gpu import engine_bench, grpc_bench, kernel_bench
from bench.summary import write_report


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary(out: Path) -> str:
    parts = [(out / "kernels.json", kernel_bench.table)]
    parts += [(path, engine_bench.table) for path in sorted(out.glob("engine-*.json"))]
    parts += [(out / "grpc.json", grpc_bench.table)]
    tables = [table(report) for path, table in parts if (report := load(path))]
    return "\n\n".join(tables) if tables else f"no results under {out}"


if __name__ == "__main__":
    write_report(summary(Path(sys.argv[1] if len(sys.argv) > 1 else ".")), None)
