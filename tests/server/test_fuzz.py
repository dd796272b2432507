"""Fuzzing through a real channel (hypothesis, derandomized: the same examples on every run): random
well-formed and malformed ScoreRequests and GenerateRequests, and raw bytes, against an in-process server —
the fake engine for speed, and a short run on the real engine over a tiny model. Only documented status
codes come back, answers that succeed are consistent (and, on the fake engine, equal to the engine called
directly), the server never dies, and a good request afterwards is still answered correctly."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pyscore import wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

WORDS = ["Yes", "No", "[M]", "<|marker|>", "a", "order", " Yes", "two words", "héllo 🙂", "\ufffd", "\x00"]
INT32 = st.integers(-(2**31), 2**31 - 1)
texts = st.one_of(st.sampled_from(WORDS), st.text(max_size=24),
                  st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join))
token_ids = st.lists(st.one_of(st.integers(-2, 420), INT32), max_size=6)
floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, -0.0, math.nan, math.inf]))


LABELS = ["Yes", "No", " Yes", " No", "A", "B"]  # single tokens for both engines
MARKERS = {"fake": "[M]", "real": "<|marker|>"}
sentences = st.lists(st.sampled_from(["the", "order", "is", "late", "Yes", "No", "héllo", "🙂", "A", "B"]),
                     min_size=1, max_size=12).map(" ".join)
models = st.sampled_from(["", "", "", "", "", "", "", "", "fake-smollm2", "other"])


@st.composite
def good_score_requests(draw: Any, marker: str) -> pb.ScoreRequest:
    """Requests that every engine must answer OK."""
    item_first = draw(st.booleans())
    msg = pb.ScoreRequest(query=draw(sentences), labels=draw(st.lists(st.sampled_from(LABELS), min_size=1,
                                                                        max_size=4, unique=True)),
                          apply_softmax=draw(st.booleans()), item_first=item_first,
                          mode=draw(st.sampled_from([0, 1] if item_first else [0, 1, 2])))
    setwise = draw(st.booleans()) and not item_first
    for _ in range(draw(st.integers(0, 8))):
        item = draw(sentences)
        msg.items.append(f"{item} {marker} {draw(sentences)} {marker}" if setwise else item)
    if setwise:
        msg.score_extraction_token = marker
    return msg


@st.composite
def wild_score_requests(draw: Any) -> pb.ScoreRequest:
    """Anything the wire can carry."""
    msg = pb.ScoreRequest(model=draw(models))
    if draw(st.booleans()):
        msg.query = draw(texts)
    if draw(st.integers(0, 3)) == 0:
        msg.query_token_ids.extend(draw(token_ids))
    if draw(st.booleans()):
        msg.items.extend(draw(st.lists(texts, max_size=10)))
    if draw(st.integers(0, 2)) == 0:
        for ids in draw(st.lists(token_ids, max_size=10)):
            msg.item_token_ids.add(ids=ids)
    if draw(st.booleans()):
        msg.labels.extend(draw(st.lists(texts, max_size=4)))
    if draw(st.integers(0, 2)) == 0:
        msg.label_token_ids.extend(draw(token_ids))
    msg.apply_softmax, msg.item_first = draw(st.booleans()), draw(st.booleans())
    msg.score_extraction_token = draw(st.one_of(st.just(""), st.just(""), texts))
    msg.mode = draw(st.one_of(st.integers(0, 2), st.integers(0, 2), INT32))  # proto3 enums are open
    return msg


def score_requests(engine: str) -> st.SearchStrategy[pb.ScoreRequest]:
    return st.one_of(good_score_requests(MARKERS[engine]), wild_score_requests())


@st.composite
def good_generate_requests(draw: Any) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(prompt=draw(sentences), max_tokens=draw(st.integers(1, 10)),
                             temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 2.0])),
                             top_p=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])), top_k=draw(st.integers(0, 50)),
                             stop=draw(st.lists(sentences, max_size=3)), top_logprobs=draw(st.integers(0, 20)))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(-(2**63), 2**63 - 1))
    return msg


@st.composite
def wild_generate_requests(draw: Any) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(model=draw(models))
    if draw(st.booleans()):
        msg.prompt = draw(texts)
    if draw(st.integers(0, 2)) == 0:
        msg.prompt_token_ids.extend(draw(token_ids))
    msg.apply_chat_template = draw(st.integers(0, 4)) == 0
    msg.max_tokens = draw(st.one_of(st.integers(-3, 12), st.sampled_from([600, 10**6, 2**31 - 1, -(2**31)])))
    msg.temperature, msg.top_p = draw(floats), draw(floats)
    msg.top_k = draw(st.one_of(st.integers(-2, 50), INT32))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(-(2**63), 2**63 - 1))
    msg.stop.extend(draw(st.one_of(st.lists(texts, max_size=3), st.lists(texts, max_size=40))))
    msg.top_logprobs = draw(st.one_of(st.integers(-2, 22), INT32))
    return msg


generate_requests = st.one_of(good_generate_requests(), wild_generate_requests())


def answered(call: Any, request: Any) -> tuple[grpc.StatusCode, Any]:
    """The status and the response (or the error message); the status is a hypothesis event, so that
    --hypothesis-show-statistics shows how many examples got how far."""
    try:
        code, answer = grpc.StatusCode.OK, call(request, timeout=10)
    except grpc.RpcError as e:
        code, answer = e.code(), e.details()
    event(code.name)
    return code, answer


def assert_score_consistent(request: pb.ScoreRequest, response: pb.ScoreResponse) -> None:
    n = len(request.items) or len(request.item_token_ids)
    assert len(response.scores) == n
    labels = len(response.label_token_ids)
    for item in response.scores:
        assert item.rows
        for row in item.rows:
            assert len(row.values) == labels and all(0.0 <= v <= 1.0 for v in row.values)


def assert_generate_consistent(request: pb.GenerateRequest, response: pb.GenerateResponse) -> None:
    assert len(response.token_ids) == len(response.logprobs) <= (request.max_tokens or wire.DEFAULT_MAX_TOKENS)
    assert response.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, pb.FINISH_REASON_EOS)
    usage = response.usage  # the prompt's whole cache blocks may come from an earlier example's
    assert usage.computed_tokens + usage.cached_tokens == usage.prompt_tokens + len(response.token_ids)


def assert_alive_and_correct(server: ServerThread, stub: Any, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    good = pb.ScoreRequest(query="where is my order", items=["track it", "refund it"], labels=["Yes", "No"])
    first, second = stub.Score(good, timeout=30), stub.Score(good, timeout=30)
    for response in (first, second):  # timing is a measurement, not part of the answer
        response.usage.ClearField("queue_duration")
        response.usage.ClearField("compute_duration")
    assert first == second and len(first.scores) == 2
    if isinstance(server.engine, FakeEngine):
        expected = FakeEngine().score("where is my order", ["track it", "refund it"], labels=["Yes", "No"])
        got = [[list(r.values) for r in i.rows] for i in first.scores]
        assert np.array_equal(np.array(got), np.array(expected.scores, dtype=np.float32))


# -- fake engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake_server() -> Iterator[ServerThread]:
    server = ServerThread(FakeEngine(), max_items=8, max_request_tokens=4096)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake_channel(fake_server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fake_server.target) as channel:
        yield channel


def not_magic(msg: Any) -> bool:
    """The fake engine fails "boom" on purpose (test_errors covers that)."""
    return "boom" not in (msg.query if isinstance(msg, pb.ScoreRequest) else msg.prompt)


@settings(FUZZ, max_examples=300)
@given(request=score_requests("fake").filter(not_magic))
def test_fuzz_score_fake(fake_server: ServerThread, fake_channel: grpc.Channel, request: pb.ScoreRequest) -> None:
    code, answer = answered(scorer_pb2_grpc.ScorerStub(fake_channel).Score, request)
    assert code in DOCUMENTED, (code, answer)
    if code == grpc.StatusCode.OK:
        assert_score_consistent(request, answer)
        expected = FakeEngine().score_batch([wire.score_request_from_proto(request)])[0]
        assert not isinstance(expected, Exception)
        got = [[list(r.values) for r in i.rows] for i in answer.scores]
        assert all(np.array_equal(np.array(g), np.array(e, dtype=np.float32))
                   for g, e in zip(got, expected.scores, strict=True))
    else:
        assert answer and "Traceback" not in answer


@settings(FUZZ, max_examples=200)
@given(request=generate_requests.filter(not_magic), stream=st.booleans())
def test_fuzz_generate_fake(fake_server: ServerThread, fake_channel: grpc.Channel, request: pb.GenerateRequest,
                            stream: bool) -> None:
    stub = scorer_pb2_grpc.ScorerStub(fake_channel)
    call = (lambda m, timeout: list(stub.GenerateStream(m, timeout=timeout))) if stream else stub.Generate
    code, answer = answered(call, request)
    assert code in DOCUMENTED, (code, answer)
    if code == grpc.StatusCode.OK and not stream:
        assert_generate_consistent(request, answer)


@settings(FUZZ, max_examples=150)
@given(method=st.sampled_from(["Score", "Generate", "Tokenize"]),
       data=st.one_of(st.binary(max_size=48),
                      st.tuples(st.binary(min_size=1, max_size=4), st.integers(0, 40)).map(
                          lambda t: pb.ScoreRequest(query="q", items=["a [M]"], labels=["Yes"],
                                                    score_extraction_token="[M]").SerializeToString()[: t[1]] + t[0])))
def test_fuzz_raw_bytes_fake(fake_server: ServerThread, fake_channel: grpc.Channel, method: str, data: bytes) -> None:
    if b"boom" in data:
        return
    code, answer = answered(fake_channel.unary_unary(f"/pyscore.v1.Scorer/{method}"), data)
    assert code in DOCUMENTED, (code, answer)


def test_fake_server_survived(fake_server: ServerThread, fake_channel: grpc.Channel) -> None:
    """Runs after the fuzz tests above (file order)."""
    assert_alive_and_correct(fake_server, scorer_pb2_grpc.ScorerStub(fake_channel), fake_channel)
    assert fake_server.batcher.waiting() == 0


# -- real engine, tiny model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_channel(tiny_server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield channel


@settings(FUZZ, max_examples=100)
@given(request=score_requests("real"))
def test_fuzz_score_real(tiny_server: ServerThread, tiny_channel: grpc.Channel, request: pb.ScoreRequest) -> None:
    request.model = "" if request.model == "fake-smollm2" else request.model
    code, answer = answered(scorer_pb2_grpc.ScorerStub(tiny_channel).Score, request)
    assert code in DOCUMENTED, (code, answer)
    if code == grpc.StatusCode.OK:
        assert_score_consistent(request, answer)


@settings(FUZZ, max_examples=60)
@given(request=generate_requests)
def test_fuzz_generate_real(tiny_server: ServerThread, tiny_channel: grpc.Channel,
                            request: pb.GenerateRequest) -> None:
    code, answer = answered(scorer_pb2_grpc.ScorerStub(tiny_channel).Generate, request)
    assert code in DOCUMENTED, (code, answer)
    if code == grpc.StatusCode.OK:
        assert_generate_consistent(request, answer)


def test_real_server_survived(tiny_server: ServerThread, tiny_channel: grpc.Channel) -> None:
    assert_alive_and_correct(tiny_server, scorer_pb2_grpc.ScorerStub(tiny_channel), tiny_channel)
