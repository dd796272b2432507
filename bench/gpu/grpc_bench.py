"""Short gRPC benchmark: starts `python -m server` on a random-weight Qwen3-shaped engine (the hidden `--engine`
flag with bench.gpu.models:RandomEngine; its log beside the JSON), then sends Score requests (token ids, MIS and
SIS) at concurrency 1 through bench.loadgen and reports p50/p95 latency per candidate count, as the client sees
it. The server is stopped with SIGTERM at the end (graceful stop, exit code recorded).

    python -m bench.gpu.grpc_bench --shape qwen3-0.6b --out grpc.json
    python -m bench.gpu.grpc_bench --tiny --out /tmp/grpc.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.common import spawned_server
from bench.gpu.common import add_run_args, cli, resolve_run_args, summarize
from bench.gpu.models import SHAPES
from bench.gpu.workload import id_questions, labels_for
from bench.summary import write_json
from bench.targets import Case, ReplayTarget


async def measure(target: str, args: argparse.Namespace, report: dict[str, Any], vocab: int) -> None:
    """bench.loadgen's closed loop at concurrency 1 over each candidate count and mode (the JSON written after
    every cell, so a stage killed by its timeout keeps what it measured)."""
    async with ReplayTarget(target, timeout=60.0) as replay:
        info = await replay.clients[0].model_info()
        report["model"] = dict(name=info.name, device=info.device, dtype=info.dtype)
        for n in args.candidates:
            questions = id_questions(n, 8, vocab, seed=5, tiny=args.tiny)
            cell: dict[str, Any] = report["results"].setdefault(str(n), {})
            for mode in args.modes:
                cases = [Case(f"{mode}-{i}", mode, q.query, q.items, dict(label_token_ids=labels_for(vocab), mode=mode))
                         for i, q in enumerate(questions)]
                run = await loadgen.closed_loop(replay, "case", [cases[i % len(cases)] for i in range(args.reps)], 1,
                                                warmup=args.warmup)
                errors = sorted({r.error for r in run.records if not r.ok})
                cell[mode] = dict(error=errors[0]) if errors else summarize([r.e2e_ms for r in run.records])
                write_json(args.out, report)


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = "tiny" if args.tiny else args.shape
    report: dict[str, Any] = dict(shape=shape, device=args.device, requests_per_cell=args.reps, results={},
                                  errors=[])
    t0 = time.perf_counter()
    log = Path(args.out).with_suffix(".server.log")
    flags = ["--engine", "bench.gpu.models:RandomEngine", "--model", shape, "--device", args.device,
             "--max-batch-tokens", str(args.max_batch_tokens), "--grace-s", "5"]
    try:
        with spawned_server(log, flags, timeout_s=args.ready_timeout_s) as server:
            report["ready_s"] = time.perf_counter() - t0
            try:
                asyncio.run(measure(server.target, args, report, SHAPES[shape].vocab))
            finally:
                report["server_exit_code"] = server.stop(30.0)
    except Exception as e:
        report["errors"].append(f"{type(e).__name__}: {e}")
    report["server_tail"] = log.read_text().splitlines()[-10:] if log.exists() else []
    report["total_s"] = time.perf_counter() - t0
    write_json(args.out, report)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"# gRPC Score at concurrency 1, {report['shape']} on {report.get('model', {}).get('device', '?')}: "
             "client-side ms p50/p95"]
    for n, cell in report["results"].items():
        parts = [f"{m} {s['p50']:.2f}/{s['p95']:.2f}" if "p95" in s else f"{m} {s.get('error')}"
                 for m, s in cell.items()]
        lines.append(f"{n:>3} candidates: " + "   ".join(parts))
    lines.append(f"server exit code {report.get('server_exit_code')}; errors: {report['errors'] or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, "requests")
    p.add_argument("--modes", nargs="+", default=["mis", "sis"], choices=["mis", "sis"])
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    args = resolve_run_args(p.parse_args(argv))
    return cli(run(args), args.out, table)


if __name__ == "__main__":
    main()
