"""In-process engine benchmark: time to decision for one question at concurrency 1 on the embedded model,
Generate-free paths only (SIS vs MIS), across candidate counts. Prints a table and writes
bench/results/engine_cpu.json. Usage: python -m bench.engine [--dtype bfloat16] [--threads 2] [--reps 5]"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.common import machine, question
from pyscore.engine import Engine
from pyscore.types import ScoreRequest


def time_score(engine: Engine, query: str, items: list[str], mode: str, reps: int) -> list[float]:
    engine.score(query, items, labels=["Yes", "No"], mode=mode)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        engine.score(query, items, labels=["Yes", "No"], mode=mode)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--candidates", type=int, nargs="+", default=[2, 5, 9, 16])
    ap.add_argument("--out", default="bench/results/engine_cpu.json")
    args = ap.parse_args()
    engine = Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads)
    rows = []
    print(f"# {machine()} | {engine.model_name} {args.dtype} threads={args.threads} reps={args.reps}")
    print(f"{'items':>5} {'tokens q/item':>14} {'SIS p50 ms':>11} {'MIS p50 ms':>11} {'MIS/SIS':>8}")
    for n in args.candidates:
        query, items = question(n, seed=n)
        prepared = engine.prepare_score(ScoreRequest(query, items, labels=["Yes", "No"]))
        item_len = sum(map(len, prepared.items)) / n
        sis = time_score(engine, query, items, "sis", args.reps)
        mis = time_score(engine, query, items, "mis", args.reps)
        row = dict(items=n, query_tokens=len(prepared.query), item_tokens=item_len,
                   sis_ms=statistics.median(sis), mis_ms=statistics.median(mis), sis_all=sis, mis_all=mis)
        rows.append(row)
        print(f"{n:>5} {len(prepared.query):>6}/{item_len:<7.1f} {row['sis_ms']:>11.1f} {row['mis_ms']:>11.1f} "
              f"{row['mis_ms'] / row['sis_ms']:>8.3f}")
    by_n = {r["items"]: r for r in rows}
    if 2 in by_n and 16 in by_n:
        print(f"MIS(16)/MIS(2) = {by_n[16]['mis_ms'] / by_n[2]['mis_ms']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(machine=machine(), dtype=args.dtype, threads=args.threads,
                                              model=engine.model_name, rows=rows), indent=2))


if __name__ == "__main__":
    main()
