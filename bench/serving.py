"""Serving benchmark: time to decision per question along each path (generate, sis, mis, fused, setwise) against a
target (bench.targets), closed loop over a concurrency sweep and open loop over an offered-QPS sweep (bench.loadgen),
each load point repeated. Every run writes `<out>/runs/<target>/<path>/<load>/rep<r>/summary.json` (and
records.jsonl.gz); `<out>/results.json` collects them for `python -m bench.report`.

`--sweep` is `make bench`, the CPU-sized sweep on the embedded model (~11 minutes on 2 cores): every path in process
at c=1 (a subprocess, before the server starts), then against `python -m server`: every path at c=1, the cheap ones
at c=8, per-path open-loop ladders cut after the first load whose median p95 exceeds 1 s, then the report. Numbers
are of a commit: a tree with uncommitted changes is refused unless --allow-dirty (the report then says so).

    python -m bench.serving --target 127.0.0.1:50051 --paths mis sis generate --concurrency 1 8 16 32
    python -m bench.serving --spawn-server --paths mis --qps 1 2 4 --duration 20 --out bench/results/mine
    python -m bench.serving --target pyscore-http://127.0.0.1:8080 --paths mis --concurrency 1 8
    python -m bench.serving --sweep [--reps 3] [--skip-inprocess] [--skip-open] [--out bench/results/latest]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import loadgen, report
from bench.common import REPO, git_commit, machine_info, spawned_server
from bench.dataset import Dataset
from bench.summary import LATEST, fmt, percentile, write_json
from bench.targets import PATHS, Target, make_target


# --- where it ran ----------------------------------------------------------------------------------------
def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --- one load point --------------------------------------------------------------------------------------
@dataclass
class LoadPoint:
    """concurrency (closed loop) or qps (open loop)."""

    concurrency: int | None = None
    qps: float | None = None

    @property
    def name(self) -> str:
        return f"closed-c{self.concurrency}" if self.qps is None else f"open-q{self.qps:g}"


@dataclass
class Settings:
    reps: int = 3
    num_questions: int = 16  # closed loop, per repetition
    duration_s: float = 20.0  # open loop: arrivals span this long (num arrivals = ceil(qps * duration))
    warmup: int = 2
    seed: int = 0
    workers: int | None = None  # open loop; None = one per arrival
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # copied into every summary


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="q", leave=False, dynamic_ncols=True, mininterval=0.5)


async def run_point(target: Target, path: str, point: LoadPoint, dataset: Dataset, rep: int,
                    s: Settings) -> tuple[dict[str, Any], list[loadgen.Record]]:
    """One repetition of one load point: the summary (without run metadata) and the records."""
    desc = f"{path} {point.name} rep{rep}"
    if point.qps is None:
        assert point.concurrency is not None
        questions = dataset.questions[: s.num_questions]
        bar = _progress(len(questions), desc, s.progress)
        result = await loadgen.closed_loop(target, path, questions, point.concurrency,
                                           warmup=s.warmup if rep == 0 else 0, progress=bar)
    else:
        n = max(1, math.ceil(point.qps * s.duration_s))
        schedule = loadgen.poisson_schedule(point.qps, n, seed=s.seed + rep)
        if rep == 0 and s.warmup:
            await loadgen.closed_loop(target, path, dataset.questions[: s.warmup], 1)
        bar = _progress(n, desc, s.progress)
        result = await loadgen.open_loop(target, path, [dataset[i % len(dataset)] for i in range(n)], schedule,
                                         num_workers=s.workers, progress=bar)
    if bar is not None:
        bar.close()
    summary = loadgen.summarize_records(result.records, result.wall_s)
    summary["num_workers"] = result.num_workers
    return summary, result.records


def run_summary(target: Target, path: str, point: LoadPoint, rep: int, measured: dict[str, Any],
                dataset: Dataset, s: Settings, load_before: Any) -> dict[str, Any]:
    """Everything summary.json holds, in a stable order."""
    return {
        "path": path, "target": target.spec, "model": target.info.model,
        "loop": "closed" if point.qps is None else "open",
        "concurrency": point.concurrency, "target_qps": point.qps, "rep": rep, "reps": s.reps,
        **measured,
        "label_token_ids": target.info.label_token_ids, "marker": target.info.marker,
        "target_details": target.info.details,
        "dataset": dataset.origin, "seed": s.seed,
        "machine": machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg(),
        "git_commit": git_commit(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **s.extra,
    }


def write_run(out: Path, summary: dict[str, Any], records: Sequence[loadgen.Record]) -> Path:
    target_slug = re.sub(r"[^A-Za-z0-9._-]+", "_", summary["target"])
    point = LoadPoint(summary["concurrency"], summary["target_qps"])
    run_dir = out / "runs" / target_slug / summary["path"] / point.name / f"rep{summary['rep']}"
    write_json(run_dir / "summary.json", summary, indent=2)
    with gzip.open(run_dir / "records.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r.to_json()) + "\n" for r in records)
    return run_dir


def one_line(summary: dict[str, Any]) -> str:
    e2e = summary["end_to_end_latency_ms"]
    load = f"c={summary['concurrency']}" if summary["target_qps"] is None else f"qps={summary['target_qps']:g}"
    return (f"{summary['path']:>8} {load:>9} rep{summary['rep']}: p50 {fmt(e2e['p50'])} ms, p95 {fmt(e2e['p95'])} ms, "
            f"achieved {summary['achieved_qps']:.2f} q/s, errors {summary['num_errors']}/{summary['num_questions']}"
            f", server queue p50 {fmt(summary['queueing_delay_ms']['p50'])} ms"
            f", lag p99 {fmt(summary['dispatch_lag_ms']['p99'])} ms")


async def sweep(target: Target, paths: Sequence[str], points: Sequence[LoadPoint], dataset: Dataset, s: Settings,
                out: Path, slo_ms: float | None = None, log=print) -> list[dict[str, Any]]:
    """Every path over every load point, `s.reps` times each. With `slo_ms`, a path's open-loop sweep stops
    after the first offered load whose median p95 already exceeds it (higher loads only queue longer)."""
    for path in paths:
        target.check_path(path)
    summaries = []
    for path in paths:
        over_slo = False
        for point in points:
            if over_slo and point.qps is not None:
                log(f"{path:>8} {point.name}: skipped (p95 already over {slo_ms:g} ms at a lower load)")
                continue
            p95s = []
            for rep in range(s.reps):
                before = loadavg()
                measured, records = await run_point(target, path, point, dataset, rep, s)
                summary = run_summary(target, path, point, rep, measured, dataset, s, before)
                write_run(out, summary, records)
                summaries.append(summary)
                log(one_line(summary))
                if point.qps is not None and (warning := loadgen.lag_warning(summary)):
                    log(warning)
                p95s.append(math.inf if summary["num_errors"] else summary["end_to_end_latency_ms"]["p95"] or math.inf)
            if slo_ms is not None and point.qps is not None and percentile(p95s, 50) > slo_ms:
                over_slo = True
    return summaries


def collect(out: Path) -> list[dict[str, Any]]:
    """All summaries under `out/runs`, written to `out/results.json`."""
    summaries = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("**/summary.json"))]
    write_json(out / "results.json", summaries, indent=2)
    return summaries


async def run(target_spec: str, paths: Sequence[str], points: Sequence[LoadPoint], dataset: Dataset, s: Settings,
              out: Path, slo_ms: float | None = None, **target_options: Any) -> list[dict[str, Any]]:
    async with make_target(target_spec, **target_options) as target:
        return await sweep(target, paths, points, dataset, s, out, slo_ms)


# --- make bench ---------------------------------------------------------------------------------------------
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
    """The engine in a fresh process, so the client of the server steps never shares an interpreter with torch."""
    cmd = [sys.executable, "-m", "bench.serving", "--target", "inprocess", "--concurrency", "1", "--reps", str(reps),
           "--num-questions", str(num_questions), "--out", str(out), "--warmup", "2",
           *(["--threads", str(threads)] if threads else [])]
    subprocess.run(cmd, check=True, cwd=REPO)


async def run_server_steps(address: str, steps: list[Step], dataset: Dataset, s: Settings, out: Path,
                           slo_ms: float) -> None:
    async with make_target(address) as target:
        for step in steps:
            await sweep(target, step.paths, step.points, dataset, s, out, slo_ms=slo_ms)


def make_bench(a: argparse.Namespace) -> None:
    require_clean_commit(git_commit(), a.allow_dirty)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if (load := os.getloadavg()[0]) > 0.5:
        print(f"WARNING: 1-minute load average {load:.2f} before the sweep: other work is running and the numbers "
              f"will be pessimistic (the report records the load before every run)", flush=True)
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    if not a.skip_inprocess:
        run_inprocess(out, a.reps, a.inprocess_questions, a.threads)
        phases["inprocess_s"] = time.monotonic() - t0
    settings = Settings(reps=a.reps, num_questions=a.num_questions, duration_s=a.duration or 12.0, warmup=2, seed=0,
                        progress=not a.no_progress)
    steps = [CLOSED_C1, CLOSED_C8] + ([] if a.skip_open else OPEN)
    t1 = time.monotonic()
    with spawned_server(out / "server.log", ["--threads", str(a.threads)] if a.threads else []) as server:
        asyncio.run(run_server_steps(server.target, steps, Dataset.synthetic(64, seed=0), replace(settings), out,
                                     slo_ms=report.SLO_MS))
    phases.update(server_s=time.monotonic() - t1, total_s=time.monotonic() - t0)
    (out / "sweep.json").write_text(json.dumps({"argv": sys.argv[1:], "phases": phases}, indent=2) + "\n")
    collect(out)
    print(f"sweep done in {phases['total_s']:.0f} s; report: {report.report(out)}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="HOST:PORT (our gRPC server), pyscore-http://HOST:PORT (our HTTP front door), "
                        "openai-http://HOST:PORT, vllm-http://HOST:PORT, sglang-score-http://HOST:PORT, or inprocess "
                        "(default %(default)s)")
    p.add_argument("--spawn-server", action="store_true",
                   help="start `python -m server` on a free port for the run (ignores --target)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the spawned server")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--concurrency", type=int, nargs="*", default=None,
                   help="closed-loop sweep (default 1 8 16 32 when no --qps is given)")
    p.add_argument("--qps", type=float, nargs="*", default=None, help="open-loop offered loads")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each load point (default %(default)s)")
    p.add_argument("--num-questions", type=int, default=16, help="closed loop: questions per repetition")
    p.add_argument("--duration", type=float, default=None,
                   help="open loop: seconds of arrivals per repetition (default 20; --sweep 12)")
    p.add_argument("--warmup", type=int, default=2, help="questions run before a path's first repetition")
    p.add_argument("--workers", type=int, default=None, help="open-loop workers (default: one per arrival)")
    p.add_argument("--slo-ms", type=float, default=None,
                   help="stop a path's QPS sweep after its median p95 exceeds this")
    p.add_argument("--dataset-dir", default=None, help="Open-Jev parquet directory (default: synthetic questions)")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=None, help="questions to load (synthetic default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--marker", default=None, help="setwise marker token (default: a special token of the model)")
    p.add_argument("--model", default=None, help="HTTP targets: the model name (default: the first /v1/models)")
    p.add_argument("--label-token-ids", type=int, nargs=2, default=None, metavar=("YES", "NO"),
                   help="sglang-score-http, vllm-http: Yes/No ids (default: the server's /tokenize)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline, seconds")
    p.add_argument("--threads", type=int, default=None, help="inprocess: model threads (default: all cores)")
    p.add_argument("--dtype", default="auto", help="inprocess: model dtype (default %(default)s)")
    p.add_argument("--out", default=str(LATEST))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--sweep", action="store_true", help="`make bench`: the CPU-sized sweep, then the report")
    p.add_argument("--inprocess-questions", type=int, default=8, help="--sweep: in-process questions per rep")
    p.add_argument("--skip-inprocess", action="store_true", help="--sweep: no in-process step")
    p.add_argument("--skip-open", action="store_true", help="--sweep: no open-loop ladders")
    p.add_argument("--allow-dirty", action="store_true", help="--sweep: run uncommitted code (the report says so)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    if a.sweep:
        return make_bench(a)
    if a.concurrency is None and a.qps is None:
        a.concurrency = [1, 8, 16, 32]
    points = [LoadPoint(concurrency=c) for c in a.concurrency or []] + [LoadPoint(qps=q) for q in a.qps or []]
    dataset = Dataset.load(a.dataset_dir, split=a.split, limit=a.limit, seed=a.seed)
    settings = Settings(reps=a.reps, num_questions=a.num_questions, duration_s=a.duration or 20.0, warmup=a.warmup,
                        seed=a.seed, workers=a.workers, progress=not a.no_progress)
    out = Path(a.out)
    options = dict(marker=a.marker, timeout=a.timeout, model=a.model, label_token_ids=a.label_token_ids,
                   threads=a.threads, dtype=a.dtype)
    with contextlib.ExitStack() as stack:
        target = a.target
        if a.spawn_server:
            target = stack.enter_context(spawned_server(out / "server.log", a.server_arg)).target
        asyncio.run(run(target, a.paths, points, dataset, settings, out, a.slo_ms, **options))
    print(f"{len(collect(out))} summaries in {out / 'results.json'}; report: python -m bench.report {out}")


if __name__ == "__main__":
    main()
