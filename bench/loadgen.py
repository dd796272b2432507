"""The one load generator of bench/: a closed loop (C requests in flight, each worker sends its next request when
the previous one is answered; optionally for a fixed time, which measures capacity) and an open loop (arrivals
from a pre-generated seeded schedule, e.g. Poisson, served by a pool of async workers large enough that the
client never holds an arrival back). Serving sweeps, the peers comparison, overload, soak and the fleet runs
(bench/deploy.py) all drive their targets (bench/targets.py: our gRPC and HTTP servers, vLLM, SGLang, the
engine in process, or recorded requests replayed against our server) through these two loops.

Time to decision = completion of a request's last call - its scheduled arrival (open loop) or its dispatch
(closed loop). Per request we record scheduled, dispatched and completed times and the status (OK, or the gRPC
code / exception that failed it); dispatched - scheduled is the client's own dispatch lag, reported as
`dispatch_lag_ms` and warned about when it is not negligible. `queueing_delay_ms` is the server-side queue wait,
where the target reports it (our server: Usage.queue_duration); it is part of `service_latency_ms` (completed -
dispatched), as is `server_compute_ms` (Usage.compute_duration).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.dataset import BUCKETS
from bench.summary import Summary
from bench.targets import Target

# Dispatch lag (p99) above which an open-loop run warns that the client, not the server, shaped the latencies:
# more than 5 ms and more than 2 % of the run's median time to decision.
LAG_WARN_MS, LAG_WARN_FRACTION = 5.0, 0.02
LATENCY_STATS = ("p50", "p90", "p95", "p99", "mean")  # each latency's fields in summary.json


@dataclass
class Record:
    """One request's life; times are seconds since the run's start (the schedule's time 0)."""

    qid: str
    num_candidates: int
    bucket: int
    scheduled: float | None  # open loop only
    dispatched: float
    completed: float
    ok: bool
    error: str | None = None
    choice: int | None = None
    correct: bool | None = None  # the right option (a question), or the answer it got alone (a replayed request)
    calls: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    server_queue_ms: float | None = None  # as the target reports it (None: it does not)
    server_compute_ms: float | None = None
    kind: str = ""  # the path, or a replayed request's kind
    status: str = "OK"  # or the gRPC status code's name / the exception's type
    diff: float | None = None  # a replayed request: largest |answer - answer alone|

    @property
    def e2e_ms(self) -> float:
        start = self.dispatched if self.scheduled is None else self.scheduled
        return (self.completed - start) * 1e3

    @property
    def service_ms(self) -> float:
        return (self.completed - self.dispatched) * 1e3

    @property
    def lag_ms(self) -> float:
        """The client's dispatch lag: dispatched - scheduled (0 in a closed loop)."""
        return 0.0 if self.scheduled is None else (self.dispatched - self.scheduled) * 1e3

    @property
    def sent(self) -> float:
        """When the request was due: its arrival (open loop) or dispatch (closed loop)."""
        return self.dispatched if self.scheduled is None else self.scheduled

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"e2e_ms": self.e2e_ms, "service_ms": self.service_ms, "lag_ms": self.lag_ms}


@dataclass
class RunResult:
    records: list[Record]
    wall_s: float  # first dispatch (closed) or schedule start (open) to the last completion, drain included
    num_workers: int


# --- arithmetic ------------------------------------------------------------------------------------------
def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """{p50, p90, p95, p99, mean} in the values' unit (bench.summary's percentile); None (JSON null) for no
    values."""
    return Summary.of(values).pick(*LATENCY_STATS, empty=None)


def latency_ms(records: Sequence[Record]) -> dict[str, float]:
    """p50, p95, p99 and max time to decision (ms, 1 decimal; NaN for none) of the answered records."""
    return Summary.of([r.e2e_ms for r in records if r.ok]).pick("p50", "p95", "p99", "max", digits=1)


def statuses(records: Sequence[Record]) -> dict[str, int]:
    """How many records ended with each status (OK, RESOURCE_EXHAUSTED, ...)."""
    return dict(sorted(Counter(r.status for r in records).items()))


