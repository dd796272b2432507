"""Continuous batching. One worker thread owns the engine; the event loop only admits jobs and awaits them.

Each worker iteration: (1) accepts the jobs that arrived (prepare_score / start_generation validate and
tokenize; a bad request is answered at once), (2) drops jobs whose client went away or whose deadline passed,
(3) runs one score batch — the waiting Score jobs in arrival order up to `max_batch_tokens` computed tokens, a
job larger than the budget alone — with a single `engine.run_prepared`, and (4) advances all running
generations by one token with a single `engine.step`. Score batches and decode steps thus interleave, and
requests that arrive during a forward pass join the next one. Results reach the loop through
`call_soon_threadsafe`. At most `max_queue` jobs wait (admitted, not yet running); the next one is refused
at once with ResourceExhausted. A request larger than `max_request_tokens` (Score: the tokens its mode
computes; Generate: prompt + max_tokens) is refused with ResourceExhausted right after tokenization, before
any model work. Every result's Usage gets the server-side timing: `queue_s` from admission to the start of the
first forward pass that included the request, `compute_s` the wall time of the passes that included it. When
the worker runs out of work it hands freed heap memory back to the OS (glibc's
malloc_trim, at most every `TRIM_EVERY_S`): without it, RSS stays at the high-water mark of the largest
batches seen.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pyscore.budget import count_within_budget
from pyscore.errors import ResourceExhausted
from pyscore.types import GenerateRequest, GenerateResult, ModelInfo, ScoreRequest, ScoreResult, TokenLogprob, Usage

log = logging.getLogger(__name__)

TRIM_EVERY_S = 10.0


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6") if sys.platform == "linux" else None
    except OSError:  # not glibc (e.g. musl)
        return None


_LIBC = _load_libc()


def trim_heap() -> None:
    """Return the free parts of the heap to the OS (glibc only; a no-op elsewhere)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class PreparedLike(Protocol):
    """What the batcher reads of a prepared Score request (pyscore.scoring.PreparedScore)."""

    computed_tokens: int
    num_items: int


class GenerationLike(Protocol):
    """What the batcher reads of a running generation (pyscore.generation.Generation)."""

    finished: bool
    prompt: list[int]
    request: GenerateRequest
    error: Exception | None

    def take_delta(self) -> tuple[list[int], list[TokenLogprob], str]: ...
    def result(self) -> GenerateResult: ...


class EngineLike(Protocol):
    """The part of pyscore.engine.Engine the server uses."""

    model_name: str

    def info(self) -> ModelInfo: ...
    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]: ...
    def prepare_score(self, request: ScoreRequest) -> PreparedLike: ...
    def run_prepared(self, prepared: list[Any]) -> list[ScoreResult | Exception]: ...
    def start_generation(self, request: GenerateRequest) -> GenerationLike: ...
    def step(self, generations: list[Any]) -> None: ...
    def prefix_cache_stats(self) -> Any: ...  # pyscore.model.prefix_cache.PrefixCacheStats, or None when off


class Unavailable(Exception):
    """The batcher is stopping (gRPC UNAVAILABLE)."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before it could run (gRPC DEADLINE_EXCEEDED)."""


