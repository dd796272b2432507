"""The scheduler's decisions on its own: no threads, no event loop, no gRPC. A fake outbox records what it delivers;
the fake engine (tests/server/fake_engine.py) chunks a long Score request into "chunks" of a few "layers", asking
the scheduler's decision at each layer boundary as the real decoder does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pyscore.errors import PassInterrupted, ResourceExhausted
from pyscore.scoring import PreparedScore
from pyscore.types import Boundary, GenerateRequest, ScoreRequest, ScoreResult
from server.scheduler import DeadlineExceeded, GenerationDelta, Job, Scheduler, Stats
from tests.server.fake_engine import FakeEngine

BUDGET = 16
LONG = " ".join(f"w{i}" for i in range(40))  # 41 tokens with BOS: over BUDGET


@dataclass
class Outbox:
    halted: bool = False
    inbox: list[Job] = field(default_factory=list)
    delivered: list[tuple[Job, Any]] = field(default_factory=list)
    waiting: int = 0

    def deliver(self, job: Job, value: Any) -> None:
        self.delivered.append((job, value))

    def release(self, n: int) -> None:
        self.waiting -= n

    def arrived(self) -> bool:
        return bool(self.inbox)

    def take_arrived(self) -> list[Job]:
        arrived, self.inbox = self.inbox, []
        return arrived

    def admit(self, job: Job) -> Job:
        self.waiting += 1
        self.inbox.append(job)
        return job

    def answers(self, job: Job) -> list[Any]:
        return [value for j, value in self.delivered if j is job]


@dataclass(eq=False)
class Plan:
    chunks: int
    done: int = 0
    open: bool = True
    ok: bool | None = None

    @property
    def finished(self) -> bool:
        return self.done >= self.chunks

    def close(self, ok: bool) -> None:
        if self.open:
            self.open, self.ok = False, ok


class ChunkingEngine(FakeEngine):
    """Chunks a Score request over the budget into 3 chunks of 2 layers; logs every pass."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[str] = []
        self.on_layer: Any = None  # called at each layer of a chunk, before the decision (a test's hook)

    def plan_chunks(self, prepared: PreparedScore) -> Plan | None:  # type: ignore[override]
        return Plan(3) if prepared.computed_tokens > BUDGET else None

    def run_prepared(self, prepared: list[PreparedScore]) -> list[ScoreResult | Exception]:
        self.log.append("batch:" + ",".join(self._tag(p) for p in prepared))
        return super().run_prepared(prepared)

    def advance_chunked(self, prepared: PreparedScore, plan: Plan) -> ScoreResult | Exception | None:  # type: ignore[override]
        if plan.finished:
            self.log.append("finish")
            plan.close(ok=True)
            return self._score_one(prepared)
        self.log.append(f"chunk{plan.done}")
        for _ in range(2):
            if self.on_layer is not None:
                self.on_layer()
            decision = self.decide()
            if decision is Boundary.STOP:
                raise PassInterrupted("stopped")
            if decision is Boundary.YIELD:
                self.between()
        plan.done += 1
        return None


def scheduler(engine: FakeEngine, outbox: Outbox, **kw: Any) -> Scheduler:
    s = Scheduler(engine, outbox, Stats(), max_batch_tokens=BUDGET, **kw)
    s.attach()
    return s


def score_job(query: str, **kw: Any) -> Job:
    return Job("score", ScoreRequest(query=query, items=[" yes"], labels=["yes"]), **kw)


def run_until_idle(s: Scheduler, outbox: Outbox, limit: int = 50) -> None:
    for _ in range(limit):
        if not (s.has_work() or outbox.inbox):
            return
        s.iterate(outbox.take_arrived())
    raise AssertionError("the scheduler did not go idle")


def test_a_score_that_arrives_during_a_chunk_runs_at_its_next_layer_boundary() -> None:
    engine, outbox = ChunkingEngine(), Outbox()
    s = scheduler(engine, outbox)
    long, short = outbox.admit(score_job(LONG)), score_job("short one")

    def arrive_once() -> None:
        if short not in [j for j, _ in outbox.delivered] and not outbox.inbox and engine.log == ["chunk0"]:
            outbox.admit(short)

    engine.on_layer = arrive_once
    run_until_idle(s, outbox)
    assert engine.log == ["chunk0", "batch:short one", "chunk1", "chunk2", "finish"]
    (answer,) = outbox.answers(short)
    assert isinstance(answer, ScoreResult) and isinstance(outbox.answers(long)[0], ScoreResult)
    assert s.stats.chunks == 3 and s.stats.batches == 1 and outbox.waiting == 0


def test_the_decision_is_a_question() -> None:
    engine, outbox = ChunkingEngine(), Outbox()
    s = scheduler(engine, outbox)
    assert s.decide() is Boundary.CONTINUE  # no pass, nothing waiting
    outbox.admit(score_job("waiting"))
    assert s.decide() is Boundary.CONTINUE  # outside a chunk's pass, arrivals wait for the next iteration
    asked: list[Boundary] = []
    engine.on_layer = lambda: asked.extend([s.decide(), s.decide()])
    outbox.admit(score_job(LONG))
    s.iterate(outbox.take_arrived())  # the short one's batch, then the long one's first chunk
    assert asked and set(asked) == {Boundary.CONTINUE}  # asking twice changes nothing; nothing else waited
    assert engine.log == ["batch:waiting", "chunk0"]
    outbox.halted = True
    assert s.decide() is Boundary.STOP


