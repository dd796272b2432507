"""Continuous batching. One worker thread owns the engine; the event loop only admits jobs and awaits them.

Each worker iteration: (1) accepts the jobs that arrived (prepare_score / start_generation validate and
tokenize; a bad request is answered at once), (2) drops jobs whose client went away or whose deadline passed,
(3) runs one score batch — the waiting Score jobs in arrival order up to `max_batch_tokens` computed tokens, a
larger job that cannot be chunked alone — with a single `engine.run_prepared`, (4) runs one chunk of the Score job
being prefilled in chunks, if any (below), (5) starts waiting generations in arrival order while both generation
bounds allow, and (6) advances all running generations by one token with a single `engine.step` (which prefills
new ones up to `max_batch_tokens` prompt tokens per step). Score batches and decode steps thus interleave, and
requests that arrive during a forward pass join the next one.

Chunked prefill (pyscore.chunked_prefill): the first waiting Score job larger than `max_batch_tokens` gets a
chunking plan from the engine (its query's blocks reserved in the prefix cache) and leaves the queue; from then on
each iteration runs one chunk of its query (one forward pass of at most the engine's prefill_chunk_tokens, by
default `max_batch_tokens`) after the batch of whatever else waits; and Score jobs that arrive during a chunk run
at its next layer boundary (`_between_layers`), so a long request delays the others by about one layer of a
chunk, not by its whole prefill. Its last passes (the query's tail and the items) run once every chunk has; a
cancel or deadline between chunks drops it, and a pass that stops inside a chunk commits nothing (the plan is
closed unpublished either way). One Score is chunked at a time: other long ones wait for their turn, the short
jobs go past them. A long job the engine cannot chunk (no prefix cache, a hybrid model, a cache too small for its
query) is batched as before: in arrival order, alone when larger than the budget. Generate's prompts are chunked
inside `engine.step` the same way (pyscore.generation).
Results reach the loop through `call_soon_threadsafe`. The engine asks the batcher at every layer boundary whether
to go on (`set_interrupt`): a pass whose jobs are all cancelled or past their deadline stops there, committing
nothing, and so does any pass once `halt()` (the end of the shutdown's grace period) has answered every waiting
caller UNAVAILABLE. Every result's Usage gets the server-side timing:
`queue_s` from admission to the start of the first forward pass that included the request, `compute_s` the wall
time of the passes that included it.

Bounds (vLLM's and SGLang's scheduler limits): at most `max_queue` jobs wait (admitted, not yet running; a
generation waits until it may run); the next one is refused at once with ResourceExhausted. At most
`max_running_generations` generations run, and the KV-store tokens they reserve — prompt + max_tokens each,
rounded up to whole pages of `kv_page_tokens`, the most the engine's store can give them — stay within
`max_kv_tokens` (the store's size: then a page is always free or reclaimable from the prefix cache when a sequence
needs one; a prompt's cached pages are counted in each sequence that shares them, although held once); a
generation that does not fit waits in the queue
(first come, first served: none overtakes it), and one that could never fit is refused right after
tokenization. So is a request larger than `max_request_tokens` (Score: the tokens its mode computes; Generate:
prompt + max_tokens), before any model work. When the worker runs out of work it hands freed heap memory back
to the OS (glibc's malloc_trim, at most every `TRIM_EVERY_S`): without it, RSS stays at the high-water mark of
the largest batches seen. `trim_under_load` trims at that pace even while busy (a control of `bench.hardening soak`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pyscore.budget import count_within_budget
from pyscore.errors import PassInterrupted, ResourceExhausted
from pyscore.memory import release_freed_memory as trim_heap  # the free heap back to the OS (glibc only)
from pyscore.types import GenerateRequest, GenerateResult, ScoreRequest, ScoreResult, TokenLogprob, Usage

from .engine_like import ChunkPlanLike, EngineLike

log = logging.getLogger(__name__)

TRIM_EVERY_S = 10.0


class Unavailable(Exception):
    """The batcher is stopping (gRPC UNAVAILABLE)."""


HALTED = "the server is shutting down and the request did not finish within its grace period (--grace-s)"


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


@dataclass(eq=False)  # hashed by identity: the loop keeps the live ones in a set
class Job:
    kind: Literal["score", "generate", "call"]
    payload: Any  # ScoreRequest | GenerateRequest | (fn, args)
    loop: asyncio.AbstractEventLoop
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future[Any] | None = None  # score, call
    deltas: asyncio.Queue[GenerationDelta | BaseException] | None = None  # generate
    cancelled: bool = False  # set on the loop when the caller stops waiting; read by the worker
    work: Any = None  # PreparedScore or Generation, once accepted
    tokens: int = 0  # Score: tokens computed; Generate: KV-store tokens reserved (prompt + max_tokens, whole pages)
    admitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the first forward pass that included this job began
    unchunked: bool = False  # Score: the engine could not chunk it, so it runs as one pass (Batcher._long)
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

    def deliver(self, value: Any) -> None:
        """On the loop: hand a result, exception or delta to whoever awaits this job."""
        if self.deltas is not None:
            self.deltas.put_nowait(value)
        elif self.future is not None and not self.future.done():
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)


@dataclass
class Stats:
    batches: int = 0  # run_prepared calls
    steps: int = 0  # engine.step calls
    dropped: int = 0  # jobs dropped before running (cancelled or past deadline)
    interrupted: int = 0  # forward passes stopped at a layer boundary (callers all gone, or halted)
    chunks: int = 0  # chunk passes of Score jobs prefilled in chunks
    refused: int = 0  # jobs refused because the queue was full


class Batcher:
    def __init__(self, engine: EngineLike, *, max_batch_tokens: int = 8192, max_queue: int = 256,
                 max_request_tokens: int | None = None, max_running_generations: int = 64,
                 max_kv_tokens: int = 65536, kv_page_tokens: int = 1,
                 on_batch: Callable[[int, int], None] | None = None, trim_under_load: bool = False) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.max_request_tokens = max_request_tokens  # None = no limit
        self.max_running_generations = max_running_generations
        self.max_kv_tokens = max_kv_tokens
        self.kv_page_tokens = kv_page_tokens
        self.trim_under_load = trim_under_load
        self.on_batch = on_batch  # (requests, computed tokens) of every score batch, on the worker thread
        self.stats = Stats()
        self._cond = threading.Condition()
        self._inbox: list[Job] = []  # guarded by _cond
        self._waiting = 0  # admitted jobs not yet running; guarded by _cond
        self._stopping = False  # guarded by _cond
        self._halted = False  # set once by halt(), on the loop; read by the worker at every layer boundary
        self._live: set[Job] = set()  # admitted jobs whose caller still waits; loop only
        self._in_pass: list[Job] = []  # the jobs of the forward pass running now; worker only
        self._pending: deque[Job] = deque()  # prepared Score jobs; worker only
        self._starting: deque[Job] = deque()  # accepted generations waiting for a running slot; worker only
        self._active: list[Job] = []  # running generations; worker only
        self._chunked: tuple[Job, ChunkPlanLike] | None = None  # the Score job prefilled in chunks; worker only
        self._in_chunk = False  # a chunk's pass is running (other Score batches may run at its layer boundaries)
        self._nested = False  # such a batch is running
        self._kv_reserved = 0  # sum of tokens over _active; written by the worker only
        self._thread = threading.Thread(target=self._run, name="pyscore-engine", daemon=True)
        self._trimmed = time.monotonic()  # worker only

    # -- loop side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.set_interrupt(self._interrupted)
        self._thread.start()

    def waiting(self) -> int:
        """Jobs admitted and not yet running."""
        with self._cond:
            return self._waiting

    def running_generations(self) -> int:
        return len(self._active)

    def kv_tokens_reserved(self) -> int:
        """KV-store tokens the running generations reserve (prompt + max_tokens each, in whole pages)."""
        return self._kv_reserved

    async def score(self, request: ScoreRequest, timeout: float | None = None) -> ScoreResult:
        return await self._await(self._admit("score", request, timeout, stream=False))

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run fn(*args) on the engine thread (e.g. tokenize), in turn with the model work."""
        return await self._await(self._admit("call", (fn, args), timeout, stream=False))

    async def generate(self, request: GenerateRequest, timeout: float | None = None) -> AsyncIterator[GenerationDelta]:
        """The generation's deltas as they are produced; the last carries `final`."""
        job = self._admit("generate", request, timeout, stream=True)
        assert job.deltas is not None
        self._live.add(job)
        try:
            while True:
                delta = await job.deltas.get()
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
                if delta.final is not None:
                    return
        finally:
            job.cancelled = True  # the caller stopped listening: free the sequence
            self._live.discard(job)

    async def _await(self, job: Job) -> Any:
        assert job.future is not None
        self._live.add(job)
        try:
            return await job.future
        finally:
            job.cancelled = True  # harmless once done; drops the job if the caller was cancelled
            self._live.discard(job)

    def _admit(self, kind: Literal["score", "generate", "call"], payload: Any, timeout: float | None,
               stream: bool) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(kind, payload, loop, None)
        if timeout is not None:
            job.deadline = job.admitted + timeout
        if stream:
            job.deltas = asyncio.Queue()
        else:
            job.future = loop.create_future()
        with self._cond:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            if self._waiting >= self.max_queue:
                self.stats.refused += 1
                raise ResourceExhausted("", f"the queue is full ({self._waiting} requests waiting; --max-queue)")
            self._waiting += 1
            self._inbox.append(job)
            self._cond.notify()
        return job

    def halt(self) -> None:
        """On the loop, when the grace period is over: every caller still waiting gets Unavailable(HALTED) now, new
        jobs are refused, and the worker stops at its next safe point (the next layer boundary of a running pass,
        which then commits nothing) and runs nothing more. stop() then joins it."""
        with self._cond:
            self._stopping = self._halted = True
            self._cond.notify()
        for job in list(self._live):
            job.deliver(Unavailable(HALTED))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the worker finish the admitted ones (all of them fail fast once halted), and join
        it (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- worker side --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._has_work() or self._stopping):
                    if not self._cond.wait(TRIM_EVERY_S):
                        break  # idle for a while: go round once, so that the heap gets trimmed
                if self._stopping and not (self._inbox or self._has_work()):
                    return
                arrived, self._inbox = self._inbox, []
            if self._halted:
                self._fail_all(arrived, Unavailable(HALTED))
                return
            try:
                self._iterate(arrived)
            except Exception as e:  # a bug here must not kill the worker: fail what is in flight
                log.exception("batcher iteration failed")
                self._fail_all([], e)
            self._trim()

    def _fail_all(self, arrived: list[Job], error: Exception) -> None:
        """Every job the worker holds (and `arrived`, not yet accepted) ends with `error`."""
        if self._chunked is not None:
            self._end_chunked(error)
        for job in [*arrived, *self._pending, *self._starting, *self._active]:
            self._finish(job, error)
        for job in self._active:
            job.work.abandon()
        self._release(len(arrived) + len(self._pending) + len(self._starting))
        self._pending.clear()
        self._starting.clear()
        self._set_active([])

    def _has_work(self) -> bool:
        return bool(self._pending or self._starting or self._active or self._chunked)

    def _trim(self) -> None:
        """malloc_trim at most every TRIM_EVERY_S, when idle (or always, with trim_under_load)."""
        if (self._has_work() and not self.trim_under_load) or time.monotonic() - self._trimmed < TRIM_EVERY_S:
            return
        with self._cond:
            if self._inbox:
                return
        trim_heap()
        self._trimmed = time.monotonic()

    def _iterate(self, arrived: list[Job]) -> None:
        for job in arrived:
            self._accept(job)
        self._drop_dead()
        batch = self._next_batch()
        if batch:
            self._run_batch(batch)
        if self._halted:
            return  # no step: _run fails what is left
        self._advance_chunked()
        if self._halted:
            return
        self._start_generations()
        if self._active:
            self._step()

    def _accept(self, job: Job) -> None:
        if job.dead(time.monotonic()):
            self._drop(job)
            self._release(1)
            return
        try:
            if job.kind == "score":
                job.work = self.engine.prepare_score(job.payload)
                job.tokens = job.work.computed_tokens
                self._check_size("items", job.tokens, "the request computes")
                self._pending.append(job)
                return
            if job.kind == "generate":
                job.work = self.engine.start_generation(job.payload)
                prompt = len(job.work.prompt)
                tokens = prompt + job.work.request.max_tokens
                self._check_size("prompt", prompt, "the prompt is")
                self._check_size("max_tokens", tokens, "prompt + max_tokens is")
                job.tokens = -(-tokens // self.kv_page_tokens) * self.kv_page_tokens  # whole pages
                if job.tokens > self.max_kv_tokens:
                    raise ResourceExhausted("max_tokens", f"prompt + max_tokens is {tokens} tokens ({job.tokens} in "
                                            f"whole KV pages), more than this server's KV store of "
                                            f"{self.max_kv_tokens} tokens (--kv-cache-mb)")
                self._starting.append(job)  # keeps its queue place until it runs
                return
            fn, args = job.payload
            self._finish(job, fn(*args))
        except Exception as e:
            self._finish(job, e)
        self._release(1)

    def _check_size(self, field: str, tokens: int, what: str) -> None:
        if self.max_request_tokens is not None and tokens > self.max_request_tokens:
            raise ResourceExhausted(field, f"{what} {tokens} tokens, over this server's limit of "
                                           f"{self.max_request_tokens} per request (--max-request-tokens)")

    def _drop_dead(self) -> None:
        """Drops cancelled and expired jobs: waiting ones give their queue place back."""
        now = time.monotonic()
        for queue in (self._pending, self._starting):
            dead = [j for j in queue if j.dead(now)]
            for job in dead:
                queue.remove(job)
                self._drop(job)
            self._release(len(dead))
        if self._chunked is not None and self._chunked[0].dead(now):
            self._end_chunked(None)
        dead = [j for j in self._active if j.dead(now)]
        for job in dead:
            job.work.abandon()
            self._drop(job)
        if dead:
            self._set_active([j for j in self._active if j not in dead])

    def _start_generations(self) -> None:
        """Waiting generations in arrival order while a running slot and their KV tokens are free."""
        started = 0
        while (self._starting and len(self._active) < self.max_running_generations
               and self._kv_reserved + self._starting[0].tokens <= self.max_kv_tokens):
            self._set_active([*self._active, self._starting.popleft()])
            started += 1
        self._release(started)

    def _set_active(self, jobs: list[Job]) -> None:
        self._active = jobs
        self._kv_reserved = sum(j.tokens for j in jobs)

    def _next_batch(self) -> list[Job]:
        """Waiting Score jobs in arrival order while they fit the token budget (the first one always), past the
        long ones waiting for their turn to be chunked."""
        eligible = [job for job in self._pending if not self._long(job)]
        batch = eligible[: count_within_budget((job.tokens for job in eligible), self.max_batch_tokens)]
        for job in batch:
            self._pending.remove(job)
        self._release(len(batch))
        return batch

    def _long(self, job: Job) -> bool:
        """Larger than the budget, and not (yet) known to be unchunkable."""
        return job.tokens > self.max_batch_tokens and not job.unchunked

    def _advance_chunked(self) -> None:
        """Runs the chunked Score job's next chunk, or its last passes once every chunk ran; first, if there is
        none, makes the first long waiting job the one the engine can chunk (those it cannot are marked so)."""
        while self._chunked is None:
            job = next((j for j in self._pending if self._long(j)), None)
            if job is None:
                return
            plan = self.engine.plan_chunks(job.work)
            if plan is None:
                job.unchunked = True  # batched as before chunked prefill (_next_batch)
                continue
            self._pending.remove(job)
            self._release(1)
            self._chunked = (job, plan)
        job, plan = self._chunked
        start = time.monotonic()
        self._in_pass = [job]
        try:
            if plan.finished:
                result = self.engine.finish_chunked(job.work, plan)
                self._chunked = None
            else:
                self.stats.chunks += 1
                self._in_chunk = True
                self.engine.run_chunk(plan)
                job.ran(start, time.monotonic())
                return
        except PassInterrupted:
            self._stopped([job])
            self._end_chunked(None, deliver=False)
            return
        except Exception as e:
            log.exception("a chunk of a long Score request failed")
            self._end_chunked(e)
            return
        finally:
            self._in_pass, self._in_chunk = [], False
        job.ran(start, time.monotonic())
        if isinstance(result, ScoreResult):
            job.timed(result.usage)
        self._finish(job, result)

    def _end_chunked(self, error: Exception | None, deliver: bool = True) -> None:
        """The chunked job ends unfinished: its plan is closed (nothing published); it gets `error`, or with None
        is dropped (cancelled or past its deadline)."""
        assert self._chunked is not None
        job, plan = self._chunked
        self._chunked = None
        plan.close(ok=False)
        if not deliver:
            return
        if error is None:
            self._drop(job)
        else:
            self._finish(job, error)

    def _interrupted(self) -> bool:
        """Asked by the engine at every layer boundary (worker thread): stop the running pass when the server is
        halting or when every job in it is cancelled or past its deadline (its answers would be discarded). In a
        chunk's pass it is also where the Score jobs that arrived meanwhile run (`_between_layers`)."""
        if self._halted:
            return True
        now = time.monotonic()
        if self._in_pass and all(job.dead(now) for job in self._in_pass):
            return True
        if self._in_chunk and not self._nested:
            self._between_layers()
        return False

    def _between_layers(self) -> None:
        """Cooperative preemption of a chunk's pass: at its layer boundary, the Score jobs that arrived run now as
        one batch of their own, then the chunk goes on from the same layer. Safe: a pass keeps its state in its
        own tensors (residual stream, attention plan) and the chunk's cache blocks are private to its lease, so
        the batch in between reads and changes nothing of it, and its arithmetic is unchanged. So a short request
        waits for one layer of a chunk, not a whole chunk (which late in a long query costs several times its
        first one). Generations are not stepped here: they take their turn between chunks."""
        with self._cond:
            arrived, self._inbox = self._inbox, []
        for job in arrived:
            self._accept(job)
        batch = self._next_batch()
        if not batch:
            return
        outer, self._nested = self._in_pass, True
        try:
            self._run_batch(batch)
        finally:
            self._in_pass, self._nested = outer, False

    def _stopped(self, jobs: list[Job]) -> None:
        """The pass over `jobs` was interrupted: halted, they fail with HALTED; else all are dead and dropped."""
        self.stats.interrupted += 1
        log.info("a forward pass of %d requests stopped at a layer boundary: %s", len(jobs),
                 "the server is halting" if self._halted else "all its callers gave up")
        for job in jobs:
            if self._halted:
                self._finish(job, Unavailable(HALTED))
            else:
                self._drop(job)

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
            if isinstance(result, ScoreResult):
                job.timed(result.usage)
            self._finish(job, result)

    def _step(self) -> None:
        self.stats.steps += 1
        start = time.monotonic()
        self._in_pass = self._active
        try:
            self.engine.step([j.work for j in self._active])
        except PassInterrupted:  # the generations are as before the step: dead ones go at the next _drop_dead
            if self._halted:
                self._stopped(self._active)
                for job in self._active:
                    job.work.abandon()
                self._set_active([])
            else:
                self.stats.interrupted += 1
            return
        except Exception as e:
            log.exception("generation step of %d sequences failed", len(self._active))
            for job in self._active:
                job.work.abandon()
                self._finish(job, e)
            self._set_active([])
            return
        finally:
            self._in_pass = []
        end = time.monotonic()
        still: list[Job] = []
        for job in self._active:
            job.ran(start, end)
            gen = job.work
            error = gen.error
            if error is not None:  # this sequence alone failed; its batch-mates go on
                self._finish(job, error)
                continue
            token_ids, logprobs, text = gen.take_delta()
            prompt = gen.take_prompt_logprobs()
            if gen.finished:
                result = gen.result()
                job.timed(result.usage)
                self._finish(job, GenerationDelta(token_ids, logprobs, text, result, prompt))
            else:
                if token_ids or text or prompt is not None:
                    self._finish(job, GenerationDelta(token_ids, logprobs, text, None, prompt))
                still.append(job)
        self._set_active(still)

    def _drop(self, job: Job) -> None:
        self.stats.dropped += 1
        if not job.cancelled:  # deadline: tell the caller, if it still listens
            self._finish(job, DeadlineExceeded("the deadline passed before the request could run"))

    def _finish(self, job: Job, value: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.deliver, value)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            log.debug("dropped a result for a closed event loop")

    def _release(self, n: int) -> None:
        if n:
            with self._cond:
                self._waiting -= n
