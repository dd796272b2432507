"""The engine thread's policy: what runs next. No threads and no gRPC here: the batcher (server/batcher.py) calls
`iterate` on its worker thread with the jobs that arrived and hands back what `Outbox.deliver` is given.

Each iteration: (1) accepts the jobs that arrived (prepare_score / start_generation validate and tokenize; a bad
request, or one that can never fit, is answered at once), (2) drops jobs whose client went away or whose deadline
passed, (3) runs one Score batch — the waiting Score jobs in arrival order up to `max_batch_tokens` computed tokens,
past the long ones waiting to be chunked; a long job the engine cannot chunk alone — with one `run_prepared`,
(4) steps the Score job prefilled in chunks, if any (below), (5) starts waiting generations in arrival order while a
running slot is free and the engine's KV store admits them (`reserve_kv`: prompt + max_tokens in whole pages beside
what the running ones reserve; first come, first served: none overtakes the first that waits), and (6) advances
the running generations by one token with one `engine.step` (which prefills new ones and chunks long prompts).

Chunked prefill (pyscore.chunked_prefill): the first waiting Score job over `max_batch_tokens` gets a plan from the
engine and leaves the queue; each iteration then runs one step of it (`advance_chunked`: a chunk, then its last
passes), one chunked job at a time. A cancel or deadline between chunks drops it; its plan is closed unpublished.

Layer boundaries: the engine asks `decide` at each (a question only); STOP when the server halts or every job of
the running pass is dead (it then commits nothing), YIELD inside a chunk's pass when Score jobs wait, and the
engine then calls `between_layers`, which runs them as one batch of their own there, so a short request waits for
one layer of a chunk, not for the chunk. Every result's Usage gets `queue_s` (admission to the first pass that
included it) and `compute_s` (the wall time of the passes that included it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pyscore.budget import count_within_budget
from pyscore.errors import PassInterrupted, ResourceExhausted
from pyscore.types import Boundary, GenerateResult, ScoreResult, TokenLogprob, Usage

from .engine_like import ChunkPlanLike, EngineLike

log = logging.getLogger(__name__)

HALTED = "the server is shutting down and the request did not finish within its grace period (--grace-s)"


class Unavailable(Exception):
    """The server is stopping (gRPC UNAVAILABLE)."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before it could run (gRPC DEADLINE_EXCEEDED)."""


