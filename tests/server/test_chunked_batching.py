"""Chunked prefill in the batcher, over a real (tiny) engine: a Score request that arrives while a long one is
prefilled in chunks is answered at the next layer boundary of the running chunk, with its idle scores, and the long
one's scores are still its one-pass ones; a long request cancelled during a chunk stops there and leaves nothing in
the prefix cache. The order is forced with a gate, never with timing."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from pyscore.engine import Engine
from pyscore.types import ScoreRequest
from server.batcher import Batcher
from tests.helpers import make_model_dir
from tests.test_engine_chunked_prefill import BUDGET, LABELS, LONG
from tests.test_engine_prefix_cache import ITEMS

SMALL = ScoreRequest(query="Is the sky blue?", items=[" Yes it is", " No", " Maybe"], labels=LABELS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


class Recorder:
    """Logs the engine's model calls in order ("chunk" ... "/chunk" around a chunk's pass, "finish" for a chunked
    request's last passes); the first chunk waits at its start until `release`."""

    def __init__(self, e: Engine) -> None:
        self.log: list[str] = []
        self.entered, self.release = threading.Event(), threading.Event()
        advance, run_prepared = e.advance_chunked, e.run_prepared

        def step(p: Any, plan: Any) -> Any:
            if plan.finished:
                self.log.append("finish")
                return advance(p, plan)
            self.log.append("chunk")
            if self.log.count("chunk") == 1:
                self.entered.set()
                assert self.release.wait(30)
            try:
                return advance(p, plan)
            finally:
                self.log.append("/chunk")

        def prepared(ps: list[Any]) -> list[Any]:
            self.log.append("batch")
            return run_prepared(ps)

        e.advance_chunked, e.run_prepared = step, prepared  # type: ignore[method-assign]


async def first_chunk_entered(rec: Recorder) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, rec.entered.wait, 30)


def test_a_small_score_is_answered_inside_a_chunk_of_a_long_one(model_dir):
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, op_backend="kernel",
                               max_batch_tokens=BUDGET)
    idle = e.score_batch([SMALL])[0]
    expected = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, op_backend="kernel")
    expected_long = expected.score(LONG, ITEMS, labels=LABELS)
    rec = Recorder(e)
    batcher = Batcher(e, max_batch_tokens=BUDGET)

    async def run() -> tuple[Any, Any]:
        batcher.start()
        long = asyncio.create_task(batcher.score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS)))
        await first_chunk_entered(rec)
        small = asyncio.create_task(batcher.score(SMALL))
        await asyncio.sleep(0)  # admitted
        rec.release.set()
        return await small, await long

    small, long = asyncio.run(run())
    batcher.stop(10)
    assert small.scores == idle.scores and long.scores == expected_long.scores
    assert rec.log[:3] == ["chunk", "batch", "/chunk"], rec.log  # at a layer boundary of the first chunk
    assert rec.log.count("chunk") == batcher.stats.chunks >= 3 and rec.log[-1] == "finish"
    assert long.usage.compute_s > 0 and long.usage.cached_tokens == 0


def test_a_long_score_cancelled_during_a_chunk_stops_and_publishes_nothing(model_dir):
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, op_backend="kernel",
                               max_batch_tokens=BUDGET)
    rec = Recorder(e)
    batcher = Batcher(e, max_batch_tokens=BUDGET)

    async def run() -> None:
        batcher.start()
        long = asyncio.create_task(batcher.score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS)))
        await first_chunk_entered(rec)
        long.cancel()
        await asyncio.sleep(0)
        rec.release.set()
        with pytest.raises(asyncio.CancelledError):
            await long
        assert (await batcher.score(SMALL, timeout=30)).scores  # the worker goes on

    asyncio.run(run())
    batcher.stop(10)
    assert rec.log[:3] == ["chunk", "/chunk", "batch"] and "finish" not in rec.log, rec.log
    assert batcher.stats.interrupted == 1
    stats = e.prefix_cache_stats()
    assert stats.blocks == 0 and stats.hit_tokens == 0  # the SMALL query is shorter than a block


def test_a_generation_cancelled_while_its_prompt_is_chunked_gives_its_blocks_back(model_dir, monkeypatch):
    from pyscore.chunked_prefill import ChunkedPrefill
    from pyscore.types import GenerateRequest

    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, op_backend="kernel",
                               max_batch_tokens=BUDGET)
    entered, release, chunks = threading.Event(), threading.Event(), []
    run_next = ChunkedPrefill.run_next

    def gated(plan: ChunkedPrefill, decoder: Any) -> int:
        chunks.append(plan.done)
        if len(chunks) == 1:
            entered.set()
            assert release.wait(30)
        return run_next(plan, decoder)

    monkeypatch.setattr(ChunkedPrefill, "run_next", gated)
    batcher = Batcher(e, max_batch_tokens=BUDGET)

    async def run() -> None:
        batcher.start()

        async def consume() -> None:
            async for _ in batcher.generate(GenerateRequest(prompt=LONG, max_tokens=3)):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        assert e.prefix_cache_stats().blocks > 0  # reserved for the whole prompt
        task.cancel()
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await batcher.score(SMALL, timeout=30)).scores  # the worker has gone round since

    asyncio.run(run())
    batcher.stop(10)
    assert len(chunks) == 1 and batcher.running_generations() == 0
    assert e.prefix_cache_stats().blocks == 0
