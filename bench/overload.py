"""Overload: open-loop Poisson load at `--factor` (default 3) times the measured MIS capacity for `--duration`
seconds against `python -m server` on the embedded model. Reports whether the queue stayed bounded
(`--max-queue`, sampled from the metrics endpoint), how fast the excess got RESOURCE_EXHAUSTED, the accepted
requests' latency, the server's RSS before/after, and whether every accepted answer equals the same request
scored alone beforehand. The load is offered twice (`--rounds`) to the same server: RSS that grows in the first
round and not in the second is a high-water mark, not a leak. Writes a JSON and a text summary. Not a CI test.
The load is bench.loadgen's (ReplayTarget); the server process is bench.common's.

    python -m bench.overload [--duration 60] [--factor 3] [--max-queue 16] [--out bench/results/hardening]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench import loadgen
from bench.common import add_server_run_args, run_header, run_record, sampled, spawned_server
from bench.loadgen import Record
from bench.summary import Summary, write_json, write_report
from bench.targets import TOLERANCE, Case, ReplayTarget, mis_cases


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """Statuses, the accepted and refused latencies, and the accepted answers against their answers alone."""
    ok = [r for r in records if r.ok]
    diffs = [r.diff for r in ok if r.diff is not None]
    return dict(sent=len(records), statuses=loadgen.statuses(records), accepted_latency_ms=loadgen.latency_ms(ok),
                refused_latency_ms=Summary.of([(r.completed - r.sent) * 1e3 for r in records
                                               if r.status == "RESOURCE_EXHAUSTED"]).pick(
                    "p50", "p95", "p99", "max", digits=1),
                wrong=sum(d > TOLERANCE for d in diffs), max_abs_diff=max(diffs, default=0.0),
                exact=sum(d == 0.0 for d in diffs))


async def run(target: str, cases: list[Case], args: argparse.Namespace, server: Any) -> dict[str, Any]:
    async with ReplayTarget(target, timeout=120) as replay:
        alone_s = await replay.record_alone(cases)
        capacity = await loadgen.capacity(replay, "case", cases, 4, args.capacity_s)
        rss_before, rate = server.rss_mb(), args.factor * capacity
        print(f"capacity {capacity:.2f} MIS req/s ({args.items} items); offering {rate:.2f} req/s for "
              f"{args.duration:.0f} s, {args.rounds} rounds", flush=True)
        rounds = []
        for k in range(args.rounds):  # a repeat shows whether RSS keeps growing or was a high-water mark
            schedule = loadgen.poisson_schedule(rate, seed=k, duration_s=args.duration)
            rng = random.Random(k)
            load = loadgen.open_loop(replay, "case", [rng.choice(cases) for _ in schedule], schedule)
            cpu0, t0 = server.cpu_s(), time.perf_counter()
            run, samples = await sampled(server, 0.25, load)
            cores = (server.cpu_s() - cpu0) / (time.perf_counter() - t0)  # < cpus: something else took CPU
            await asyncio.sleep(5)
            rounds.append(dict(round=k + 1, **summarize(run.records), server_cores_used=round(cores, 2),
                               loadavg_after=os.getloadavg(),
                               max_queue_depth_seen=max((s["queue"] for s in samples), default=float("nan")),
                               rss_mb=dict(peak=max(s["rss_mb"] for s in samples), after_5s=round(server.rss_mb(), 1)),
                               queue_samples=[(s["t"], s["queue"]) for s in samples],
                               rss_samples=[(s["t"], s["rss_mb"]) for s in samples[::4]]))
    return dict(alone_latency_ms=Summary.of(alone_s, scale=1e3).pick("p50", "p95", "p99", "max", digits=1),
                capacity_rps=round(capacity, 3), offered_rps=round(rate, 3), rss_mb_before=round(rss_before, 1),
                rounds=rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_run_args(ap, capacity_s=20.0, duration=(60.0, "seconds of open-loop load"),
                        factor=(3.0, "offered load / measured capacity"), items=(5, "candidates per MIS request"),
                        pool=(16, "distinct requests"), max_queue=(16, "the server's --max-queue"),
                        rounds=(2, "load rounds on the same server"))
    args = ap.parse_args()
    args.name = args.name or "overload"

    load_before = os.getloadavg()
    cases = mis_cases(args.pool, args.items)
    flags = ["--max-queue", str(args.max_queue), *shlex.split(args.server_args)]
    with spawned_server(args.out / f"{args.name}_server.log", flags, metrics=True) as server:
        result = asyncio.run(run(server.target, cases, args, server))
        exit_code = server.stop()
    usage = cases[0].alone.usage if cases[0].alone else None
    result = run_record(args.name, args, load_before, usage_of_one_request=asdict(usage) if usage else None,
                        server_exit_code=exit_code, **result)
    write_json(args.out / f"{args.name}.json", result)
    write_report(report(result), args.out / f"{args.name}.txt")


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [*run_header(r, f"{c['rounds']} rounds of {c['duration']:g} s", f"({c['factor']}x) open-loop Poisson "
                         f"for {c['duration']:.0f} s per round; --max-queue {c['max_queue']}"),
             f"MIS request: {c['items']} items, {r['usage_of_one_request']} tokens; alone {r['alone_latency_ms']} ms",
             f"server RSS MiB before the load: {r['rss_mb_before']}; exit code on SIGTERM {r['server_exit_code']}"]
    for k in r["rounds"]:
        lines += [
            f"round {k['round']}: sent {k['sent']}: {k['statuses']}; queue depth max seen "
            f"{k['max_queue_depth_seen']:.0f} (limit {c['max_queue']}); the server used {k['server_cores_used']} "
            f"cores on average (load average after {tuple(round(x, 2) for x in k['loadavg_after'])})",
            f"  RESOURCE_EXHAUSTED latency ms {k['refused_latency_ms']}",
            f"  accepted latency ms {k['accepted_latency_ms']}",
            f"  wrong answers {k['wrong']} (|diff| > {TOLERANCE}); bitwise equal to alone {k['exact']}; "
            f"max |diff| {k['max_abs_diff']:.2e}",
            f"  RSS MiB peak {k['rss_mb']['peak']}, 5 s after {k['rss_mb']['after_5s']}",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