@dataclass
class GenerationDelta:
    """Tokens a generation produced since its previous delta; `final` is set on the last one only."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    text: str
    final: GenerateResult | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # the first delta, when the request asked for them


@dataclass(eq=False)  # hashed by identity
class Job:
    kind: Literal["score", "generate", "call"]
    payload: Any  # ScoreRequest | GenerateRequest | (fn, args)
    deadline: float | None = None  # time.monotonic() seconds
    cancelled: bool = False  # set on the loop when the caller stops waiting; read by the worker
    work: Any = None  # PreparedScore or Generation, once accepted
    tokens: int = 0  # Score: tokens computed
    admitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the first forward pass that included this job began
    unchunked: bool = False  # Score: the engine could not chunk it, so it runs as one pass
    compute_s: float = 0.0  # wall time of the forward passes that included it

    def timed(self, usage: Usage) -> None:
        """Write this job's server-side timing into its result's usage."""
        usage.queue_s = (self.started if self.started is not None else time.monotonic()) - self.admitted
        usage.compute_s = self.compute_s

    def ran(self, start: float, end: float) -> None:
        """Account a forward pass over [start, end) that included this job."""
        if self.started is None:
            self.started = start
        self.compute_s += end - start

    def dead(self, now: float) -> bool:
        return self.cancelled or (self.deadline is not None and now >= self.deadline)


@dataclass
class Stats:
    batches: int = 0  # run_prepared calls
    steps: int = 0  # engine.step calls
    dropped: int = 0  # jobs dropped before running (cancelled or past deadline)
    interrupted: int = 0  # forward passes stopped at a layer boundary (callers all gone, or halted)
    chunks: int = 0  # chunk passes of Score jobs prefilled in chunks
    refused: int = 0  # jobs refused because the queue was full (counted by the batcher)


class Outbox(Protocol):
    """What the scheduler needs of the batcher."""

    halted: bool  # the grace period is over: stop every pass, fail what is left

    def deliver(self, job: Job, value: Any) -> None: ...  # a result, an exception or a GenerationDelta
    def release(self, n: int) -> None: ...  # n admitted jobs left the queue (running, answered or dropped)
    def arrived(self) -> bool: ...  # jobs wait in the inbox (asked at layer boundaries)
    def take_arrived(self) -> list[Job]: ...


class Scheduler:
    def __init__(self, engine: EngineLike, outbox: Outbox, stats: Stats, *, max_batch_tokens: int = 8192,
                 max_request_tokens: int | None = None, max_running_generations: int = 64,
                 on_batch: Callable[[int, int], None] | None = None) -> None:
        self.engine, self.outbox, self.stats = engine, outbox, stats
        self.max_batch_tokens = max_batch_tokens
        self.max_request_tokens = max_request_tokens  # None = no limit
        self.max_running_generations = max_running_generations
        self.on_batch = on_batch  # (requests, computed tokens) of every Score batch
        self.pending: deque[Job] = deque()  # prepared Score jobs
        self.starting: deque[Job] = deque()  # accepted generations waiting for a running slot
        self.active: list[Job] = []  # running generations
        self.chunked: tuple[Job, ChunkPlanLike] | None = None  # the Score job prefilled in chunks
        self._in_pass: list[Job] = []  # the jobs of the forward pass running now
        self._in_chunk = False  # a chunk's pass is running (other Score batches may run at its layer boundaries)
        self._nested = False  # such a batch is running

    def attach(self) -> None:
        """Make the engine ask this scheduler at its layer boundaries."""
        self.engine.set_boundary(self.decide, self.between_layers)

    def has_work(self) -> bool:
        return bool(self.pending or self.starting or self.active or self.chunked)

    def iterate(self, arrived: list[Job]) -> None:
        for job in arrived:
            self._accept(job)
        self._drop_dead()
        batch = self._next_batch()
        if batch:
            self._run_batch(batch)
        if self.outbox.halted:
            return  # no step: the batcher fails what is left
        self._advance_chunked()
        if self.outbox.halted:
            return
        self._start_generations()
        if self.active:
            self._step()

    def fail_all(self, arrived: list[Job], error: Exception) -> None:
        """Every job held (and `arrived`, not yet accepted) ends with `error`."""
        if self.chunked is not None:
            self._end_chunked(error)
        for job in [*arrived, *self.pending, *self.starting, *self.active]:
            self.outbox.deliver(job, error)
        for job in self.active:
            job.work.abandon()
        self.outbox.release(len(arrived) + len(self.pending) + len(self.starting))
        self.pending.clear()
        self.starting.clear()
        self.active = []

    # -- layer boundaries ------------------------------------------------------------------------------------
    def decide(self) -> Boundary:
        """What the running pass does at this layer boundary (a question: nothing changes here)."""
        if self.outbox.halted:
            return Boundary.STOP
        now = time.monotonic()
        if self._in_pass and all(job.dead(now) for job in self._in_pass):
            return Boundary.STOP  # its answers would be discarded
        if self._in_chunk and not self._nested and (self.outbox.arrived() or self._eligible()):
            return Boundary.YIELD
        return Boundary.CONTINUE

    def between_layers(self) -> None:
        """The YIELD of a chunk's pass: the Score jobs that arrived run now as one batch of their own, then the chunk
        goes on from the same layer. Safe: a pass keeps its state in its own tensors and the chunk's cache blocks
        are private to its lease, so the batch reads and changes nothing of it, and its arithmetic is unchanged.
        Generations are not stepped here: they take their turn between chunks."""
        for job in self.outbox.take_arrived():
            self._accept(job)
        batch = self._next_batch()
        if not batch:
            return
        outer, self._nested = self._in_pass, True
        try:
            self._run_batch(batch)
        finally:
            self._in_pass, self._nested = outer, False

    # -- admission ---------------------------------------------------------------------------------------------
    def _accept(self, job: Job) -> None:
        if job.dead(time.monotonic()):
            self._drop(job)
            self.outbox.release(1)
            return
        try:
            if job.kind == "score":
                job.work = self.engine.prepare_score(job.payload)
                job.tokens = job.work.computed_tokens
                self._check_size("items", job.tokens, "the request computes")
                self.pending.append(job)
                return
            if job.kind == "generate":
                job.work = self.engine.start_generation(job.payload)
                prompt = len(job.work.prompt)
                self._check_size("prompt", prompt, "the prompt is")
                self._check_size("max_tokens", prompt + job.work.request.max_tokens, "prompt + max_tokens is")
                self.engine.check_kv(job.work)  # one that can never fit the KV store is refused now
                self.starting.append(job)  # keeps its queue place until it runs
                return
            fn, args = job.payload
            self.outbox.deliver(job, fn(*args))
        except Exception as e:
            self.outbox.deliver(job, e)
        self.outbox.release(1)

    def _check_size(self, field: str, tokens: int, what: str) -> None:
        if self.max_request_tokens is not None and tokens > self.max_request_tokens:
            raise ResourceExhausted(field, f"{what} {tokens} tokens, over this server's limit of "
                                           f"{self.max_request_tokens} per request (--max-request-tokens)")

    def _drop_dead(self) -> None:
        """Drops cancelled and expired jobs: waiting ones give their queue place back."""
        now = time.monotonic()
        for queue in (self.pending, self.starting):
            dead = [j for j in queue if j.dead(now)]
            for job in dead:
                queue.remove(job)
                self._drop(job)
            self.outbox.release(len(dead))
        if self.chunked is not None and self.chunked[0].dead(now):
            self._end_chunked(None)
        dead = [j for j in self.active if j.dead(now)]
        for job in dead:
            job.work.abandon()
            self._drop(job)
        if dead:
            self.active = [j for j in self.active if j not in dead]

    def _drop(self, job: Job) -> None:
        self.stats.dropped += 1
        if not job.cancelled:  # deadline: tell the caller, if it still listens
            self.outbox.deliver(job, DeadlineExceeded("the deadline passed before the request could run"))

    # -- Score -------------------------------------------------------------------------------------------------
    def _long(self, job: Job) -> bool:
        """Larger than the budget, and not (yet) known to be unchunkable."""
        return job.tokens > self.max_batch_tokens and not job.unchunked

    def _eligible(self) -> bool:
        return any(not self._long(job) for job in self.pending)

    def _next_batch(self) -> list[Job]:
        """Waiting Score jobs in arrival order while they fit the token budget (the first one always), past the
        long ones waiting for their turn to be chunked."""
        eligible = [job for job in self.pending if not self._long(job)]
        batch = eligible[: count_within_budget((job.tokens for job in eligible), self.max_batch_tokens)]
        for job in batch:
            self.pending.remove(job)
        self.outbox.release(len(batch))
        return batch

    def _run_batch(self, batch: list[Job]) -> None:
        self.stats.batches += 1
        if self.on_batch is not None:
            self.on_batch(len(batch), sum(j.tokens for j in batch))
        start = time.monotonic()
        self._in_pass = batch
        try:
            results: list[Any] = self.engine.run_prepared([j.work for j in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} requests")
        except PassInterrupted:
            self._stopped(batch)
            return
        except Exception as e:
            log.exception("score batch of %d requests failed", len(batch))
            results = [e] * len(batch)
        finally:
            self._in_pass = []
        end = time.monotonic()
        for job, result in zip(batch, results, strict=True):
            job.ran(start, end)
            self._answer(job, result)

    def _answer(self, job: Job, result: Any) -> None:
        if isinstance(result, ScoreResult):
            job.timed(result.usage)
        self.outbox.deliver(job, result)

    def _choose_chunked(self) -> bool:
        """Makes the first long waiting job the chunked one, if the engine can chunk it (those it cannot are
        marked so and batched as one pass); False when there is none."""
        while self.chunked is None:
            job = next((j for j in self.pending if self._long(j)), None)
            if job is None:
                return False
            plan = self.engine.plan_chunks(job.work)
            if plan is None:
                job.unchunked = True
                continue
            self.pending.remove(job)
            self.outbox.release(1)
            self.chunked = (job, plan)
        return True

    def _advance_chunked(self) -> None:
        """One step of the chunked Score job: its next chunk, or its last passes once every chunk ran."""
        if not self._choose_chunked():
            return
        assert self.chunked is not None
        job, plan = self.chunked
        start, chunk = time.monotonic(), not plan.finished
        self._in_pass, self._in_chunk = [job], chunk
        self.stats.chunks += chunk
        try:
            result = self.engine.advance_chunked(job.work, plan)
        except PassInterrupted:
            self._stopped([job])
            self._end_chunked(None, deliver=False)
            return
        except Exception as e:
            log.exception("a step of a chunked Score request failed")
            self._end_chunked(e)
            return
        finally:
            self._in_pass, self._in_chunk = [], False
        job.ran(start, time.monotonic())
        if result is not None:  # its plan is closed
            self.chunked = None
            self._answer(job, result)

    def _end_chunked(self, error: Exception | None, deliver: bool = True) -> None:
        """The chunked job ends unfinished: its plan is closed (nothing published); it gets `error`, or with None
        is dropped (cancelled or past its deadline)."""
        assert self.chunked is not None
        job, plan = self.chunked
        self.chunked = None
        plan.close(ok=False)
        if not deliver:
            return
        if error is None:
            self._drop(job)
        else:
            self.outbox.deliver(job, error)

    def _stopped(self, jobs: list[Job]) -> None:
        """The pass over `jobs` was interrupted: halted, they fail with HALTED; else all are dead and dropped."""
        self.stats.interrupted += 1
        halted = self.outbox.halted
        log.info("a forward pass of %d requests stopped at a layer boundary: %s", len(jobs),
                 "the server is halting" if halted else "all its callers gave up")
        for job in jobs:
            if halted:
                self.outbox.deliver(job, Unavailable(HALTED))
            else:
                self._drop(job)

    # -- generation --------------------------------------------------------------------------------------------
    def _start_generations(self) -> None:
        """Waiting generations in arrival order while a running slot is free and the KV store admits them."""
        started = 0
        while (self.starting and len(self.active) < self.max_running_generations
               and self.engine.reserve_kv(self.starting[0].work)):
            self.active.append(self.starting.popleft())
            started += 1
        self.outbox.release(started)

    def _step(self) -> None:
        self.stats.steps += 1
        start = time.monotonic()
        self._in_pass = self.active
        try:
            self.engine.step([j.work for j in self.active])
        except PassInterrupted:  # the generations are as before the step: dead ones go at the next _drop_dead
            if self.outbox.halted:
                self._stopped(self.active)
                self._abandon_active()
            else:
                self.stats.interrupted += 1
            return
        except Exception as e:
            log.exception("generation step of %d sequences failed", len(self.active))
            for job in self.active:
                self.outbox.deliver(job, e)
            self._abandon_active()
            return
        finally:
            self._in_pass = []
        end = time.monotonic()
        self.active = [job for job in self.active if self._stepped(job, start, end)]

    def _abandon_active(self) -> None:
        for job in self.active:
            job.work.abandon()
        self.active = []

    def _stepped(self, job: Job, start: float, end: float) -> bool:
        """Delivers what the step produced for `job`; whether it goes on running."""
        job.ran(start, end)
        gen = job.work
        if gen.error is not None:  # this sequence alone failed; its batch-mates go on
            self.outbox.deliver(job, gen.error)
            return False
        token_ids, logprobs, text = gen.take_delta()
        prompt = gen.take_prompt_logprobs()
        if gen.finished:
            result = gen.result()
            job.timed(result.usage)
            self.outbox.deliver(job, GenerationDelta(token_ids, logprobs, text, result, prompt))
            return False
        if token_ids or text or prompt is not None:
            self.outbox.deliver(job, GenerationDelta(token_ids, logprobs, text, None, prompt))
        return True
