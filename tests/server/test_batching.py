"""Continuous batching through a real server: requests that wait behind a forward pass are packed into the
next one in arrival order up to the token budget, results do not depend on batch-mates, generations share
steps, and cancelled, expired or refused requests never reach the engine."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import grpc
import numpy as np
import pytest

from pyscore import wire
from pyscore.client import AsyncScorerClient, ScorerClient, generate_message
from pyscore.model.kv_store import Reservations
from pyscore.types import ScoreResult
from tests.server.conftest import ServerThread, wait_for
from tests.server.fake_engine import FakeEngine


def mixed_requests(n: int) -> list[tuple[Any, Any, dict[str, Any]]]:
    """n Score requests of different shapes: text and ids, SIS/MIS/AUTO, setwise, softmax, 0-5 items."""
    out: list[tuple[Any, Any, dict[str, Any]]] = []
    for i in range(n):
        k = i % 6
        if i % 4 == 3:
            out.append(([20 + i, 21, 22][: 1 + k % 3], [[30 + j] * (1 + j) for j in range(k)],
                        dict(label_token_ids=[3, 4 + i])))
        elif i % 4 == 2:
            items = [f"option {j} [M] more [M]" for j in range(1 + k % 3)]
            out.append((f"rank request {i}", items, dict(labels=["Yes", "No"], score_extraction_token="[M]")))
        else:
            items = [f"item {i} {j} " + "word " * j for j in range(k)]
            mode = ("auto", "sis", "mis")[i % 3]
            out.append((f"query number {i}", items, dict(labels=["Yes", "No"], mode=mode, apply_softmax=i % 2 == 0)))
    return out


def test_concurrent_requests_equal_alone(server: ServerThread, client: ScorerClient, fake: FakeEngine) -> None:
    requests = mixed_requests(32)
    alone = [client.score(q, items, **kw) for q, items, kw in requests]
    batches_before = len(fake.batches)

    async def together() -> list[ScoreResult]:
        async with AsyncScorerClient(server.target, timeout=20) as c:
            return await asyncio.gather(*(c.score(q, items, **kw) for q, items, kw in requests))

    fake.delay_s = 0.02  # give arrivals time to pile up behind each pass
    concurrent = asyncio.run(together())
    assert concurrent == alone  # exact: same floats, labels, mode, usage
    sizes = [len(b) for b in fake.batches[batches_before:]]
    assert sum(sizes) == 32 and max(sizes) > 1, sizes


def _score_future(stub_client: ScorerClient, query: str, timeout: float = 10, **kw: Any) -> grpc.Future:
    from pyscore.client import score_message

    kw.setdefault("labels", ["Yes"])
    return stub_client.stub.Score.future(score_message(query, ["an item"], "", **kw), timeout=timeout)


def test_waiting_requests_share_the_next_pass(server: ServerThread, client: ScorerClient, fake: FakeEngine) -> None:
    fake.pause()
    first = _score_future(client, "first")
    assert fake.wait_entered()
    rest = []
    for i in range(5):  # one at a time: calls in flight together may arrive in any order
        rest.append(_score_future(client, f"r{i}"))
        wait_for(lambda n=i + 1: server.batcher.waiting() == n, what=f"{i + 1} waiting requests")
    fake.resume()
    for f in [first, *rest]:
        f.result()
    assert fake.batches[-2:] == [["first"], ["r0", "r1", "r2", "r3", "r4"]]


def test_token_budget_splits_in_arrival_order(start_server: Any, fake: FakeEngine) -> None:
    # each "rN" request is 1 (BOS) + 1 query + 2 item tokens = 4 tokens; "big" is larger than the budget
    server = start_server(fake, max_batch_tokens=9)
    with ScorerClient(server.target, timeout=10) as client:
        fake.pause()
        first = _score_future(client, "first")
        assert fake.wait_entered()
        queries = ["r0", "r1", "big " * 20, "r2", "r3", "r4"]
        rest = []
        for i, q in enumerate(queries):  # one at a time: calls in flight together may arrive in any order
            rest.append(_score_future(client, q))
            wait_for(lambda n=i + 1: server.batcher.waiting() == n, what=f"{i + 1} waiting requests")
        fake.resume()
        for f in [first, *rest]:
            f.result()
    assert fake.batches[-5:] == [["first"], ["r0", "r1"], [queries[2]], ["r2", "r3"], ["r4"]]


def test_generations_share_steps(server: ServerThread, client: ScorerClient, fake: FakeEngine) -> None:
    fake.pause()
    blocker = _score_future(client, "first")
    assert fake.wait_entered()
    from pyscore.client import generate_message

    gens = [client.stub.Generate.future(generate_message(f"prompt {i}", "", max_tokens=3 + i), timeout=10)
            for i in range(3)]
    wait_for(lambda: server.batcher.waiting() == 3, what="3 waiting generations")
    steps_before = len(fake.steps)
    fake.resume()
    blocker.result()
    assert [len(g.result().token_ids) for g in gens] == [3, 4, 5]
    assert fake.steps[steps_before:] == [3, 3, 3, 2, 1]


def test_cancelled_request_never_runs(server: ServerThread, client: ScorerClient, fake: FakeEngine,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.requests")
    fake.pause()
    first = _score_future(client, "first")
    assert fake.wait_entered()
    doomed = _score_future(client, "doomed")
    after = _score_future(client, "after")
    wait_for(lambda: server.batcher.waiting() == 2, what="2 waiting requests")
    doomed.cancel()
    wait_for(lambda: any("status=CANCELLED" in r.getMessage() for r in caplog.records), what="server saw the cancel")
    fake.resume()
    first.result()
    after.result()
    assert fake.batches[-2:] == [["first"], ["after"]]
    assert server.batcher.stats.dropped == 1


def test_expired_deadline_never_runs(server: ServerThread, client: ScorerClient, fake: FakeEngine,
                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.requests")
    fake.pause()
    first = _score_future(client, "first")
    assert fake.wait_entered()
    # it must reach the server (be queued) before it expires, or the server has nothing to drop: 1 s, not a
    # fraction of one, leaves a loaded machine the time to deliver it
    late = _score_future(client, "late", timeout=1.0)
    wait_for(lambda: server.batcher.waiting() == 1, what="the late request queued")
    with pytest.raises(grpc.RpcError) as err:
        late.result()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The client's clock passes the deadline first; the server's copy (set on arrival) a moment later, and the
    # client's cancel is on its way: resumed before either lands, the engine may rightly run the request.
    wait_for(lambda: any("status=DEADLINE_EXCEEDED" in r.getMessage() for r in caplog.records),
             what="the server to see the deadline pass")
    fake.resume()
    first.result()
    client.score("next", ["x"], labels=["Yes"])
    assert fake.batches[-2:] == [["first"], ["next"]]
    assert server.batcher.stats.dropped == 1


def test_cancelled_stream_frees_its_sequence(server: ServerThread, client: ScorerClient, fake: FakeEngine) -> None:
    fake.delay_s = 0.01  # 500 steps take 5 s: the cancel surely comes first
    stream = client.generate_stream("long story", max_tokens=500)
    next(stream)
    stream.close()  # cancels the call
    wait_for(lambda: server.batcher.stats.dropped == 1, what="the generation to be dropped")
    fake.delay_s = 0.0
    steps = len(fake.steps)
    assert client.generate("short", max_tokens=2).token_ids
    assert fake.steps[steps:] == [1, 1]


def test_full_queue_refuses_at_once(start_server: Any, fake: FakeEngine) -> None:
    server = start_server(fake, max_queue=2)
    with ScorerClient(server.target, timeout=10) as client:
        fake.pause()
        first = _score_future(client, "first")
        assert fake.wait_entered()
        queued = [_score_future(client, f"q{i}") for i in range(2)]
        wait_for(lambda: server.batcher.waiting() == 2, what="a full queue")
        with pytest.raises(grpc.RpcError) as err:
            client.score("refused", ["x"], labels=["Yes"], timeout=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        fake.resume()
        for f in [first, *queued]:
            f.result()
        assert client.score("afterwards", ["x"], labels=["Yes"]).scores
    assert server.batcher.stats.refused == 1


def f32(scores: list[list[list[float]]]) -> list[list[list[float]]]:
    return [[[float(np.float32(v)) for v in row] for row in rows] for rows in scores]


def _hold_worker(server: ServerThread) -> threading.Event:
    """Park the engine worker inside a job of its own until the returned event is set, so that requests sent
    meanwhile all arrive together and form one batch."""
    release, parked = threading.Event(), threading.Event()

    def park() -> None:
        parked.set()
        release.wait(10)

    asyncio.run_coroutine_threadsafe(server.batcher.call(park), server.loop)
    assert parked.wait(10)
    return release


def test_cancel_and_deadline_mid_batch(server: ServerThread, client: ScorerClient, fake: FakeEngine,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """A Score batch is one forward pass: a batch-mate that cancels, or whose deadline passes, while it runs
    has its answer discarded; the others in the same batch get exactly what they get alone."""
    caplog.set_level(logging.INFO, logger="server.requests")
    queries = ["stays", "cancels", "expires", "stays too"]
    alone = {q: FakeEngine().score(q, ["an item"], labels=["Yes"]) for q in queries}
    release = _hold_worker(server)
    fake.pause()
    futures = {q: _score_future(client, q, timeout=1.5 if q == "expires" else 10) for q in queries}
    wait_for(lambda: server.batcher.waiting() == 5, what="4 requests behind the parked worker")
    release.set()
    assert fake.wait_entered()  # the batch of four is inside run_prepared now
    futures["cancels"].cancel()
    assert futures["expires"].exception(5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: [sum(f"status={s}" in r.getMessage() for r in caplog.records)
                      for s in ("CANCELLED", "DEADLINE_EXCEEDED")] == [1, 1], what="both seen, as their clients saw")
    fake.resume()
    for q in ("stays", "stays too"):
        got = wire.score_result_from_proto(futures[q].result())
        assert f32(got.scores) == f32(alone[q].scores) and got.usage == alone[q].usage
    assert sorted(fake.batches[-1]) == sorted(queries)  # they did run together
    assert client.score("next", ["x"], labels=["Yes"]).scores


def test_generation_cancelled_or_expired_mid_batch(server: ServerThread, client: ScorerClient, fake: FakeEngine,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Generations share decode steps: one whose client cancels, and one whose deadline passes, after three
    shared steps are dropped from the steps that follow; the survivor's tokens equal its tokens alone."""
    caplog.set_level(logging.INFO, logger="server.requests")
    alone = client.generate("survivor", max_tokens=12)
    release = _hold_worker(server)
    survivor = client.stub.Generate.future(generate_message("survivor", "", max_tokens=12), timeout=30)
    expiring = client.stub.Generate.future(generate_message("expiring", "", max_tokens=100), timeout=1.5)
    cancelled = client.stub.GenerateStream(generate_message("cancelled", "", max_tokens=100), timeout=30)
    wait_for(lambda: server.batcher.waiting() == 4, what="3 generations behind the parked worker")
    steps = len(fake.steps)
    fake.pause(after=3)  # three steps shared by all three, then hold the fourth
    release.set()
    assert fake.wait_entered()
    cancelled.cancel()
    assert expiring.exception(5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: [sum(f"status={s}" in r.getMessage() for r in caplog.records)
                      for s in ("CANCELLED", "DEADLINE_EXCEEDED")] == [1, 1], what="both seen, as their clients saw")
    fake.resume()
    result = survivor.result()
    assert list(result.token_ids) == alone.token_ids and result.text == alone.text
    assert fake.steps[steps:] == [3, 3, 3, 3] + [1] * 8  # the held 4th step still had all three
    assert server.batcher.stats.dropped == 2


