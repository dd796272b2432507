"""The hostile-input matrix that the server's tests and `bench.bad_input_latency` both send: request bytes that
make protobuf give up, and requests whose error messages would otherwise quote megabytes of input, each with the
status and the field its answer must name; and the helpers that send them (a raw bytes-in, bytes-out call) and
watch the server meanwhile (Health checks back to back from a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pyscore._proto.pyscore.v1 import scorer_pb2 as pb

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
NOT_UTF8 = b"\xc3\x28\xff"
LONG = "word " * 600  # over the tiny test model's 512-token context
GOOD_SCORE = dict(query="Is this correct?", items=[" Yes it is", " A"], labels=["Yes", "No"])
GOOD_GENERATE = dict(prompt="The quick brown fox", max_tokens=3)


def score(**fields: Any) -> bytes:
    return pb.ScoreRequest(**(GOOD_SCORE | fields)).SerializeToString()


def generate(**fields: Any) -> bytes:
    return pb.GenerateRequest(**(GOOD_GENERATE | fields)).SerializeToString()


# (name, method, request bytes, status, field named first in the message; "" for none)
CASES: list[tuple[str, str, bytes, grpc.StatusCode, str]] = [
    # repeated fields that would take a second or more to turn into Python lists on the event loop
    ("16M label ids", "Score", score(labels=[], label_token_ids=[7] * 2**24), INVALID, "label_token_ids"),
    ("4M labels", "Score", score(labels=["a"] * 2**22), INVALID, "labels"),
    ("4M stop strings", "Generate", generate(stop=["a"] * 2**22), INVALID, "stop"),
    ("2M item_token_ids beside items", "Score", score(item_token_ids=[pb.TokenIds(ids=[5])] * 2**21),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "items"),
    ("1 MB of 0xFF", "Score", b"\xff" * 2**20, INVALID, ""),
    ("1 MB of 0xFF, generate", "Generate", b"\xff" * 2**20, INVALID, ""),
    ("1M tiny items, then a label that is not UTF-8", "Score",
     pb.ScoreRequest(query="q", items=["a"] * 2**20).SerializeToString() + b"\x3a\x03" + NOT_UTF8, INVALID, "labels"),
    ("1,000 duplicate label ids", "Score", score(labels=[], label_token_ids=[7] * 1000), INVALID, "label_token_ids"),
    ("460 KB label", "Score", score(labels=["Yes" * 153_000]), INVALID, "labels"),
    ("460 KB label of 4-byte characters", "Score", score(labels=["\U0001f642" * 115_000]), INVALID, "labels"),
    ("160 KB score_extraction_token", "Score", score(score_extraction_token="x y" * 53_000), INVALID,
     "score_extraction_token"),
    ("200 KB model name", "Score", score(model="m" * 200_000), NOT_FOUND, "model"),
    ("200 KB model name, generate", "Generate", generate(model="m" * 200_000), NOT_FOUND, "model"),
    ("200 KB stop string", "Generate", generate(stop=["s" * 200_000]), INVALID, "stop"),
    ("5,000 stop strings of 200 characters", "Generate", generate(stop=["s" * 200] * 5000), INVALID, "stop"),
    ("item over the context", "Score", score(items=[LONG * 50]), INVALID, "items"),
]


class HealthProbe:
    """Health checks back to back on their own channel, from a thread, recording each one's latency (a failed
    check counts as infinitely slow)."""

    def __init__(self, target: str) -> None:
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(target)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel)
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                self.latencies.append(time.monotonic() - start)
            except grpc.RpcError:
                self.latencies.append(float("inf"))
            time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._channel.close()


def raw_call(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    return channel.unary_unary(f"/pyscore.v1.Scorer/{method}")  # bytes in, bytes out