def test_no_yield_inside_the_batch_a_chunk_yielded_to() -> None:
    engine, outbox = ChunkingEngine(), Outbox()
    s = scheduler(engine, outbox)
    outbox.admit(score_job(LONG))
    inner: list[Boundary] = []
    run_prepared = engine.run_prepared

    def batch(prepared: list[PreparedScore]) -> list[Any]:
        outbox.admit(score_job("later"))  # arrives while the nested batch runs
        inner.append(s.decide())
        return run_prepared(prepared)

    engine.run_prepared = batch  # type: ignore[method-assign]
    engine.on_layer = lambda: outbox.admit(score_job("short")) if engine.log == ["chunk0"] and not inner else None
    s.iterate(outbox.take_arrived())
    assert inner[0] is Boundary.CONTINUE  # the nested batch never yields: "later" waits for the next boundary
    assert engine.log[:2] == ["chunk0", "batch:short"]


def test_a_chunk_whose_caller_left_stops_and_its_plan_is_closed_unpublished() -> None:
    engine, outbox = ChunkingEngine(), Outbox()
    s = scheduler(engine, outbox)
    long = outbox.admit(score_job(LONG))
    engine.on_layer = lambda: setattr(long, "cancelled", True)
    s.iterate(outbox.take_arrived())
    assert s.chunked is None and s.stats.interrupted == 1 and s.stats.dropped == 1
    assert outbox.answers(long) == []  # cancelled: nobody to answer
    s.iterate([])
    assert engine.log == ["chunk0"]


def test_a_job_past_its_deadline_is_dropped_and_gives_its_queue_place_back() -> None:
    engine, outbox = ChunkingEngine(), Outbox()
    s = scheduler(engine, outbox)
    late = outbox.admit(score_job("late", deadline=0.0))
    s.iterate(outbox.take_arrived())
    (answer,) = outbox.answers(late)
    assert isinstance(answer, DeadlineExceeded) and outbox.waiting == 0 and engine.log == []


def test_generations_are_admitted_first_come_first_served_against_the_kv_store() -> None:
    engine, outbox = ChunkingEngine(kv_tokens=20), Outbox()
    s = scheduler(engine, outbox)
    # 1 (BOS) + 2 words + 6 new = 9 tokens each: two fit the 20-token store, the third waits its turn
    jobs = [outbox.admit(Job("generate", GenerateRequest(prompt=f"prompt {i}", max_tokens=6))) for i in range(3)]
    s.iterate(outbox.take_arrived())
    assert [j.work for j in s.active] == [jobs[0].work, jobs[1].work] and list(s.starting) == [jobs[2]]
    assert engine.kv_tokens_reserved() == 18 and outbox.waiting == 1
    run_until_idle(s, outbox)
    assert all(isinstance(outbox.answers(j)[-1], GenerationDelta) and outbox.answers(j)[-1].final for j in jobs)
    assert engine.kv_tokens_reserved() == 0 and outbox.waiting == 0


def test_a_generation_that_can_never_fit_is_refused_at_once_naming_the_budget() -> None:
    engine, outbox = ChunkingEngine(kv_tokens=20), Outbox()
    s = scheduler(engine, outbox)
    job = outbox.admit(Job("generate", GenerateRequest(prompt="a long prompt of words", max_tokens=16)))
    s.iterate(outbox.take_arrived())
    (answer,) = outbox.answers(job)
    assert isinstance(answer, ResourceExhausted) and answer.field == "max_tokens" and "--kv-cache-mb" in str(answer)
    assert engine.steps == [] and outbox.waiting == 0


def test_an_abandoned_generation_gives_its_kv_reservation_back() -> None:
    engine, outbox = ChunkingEngine(kv_tokens=20), Outbox()
    s = scheduler(engine, outbox)
    job = outbox.admit(Job("generate", GenerateRequest(prompt="hello there", max_tokens=6)))
    s.iterate(outbox.take_arrived())
    assert engine.kv_tokens_reserved() == 9
    job.cancelled = True
    s.iterate([])
    assert s.active == [] and engine.kv_tokens_reserved() == 0


@pytest.mark.parametrize("halted", [False, True])
def test_fail_all_answers_every_held_job(halted: bool) -> None:
    engine, outbox = ChunkingEngine(), Outbox(halted=halted)
    s = scheduler(engine, outbox)
    arrived = [outbox.admit(score_job("a")), outbox.admit(Job("generate", GenerateRequest(prompt="p", max_tokens=2)))]
    s.fail_all(outbox.take_arrived(), RuntimeError("bug"))
    assert [type(outbox.answers(j)[0]) for j in arrived] == [RuntimeError, RuntimeError] and outbox.waiting == 0
