"""The bridge between the event loop and the engine thread: the loop only admits jobs and awaits them; one worker
thread owns the engine and runs server/scheduler.py's policy over whatever arrived.

At most `max_queue` jobs wait (admitted, not yet running); the next is refused at once (ResourceExhausted naming
--max-queue). A caller that stops waiting marks its job cancelled: the scheduler drops it, or stops its pass at the
next layer boundary. Answers reach the loop through `call_soon_threadsafe`. `halt()` (the end of the shutdown's
grace) answers every waiting caller UNAVAILABLE and stops the worker at its next safe point. An idle worker hands
freed heap back to the OS (malloc_trim, at most every `TRIM_EVERY_S`; else RSS stays at the largest batches'
high-water mark); `trim_under_load` trims at that pace even while busy (a control of `bench.hardening soak`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pyscore.errors import ResourceExhausted
from pyscore.memory import release_freed_memory as trim_heap  # the free heap back to the OS (glibc only)
from pyscore.types import GenerateRequest, ScoreRequest, ScoreResult

from .engine_like import EngineLike
from .scheduler import HALTED, GenerationDelta, Job, Scheduler, Stats, Unavailable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 10.0


@dataclass(eq=False)  # hashed by identity: the loop keeps the live ones in a set
class Waiter(Job):
    """A job and where its answer goes: a future (score, call) or a queue of deltas (generate), on `loop`."""

    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[Any] | None = None
    deltas: asyncio.Queue[GenerationDelta | BaseException] | None = None

    def settle(self, value: Any) -> None:
        """On the loop: hand a result, exception or delta to whoever awaits this job."""
        if self.deltas is not None:
            self.deltas.put_nowait(value)
        elif self.future is not None and not self.future.done():
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)


class Batcher:
    def __init__(self, engine: EngineLike, *, max_batch_tokens: int = 8192, max_queue: int = 256,
                 max_request_tokens: int | None = None, max_running_generations: int = 64,
                 on_batch: Callable[[int, int], None] | None = None, trim_under_load: bool = False) -> None:
        self.max_queue = max_queue
        self.trim_under_load = trim_under_load
        self.stats = Stats()
        self.scheduler = Scheduler(engine, self, self.stats, max_batch_tokens=max_batch_tokens,
                                   max_request_tokens=max_request_tokens,
                                   max_running_generations=max_running_generations, on_batch=on_batch)
        self._cond = threading.Condition()
        self._inbox: list[Waiter] = []  # guarded by _cond
        self._waiting = 0  # admitted jobs not yet running; guarded by _cond
        self._stopping = False  # guarded by _cond
        self.halted = False  # set once by halt(), on the loop; read by the worker at every layer boundary
        self._live: set[Waiter] = set()  # admitted jobs whose caller still waits; loop only
        self._thread = threading.Thread(target=self._run, name="pyscore-engine", daemon=True)
        self._trimmed = time.monotonic()  # worker only

    # -- loop side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.scheduler.attach()
        self._thread.start()

    def waiting(self) -> int:
        """Jobs admitted and not yet running."""
        with self._cond:
            return self._waiting

    def running_generations(self) -> int:
        return len(self.scheduler.active)

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

    async def _await(self, job: Waiter) -> Any:
        assert job.future is not None
        self._live.add(job)
        try:
            return await job.future
        finally:
            job.cancelled = True  # harmless once done; drops the job if the caller was cancelled
            self._live.discard(job)

    def _admit(self, kind: Literal["score", "generate", "call"], payload: Any, timeout: float | None,
               stream: bool) -> Waiter:
        loop = asyncio.get_running_loop()
        job = Waiter(kind, payload, loop=loop)
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
            self._stopping = self.halted = True
            self._cond.notify()
        for job in list(self._live):
            job.settle(Unavailable(HALTED))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the worker finish the admitted ones (all of them fail fast once halted), and join
        it (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the scheduler's outbox (worker side) ---------------------------------------------------------------
    def deliver(self, job: Job, value: Any) -> None:
        assert isinstance(job, Waiter) and job.loop is not None
        try:
            job.loop.call_soon_threadsafe(job.settle, value)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            log.debug("dropped a result for a closed event loop")

    def release(self, n: int) -> None:
        if n:
            with self._cond:
                self._waiting -= n

    def arrived(self) -> bool:
        with self._cond:
            return bool(self._inbox)

    def take_arrived(self) -> list[Job]:
        with self._cond:
            arrived, self._inbox = self._inbox, []
        return list(arrived)

    # -- worker side ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._cond:
                while not (self._inbox or scheduler.has_work() or self._stopping):
                    if not self._cond.wait(TRIM_EVERY_S):
                        break  # idle for a while: go round once, so that the heap gets trimmed
                if self._stopping and not (self._inbox or scheduler.has_work()):
                    return
                arrived: list[Job] = list(self._inbox)
                self._inbox = []
            if self.halted:
                scheduler.fail_all(arrived, Unavailable(HALTED))
                return
            try:
                scheduler.iterate(arrived)
            except Exception as e:  # a bug there must not kill the worker: fail what is in flight
                log.exception("scheduler iteration failed")
                scheduler.fail_all([], e)
            self._trim()

    def _trim(self) -> None:
        """malloc_trim at most every TRIM_EVERY_S, when idle (or always, with trim_under_load)."""
        busy = self.scheduler.has_work() and not self.trim_under_load
        if busy or time.monotonic() - self._trimmed < TRIM_EVERY_S or self.arrived():
            return
        trim_heap()
        self._trimmed = time.monotonic()