@dataclass
class GenerationDelta:
    """Tokens a generation produced since its previous delta; `final` is set on the last one only."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    text: str
    final: GenerateResult | None = None


@dataclass
class Job:
    kind: Literal["score", "generate", "call"]
    payload: Any  # ScoreRequest | GenerateRequest | (fn, args)
    loop: asyncio.AbstractEventLoop
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future[Any] | None = None  # score, call
    deltas: asyncio.Queue[GenerationDelta | BaseException] | None = None  # generate
    cancelled: bool = False  # set on the loop when the caller stops waiting; read by the worker
    work: Any = None  # PreparedScore or Generation, once accepted
    tokens: int = 0
    admitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the first forward pass that included this job began
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
    refused: int = 0  # jobs refused because the queue was full


class Batcher:
    def __init__(self, engine: EngineLike, *, max_batch_tokens: int = 8192, max_queue: int = 256,
                 max_request_tokens: int | None = None,
                 on_batch: Callable[[int, int], None] | None = None) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.max_request_tokens = max_request_tokens  # None = no limit
        self.on_batch = on_batch  # (requests, computed tokens) of every score batch, on the worker thread
        self.stats = Stats()
        self._cond = threading.Condition()
        self._inbox: list[Job] = []  # guarded by _cond
        self._waiting = 0  # admitted jobs not yet running; guarded by _cond
        self._stopping = False  # guarded by _cond
        self._pending: deque[Job] = deque()  # prepared Score jobs; worker only
        self._active: list[Job] = []  # running generations; worker only
        self._thread = threading.Thread(target=self._run, name="pyscore-engine", daemon=True)
        self._trimmed = time.monotonic()  # worker only

    # -- loop side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def waiting(self) -> int:
        """Jobs admitted and not yet running."""
        with self._cond:
            return self._waiting

    async def score(self, request: ScoreRequest, timeout: float | None = None) -> ScoreResult:
        return await self._await(self._admit("score", request, timeout, stream=False))

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run fn(*args) on the engine thread (e.g. tokenize), in turn with the model work."""
        return await self._await(self._admit("call", (fn, args), timeout, stream=False))

    async def generate(self, request: GenerateRequest, timeout: float | None = None) -> AsyncIterator[GenerationDelta]:
        """The generation's deltas as they are produced; the last carries `final`."""
        job = self._admit("generate", request, timeout, stream=True)
        assert job.deltas is not None
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

    async def _await(self, job: Job) -> Any:
        assert job.future is not None
        try:
            return await job.future
        finally:
            job.cancelled = True  # harmless once done; drops the job if the caller was cancelled

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

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the worker finish the admitted ones, and join it (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- worker side --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._pending or self._active or self._stopping):
                    if not self._cond.wait(TRIM_EVERY_S):
                        break  # idle for a while: go round once, so that the heap gets trimmed
                if self._stopping and not (self._inbox or self._pending or self._active):
                    return
                arrived, self._inbox = self._inbox, []
            try:
                self._iterate(arrived)
            except Exception as e:  # a bug here must not kill the worker: fail what is in flight
                log.exception("batcher iteration failed")
                for job in [*self._pending, *self._active]:
                    self._finish(job, e)
                self._release(len(self._pending))
                self._pending.clear()
                self._active.clear()
            self._trim_when_idle()

    def _trim_when_idle(self) -> None:
        if self._pending or self._active or time.monotonic() - self._trimmed < TRIM_EVERY_S:
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
                self._check_size("prompt", prompt, "the prompt is")
                self._check_size("max_tokens", prompt + job.work.request.max_tokens, "prompt + max_tokens is")
                self._active.append(job)
            else:
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
        now = time.monotonic()
        alive = deque(j for j in self._pending if not j.dead(now))
        dead = len(self._pending) - len(alive)
        for job in self._pending:
            if job.dead(now):
                self._drop(job)
        self._pending = alive
        self._release(dead)
        for job in [j for j in self._active if j.dead(now)]:
            self._drop(job)
            self._active.remove(job)

    def _next_batch(self) -> list[Job]:
        """Waiting Score jobs in arrival order while they fit the token budget (the first one always)."""
        n = count_within_budget((job.tokens for job in self._pending), self.max_batch_tokens)
        batch = [self._pending.popleft() for _ in range(n)]
        self._release(n)
        return batch

    def _run_batch(self, batch: list[Job]) -> None:
        self.stats.batches += 1
        if self.on_batch is not None:
            self.on_batch(len(batch), sum(j.tokens for j in batch))
        start = time.monotonic()
        try:
            results: list[Any] = self.engine.run_prepared([j.work for j in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} requests")
        except Exception as e:
            log.exception("score batch of %d requests failed", len(batch))
            results = [e] * len(batch)
        end = time.monotonic()
        for job, result in zip(batch, results, strict=True):
            job.ran(start, end)
            if isinstance(result, ScoreResult):
                job.timed(result.usage)
            self._finish(job, result)

    def _step(self) -> None:
        self.stats.steps += 1
        start = time.monotonic()
        try:
            self.engine.step([j.work for j in self._active])
        except Exception as e:
            log.exception("generation step of %d sequences failed", len(self._active))
            for job in self._active:
                self._finish(job, e)
            self._active.clear()
            return
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
            if gen.finished:
                result = gen.result()
                job.timed(result.usage)
                self._finish(job, GenerationDelta(token_ids, logprobs, text, result))
            else:
                if token_ids or text:
                    self._finish(job, GenerationDelta(token_ids, logprobs, text))
                still.append(job)
        self._active = still

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
