"""Every RPC through a real server and channel, against the FakeEngine called directly: the server must
add nothing and lose nothing but float32 rounding on the wire. Also the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any

import grpc
import numpy as np
import pytest

import pyscore
from pyscore import cli
from pyscore.client import AsyncScorerClient, ScorerClient
from pyscore.types import GenerateRequest, ScoreResult, ServerLimits
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine, word_id


def f32(result: ScoreResult) -> list[list[list[float]]]:
    return [[[float(np.float32(v)) for v in row] for row in rows] for rows in result.scores]


SCORE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("sis", dict(query="where is my order", items=["track it", "refund it", "reset password"],
                 labels=["Yes", "No"], mode="sis")),
    ("mis", dict(query="where is my order", items=["track it", "refund it"], labels=["Yes", "No"], mode="mis")),
    ("auto one item", dict(query="where is my order", items=["track it"], labels=["Yes", "No"])),
    ("softmax", dict(query="q", items=["a b", "c"], labels=["Yes", "No", "Maybe"], apply_softmax=True)),
    ("label ids", dict(query="q", items=["a", "b"], label_token_ids=[11, 12])),
    ("token ids", dict(query=[5, 6, 7], items=[[8, 9], [10]], label_token_ids=[3, 4], mode="mis")),
    ("item first", dict(query="q", items=["a", "b"], labels=["Yes"], item_first=True)),
    ("setwise", dict(query="rank these", items=["x [M] y [M]", "z [M]"], labels=["Yes", "No"],
                     score_extraction_token="[M]")),
    ("no items", dict(query="q", items=[], labels=["Yes"])),
]


@pytest.mark.parametrize("case", [c for _, c in SCORE_CASES], ids=[n for n, _ in SCORE_CASES])
def test_score_equals_engine(client: ScorerClient, case: dict[str, Any]) -> None:
    query, items = case["query"], case["items"]
    options = {k: v for k, v in case.items() if k not in ("query", "items")}
    expected = FakeEngine().score(query, items, **options)
    got = client.score(query, items, **options)
    assert f32(got) == f32(expected)
    assert got.label_token_ids == expected.label_token_ids
    assert got.mode == expected.mode
    assert got.usage == expected.usage


def test_score_response_names_the_model(server: ServerThread, channel: Any) -> None:
    from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
    from pyscore._proto.pyscore.v1 import scorer_pb2_grpc

    stub = scorer_pb2_grpc.ScorerStub(channel)
    response = stub.Score(pb.ScoreRequest(model="fake-smollm2", query="q", items=["a"], labels=["Yes"]), timeout=10)
    assert response.model == "fake-smollm2"
    assert response.mode == pb.SCORING_MODE_MIS  # unspecified: the server's choice, MIS without item_first
    assert len(response.scores) == 1 and len(response.scores[0].rows) == 1


def test_generate_equals_engine(client: ScorerClient) -> None:
    options = dict(max_tokens=7, top_logprobs=2)
    expected = FakeEngine().generate(GenerateRequest(prompt="once upon a time", **options))  # type: ignore[arg-type]
    got = client.generate("once upon a time", **options)
    assert got.text == expected.text and got.token_ids == expected.token_ids
    assert got.finish_reason == "length" and got.usage == expected.usage
    assert [(lp.token_id, lp.token, len(lp.top)) for lp in got.logprobs] == [
        (lp.token_id, lp.token, 2) for lp in expected.logprobs
    ]


@pytest.mark.parametrize("options", [dict(max_tokens=9), dict(max_tokens=20, stop=["w5"]), dict(max_tokens=6,
                         temperature=0.8, seed=3, top_logprobs=1)], ids=["length", "stop", "seeded"])
def test_stream_concatenates_to_unary(client: ScorerClient, options: dict[str, Any]) -> None:
    unary = client.generate([4, 5, 6], **options)
    chunks = list(client.generate_stream([4, 5, 6], **options))
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [lp.logprob for lp in unary.logprobs]
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == unary.finish_reason and chunks[-1].usage == unary.usage
    assert len(chunks) > 1


def test_stop_string_ends_generation(client: ScorerClient) -> None:
    full = client.generate([4, 5, 6], max_tokens=8)
    stop = full.text.split()[3]
    stopped = client.generate([4, 5, 6], max_tokens=8, stop=[stop])
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert full.text.startswith(stopped.text)


def test_tokenize_and_model_info(client: ScorerClient) -> None:
    assert client.tokenize("hello world") == ([1, word_id("hello"), word_id("world")], ["<s>", "hello", "world"])
    assert client.tokenize("hello", add_special_tokens=False) == ([word_id("hello")], ["hello"])
    info = client.model_info()
    limits = ServerLimits(max_items=8, max_request_tokens=65536, max_batch_tokens=8192,
                          max_message_bytes=8 * 1024 * 1024, max_queue=256)  # the `server` fixture's config
    # the version the wheel's metadata reads (pyproject.toml: pyscore.__version__) is the one the server reports
    assert info == dataclasses.replace(FakeEngine().info(), limits=limits, server_version=pyscore.__version__)
    assert info.server_version
    assert info.ops == {"fake_op": "python"} and info.kind == "causal_lm"


def test_async_client(server: ServerThread) -> None:
    async def main() -> None:
        async with AsyncScorerClient(server.target, timeout=10) as c:
            result = await c.score("q", ["a", "b"], labels=["Yes", "No"])
            assert f32(result) == f32(FakeEngine().score("q", ["a", "b"], labels=["Yes", "No"]))
            unary = await c.generate("hi there", max_tokens=4)
            chunks = [chunk async for chunk in c.generate_stream("hi there", max_tokens=4)]
            assert "".join(ch.text for ch in chunks) == unary.text
            assert (await c.tokenize("a b"))[0] == [1, word_id("a"), word_id("b")]
            assert (await c.model_info()).name == "fake-smollm2"

    asyncio.run(main())


def test_cli_score_table_and_json(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["score", "--target", server.target, "--query", "where is my order", "--item", "track it",
            "--item", "refund it", "--labels", "Yes", "No", "--mode", "mis"]
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "mode mis" in table and "track it" in table and "Yes" in table.splitlines()[1]
    assert re.search(r"server \d+\.\d ms queued / \d+\.\d ms computing", table.splitlines()[0]), table
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = FakeEngine().score("where is my order", ["track it", "refund it"], labels=["Yes", "No"], mode="mis")
    assert np.allclose(data["scores"], expected.scores, rtol=1e-6)
    assert data["label_token_ids"] == expected.label_token_ids


def test_cli_other_commands(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    t = ["--target", server.target]
    assert cli.main(["generate", "hello", "--max-tokens", "3", "--top-logprobs", "1", *t]) == 0
    assert "finish length" in capsys.readouterr().out
    assert cli.main(["generate", "hello", "--max-tokens", "3", "--stream", *t]) == 0
    assert "finish length" in capsys.readouterr().out
    assert cli.main(["info", *t]) == 0
    assert "fake-smollm2" in capsys.readouterr().out
    assert cli.main(["tokenize", "hello world", "--json", *t]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ["<s>", "hello", "world"]
    assert cli.main(["score", "--query", "q", "--item", "a", *t]) == 1
    assert "error: INVALID_ARGUMENT: label_token_ids" in capsys.readouterr().err


def test_server_tests_run_the_real_scoring_rules(client: ScorerClient) -> None:
    """The fake engine prepares Score requests with pyscore.scoring itself (one source of truth for
    validation and for AUTO: MIS unless item_first), so these server tests exercise the real rules."""
    from pyscore import scoring
    from pyscore.types import ScoreRequest

    assert isinstance(FakeEngine().prepare_score(ScoreRequest("q", ["a"], labels=["Yes"])), scoring.PreparedScore)
    assert client.score("q", ["a"], labels=["Yes"]).mode == "mis"
    assert client.score("q", ["a", "b"], labels=["Yes"], item_first=True).mode == "sis"
    with pytest.raises(grpc.RpcError) as err:
        client.score("q", ["a"])
    assert err.value.details().startswith("label_token_ids:")  # as Engine says it
