"""pyscore.wire.undecodable_field: which string field of bytes that protobuf refused is not UTF-8, found by
protobuf's own parser (no Python walk over the bytes: a walk with uncapped varints took ~30 s on 1 MB of 0xFF).
And a GenerateRequest field the proto has no place for is refused by name, never dropped."""

from __future__ import annotations

import pytest

from pyscore import wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore.errors import InvalidArgument
from pyscore.types import GenerateRequest

NOT_UTF8 = b"\xc3\x28\xff"
SCORE, GENERATE = pb.ScoreRequest.DESCRIPTOR, pb.GenerateRequest.DESCRIPTOR

CASES = [
    ("query", SCORE, pb.ScoreRequest(items=["a"], mode=2).SerializeToString() + b"\x12\x03" + NOT_UTF8),
    ("items", SCORE, pb.ScoreRequest(query="q", item_token_ids=[pb.TokenIds(ids=[1, 2])]).SerializeToString()
     + b"\x22\x03" + NOT_UTF8),
    ("labels", SCORE, pb.ScoreRequest(items=["a"] * 100_000).SerializeToString() + b"\x3a\x03" + NOT_UTF8),
    ("stop", GENERATE, pb.GenerateRequest(prompt="hi", seed=-1).SerializeToString() + b"\x52\x03" + NOT_UTF8),
    ("", SCORE, b"\xff" * 2**20),  # one endless varint
    ("", SCORE, b"\x08" + b"\x80" * 10 + b"\x01"),  # an 11-byte varint
    ("", SCORE, pb.ScoreRequest(query="q", items=["a", "b"]).SerializeToString()[:-1]),  # truncated
    ("", SCORE, pb.ScoreRequest(query="q").SerializeToString()),  # nothing wrong with it
]


@pytest.mark.parametrize(("field", "descriptor", "data"), CASES)
def test_undecodable_field(field: str, descriptor: object, data: bytes) -> None:
    assert wire.undecodable_field(descriptor, data) == field


def test_stop_token_ids_are_refused_not_dropped() -> None:
    """stop_token_ids (the HTTP routes' vLLM field) has no pyscore.v1 field: a client asking for it over gRPC
    gets InvalidArgument naming it, not a generation that ignores it."""
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_to_proto(GenerateRequest(prompt="hi", stop_token_ids=[5]))
    assert info.value.field == "stop_token_ids"
    assert wire.generate_request_to_proto(GenerateRequest(prompt="hi")).prompt == "hi"
