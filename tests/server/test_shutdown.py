"""Stopping with work still running. Past the grace period every unfinished call answers UNAVAILABLE (HALTED), the
same status in the log as at the client, the engine thread stops at its next layer boundary and is joined, and
`python -m server` exits 0 — on the real engine's kernel and reference paths (it used to end in `terminate called
without an active exception`, SIGABRT, with clients seeing "Cancelling all calls" and the log CANCELLED). And a
forward pass whose callers have all gone (cancelled or past their deadline) stops at its next layer boundary."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from pyscore.client import ScorerClient, generate_message, score_message
from server.batcher import HALTED
from tests.server.conftest import ServerThread, wait_for
from tests.server.fake_engine import FakeEngine
from tests.server.test_lifecycle import ROOT, free_port, in_flight

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def outcome(future: Any) -> tuple[str, str]:
    """(status name, details) of a finished call future; ("OK", "") when it succeeded."""
    error = future.exception()
    return ("OK", "") if error is None else (error.code().name, error.details())


# -- the plumbing, on the fake engine (in process) --------------------------------------------------------------
def test_past_the_grace_period_calls_answer_unavailable_and_the_engine_stops(start_server: Any,
                                                                              caplog: Any) -> None:
    fake = FakeEngine()
    server: ServerThread = start_server(fake)
    fake.delay_s, warm_up = 30, fake.calls  # each model call now takes 30 s: far past the grace period
    with ScorerClient(server.target, timeout=60) as client:
        score = client.stub.Score.future(score_message("q", ["a"], "", labels=["Yes"]), timeout=60)
        stream = client.stub.GenerateStream(generate_message("a prompt", "", max_tokens=3), timeout=60)
        wait_for(lambda: fake.calls > warm_up and len(server.batcher._live) == 2, what="both calls in the batcher")
        with caplog.at_level("INFO", logger="server.requests"):
            server.run(server.app.stop(grace=0.2))
        assert outcome(score) == ("UNAVAILABLE", HALTED)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert (err.value.code(), err.value.details()) == (UNAVAILABLE, HALTED)
    assert not server.batcher._thread.is_alive()  # joined: stopped at the fake's next "layer"
    assert server.batcher.stats.interrupted == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "server.requests"]
    assert sorted(line.split()[0] for line in logged if line.endswith("status=UNAVAILABLE")) == \
        ["GenerateStream", "Score"], logged


def test_a_pass_whose_callers_all_left_stops_at_a_layer_boundary(server: ServerThread, fake: FakeEngine) -> None:
    fake.delay_s, warm_up = 30, fake.calls
    with ScorerClient(server.target, timeout=60) as client:
        cancelled = client.stub.Score.future(score_message("q", ["a"], "", labels=["Yes"]), timeout=60)
        expired = client.stub.Score.future(score_message("r", ["b"], "", labels=["Yes"]), timeout=0.5)
        wait_for(lambda: fake.calls > warm_up, what="the pass to start")
        cancelled.cancel()
        wait_for(lambda: server.batcher.stats.interrupted == 1, what="the pass to stop")  # not after 30 s
        assert outcome(expired)[0] == "DEADLINE_EXCEEDED"
        stream = client.stub.GenerateStream(generate_message("a prompt", "", max_tokens=3), timeout=60)
        wait_for(lambda: fake.calls > warm_up + 1, what="the generation step to start")
        stream.cancel()
        wait_for(lambda: server.batcher.stats.interrupted == 2, what="the step to stop")
        fake.delay_s = 0
        assert client.score("after", ["a"], labels=["Yes"], timeout=10).scores  # the engine is free again


# -- SIGTERM on `python -m server` with the real engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 big enough that a few thousand tokens take seconds: 8 layers, hidden 256, 16k context."""
    from tests.helpers import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("slow"), "qwen3", hidden_size=256, intermediate_size=1024,
                          num_hidden_layers=8, layer_types=["full_attention"] * 8, max_position_embeddings=16384)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.parametrize(("backend", "tokens"), [("kernel", 4000), ("reference", 3000)])
def test_sigterm_past_the_grace_period_exits_0(slow_model_dir: Path, spawned: list[Any], backend: str,
                                               tokens: int) -> None:
    metrics_port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYSCORE_OP_BACKEND="reference" if backend == "reference" else "")
    cmd = [sys.executable, "-m", "server", "--model", str(slow_model_dir), "--dtype", "float32", "--threads", "1",
           "--port", "0", "--grace-s", "1", "--no-prefix-cache", "--metrics-port", str(metrics_port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(proc)
    assert proc.stdout is not None and proc.stderr is not None
    target = proc.stdout.readline().split()[3]
    while not (line := proc.stdout.readline()).startswith("pyscore: serving"):
        assert line, proc.stderr.read()
    ids = [5 + i % 300 for i in range(tokens)]
    with grpc.insecure_channel(target) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        calls = [stub.Score.future(pb.ScoreRequest(query_token_ids=ids, item_token_ids=[pb.TokenIds(ids=[7, 8])],
                                                   label_token_ids=[9]), timeout=600) for _ in range(4)]
        calls.append(stub.Generate.future(pb.GenerateRequest(prompt_token_ids=ids, max_tokens=4), timeout=600))
        wait_for(lambda: in_flight(metrics_port) == len(calls), timeout=60, what="every call at the server")
        proc.send_signal(signal.SIGTERM)
        outcomes = [outcome(f) for f in calls]
    assert proc.wait(120) == 0
    log = proc.stderr.read()
    assert "terminate called" not in log
    assert {o for o in outcomes} <= {("OK", ""), ("UNAVAILABLE", HALTED)}, outcomes
    halted = sum(o[0] == "UNAVAILABLE" for o in outcomes)
    assert halted >= 1, "the work did not outlast the grace period"
    logged = re.findall(r"server.requests: (Score|Generate) .*status=(\w+)", log)
    assert sorted(status for _, status in logged) == sorted(o[0] for o in outcomes), log[-3000:]