def test_idle_worker_trims_the_heap(server: ServerThread, client: ScorerClient,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Once out of work the worker hands freed memory back to the OS (RSS otherwise stays at its peak)."""
    import server.batcher as batcher_module

    trims: list[float] = []
    monkeypatch.setattr(batcher_module, "TRIM_EVERY_S", 0.05)
    monkeypatch.setattr(batcher_module, "trim_heap", lambda: trims.append(0.0))
    assert client.score("q", ["a"], labels=["Yes"]).scores
    wait_for(lambda: len(trims) >= 1, what="a trim after the request")
    monkeypatch.undo()
    batcher_module.trim_heap()  # the real one runs here (glibc) or does nothing


def _generate_future(client: ScorerClient, prompt: str, max_tokens: int, timeout: float = 10) -> grpc.Future:
    return client.stub.Generate.future(generate_message(prompt, "", max_tokens=max_tokens), timeout=timeout)


def _generations_behind_a_blocker(server: Any, client: ScorerClient, fake: FakeEngine, count: int,
                                  max_tokens: int) -> tuple[list[int], list[int]]:
    """`count` generations queued while a Score holds the engine, then released together: (each one's number of
    tokens, the engine's step batch sizes after the release)."""
    fake.pause()
    blocker = _score_future(client, "first")
    assert fake.wait_entered()
    gens = [_generate_future(client, f"prompt {i}", max_tokens) for i in range(count)]
    wait_for(lambda: server.batcher.waiting() == count, what=f"{count} waiting generations")
    steps_before = len(fake.steps)
    fake.resume()
    blocker.result()
    return [len(g.result().token_ids) for g in gens], fake.steps[steps_before:]


def test_generations_past_max_running_wait_their_turn(start_server: Any, fake: FakeEngine) -> None:
    server = start_server(fake, max_running_generations=2)
    with ScorerClient(server.target, timeout=10) as client:
        lengths, steps = _generations_behind_a_blocker(server, client, fake, 5, 3)
        assert lengths == [3] * 5
        # two run at a time; a finished one's place is taken at the next step, in arrival order
        assert steps == [2, 2, 2, 2, 2, 2, 1, 1, 1]


def test_kv_budget_reserves_prompt_plus_max_tokens(start_server: Any, fake: FakeEngine) -> None:
    # each generation reserves 1 (BOS) + 2 prompt + 6 new = 9 tokens; a 20-token store runs two at a time
    fake.kv = Reservations(20, 1)
    server = start_server(fake)
    with ScorerClient(server.target, timeout=10) as client:
        lengths, steps = _generations_behind_a_blocker(server, client, fake, 3, 6)
        assert lengths == [6] * 3
        assert max(steps) == 2 and sum(steps) == 18


def test_generations_reserve_whole_pages_of_the_engines_kv_store(start_server: Any, fake: FakeEngine) -> None:
    # an engine with a KV store of 128 tokens in 64-token pages: a 9-token generation reserves a whole page, so
    # two run at a time, and one of prompt + max_tokens > 128 is refused naming the one budget
    fake.kv = Reservations(128, 64)
    server = start_server(fake)
    with ScorerClient(server.target, timeout=10) as client:
        lengths, steps = _generations_behind_a_blocker(server, client, fake, 3, 6)
        assert lengths == [6] * 3
        assert max(steps) == 2 and fake.kv_tokens_reserved() == 0
        with pytest.raises(grpc.RpcError) as err:
            client.generate("short", max_tokens=127)  # prompt + 127 > 128: three pages, more than the store
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details().startswith("max_tokens:") and "--kv-cache-mb" in err.value.details()


def test_generation_that_can_never_fit_is_refused_at_once(start_server: Any, fake: FakeEngine) -> None:
    fake.kv = Reservations(20, 1)
    server = start_server(fake)
    with ScorerClient(server.target, timeout=10) as client:
        steps = len(fake.steps)
        with pytest.raises(grpc.RpcError) as err:
            client.generate("a long prompt of words", max_tokens=16)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details().startswith("max_tokens:") and "--kv-cache-mb" in err.value.details()
        assert fake.steps[steps:] == []
        assert client.generate("short", max_tokens=2).token_ids


def test_generations_waiting_for_a_slot_hold_queue_places(start_server: Any, fake: FakeEngine) -> None:
    server = start_server(fake, max_running_generations=1, max_queue=2)
    with ScorerClient(server.target, timeout=20) as client:
        fake.delay_s = 0.02  # the running generation takes 40 steps, ~1 s
        steps = len(fake.steps)  # the warm-up's
        running = _generate_future(client, "running", 40)
        wait_for(lambda: len(fake.steps) > steps, what="the first generation to run")
        queued = [_generate_future(client, f"queued {i}", 2) for i in range(2)]
        wait_for(lambda: server.batcher.waiting() == 2 and len(fake.steps) > steps + 3, what="2 generations waiting")
        with pytest.raises(grpc.RpcError) as err:
            client.generate("refused", max_tokens=2, timeout=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.value.details()
        assert [len(f.result().token_ids) for f in [running, *queued]] == [40, 2, 2]
        assert max(fake.steps[steps:]) == 1
def test_usage_reports_server_queue_wait_and_compute_time(server: ServerThread, client: ScorerClient,
                                                          fake: FakeEngine) -> None:
    """Usage.queue_duration is the wait before the first forward pass that included the request, and
    compute_duration the passes' wall time: a request queued behind a pass held for 0.3 s waited at least that
    long; the held pass itself computed at least that long; a generation's steps add up."""
    fake.pause()
    first = _score_future(client, "first")
    assert fake.wait_entered()
    second = _score_future(client, "second")
    wait_for(lambda: server.batcher.waiting() == 1, what="the second request to queue")
    threading.Event().wait(0.3)
    fake.resume()
    held, queued = (wire.usage_from_proto(f.result(10).usage) for f in (first, second))
    assert held.compute_s >= 0.3 and held.queue_s < 0.3
    assert queued.queue_s >= 0.3 and queued.compute_s < 0.3
    fake.delay_s = 0.05  # 0.25 s of steps: well above the worker's wake-up on a loaded machine (its queue wait)
    generated = client.generate("hi there", max_tokens=5).usage
    assert generated.compute_s >= 5 * 0.05 and generated.queue_s < generated.compute_s
