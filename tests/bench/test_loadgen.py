"""The one load generator: its schedules and summary arithmetic (the percentile itself: test_summary.py), and
its closed loop, open loop and overload run against a real gRPC server."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import numpy as np
import pytest

from bench import hardening, loadgen
from bench.dataset import Dataset
from bench.loadgen import Record
from bench.targets import Case, Decision, ReplayTarget, Target
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine


def test_poisson_schedule_is_seeded_and_at_rate():
    a, b, c = (loadgen.poisson_schedule(5.0, 20_000, seed=s) for s in (1, 1, 2))
    assert a == b and a != c
    assert all(x < y for x, y in itertools.pairwise(a))
    gaps = np.diff([0.0, *a])
    assert len(a) / a[-1] == pytest.approx(5.0, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.05)  # exponential: stdev = mean
    with pytest.raises(ValueError):
        loadgen.poisson_schedule(0, 3)
    until = loadgen.poisson_schedule(5.0, seed=1, duration_s=100.0)  # overload, soak: arrivals for a time
    assert until == a[: len(until)] and until[-1] < 100.0 <= a[len(until)]


def test_latency_stats_of_nothing_is_null():
    assert loadgen.latency_stats([])["p95"] is None


def test_achieved_qps_and_summary():
    recs = [
        Record("a", 2, 2, scheduled=0.0, dispatched=0.001, completed=0.101, ok=True, choice=0, correct=True,
               server_queue_ms=10.0, server_compute_ms=80.0),
        Record("b", 16, 16, scheduled=0.5, dispatched=0.502, completed=0.902, ok=True, choice=1, correct=False,
               server_queue_ms=30.0, server_compute_ms=350.0),
        Record("c", 5, 5, scheduled=1.0, dispatched=1.0, completed=1.5, ok=False, error="UNAVAILABLE: x"),
    ]
    s = loadgen.summarize_records(recs, wall_s=2.0)
    assert s["num_questions"] == 3 and s["num_errors"] == 1
    assert s["achieved_qps"] == 1.0  # successes / wall, not arrivals / wall
    assert s["end_to_end_latency_ms"]["p50"] == pytest.approx((101 + 402) / 2)
    assert s["service_latency_ms"]["mean"] == pytest.approx((100 + 400) / 2)
    assert s["dispatch_lag_ms"]["p99"] == pytest.approx(1 + 0.98 * (2 - 1))  # the client's: 0, 1, 2 ms (all records)
    assert s["queueing_delay_ms"]["p50"] == pytest.approx(20.0)  # the server's, as the target reported it
    assert s["server_compute_ms"]["mean"] == pytest.approx(215.0)
    no_timing = loadgen.summarize_records([Record("e", 2, 2, None, 0.0, 0.1, ok=True)], wall_s=1.0)
    assert no_timing["queueing_delay_ms"]["p50"] is None  # a target that does not report it: unknown, not 0
    assert s["p95_by_candidates"] == {"2": pytest.approx(101), "5": None, "9": None, "16": pytest.approx(402)}
    assert s["accuracy"] == 0.5 and s["errors"] == ["UNAVAILABLE: x"]
    closed = Record("d", 2, 2, scheduled=None, dispatched=1.0, completed=1.25, ok=True)
    assert (closed.e2e_ms, closed.lag_ms) == (250.0, 0.0)


class SleepTarget(Target):
    """Decides after 20 ms; counts how many decisions were in flight at once."""

    spec, paths = "sleep", ("mis",)

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.most = 0

    async def _mis(self, q):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        return Decision(choice=q.answer)


def test_closed_and_open_loop_timing():
    qs = Dataset.synthetic(12).questions
    t = SleepTarget()
    closed = asyncio.run(loadgen.closed_loop(t, "mis", qs, concurrency=3, warmup=2))
    assert t.most == 3 and len(closed.records) == 12 and all(r.correct for r in closed.records)
    assert 0.07 < closed.wall_s < 0.5  # 4 rounds of 20 ms
    t = SleepTarget()
    schedule = [0.01 * i for i in range(12)]  # arrivals faster than one decision: they must overlap
    run = asyncio.run(loadgen.open_loop(t, "mis", qs, schedule))
    assert t.most >= 2 and run.num_workers == 12
    s = loadgen.summarize_records(run.records, run.wall_s)
    assert s["dispatch_lag_ms"]["p50"] < 5
    assert all(r.scheduled is not None and r.dispatched >= r.scheduled - 1e-3 for r in run.records)
    assert loadgen.lag_warning({"dispatch_lag_ms": {"p99": 50.0}}).startswith("WARNING")
    assert loadgen.lag_warning({"dispatch_lag_ms": {"p99": 0.5}}) is None
    slow = {"p50": 4000.0}  # 50 ms of lag is noise against 4 s decisions
    assert loadgen.lag_warning({"dispatch_lag_ms": {"p99": 50.0}, "end_to_end_latency_ms": slow}) is None


CASES = [Case(f"mis-{i}", "mis", f"question {i}?", ["yes it is", "no"], dict(labels=[" Yes", " No"], mode="mis"))
         for i in range(3)] + [Case("gen", "generate", "hello there", [], dict(max_tokens=3, temperature=0.0))]


class CountingReplay(ReplayTarget):
    """Counts the calls that failed (the overload's refusals) as they happen."""

    failed = 0

    async def decide(self, path, q):
        try:
            return await super().decide(path, q)
        except Exception:
            self.failed += 1
            raise


def test_closed_open_and_overload_against_a_server():
    """ReplayTarget through each cheap mode against our server (the fake engine): a timed closed loop (capacity)
    and an open loop whose answers all equal their answers alone; then overload, against a server with a queue of
    2 whose engine one request holds: a burst of 12 fills the queue and the other 10 are refused with
    RESOURCE_EXHAUSTED, not queued."""
    fake = FakeEngine(delay_s=0.005)
    roomy, tight = ServerThread(fake), ServerThread(fake, max_queue=2)

    async def run() -> tuple[loadgen.RunResult, loadgen.RunResult, loadgen.RunResult]:
        target, small = ReplayTarget(roomy.target, channels=2, timeout=30), CountingReplay(tight.target, timeout=30)
        await target.open()
        await small.open()
        try:
            assert len(await target.record_alone(CASES)) == len(CASES)
            closed = await loadgen.closed_loop(target, "case", CASES, 2, seconds=0.2)
            schedule = loadgen.poisson_schedule(50.0, len(CASES) * 2, seed=0)
            opened = await loadgen.open_loop(target, "case", CASES * 2, schedule)
            fake.pause()
            holder = asyncio.ensure_future(small.answer(CASES[0]))
            await asyncio.to_thread(fake.wait_entered)
            burst = asyncio.ensure_future(loadgen.open_loop(small, "case", CASES[:3] * 4, [0.0] * 12))
            for _ in range(3000):  # until 10 are refused and 2 queued (30 s at most: then the asserts below fail)
                if small.failed >= 10 and tight.batcher.waiting() >= 2:
                    break
                await asyncio.sleep(0.01)
            fake.resume()
            await holder
            return closed, opened, await burst
        finally:
            await target.close()
            await small.close()

    try:
        closed, opened, burst = asyncio.run(run())
    finally:
        roomy.stop()
        tight.stop()
    assert len(closed.records) >= 2 and all(r.ok and r.correct for r in closed.records)
    assert {r.kind for r in opened.records} == {"mis", "generate"}
    assert loadgen.statuses(opened.records) == {"OK": 8} and all(r.correct for r in opened.records)
    s = hardening.summarize(burst.records)
    assert s["sent"] == 12 and s["statuses"] == {"OK": 2, "RESOURCE_EXHAUSTED": 10}
    assert s["wrong"] == 0 and s["exact"] == 2  # the accepted answers bitwise equal to alone
