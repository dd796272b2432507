"""Overload: open-loop Poisson load at `--factor` (default 3) times the measured MIS capacity for `--duration`
seconds against `python -m server` on the embedded model. Reports whether the queue stayed bounded
(`--max-queue`, sampled from the metrics endpoint), how fast the excess got RESOURCE_EXHAUSTED, the accepted
requests' latency, the server's RSS before/after, and whether every accepted answer equals the same request
scored alone beforehand. The load is offered twice (`--rounds`) to the same server: RSS that grows in the first
round and not in the second is a high-water mark, not a leak. Writes a JSON and a text summary. Not a CI test.

    python -m bench.overload [--duration 60] [--factor 3] [--max-queue 16] [--out bench/results/hardening]

The helpers here (latency summaries, references) are shared with bench/soak.py; the server process is bench.common's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.common import REPO, ServerProcess, question, spawn_server
from bench.summary import Summary, write_json, write_report
from pyscore.client import AsyncScorerClient, ScorerClient
from pyscore.types import ScoreResult

TOLERANCE = 1e-3  # |batched - alone| on a probability above which an answer counts as wrong (bf16 serving)


def machine_load() -> dict[str, Any]:
    """What else the machine was doing: load averages and the CPUs."""
    return dict(loadavg=os.getloadavg(), cpus=os.cpu_count())


# -- requests and their reference answers ---------------------------------------------------------------------
@dataclass
class ScoreCase:
    name: str
    query: str
    items: list[str]
    options: dict[str, Any]
    alone: ScoreResult | None = None


def max_diff(a: ScoreResult, b: ScoreResult) -> float:
    """Largest |a - b| over all values; inf when the shapes, labels or modes differ."""
    if (a.label_token_ids, a.mode, [len(r) for r in a.scores]) != (b.label_token_ids, b.mode,
                                                                    [len(r) for r in b.scores]):
        return float("inf")
    return max((abs(x - y) for ra, rb in zip(a.scores, b.scores, strict=True) for xa, xb in zip(ra, rb, strict=True)
                for x, y in zip(xa, xb, strict=True)), default=0.0)


def score_alone(target: str, cases: list[ScoreCase]) -> list[float]:
    """Scores each case by itself (sequentially, nothing else running) and keeps the answer; returns the
    latencies in seconds."""
    times = []
    with ScorerClient(target, timeout=120) as client:
        for case in cases:
            t0 = time.perf_counter()
            case.alone = client.score(case.query, case.items, **case.options)
            times.append(time.perf_counter() - t0)
    return times


def mis_cases(n: int, items: int) -> list[ScoreCase]:
    out = []
    for seed in range(n):
        query, candidates = question(items, seed=1000 + seed)
        out.append(ScoreCase(f"mis-{seed}", query, candidates, dict(labels=[" Yes", " No"], mode="mis")))
    return out


def ms(values: list[float]) -> dict[str, float]:
    """p50, p95, p99 and max in ms (1 decimal; NaN for none) of latencies in seconds (bench.summary's
    percentile)."""
    return Summary.of(values, scale=1e3).pick("p50", "p95", "p99", "max", digits=1)


async def closed_loop_capacity(target: str, cases: list[ScoreCase], concurrency: int, seconds: float) -> float:
    """Completed Score requests per second with `concurrency` callers that each send the next request as soon
    as the previous one is answered (the server's throughput at saturation, with batching)."""
    done = 0
    stop = time.perf_counter() + seconds

    async def caller(k: int, client: AsyncScorerClient) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop:
            case = cases[i % len(cases)]
            await client.score(case.query, case.items, **case.options)
            done += 1
            i += concurrency

    start = time.perf_counter()
    async with AsyncScorerClient(target, timeout=120) as client:
        await asyncio.gather(*(caller(k, client) for k in range(concurrency)))
    return done / (time.perf_counter() - start)


# -- the overload run -----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    sent: float  # seconds since the start of the run
    latency: float
    status: str
    diff: float = 0.0


@dataclass
class Samples:
    queue: list[tuple[float, float]] = field(default_factory=list)  # (t, depth)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB)


async def sample(server: ServerProcess, samples: Samples, start: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter() - start
        samples.queue.append((round(t, 2), await asyncio.to_thread(server.queue_depth)))
        samples.rss.append((round(t, 2), server.rss_mb()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


async def poisson_arrivals(rate: float, seconds: float, rng: random.Random, start: float,
                           send: Callable[[float], Awaitable[None]]) -> None:
    """Calls `send(seconds since start)` at Poisson arrival times (`rate` per second) until `seconds` after
    `start` (a perf_counter time), without waiting for one before the next; returns when all have finished."""
    tasks = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.ensure_future(send(time.perf_counter() - start)))
    await asyncio.gather(*tasks)


async def open_loop(server: ServerProcess, cases: list[ScoreCase], rate: float, seconds: float,
                    seed: int = 0) -> tuple[list[Outcome], Samples]:
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    samples = Samples()
    stop = asyncio.Event()
    start = time.perf_counter()

    async def one(client: AsyncScorerClient, case: ScoreCase, sent: float) -> None:
        try:
            got = await client.score(case.query, case.items, **case.options)
            assert case.alone is not None
            outcomes.append(Outcome(sent, time.perf_counter() - start - sent, "OK", max_diff(got, case.alone)))
        except grpc.RpcError as e:
            outcomes.append(Outcome(sent, time.perf_counter() - start - sent, e.code().name))

    sampler = asyncio.ensure_future(sample(server, samples, start, stop))
    async with AsyncScorerClient(server.target, timeout=120) as client:
        await poisson_arrivals(rate, seconds, rng, start, lambda sent: one(client, rng.choice(cases), sent))
    stop.set()
    await sampler
    return outcomes, samples


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    by_status: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_status.setdefault(o.status, []).append(o)
    ok = by_status.get("OK", [])
    refused = by_status.get("RESOURCE_EXHAUSTED", [])
    return dict(
        sent=len(outcomes), statuses={k: len(v) for k, v in sorted(by_status.items())},
        accepted_latency_ms=ms([o.latency for o in ok]), refused_latency_ms=ms([o.latency for o in refused]),
        wrong=sum(o.diff > TOLERANCE for o in ok), max_abs_diff=max((o.diff for o in ok), default=0.0),
        exact=sum(o.diff == 0.0 for o in ok))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of open-loop load (default 60)")
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / measured capacity (default 3)")
    ap.add_argument("--items", type=int, default=5, help="candidates per MIS request (default 5)")
    ap.add_argument("--pool", type=int, default=16, help="distinct requests (default 16)")
    ap.add_argument("--max-queue", type=int, default=16, help="the server's --max-queue (default 16)")
    ap.add_argument("--capacity-s", type=float, default=20.0, help="seconds of the capacity measurement")
    ap.add_argument("--rounds", type=int, default=2, help="load rounds on the same server (default 2)")
    ap.add_argument("--server-args", default="", help='more `python -m server` flags, e.g. "--threads 1"')
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/hardening")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    load_before = machine_load()
    server = spawn_server("--max-queue", str(args.max_queue), *shlex.split(args.server_args),
                          log=args.out / "overload_server.log", metrics=True)
    try:
        cases = mis_cases(args.pool, args.items)
        alone_s = score_alone(server.target, cases)
        capacity = asyncio.run(closed_loop_capacity(server.target, cases, 4, args.capacity_s))
        rss_before = server.rss_mb()
        rate = args.factor * capacity
        print(f"capacity {capacity:.2f} MIS req/s ({args.items} items); offering {rate:.2f} req/s for "
              f"{args.duration:.0f} s, {args.rounds} rounds", flush=True)
        rounds = []
        for k in range(args.rounds):  # a repeat shows whether RSS keeps growing or was a high-water mark
            cpu0, t0 = server.cpu_s(), time.perf_counter()
            outcomes, samples = asyncio.run(open_loop(server, cases, rate, args.duration, seed=k))
            cores = (server.cpu_s() - cpu0) / (time.perf_counter() - t0)  # < cpus: something else took CPU
            time.sleep(5)
            rounds.append(dict(round=k + 1, **summarize(outcomes), server_cores_used=round(cores, 2),
                               loadavg_after=os.getloadavg(),
                               max_queue_depth_seen=max((d for _, d in samples.queue), default=float("nan")),
                               rss_mb=dict(peak=round(max(r for _, r in samples.rss), 1),
                                           after_5s=round(server.rss_mb(), 1)),
                               queue_samples=samples.queue, rss_samples=samples.rss[::4]))
        exit_code = server.stop()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    usage = cases[0].alone.usage if cases[0].alone else None
    result = dict(
        run="overload", when=time.strftime("%Y-%m-%d %H:%M:%S"),
        machine=dict(before=load_before, after=machine_load()), config=dict(vars(args), out=str(args.out)),
        usage_of_one_request=asdict(usage) if usage else None, alone_latency_ms=ms(alone_s),
        capacity_rps=round(capacity, 3), offered_rps=round(rate, 3), rss_mb_before=round(rss_before, 1),
        server_exit_code=exit_code, rounds=rounds)
    write_json(args.out / "overload.json", result)
    write_report(report(result), args.out / "overload.txt")


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"# overload {r['when']}: load average before {r['machine']['before']['loadavg']}, after "
        f"{r['machine']['after']['loadavg']}, {r['machine']['before']['cpus']} CPUs",
        f"MIS request: {c['items']} items, {r['usage_of_one_request']} tokens; alone {r['alone_latency_ms']} ms",
        f"capacity (closed loop, 4 callers) {r['capacity_rps']} req/s; offered {r['offered_rps']} req/s "
        f"({c['factor']}x) open-loop Poisson for {c['duration']:.0f} s per round; --max-queue {c['max_queue']}",
        f"server RSS MiB before the load: {r['rss_mb_before']}; exit code on SIGTERM {r['server_exit_code']}",
    ]
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