def poisson_schedule(qps: float, num_arrivals: int | None = None, seed: int = 0,
                     duration_s: float | None = None) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process at `qps`: cumulative exponential gaps, seeded, so
    every repetition and every path of a sweep replays the same arrivals. It stops after `num_arrivals`
    arrivals or before `duration_s`, whichever comes first."""
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if num_arrivals is None and duration_s is None:
        raise ValueError("give num_arrivals or duration_s")
    rng = random.Random(seed)
    t, times = 0.0, []
    while num_arrivals is None or len(times) < num_arrivals:
        t += rng.expovariate(qps)
        if duration_s is not None and t >= duration_s:
            break
        times.append(t)
    return times


def summarize_records(records: Sequence[Record], wall_s: float) -> dict[str, Any]:
    """The measured part of summary.json."""
    good = [r for r in records if r.ok]
    e2e = Summary.of([r.e2e_ms for r in good], errors=len(records) - len(good), wall_s=wall_s)
    decided = [r for r in good if r.correct is not None]
    bucket_stats = {str(b): latency_stats([r.e2e_ms for r in good if r.bucket == b]) for b in BUCKETS}
    count_by_bucket = {str(b): sum(r.bucket == b for r in good) for b in BUCKETS}
    return {
        "num_questions": len(records),
        "num_errors": e2e.errors,
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
        "achieved_qps": e2e.throughput,
        "end_to_end_latency_ms": e2e.pick(*LATENCY_STATS, empty=None),
        "service_latency_ms": latency_stats([r.service_ms for r in good]),
        "queueing_delay_ms": latency_stats([r.server_queue_ms for r in good if r.server_queue_ms is not None]),
        "server_compute_ms": latency_stats([r.server_compute_ms for r in good if r.server_compute_ms is not None]),
        "dispatch_lag_ms": latency_stats([r.lag_ms for r in records]),
        "p95_by_candidates": {b: st["p95"] for b, st in bucket_stats.items()},
        "p50_by_candidates": {b: st["p50"] for b, st in bucket_stats.items()},
        "questions_by_candidates": count_by_bucket,
        "accuracy": sum(bool(r.correct) for r in decided) / len(decided) if decided else None,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in good) / len(good) if good else None,
        "mean_computed_tokens": sum(r.computed_tokens for r in good) / len(good) if good else None,
    }


# --- clients ---------------------------------------------------------------------------------------------
async def _decide(target: Target, path: str, q: Any, scheduled: float | None, t0: float) -> Record:
    dispatched = time.perf_counter() - t0
    kind = getattr(q, "kind", path)
    try:
        d = await target.decide(path, q)
    except Exception as e:  # a failed request is data, not a crash: it counts in num_errors
        return Record(q.id, q.num_candidates, q.bucket, scheduled, dispatched, time.perf_counter() - t0, ok=False,
                      error=f"{type(e).__name__}: {_short(e)}", kind=kind, status=_status(e))
    completed = time.perf_counter() - t0
    answer = getattr(q, "answer", None)
    correct = d.correct if d.correct is not None else None if d.choice is None else d.choice == answer
    return Record(q.id, q.num_candidates, q.bucket, scheduled, dispatched, completed, ok=True, choice=d.choice,
                  correct=correct, calls=d.calls, prompt_tokens=d.prompt_tokens, computed_tokens=d.computed_tokens,
                  server_queue_ms=d.server_queue_ms, server_compute_ms=d.server_compute_ms, kind=kind, diff=d.diff)


def _status(e: Exception) -> str:
    code = getattr(e, "code", None)
    return code().name if callable(code) else type(e).__name__


def _short(e: Exception) -> str:
    details = getattr(e, "details", None)
    text = details() if callable(details) else str(e)
    code = getattr(e, "code", None)
    if callable(code):
        text = f"{code().name}: {text}"
    return (text or "").splitlines()[0][:200] if text else ""


async def closed_loop(target: Target, path: str, questions: Sequence[Any], concurrency: int, warmup: int = 0,
                      progress: Any = None, seconds: float | None = None) -> RunResult:
    """`concurrency` workers each send their next request as soon as the previous one is answered: each request
    once, or, with `seconds`, the requests over and over until that time is up. The first `warmup` requests run
    the same way and are not recorded."""
    if warmup:
        await closed_loop(target, path, [questions[i % len(questions)] for i in range(warmup)], concurrency)
    pending = iter(range(len(questions))) if seconds is None else itertools.count()
    records: list[Record] = []
    t0 = time.perf_counter()
    deadline = None if seconds is None else t0 + seconds

    async def worker() -> None:
        for i in pending:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            records.append(await _decide(target, path, questions[i % len(questions)], None, t0))
            if progress is not None:
                progress.update(1)

    workers = concurrency if seconds is not None else min(concurrency, len(questions))
    await asyncio.gather(*(worker() for _ in range(workers)))
    wall = max((r.completed for r in records), default=0.0) - min((r.dispatched for r in records), default=0.0)
    return RunResult(records, wall, num_workers=concurrency)


async def capacity(target: Target, path: str, questions: Sequence[Any], concurrency: int, seconds: float) -> float:
    """Answered requests per second with `concurrency` closed-loop callers for `seconds` (the server's
    throughput at saturation, with batching)."""
    run = await closed_loop(target, path, questions, concurrency, seconds=seconds)
    return sum(r.ok for r in run.records) / run.wall_s if run.wall_s > 0 else 0.0


async def open_loop(target: Target, path: str, questions: Sequence[Any], schedule: Sequence[float],
                    num_workers: int | None = None, progress: Any = None, lead_s: float = 0.05) -> RunResult:
    """Arrival i (request i) is due at schedule[i] seconds; each worker takes the next arrival, sleeps until
    it is due, sends it and awaits its answer. Workers default to one per arrival (capped at 1024): an
    asyncio task costs little, so an arrival never waits for a free worker."""
    if len(questions) != len(schedule):
        raise ValueError(f"{len(questions)} questions for {len(schedule)} arrivals")
    workers = num_workers or max(1, min(len(schedule), 1024))
    pending = iter(range(len(schedule)))
    records: list[Record] = []
    t0 = time.perf_counter() + lead_s

    async def worker() -> None:
        for i in pending:
            delay = t0 + schedule[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            records.append(await _decide(target, path, questions[i], schedule[i], t0))
            if progress is not None:
                progress.update(1)

    await asyncio.gather(*(worker() for _ in range(workers)))
    wall = max((r.completed for r in records), default=0.0)
    return RunResult(records, wall, num_workers=workers)


def lag_warning(summary: dict[str, Any]) -> str | None:
    """A loud line when the client's dispatch lag (p99) was not negligible, else None."""
    p99 = summary["dispatch_lag_ms"]["p99"]
    p50 = summary.get("end_to_end_latency_ms", {}).get("p50") or 0.0
    if p99 is not None and p99 > max(LAG_WARN_MS, LAG_WARN_FRACTION * p50):
        return (f"WARNING: client dispatch lag p99 {p99:.1f} ms (time to decision p50 {p50:.0f} ms): the load "
                f"generator, not only the server, delayed arrivals (CPU shared with the server? too few workers?)")
    return None
