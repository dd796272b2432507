"""The server on the real pyscore.Engine (a tiny random Qwen3 built in code, fp32 on CPU): every RPC answers
what Engine answers directly and what stock transformers computes, and concurrent requests packed together
get what each gets alone."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pyscore
from pyscore.client import AsyncScorerClient, ScorerClient
from pyscore.engine import Engine
from pyscore.model.kv_store import page_tokens
from pyscore.ops import _ext
from pyscore.types import GenerateRequest
from tests.helpers import load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores
from tests.server.conftest import ServerThread, make_tiny_engine

QUERY = "Context: the order 1234 was shipped on Monday and is in transit.\nQuestion: what should the agent do?"
ITEMS = [" Proposed answer: tell the customer the order is on its way. Is this proposed answer correct?",
         " Proposed answer: cancel the order.",
         " A"]
TOL = 1e-5  # fp32 engine vs fp32 transformers, and float32 on the wire


def make_engine(path: Path) -> Engine:
    return make_tiny_engine(path)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    """A second engine, called directly: what the served one must equal."""
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def served(tiny_server: ServerThread) -> ServerThread:
    return tiny_server


@pytest.fixture
def client(served: ServerThread) -> Iterator[ScorerClient]:
    with ScorerClient(served.target, timeout=30) as c:
        yield c


def item_ids(engine: Engine, items: list[str]) -> list[list[int]]:
    return [engine.tokenize(i, add_special_tokens=False)[0] for i in items]


@pytest.mark.parametrize("mode", ["sis", "mis", "auto"])
@pytest.mark.parametrize("apply_softmax", [False, True])
def test_score_equals_engine_and_transformers(client: ScorerClient, engine: Engine, reference: Any, mode: str,
                                              apply_softmax: bool) -> None:
    got = client.score(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=apply_softmax, mode=mode)
    direct = engine.score(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=apply_softmax, mode=mode)
    assert (got.mode, got.label_token_ids, got.usage) == (direct.mode, direct.label_token_ids, direct.usage)
    assert got.mode == ("sis" if mode == "sis" else "mis")
    assert max_abs_diff(got.scores, direct.scores) <= 1e-7  # float32 rounding only
    expected = reference_scores(reference, engine.tokenize(QUERY)[0], item_ids(engine, ITEMS), got.label_token_ids,
                                apply_softmax=apply_softmax)
    assert max_abs_diff(got.scores, expected) <= TOL


def test_setwise_and_token_ids(client: ScorerClient, engine: Engine, reference: Any) -> None:
    items = [" A) ship B) cancel Scores: <|marker|> <|marker|>", " one <|marker|>"]
    marker = engine.tokenizer.convert_tokens_to_ids("<|marker|>")
    labels = [engine.tokenize(s, add_special_tokens=False)[0][0] for s in ("Yes", "No")]
    query = engine.tokenize(QUERY)[0]
    got = client.score(query, item_ids(engine, items), label_token_ids=labels, score_extraction_token="<|marker|>",
                       mode="mis")
    assert [len(rows) for rows in got.scores] == [2, 1]
    expected = reference_scores(reference, query, item_ids(engine, items), labels, marker=marker)
    assert max_abs_diff(got.scores, expected) <= TOL


def test_generate_greedy_equals_transformers_and_stream(client: ScorerClient, engine: Engine,
                                                        reference: Any) -> None:
    prompt = "Context: the order 1234 was shipped on Monday. Question:"
    unary = client.generate(prompt, max_tokens=8, top_logprobs=3)
    direct = engine.generate(GenerateRequest(prompt=prompt, max_tokens=8, top_logprobs=3))
    assert (unary.text, unary.token_ids, unary.finish_reason, unary.usage) == (
        direct.text, direct.token_ids, direct.finish_reason, direct.usage)
    assert [[t.token_id for t in lp.top] for lp in unary.logprobs] == [[t.token_id for t in lp.top]
                                                                        for lp in direct.logprobs]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(unary.logprobs, direct.logprobs, strict=True)) <= TOL
    ids = engine.tokenize(prompt)[0]
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    assert unary.token_ids == out[0, len(ids):].tolist()[: len(unary.token_ids)]
    chunks = list(client.generate_stream(prompt, max_tokens=8, top_logprobs=3))
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    assert chunks[-1].finish_reason == unary.finish_reason
    # The stream may read the prompt blocks the unary call cached (16-token pages on CPU): the same tokens, split
    # otherwise between computed and cached, whatever ran before this test.
    got, want = chunks[-1].usage, unary.usage
    assert (got.prompt_tokens, got.computed_tokens + got.cached_tokens) == (
        want.prompt_tokens, want.computed_tokens + want.cached_tokens)


def test_tokenize_and_model_info(client: ScorerClient, engine: Engine) -> None:
    assert client.tokenize(QUERY) == engine.tokenize(QUERY)
    assert client.tokenize(" A", add_special_tokens=False) == engine.tokenize(" A", add_special_tokens=False)
    ids, tokens = client.tokenize(" Yes No", add_special_tokens=False)
    assert tokens == [engine.tokenizer.decode([i]) for i in ids]  # each token's text, as generation reports it
    info = client.model_info()
    assert info.limits is not None and info.limits.max_batch_tokens == 256  # the tiny server's config
    assert info == dataclasses.replace(engine.info(), limits=info.limits, server_version=pyscore.__version__)
    assert info.kind == "causal_lm"
    assert set(info.ops) == set(_ext.REGISTRY) and all(info.ops.values())


def test_concurrent_requests_equal_alone(served: ServerThread, client: ScorerClient) -> None:
    requests: list[tuple[Any, list[Any], dict[str, Any]]] = []
    for i in range(12):
        items = [f" Proposed answer {j}: {'cancel the order ' * (1 + (i + j) % 3)}" for j in range(i % 4)]
        requests.append((f"Question {i}: what should the agent do?", items,
                         dict(labels=["Yes", "No"], mode=("auto", "sis", "mis")[i % 3], apply_softmax=i % 2 == 0)))
    alone = [client.score(q, items, **kw) for q, items, kw in requests]

    async def together() -> list[Any]:
        async with AsyncScorerClient(served.target, timeout=60) as c:
            return await asyncio.gather(*(c.score(q, items, **kw) for q, items, kw in requests))

    batches = served.batcher.stats.batches
    concurrent = asyncio.run(together())
    assert served.batcher.stats.batches - batches < len(requests)  # some requests shared a pass
    for a, b in zip(alone, concurrent, strict=True):
        assert (a.mode, a.label_token_ids, a.usage.prompt_tokens) == (b.mode, b.label_token_ids, b.usage.prompt_tokens)
        # the second run reads the first's cached blocks (queries of whole 16-token blocks): the same tokens in all
        assert a.usage.computed_tokens + a.usage.cached_tokens == b.usage.computed_tokens + b.usage.cached_tokens
        assert max_abs_diff(a.scores, b.scores) <= TOL


def test_classifier_scores_its_classes(start_server: Any, tmp_path: Path) -> None:
    path = make_model_dir(tmp_path / "cls", "qwen3", classifier=True)
    server = start_server(make_engine(path))
    direct = make_engine(path)
    with ScorerClient(server.target, timeout=30) as client:
        info = client.model_info()
        assert info.kind == "classifier" and info.num_labels == 3
        got = client.score(QUERY, ITEMS, apply_softmax=True)
        expected = direct.score(QUERY, ITEMS, apply_softmax=True)
        assert got.label_token_ids == [0, 1, 2] == expected.label_token_ids
        assert max_abs_diff(got.scores, expected.scores) <= 1e-7


def test_prefix_cache_usage_and_metrics_over_the_wire(start_server: Any, model_dir: Path) -> None:
    """A long query's second request reads its whole blocks from the cache: Usage.cached_tokens says so, the
    scores do not change, the opt-out and the salt travel, and the Prometheus endpoint counts it all."""
    from tests.server.test_metrics import scrape

    server = start_server(make_engine(model_dir), metrics_port=0)
    query = (QUERY + " ") * 5  # ~150 tokens: two whole blocks
    with ScorerClient(server.target, timeout=30) as client:
        info = client.model_info()
        block = info.prefix_cache_block_tokens
        assert block == page_tokens("cpu") and info.prefix_cache_bytes > 0
        full = len(client.tokenize(query)[0]) // block * block
        assert full >= 128
        first = client.score(query, ITEMS, labels=["Yes", "No"])
        second = client.score(query, ITEMS, labels=["Yes", "No"])
        cold = client.score(query, ITEMS, labels=["Yes", "No"], bypass_prefix_cache=True)
        salted = client.score(query, ITEMS, labels=["Yes", "No"], prefix_cache_salt="tenant")
        generated = client.generate(query, max_tokens=2)
    assert (first.usage.cached_tokens, second.usage.cached_tokens, cold.usage.cached_tokens) == (0, full, 0)
    assert salted.usage.cached_tokens == 0 and generated.usage.cached_tokens == full
    assert second.usage.computed_tokens == first.usage.computed_tokens - full
    assert first.scores == second.scores == cold.scores == salted.scores
    m = scrape(server.app.metrics_port)
    assert m[("pyscore_prefix_cache_hit_tokens_total", ())] == 2 * full
    assert m[("pyscore_prefix_cache_miss_tokens_total", ())] == 2 * full  # the first and the salted request
    assert m[("pyscore_prefix_cache_blocks", ())] == 2 * full // block  # unsalted and salted chains
    assert m[("pyscore_prefix_cache_bytes", ())] > 0 and m[("pyscore_prefix_cache_evicted_blocks_total", ())] == 0
    # the KV store: the cache's pages (the finished generation gave its own back), within its budget
    assert m[("pyscore_kv_store_held_bytes", ())] == m[("pyscore_prefix_cache_bytes", ())]
    assert m[("pyscore_kv_store_capacity_bytes", ())] >= m[("pyscore_prefix_cache_capacity_bytes", ())] > 0
    assert m[("pyscore_tokens_cached_total", (("method", "Score"),))] == full
    assert m[("pyscore_tokens_cached_total", (("method", "Generate"),))] == full
