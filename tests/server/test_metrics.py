"""The Prometheus endpoint, scraped over HTTP: requests by method and status, latency histograms, queue depth,
batch sizes, and tokens computed and saved by MIS against SIS."""

from __future__ import annotations

import urllib.request
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyscore.client import ScorerClient, score_message
from tests.server.conftest import ServerThread, wait_for
from tests.server.fake_engine import FakeEngine


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint(start_server: Any) -> None:
    engine = FakeEngine()
    server: ServerThread = start_server(engine, metrics_port=0)
    port = server.app.metrics_port
    assert port
    with ScorerClient(server.target, timeout=10) as client:
        sis = client.score("where is my order", ["track it", "refund it"], labels=["Yes"], mode="sis")
        mis = client.score("where is my order", ["track it", "refund it", "call back"], labels=["Yes"], mode="mis")
        gen = client.generate("hi", max_tokens=3)
        with pytest.raises(grpc.RpcError):
            client.score("q", ["a"], labels=["Yes", "Yes"])

        engine.pause()  # hold the worker so that requests pile up in the queue
        first = client.stub.Score.future(score_message("first", ["a"], "", labels=["Yes"]), timeout=10)
        assert engine.wait_entered()
        queued = [client.stub.Score.future(score_message(f"q{i}", ["a"], "", labels=["Yes"]), timeout=10)
                  for i in range(3)]
        wait_for(lambda: server.batcher.waiting() == 3, what="3 waiting requests")
        during = scrape(port)
        assert during[("pyscore_queue_depth", ())] == 3
        assert during[("pyscore_requests_in_flight", (("method", "Score"),))] == 4
        engine.resume()
        for f in [first, *queued]:
            f.result()

    m = scrape(port)
    assert m[("pyscore_requests_total", (("method", "Score"), ("status", "OK")))] == 6
    assert m[("pyscore_requests_total", (("method", "Score"), ("status", "INVALID_ARGUMENT")))] == 1
    assert m[("pyscore_requests_total", (("method", "Generate"), ("status", "OK")))] == 1
    assert m[("pyscore_request_latency_seconds_count", (("method", "Score"),))] == 7
    assert m[("pyscore_request_latency_seconds_bucket", (("le", "+Inf"), ("method", "Score")))] == 7
    assert m[("pyscore_queue_depth", ())] == 0
    assert m[("pyscore_requests_in_flight", (("method", "Score"),))] == 0
    # passes through the batcher (the warm-up calls the engine directly): sis, mis, "first", then q0-q2 together (in
    # whatever order they reached the server: calls in flight together may arrive in any order)
    assert engine.batches[-4:-1] == [["where is my order"], ["where is my order"], ["first"]]
    assert sorted(engine.batches[-1]) == ["q0", "q1", "q2"]
    assert m[("pyscore_batch_requests_count", ())] == 4
    assert m[("pyscore_batch_requests_sum", ())] == 6
    assert m[("pyscore_batch_requests_bucket", (("le", "2.0"),))] == 3
    assert m[("pyscore_batch_tokens_sum", ())] == sis.usage.computed_tokens + mis.usage.computed_tokens + 4 * 3
    assert sis.usage.prompt_tokens == sis.usage.computed_tokens  # SIS saves nothing, nor do one-item requests
    saved = mis.usage.prompt_tokens - mis.usage.computed_tokens
    assert saved > 0
    assert m[("pyscore_tokens_saved_by_mis_total", ())] == saved
    computed = sis.usage.computed_tokens + mis.usage.computed_tokens + 4 * 3  # "first"/"qN": BOS + query + item
    assert m[("pyscore_tokens_computed_total", (("method", "Score"),))] == computed
    assert m[("pyscore_tokens_computed_total", (("method", "Generate"),))] == gen.usage.computed_tokens


def test_deadline_expiry_is_logged_and_counted_as_the_client_saw_it(start_server: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A deadline that passes while the request waits (Score, Generate, GenerateStream) is DEADLINE_EXCEEDED for
    the client, in the request log and in the metrics; a client that cancels is CANCELLED in all three."""
    import logging

    caplog.set_level(logging.INFO, logger="server.requests")
    engine = FakeEngine()
    server: ServerThread = start_server(engine, metrics_port=0)
    with ScorerClient(server.target, timeout=10) as client:
        engine.pause()
        first = client.stub.Score.future(score_message("first", ["a"], "", labels=["Yes"]), timeout=30)
        assert engine.wait_entered()
        seen = []
        for call in (lambda: client.score("late", ["a"], labels=["Yes"], timeout=0.3),
                     lambda: client.generate("late", max_tokens=2, timeout=0.3),
                     lambda: list(client.generate_stream("late", max_tokens=2, timeout=0.3))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            seen.append(err.value.code())
        cancelled = client.stub.Score.future(score_message("cancelled", ["a"], "", labels=["Yes"]), timeout=10)
        wait_for(lambda: server.batcher.waiting() == 4, what="the request to be queued behind the late ones")
        cancelled.cancel()
        wait_for(lambda: sum("status=" in r.getMessage() for r in caplog.records) >= 4, what="four log lines")
        engine.resume()
        first.result()
    assert seen == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3
    lines = [r.getMessage() for r in caplog.records if "status=" in r.getMessage()]
    statuses = sorted(line.split()[0] + " " + line.rsplit("status=", 1)[1] for line in lines
                      if "status=OK" not in line)
    assert statuses == ["Generate DEADLINE_EXCEEDED", "GenerateStream DEADLINE_EXCEEDED", "Score CANCELLED",
                        "Score DEADLINE_EXCEEDED"], lines
    m = scrape(server.app.metrics_port)
    for method in ("Score", "Generate", "GenerateStream"):
        assert m[("pyscore_requests_total", (("method", method), ("status", "DEADLINE_EXCEEDED")))] == 1, method
    assert m[("pyscore_requests_total", (("method", "Score"), ("status", "CANCELLED")))] == 1
