"""`make bench`: the CPU-sized serving sweep on the embedded model (about 11 minutes on 2 cores), then the report.

1. in-process engine, no gRPC (a subprocess, before the server starts): every path at concurrency 1;
2. `python -m server` on a free port: every path closed loop at concurrency 1, the cheap paths also at 8;
3. open loop: per-path ladders of offered QPS (seeded Poisson schedules), each path's ladder cut after the
   first load whose median p95 exceeds 1 s;
4. results.json, report.md and the plots in the output folder.

Each load point is repeated (--reps, default 3). Check that the machine is otherwise idle first (`uptime`):
the report prints the load average seen before every run. Numbers are of a commit: a tree with uncommitted
changes to tracked files is refused unless --allow-dirty, and the report then says so at its top.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import report, serving
from bench.common import REPO, git_commit, spawned_server
from bench.dataset import Dataset
from bench.serving import LoadPoint, Settings


@dataclass
class Step:
    paths: tuple[str, ...]
    points: tuple[LoadPoint, ...]


CLOSED_C1 = Step(("mis", "sis", "generate", "setwise", "fused"), (LoadPoint(concurrency=1),))
CLOSED_C8 = Step(("mis", "setwise", "fused"), (LoadPoint(concurrency=8),))
OPEN = [
    Step(("mis",), tuple(LoadPoint(qps=q) for q in (0.5, 1, 2, 4, 6))),
    Step(("sis", "generate"), tuple(LoadPoint(qps=q) for q in (0.5, 1))),
    Step(("setwise", "fused"), tuple(LoadPoint(qps=q) for q in (2, 4))),
]


def require_clean_commit(commit: str | None, allow_dirty: bool) -> None:
    """Refuses (SystemExit) to benchmark uncommitted code unless allowed; then warns that the report will say so."""
    if commit is not None and not commit.endswith("+dirty"):
        return
    what = commit or "a tree outside git"
    if not allow_dirty:
        raise SystemExit(f"refusing to benchmark {what}: commit first, or pass --allow-dirty "
                         "(make bench BENCH_ARGS=--allow-dirty) to run it marked as such")
    print(f"WARNING: benchmarking {what}: the report will say it is not from a clean commit", flush=True)


def run_inprocess(out: Path, reps: int, num_questions: int, threads: int | None) -> None:
    """The engine in a fresh process, so the client of step 2 never shares an interpreter with torch."""
    cmd = [sys.executable, "-m", "bench.serving", "--target", "inprocess", "--concurrency", "1", "--reps", str(reps),
           "--num-questions", str(num_questions), "--out", str(out), "--warmup", "2"]
    if threads:
        cmd += ["--threads", str(threads)]
    subprocess.run(cmd, check=True, cwd=REPO)


async def run_server_steps(address: str, steps: list[Step], dataset: Dataset, s: Settings, out: Path,
                           slo_ms: float) -> None:
    async with serving.make_target(address) as target:
        for step in steps:
            await serving.sweep(target, step.paths, step.points, dataset, s, out, slo_ms=slo_ms)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-questions", type=int, default=16, help="closed loop, per repetition (4 per bucket)")
    p.add_argument("--inprocess-questions", type=int, default=8)
    p.add_argument("--duration", type=float, default=12.0, help="open loop: seconds of arrivals per repetition")
    p.add_argument("--threads", type=int, default=None, help="model threads (server and in-process)")
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--skip-open", action="store_true")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes (the report says so)")
    a = p.parse_args()
    require_clean_commit(git_commit(), a.allow_dirty)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"WARNING: 1-minute load average {load:.2f} before the sweep: other work is running and the numbers "
              f"will be pessimistic (the report records the load before every run)", flush=True)
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    if not a.skip_inprocess:
        run_inprocess(out, a.reps, a.inprocess_questions, a.threads)
        phases["inprocess_s"] = time.monotonic() - t0
    dataset = Dataset.synthetic(64, seed=0)
    settings = Settings(reps=a.reps, num_questions=a.num_questions, duration_s=a.duration, warmup=2, seed=0)
    steps = [CLOSED_C1, CLOSED_C8] + ([] if a.skip_open else OPEN)
    server_args = ["--threads", str(a.threads)] if a.threads else []
    t1 = time.monotonic()
    with spawned_server(out / "server.log", server_args) as server:
        asyncio.run(run_server_steps(server.target, steps, dataset, replace(settings), out, slo_ms=report.SLO_MS))
    phases["server_s"] = time.monotonic() - t1
    phases["total_s"] = time.monotonic() - t0
    (out / "sweep.json").write_text(json.dumps({"argv": sys.argv[1:], "phases": phases}, indent=2) + "\n")
    serving.collect(out)
    print(f"sweep done in {phases['total_s']:.0f} s; report: {report.report(out)}")


if __name__ == "__main__":
    main()
