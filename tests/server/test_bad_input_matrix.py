"""The bad-input matrix on the real engine (tiny random Qwen3, 512-token context, through a real channel): each
case answers its status with a message that starts with the offending field, and a good request right after
still succeeds. Plumbing cases that the fake engine already shows live in test_errors.py; these are the ones
only the real tokenizer, vocabulary, context and sampler validation can show. Also: token ids that decode to
invalid UTF-8 are served, not crashed on."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from bench.hostile_input import GOOD_GENERATE, GOOD_SCORE, LONG
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from tests.server.conftest import ServerThread

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
VOCAB = 408  # tiny model: 400 tokenizer entries + 8 spare rows

SCORE: list[tuple[str, dict[str, Any], grpc.StatusCode, str]] = [
    ("no query", dict(query=""), INVALID, "query"),
    ("text query, id items", dict(items=[], item_token_ids=[pb.TokenIds(ids=[5, 6])]), INVALID, "item_token_ids"),
    ("empty id item", dict(query="", query_token_ids=[5], items=[], item_token_ids=[pb.TokenIds(ids=[])],
                           labels=[], label_token_ids=[7]), INVALID, "item_token_ids"),
    ("query id >= vocab", dict(query="", query_token_ids=[VOCAB], items=[], item_token_ids=[pb.TokenIds(ids=[5])]),
     INVALID, "query_token_ids"),
    ("item id negative", dict(query="", query_token_ids=[5], items=[], item_token_ids=[pb.TokenIds(ids=[-3])]),
     INVALID, "item_token_ids"),
    ("item longer than context", dict(items=[LONG]), INVALID, "items"),
    ("label id negative", dict(labels=[], label_token_ids=[-1]), INVALID, "label_token_ids"),
    ("label id = vocab", dict(labels=[], label_token_ids=[VOCAB]), INVALID, "label_token_ids"),
    ("label id huge", dict(labels=[], label_token_ids=[10**6]), INVALID, "label_token_ids"),
    ("duplicate label ids", dict(labels=[], label_token_ids=[7, 7]), INVALID, "label_token_ids"),
    ("labels and label ids", dict(label_token_ids=[7]), INVALID, "labels"),
    ("no labels, causal LM", dict(labels=[]), INVALID, "label_token_ids"),
    ("two-token label", dict(labels=["Yes please"]), INVALID, "labels"),
    ("marker not one token", dict(score_extraction_token="two words"), INVALID, "score_extraction_token"),
    ("marker missing from an item", dict(score_extraction_token="<|marker|>"), INVALID, "items"),
    ("marker inside the query", dict(query="rank <|marker|> these", items=["a <|marker|>"],
                                     score_extraction_token="<|marker|>"), INVALID, "score_extraction_token"),
    ("MIS with item_first", dict(mode=pb.SCORING_MODE_MIS, item_first=True), PRECONDITION, "mode"),
    ("unknown model", dict(model="other"), grpc.StatusCode.NOT_FOUND, "model"),
]

GENERATE: list[tuple[str, dict[str, Any], grpc.StatusCode, str]] = [
    ("max_tokens above context", dict(max_tokens=10**6), INVALID, "max_tokens"),
    ("prompt + max_tokens above context", dict(prompt=LONG[:1500], max_tokens=400), INVALID, "max_tokens"),
    ("temperature negative", dict(temperature=-0.5), INVALID, "temperature"),
    ("temperature NaN", dict(temperature=math.nan), INVALID, "temperature"),
    ("temperature inf", dict(temperature=math.inf), INVALID, "temperature"),
    ("top_p above 1", dict(top_p=1.5), INVALID, "top_p"),
    ("top_p negative", dict(top_p=-0.1), INVALID, "top_p"),
    ("top_p NaN", dict(top_p=math.nan), INVALID, "top_p"),
    ("top_k negative", dict(top_k=-1), INVALID, "top_k"),
    ("top_logprobs above limit", dict(top_logprobs=21), INVALID, "top_logprobs"),
    ("top_logprobs negative", dict(top_logprobs=-1), INVALID, "top_logprobs"),
    ("prompt_logprobs above limit", dict(prompt_logprobs=21), INVALID, "prompt_logprobs"),
    ("prompt_logprobs negative", dict(prompt_logprobs=-1), INVALID, "prompt_logprobs"),
    ("prompt_logprobs_start past the prompt", dict(prompt_logprobs=0, prompt_logprobs_start=10**6), INVALID,
     "prompt_logprobs_start"),
    ("thousands of stop strings", dict(stop=[f"s{i}" for i in range(5000)]), INVALID, "stop"),
    ("empty stop string", dict(stop=[""]), INVALID, "stop"),
    ("stop string too long", dict(stop=["x" * 300]), INVALID, "stop"),
    ("prompt id >= vocab", dict(prompt="", prompt_token_ids=[1, VOCAB]), INVALID, "prompt_token_ids"),
    ("prompt id negative", dict(prompt="", prompt_token_ids=[-7]), INVALID, "prompt_token_ids"),
    ("chat template on ids", dict(prompt="", prompt_token_ids=[5], apply_chat_template=True), INVALID,
     "apply_chat_template"),
]


@pytest.fixture(scope="module")
def stub(tiny_server: ServerThread) -> Any:
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield scorer_pb2_grpc.ScorerStub(channel)


def field_of(details: str) -> str:
    return details.split(":")[0].split("[")[0]


@pytest.mark.parametrize(("fields", "code", "field"), [c[1:] for c in SCORE], ids=[c[0] for c in SCORE])
def test_bad_score(stub: Any, fields: dict[str, Any], code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(**(GOOD_SCORE | fields)), timeout=30)
    assert err.value.code() == code, err.value.details()
    assert field_of(err.value.details()) == field, err.value.details()
    assert len(stub.Score(pb.ScoreRequest(**GOOD_SCORE), timeout=30).scores) == 2


@pytest.mark.parametrize(("fields", "code", "field"), [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE])
def test_bad_generate(stub: Any, fields: dict[str, Any], code: grpc.StatusCode, field: str) -> None:
    request = pb.GenerateRequest(**(GOOD_GENERATE | fields))
    for call in (stub.Generate, lambda m, timeout: list(stub.GenerateStream(m, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=30)
        assert err.value.code() == code, err.value.details()
        assert field_of(err.value.details()) == field, err.value.details()
    assert len(stub.Generate(pb.GenerateRequest(**GOOD_GENERATE), timeout=30).token_ids) == 3


def test_no_items_is_an_empty_answer(stub: Any) -> None:
    """Documented in the proto: no items is not an error but an empty result that costs no model work."""
    response = stub.Score(pb.ScoreRequest(**(GOOD_SCORE | dict(items=[]))), timeout=30)
    assert list(response.scores) == [] and response.usage.computed_tokens == 0


def lone_byte_ids(tiny_server: ServerThread) -> list[int]:
    """Token ids of the tiny byte-level vocabulary that are single bytes of a multi-byte UTF-8 character, so
    that any one of them alone (or several in the wrong order) decodes to invalid UTF-8."""
    tokenizer = tiny_server.engine.tokenizer
    return [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]


def test_token_ids_that_decode_to_invalid_utf8(tiny_server: ServerThread, stub: Any) -> None:
    bad = lone_byte_ids(tiny_server)
    assert len(bad) > 100
    prompt = bad[-1:] + bad[:5]  # continuation bytes first: no valid character at all
    replaced = 0
    for seed in range(3):
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=12, temperature=1.0, seed=seed,
                                     top_logprobs=20)
        unary = stub.Generate(request, timeout=30)
        chunks = list(stub.GenerateStream(request, timeout=30))
        assert "".join(c.text for c in chunks) == unary.text  # streaming holds back incomplete characters
        assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
        replaced += sum("\ufffd" in t.token for lp in unary.logprobs for t in lp.top)
    assert replaced > 0  # the test did reach tokens that decode to invalid UTF-8 (served as U+FFFD)
    tokens = stub.Tokenize(pb.TokenizeRequest(text="h\u00e9llo \U0001f642 \ufffd"), timeout=30)
    assert len(tokens.token_ids) == len(tokens.tokens) > 0
    scored = stub.Score(pb.ScoreRequest(query_token_ids=prompt, item_token_ids=[pb.TokenIds(ids=bad[5:9])],
                                        label_token_ids=bad[:2]), timeout=30)
    assert len(scored.scores[0].rows[0].values) == 2
    assert len(stub.Score(pb.ScoreRequest(**GOOD_SCORE), timeout=30).scores) == 2
