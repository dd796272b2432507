"""Bad input answers its status with a message naming the field (INVALID_ARGUMENT also with a google.rpc.BadRequest
field violation naming it); an engine failure answers INTERNAL; either way the next good request succeeds."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from pyscore.client import ScorerClient, field_violations, generate_message, score_message
from tests.server.conftest import ServerThread, wait_for
from tests.server.fake_engine import FakeEngine

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
GOOD = dict(query="q", items=["a"], labels=["Yes"])

SCORE_CASES: list[tuple[str, dict[str, Any], grpc.StatusCode, str]] = [
    ("query and ids", dict(GOOD, query_token_ids=[5]), INVALID, "query_token_ids"),
    ("items and ids", dict(GOOD, item_token_ids=[pb.TokenIds(ids=[5])]), INVALID, "item_token_ids"),
    ("empty query", dict(GOOD, query=""), INVALID, "query"),
    ("no labels", dict(GOOD, labels=[]), INVALID, "label_token_ids"),
    ("multi-token label", dict(GOOD, labels=["Yes please"]), INVALID, "labels[0]"),
    ("duplicate labels", dict(GOOD, labels=["Yes", "Yes"]), INVALID, "labels"),
    ("label id out of vocab", dict(GOOD, labels=[], label_token_ids=[10**6]), INVALID, "label_token_ids"),
    ("query id out of vocab", dict(GOOD, query="", query_token_ids=[-1], items=[],
                                   item_token_ids=[pb.TokenIds(ids=[5])]), INVALID, "query_token_ids"),
    ("mixed text and ids", dict(GOOD, query="", query_token_ids=[5]), INVALID, "items"),
    ("unknown mode", dict(GOOD, mode=7), INVALID, "mode"),
    ("marker missing", dict(GOOD, score_extraction_token="[M]"), INVALID, "items[0]"),
    ("too long", dict(GOOD, items=["word " * 600]), INVALID, "items[0]"),
    ("other model", dict(GOOD, model="llama-70b"), grpc.StatusCode.NOT_FOUND, "model"),
    ("too many items", dict(GOOD, items=["a"] * 9), grpc.StatusCode.RESOURCE_EXHAUSTED, "items"),
]

GENERATE_CASES: list[tuple[str, dict[str, Any], grpc.StatusCode, str]] = [
    ("no chat template", dict(prompt="hi", apply_chat_template=True), PRECONDITION, "apply_chat_template"),
    ("prompt and ids", dict(prompt="hi", prompt_token_ids=[5]), INVALID, "prompt_token_ids"),
    ("empty prompt", dict(), INVALID, "prompt"),
    ("negative max_tokens", dict(prompt="hi", max_tokens=-1), INVALID, "max_tokens"),
    ("other model", dict(prompt="hi", model="x"), grpc.StatusCode.NOT_FOUND, "model"),
]


def assert_names_field(error: grpc.RpcError, code: grpc.StatusCode, field: str) -> None:
    """The status, the message's field prefix and, for INVALID_ARGUMENT, the one BadRequest field violation
    (AIP-193) with the same field and the rest of the message as its description."""
    assert error.code() == code, error.details()
    assert error.details().startswith(f"{field}:"), error.details()
    expected = [(field, error.details().removeprefix(f"{field}: "))] if code == INVALID else []
    assert field_violations(error) == expected


@pytest.fixture
def stub(channel: grpc.Channel) -> scorer_pb2_grpc.ScorerStub:
    return scorer_pb2_grpc.ScorerStub(channel)


@pytest.mark.parametrize(("fields", "code", "field"), [c[1:] for c in SCORE_CASES], ids=[c[0] for c in SCORE_CASES])
def test_bad_score_request(stub: scorer_pb2_grpc.ScorerStub, fields: dict[str, Any], code: grpc.StatusCode,
                           field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(**fields), timeout=10)
    assert_names_field(err.value, code, field)
    assert stub.Score(pb.ScoreRequest(**GOOD), timeout=10).scores


@pytest.mark.parametrize(("fields", "code", "field"), [c[1:] for c in GENERATE_CASES],
                         ids=[c[0] for c in GENERATE_CASES])
def test_bad_generate_request(stub: scorer_pb2_grpc.ScorerStub, fields: dict[str, Any], code: grpc.StatusCode,
                              field: str) -> None:
    for call in (stub.Generate, lambda m, timeout: list(stub.GenerateStream(m, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(pb.GenerateRequest(**fields), timeout=10)
        assert_names_field(err.value, code, field)
    assert stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=10).token_ids


def test_mis_with_item_first(client: ScorerClient) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.score("q", ["a", "b"], labels=["Yes"], mode="mis", item_first=True)
    assert err.value.code() == PRECONDITION and err.value.details().startswith("mode:")
    assert client.score("q", ["a", "b"], labels=["Yes"], item_first=True).mode == "sis"


def test_engine_failure_is_internal_and_the_server_goes_on(server: ServerThread, client: ScorerClient,
                                                            fake: FakeEngine) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.score("boom", ["a"], labels=["Yes"])
    assert err.value.code() == grpc.StatusCode.INTERNAL and "injected failure" in err.value.details()
    assert client.score("fine", ["a"], labels=["Yes"]).scores

    fake.fail_next_run = True
    with pytest.raises(grpc.RpcError) as err:
        client.score("unlucky", ["a"], labels=["Yes"])
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert client.score("fine again", ["a"], labels=["Yes"]).scores

    with pytest.raises(grpc.RpcError) as err:
        client.generate("boom", max_tokens=3)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert client.generate("fine", max_tokens=3).token_ids


def test_batch_mates_of_a_failing_request_succeed(server: ServerThread, client: ScorerClient,
                                                  fake: FakeEngine) -> None:
    fake.pause()
    first = client.stub.Score.future(score_message("first", ["a"], "", labels=["Yes"]), timeout=10)
    assert fake.wait_entered()
    mates = [client.stub.Score.future(score_message(q, ["a"], "", labels=["Yes"]), timeout=10)
             for q in ("before", "boom", "after")]
    wait_for(lambda: server.batcher.waiting() == 3, what="3 waiting requests")
    fake.resume()
    first.result()
    assert mates[0].result().scores and mates[2].result().scores
    assert mates[1].exception().code() == grpc.StatusCode.INTERNAL
    assert ["after", "before", "boom"] in [sorted(b) for b in fake.batches]  # together, in whatever arrival order


def test_unavailable_until_the_model_is_served(start_server: Any) -> None:
    server = start_server(None)  # listening, no engine yet
    with ScorerClient(server.target, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
        server.run(server.app.serve_engine(FakeEngine()))
        assert client.model_info().name == "fake-smollm2"


def test_request_larger_than_the_message_limit(start_server: Any, fake: FakeEngine) -> None:
    server = start_server(fake, max_message_mb=1)
    with grpc.insecure_channel(server.target) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        calls = fake.calls
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(pb.ScoreRequest(**dict(GOOD, items=["word " * 1000] * 300)), timeout=10)  # ~1.5 MB
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # refused by gRPC before parsing
        assert "larger than max" in err.value.details(), err.value.details()
        assert fake.calls == calls
        assert stub.Score(pb.ScoreRequest(**GOOD), timeout=10).scores


# Raw bytes no client library would send: a string field that is not UTF-8, and bytes that are no message.
NOT_UTF8 = b"\xc3\x28\xff"
RAW_CASES: list[tuple[str, str, bytes, str]] = [
    ("query not utf-8", "Score", pb.ScoreRequest(items=["a"], labels=["Yes"]).SerializeToString() + b"\x12\x03"
     + NOT_UTF8, "query"),
    ("item not utf-8", "Score", pb.ScoreRequest(query="q", labels=["Yes"]).SerializeToString() + b"\x22\x03"
     + NOT_UTF8, "items"),
    ("label not utf-8", "Score", pb.ScoreRequest(query="q", items=["a"]).SerializeToString() + b"\x3a\x03"
     + NOT_UTF8, "labels"),
    ("stop not utf-8", "Generate", pb.GenerateRequest(prompt="hi").SerializeToString() + b"\x52\x03" + NOT_UTF8,
     "stop"),
    ("prompt not utf-8", "GenerateStream", b"\x12\x03" + NOT_UTF8, "prompt"),
    ("text not utf-8", "Tokenize", b"\x0a\x03" + NOT_UTF8, "text"),
    ("truncated message", "Score", pb.ScoreRequest(**GOOD).SerializeToString()[:-2], ""),
    ("garbage", "Generate", b"\xff\xff\xff\xff", ""),
]


@pytest.mark.parametrize(("method", "payload", "field"), [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_bytes_that_are_not_a_valid_request(channel: grpc.Channel, stub: scorer_pb2_grpc.ScorerStub, method: str,
                                            payload: bytes, field: str) -> None:
    streaming = method == "GenerateStream"
    raw = (channel.unary_stream if streaming else channel.unary_unary)(f"/pyscore.v1.Scorer/{method}")
    with pytest.raises(grpc.RpcError) as err:
        response = raw(payload, timeout=10)
        if streaming:
            list(response)
    assert err.value.code() == INVALID, err.value.details()  # not grpc's UNKNOWN
    if field:
        assert err.value.details() == f"{field}: the request is not valid UTF-8"
        assert field_violations(err.value) == [(field, "the request is not valid UTF-8")]
    else:
        assert err.value.details().startswith("the request does not parse"), err.value.details()
        assert field_violations(err.value) == []
    assert stub.Score(pb.ScoreRequest(**GOOD), timeout=10).scores


def test_deadline_already_expired(server: ServerThread, fake: FakeEngine) -> None:
    """Requests whose deadline has passed by the time the server gets to them (its event loop is held for
    1 s; they allow 0.05 s): DEADLINE_EXCEEDED, and nothing reaches the engine."""
    import threading
    import time

    calls, batches = fake.calls, len(fake.batches)
    held, released = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        held.set()
        # long enough that the requests below are sent and expire inside it even when this thread is not
        # scheduled for a while after `held` (a loaded machine): else they could reach a free loop in time
        time.sleep(1.0)
        released.set()

    with ScorerClient(server.target, timeout=0.05) as client:
        server.loop.call_soon_threadsafe(hold_the_loop)
        assert held.wait(5)
        requests = [client.stub.Score.future(score_message("q", ["a"], "", labels=["Yes"]), timeout=0.05),
                    client.stub.Generate.future(generate_message("hi", ""), timeout=0.05),
                    client.stub.Tokenize.future(pb.TokenizeRequest(text="hi"), timeout=0.05)]
        for f in requests:
            assert f.exception(5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert released.wait(5)
        time.sleep(0.3)  # the freed loop's turn: a server that ran them anyway would have called the engine by now
        assert (fake.calls, len(fake.batches)) == (calls, batches)  # nothing reached the engine
        assert client.score("q", ["a"], labels=["Yes"], timeout=10).scores
