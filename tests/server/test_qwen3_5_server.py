"""The server on a Qwen3.5 image-text-to-text checkpoint (tiny, random, fp32 on CPU): every RPC answers what the
engine answers directly (scores in every mode, setwise, token ids, generation unary and streamed, tokenize, model
info), and requests of different modes packed together get what each gets alone."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pyscore
from pyscore.client import AsyncScorerClient, ScorerClient
from pyscore.engine import Engine
from pyscore.types import GenerateRequest
from tests.helpers import make_model_dir
from tests.reference_scoring import max_abs_diff
from tests.server.conftest import ServerThread, make_tiny_engine

QUERY = "Context: the order 1234 was shipped on Monday and is in transit.\nQuestion: what should the agent do?"
ITEMS = [" Proposed answer: tell the customer the order is on its way.", " A", " Proposed answer: cancel the order."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("qwen3_5_vl"), "qwen3_5_vl")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return make_tiny_engine(model_dir)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[ServerThread]:
    server = ServerThread(make_tiny_engine(model_dir), max_batch_tokens=256)
    yield server
    server.stop()


@pytest.fixture
def client(served: ServerThread) -> Iterator[ScorerClient]:
    with ScorerClient(served.target, timeout=30) as c:
        yield c


def test_every_rpc_equals_the_engine(client: ScorerClient, engine: Engine) -> None:
    info = client.model_info()
    # limits and server_version: the server's own
    assert info == dataclasses.replace(engine.info(), limits=info.limits, server_version=pyscore.__version__)
    assert info.architecture == "Qwen3_5ForConditionalGeneration" and info.kind == "causal_lm"
    assert info.ops["gated_delta_rule"].startswith("kernel") and info.ops["causal_conv1d"].startswith("kernel")
    assert client.tokenize(QUERY) == engine.tokenize(QUERY)
    for mode in ("sis", "mis", "auto"):
        got = client.score(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True, mode=mode)
        direct = engine.score(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True, mode=mode)
        assert (got.mode, got.usage) == (direct.mode, direct.usage)
        assert max_abs_diff(got.scores, direct.scores) <= 1e-7
    query = engine.tokenize(QUERY)[0]
    items = [engine.tokenize(i, add_special_tokens=False)[0] for i in (" x <|marker|> y <|marker|>", " z <|marker|>")]
    labels = [engine.tokenize(s, add_special_tokens=False)[0][0] for s in ("Yes", "No")]
    got = client.score(query, items, label_token_ids=labels, score_extraction_token="<|marker|>")
    direct = engine.score(query, items, label_token_ids=labels, score_extraction_token="<|marker|>")
    assert [len(rows) for rows in got.scores] == [2, 1] and max_abs_diff(got.scores, direct.scores) <= 1e-7
    first = client.score(QUERY, ITEMS, labels=["Yes"], item_first=True)
    assert first.mode == "sis"
    assert max_abs_diff(first.scores, engine.score(QUERY, ITEMS, labels=["Yes"], item_first=True).scores) <= 1e-7


def test_generation_unary_and_streamed(client: ScorerClient, engine: Engine) -> None:
    prompt = "Context: the order 1234 was shipped on Monday. Question:"
    unary = client.generate(prompt, max_tokens=6, top_logprobs=2)
    direct = engine.generate(GenerateRequest(prompt=prompt, max_tokens=6, top_logprobs=2))
    assert (unary.token_ids, unary.text, unary.finish_reason) == (direct.token_ids, direct.text, direct.finish_reason)
    chunks = list(client.generate_stream(prompt, max_tokens=6))
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids


def test_concurrent_requests_equal_alone(served: ServerThread, client: ScorerClient) -> None:
    requests: list[tuple[Any, list[Any], dict[str, Any]]] = []
    for i in range(6):
        items = [f" Proposed answer {j}: {'cancel the order ' * (1 + (i + j) % 3)}" for j in range(1 + i % 3)]
        requests.append((f"Question {i}: what should the agent do?", items,
                         dict(labels=["Yes", "No"], mode=("auto", "sis", "mis")[i % 3])))
    alone = [client.score(q, items, **kw) for q, items, kw in requests]

    async def together() -> list[Any]:
        async with AsyncScorerClient(served.target, timeout=60) as c:
            return await asyncio.gather(*(c.score(q, items, **kw) for q, items, kw in requests))

    for a, b in zip(alone, asyncio.run(together()), strict=True):
        assert a.mode == b.mode and max_abs_diff(a.scores, b.scores) <= 1e-5
