"""The H200 kit's own parts (bench/gpu_check.sh runs them; its kernel and engine stages are `bench.kernels --json`
and `bench.engine --shape S --device cuda`):

- `grpc`: starts `python -m server` on a random-weight engine (the hidden `--engine` flag with
  bench.models:RandomEngine; its log beside the JSON), sends Score requests (token ids, MIS and SIS) at concurrency
  1 through bench.loadgen's closed loop and reports p50/p95 per candidate count as the client sees it; the server
  is stopped with SIGTERM at the end (graceful stop, exit code recorded);
- `summary`: the table gpu_check.sh prints last, each benchmark's own table (with its verdicts against the targets
  and the LMSYS study's SGLang numbers) from the JSON files of one run.

    python -m bench.gpu grpc --shape qwen3-0.6b --device cuda --out grpc.json
    python -m bench.gpu grpc --tiny --out /tmp/grpc.json      # CPU plumbing check
    python -m bench.gpu summary OUT_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench import engine, kernels, loadgen
from bench.common import spawned_server
from bench.models import CANDIDATE_COUNTS, SHAPES, id_questions, labels_for
from bench.summary import timings, write_json, write_report
from bench.targets import Case, ReplayTarget


async def measure(target: str, args: argparse.Namespace, report: dict[str, Any], vocab: int) -> None:
    """Every candidate count and mode in turn, the JSON written after each cell (a stage killed by its timeout
    keeps what it measured)."""
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
                cell[mode] = dict(error=errors[0]) if errors else timings([r.e2e_ms for r in run.records])
                write_json(args.out, report)


def grpc(args: argparse.Namespace) -> dict[str, Any]:
    shape = "tiny" if args.tiny else args.shape
    report: dict[str, Any] = dict(shape=shape, device=args.device, requests_per_cell=args.reps, results={},
                                  errors=[])
    t0 = time.perf_counter()
    log = Path(args.out).with_suffix(".server.log")
    flags = ["--engine", "bench.models:RandomEngine", "--model", shape, "--device", args.device,
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
    print(grpc_table(report), flush=True)
    return report


def grpc_table(report: dict[str, Any]) -> str:
    lines = [f"# gRPC Score at concurrency 1, {report['shape']} on {report.get('model', {}).get('device', '?')}: "
             "client-side ms p50/p95"]
    for n, cell in report["results"].items():
        parts = [f"{m} {s['p50']:.2f}/{s['p95']:.2f}" if "p95" in s else f"{m} {s.get('error')}"
                 for m, s in cell.items()]
        lines.append(f"{n:>3} candidates: " + "   ".join(parts))
    lines.append(f"server exit code {report.get('server_exit_code')}; errors: {report['errors'] or 'none'}")
    return "\n".join(lines)


def summary(out: Path) -> str:
    """Each benchmark's table, from the JSON files under `out` (a missing or unreadable one is left out)."""
    parts = [(out / "kernels.json", kernels.kit_table)]
    parts += [(path, engine.table) for path in sorted(out.glob("engine-*.json"))]
    parts += [(out / "grpc.json", grpc_table)]
    tables = []
    for path, table in parts:
        try:
            tables.append(table(json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return "\n\n".join(tables) if tables else f"no results under {out}"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("grpc", help="the short gRPC benchmark")
    g.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    g.add_argument("--tiny", action="store_true", help="the tiny shape and lengths on the CPU (plumbing tests)")
    g.add_argument("--device", default=None, help="auto | cpu | cuda (default: cpu with --tiny, else auto)")
    g.add_argument("--candidates", type=int, nargs="+", default=list(CANDIDATE_COUNTS))
    g.add_argument("--modes", nargs="+", default=["mis", "sis"], choices=["mis", "sis"])
    g.add_argument("--reps", type=int, default=None, help="timed requests per cell (default 40; 3 with --tiny)")
    g.add_argument("--warmup", type=int, default=None, help="untimed requests per cell (default 3; 1 with --tiny)")
    g.add_argument("--max-batch-tokens", type=int, default=8192)
    g.add_argument("--ready-timeout-s", type=float, default=180.0)
    g.add_argument("--out", required=True)
    s = sub.add_parser("summary", help="the tables of one gpu_check.sh run")
    s.add_argument("dir", type=Path, nargs="?", default=Path("."))
    args = p.parse_args(argv)
    if args.what == "summary":
        write_report(summary(args.dir), None)
        return None
    args.device = args.device or ("cpu" if args.tiny else "auto")
    args.reps = args.reps or (3 if args.tiny else 40)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    return grpc(args)


if __name__ == "__main__":
    main()
