"""The engine's one KV store: generations that share a cached prompt hold its pages once (referenced, not copied:
the pages held are counted), greedy tokens do not change whether the prefix is shared or each sequence computed
it alone, a finished sequence gives back its own pages, and the store never holds more than its budget: the
cache's unheld pages are evicted for running sequences, and a sequence that finds no page fails alone."""

from __future__ import annotations

import pytest

from pyscore.engine import Engine
from pyscore.model.kv_store import KVStoreFull, page_tokens
from pyscore.types import GenerateRequest
from tests.helpers import make_model_dir

B = page_tokens("cpu")  # the CPU store's page: a cache block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def engine(path, **kw) -> Engine:
    return Engine.from_pretrained(path, dtype="float32", device="cpu", threads=2, op_backend="kernel", **kw)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]


def run(e: Engine, gens) -> None:
    store = e.kv_store
    while not all(g.finished for g in gens):
        e.step(gens)
        assert store.stats.held_pages <= store.capacity


def test_generations_sharing_a_cached_prompt_hold_its_pages_once(model_dir):
    e = engine(model_dir)
    store, cache = e.kv_store, e.prefix_cache
    vocab = e.cfg.vocab_size
    prefix = tokens(1, 4 * B, vocab)  # four whole pages
    e.generate(GenerateRequest(prompt_token_ids=[*prefix, 7], max_tokens=1))  # the cache now holds them
    assert cache.stats.blocks == 4 and store.stats.held_pages == 4

    suffixes = [tokens(10 + s, 10, vocab) for s in range(6)]
    gens = [e.start_generation(GenerateRequest(prompt_token_ids=prefix + s, max_tokens=5)) for s in suffixes]
    e.step(gens)  # the prefill: each reads the prefix from the cache
    tables = [g.cache.table.pages for g in gens]
    assert all(t[:4] == tables[0][:4] for t in tables)  # the same four pages, referenced by every table
    assert all(len(t) == 5 for t in tables)  # 266 tokens (+1 to decode): one page of its own each
    # Held: the prefix once + one page per sequence. A copied prefix would hold 6 x 5 = 30 pages.
    assert store.stats.held_pages == 4 + len(gens) == 10
    run(e, gens)
    assert store.stats.held_pages == cache.stats.blocks == 4  # finished: their own pages went back

    for g, s in zip(gens, suffixes, strict=True):  # shared pages read as the sequence's own computed keys
        alone = e.generate(GenerateRequest(prompt_token_ids=prefix + s, max_tokens=5, bypass_prefix_cache=True))
        assert g.result().token_ids == alone.token_ids and g.result().usage.cached_tokens == 4 * B
        pairs = zip(g.result().logprobs, alone.logprobs, strict=True)  # within the batch-mate rounding
        assert max(abs(a.logprob - b.logprob) for a, b in pairs) <= 1e-5
    # Alone, warm (the prefix read from shared pages) = cold (computed), bitwise.
    warm = e.generate(GenerateRequest(prompt_token_ids=prefix + suffixes[0], max_tokens=5, top_logprobs=2))
    cold = e.generate(GenerateRequest(prompt_token_ids=prefix + suffixes[0], max_tokens=5, top_logprobs=2,
                                      bypass_prefix_cache=True))
    assert warm.usage.cached_tokens == 4 * B and warm.token_ids == cold.token_ids and warm.logprobs == cold.logprobs


def test_the_store_never_exceeds_its_budget(model_dir):
    probe = engine(model_dir, kv_cache_mb=1)
    page_mb = probe.kv_store.block_bytes / 2**20
    e = engine(model_dir, kv_cache_mb=8 * page_mb)
    store, cache = e.kv_store, e.prefix_cache
    assert store.capacity == 8 and cache.capacity == 8
    vocab = e.cfg.vocab_size

    for seed in range(3):  # three prompts of 3 whole pages: 9 > 8, the cache evicts its least recently used
        e.generate(GenerateRequest(prompt_token_ids=tokens(seed, 3 * B + 1, vocab), max_tokens=1))
        assert store.stats.held_pages <= 8
    assert cache.stats.evicted_blocks > 0 and cache.stats.blocks == store.stats.held_pages

    # Two prompts of 5 pages each cannot both run in 8 pages: the one that finds no page fails with KVStoreFull,
    # alone; the other takes the cache's unheld pages and finishes as it would alone (in 6 pages).
    first, second = (e.start_generation(GenerateRequest(prompt_token_ids=tokens(20 + i, 5 * B - 4, vocab),
                                                        max_tokens=20)) for i in range(2))
    run(e, [first, second])
    assert first.error is None and isinstance(second.error, KVStoreFull)
    assert store.stats.held_pages == cache.stats.blocks <= 8  # both ended: only cached pages are left
    alone = e.generate(GenerateRequest(prompt_token_ids=first.prompt, max_tokens=20, bypass_prefix_cache=True))
    assert first.result().token_ids == alone.token_ids
