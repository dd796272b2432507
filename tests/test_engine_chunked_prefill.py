"""Chunked prefill in the engine (pyscore.chunked_prefill): a request larger than --max-batch-tokens computes its
query / prompt in chunks of whole cache blocks and scores (and generates) bitwise as one pass does on the kernel
path; other requests run between its chunks; a request given up between chunks publishes nothing; its blocks
survive cache pressure; without room in the cache (or without a cache) it runs as one pass. Every test runs on
Qwen3.5's hybrid model too, whose chunks resume the linear layers' states kept at the previous chunk's end."""

from __future__ import annotations

import pytest

from pyscore.chunked_prefill import ChunkedPrefill
from pyscore.engine import Engine
from pyscore.errors import PassInterrupted
from pyscore.generation import SeqState
from pyscore.model.kv_store import page_tokens
from pyscore.types import Boundary, GenerateRequest, ScoreRequest
from tests.helpers import make_model_dir
from tests.reference_scoring import max_abs_diff
from tests.test_engine_prefix_cache import FP32_TOL, ITEMS, QUERY

B = page_tokens("cpu")  # the CPU store's page: a cache block
BUDGET = 2 * B  # --max-batch-tokens of the chunking engines: chunks of two blocks
LONG = QUERY + " The carrier adds that the parcel left the hub on time and the route is clear." * 4
LABELS = ["Yes", "No"]


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def engine(path, dtype="float32", backend="kernel", **kw) -> Engine:
    return Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2, op_backend=backend, **kw)


def reserved_pages(e: Engine, tokens: int) -> int:
    """The pages a chunked plan of `tokens` reserves up front: its whole blocks and, for a hybrid model, a set of
    state pages at each chunk's end (chunks of BUDGET)."""
    end = tokens // B * B
    assert e.prefix_cache is not None
    return end // B + -(-end // BUDGET) * e.prefix_cache.state_pages


@pytest.fixture
def chunks(monkeypatch) -> list[int]:
    """Tokens of every chunk pass (Score or Generate) run during the test."""
    seen: list[int] = []
    real = ChunkedPrefill.run_next

    def spy(self, decoder):
        seen.append(real(self, decoder))
        return seen[-1]

    monkeypatch.setattr(ChunkedPrefill, "run_next", spy)
    return seen


def test_the_long_query_is_several_chunks(model_dir):
    e = engine(model_dir)
    n = len(e.tokenize(LONG)[0])
    longest_item = max(len(e.tokenize(i, False)[0]) for i in ITEMS)
    assert n // B * B > 3 * BUDGET and n + longest_item <= e.cfg.max_position_embeddings


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_chunked_scores_are_bitwise_the_unchunked_ones(model_dir, mode, dtype, chunks):
    """Each chunk continues the blocks before it in the kernels' key tiles (kCachedBeforeOwn), as a warm request
    continues a cached prefix: not a bit changes. The chunked request computes each query token once."""
    whole, chunked = engine(model_dir, dtype), engine(model_dir, dtype, max_batch_tokens=BUDGET)
    n = len(chunked.tokenize(LONG)[0])
    expected = whole.score(LONG, ITEMS, labels=LABELS, mode=mode, bypass_prefix_cache=True)
    got = chunked.score(LONG, ITEMS, labels=LABELS, mode=mode)
    assert got.scores == expected.scores
    assert chunks == [BUDGET] * (n // B * B // BUDGET) + [n // B * B % BUDGET] * bool(n // B * B % BUDGET)
    assert got.usage.cached_tokens == (0 if mode == "mis" else n // B * B * (len(ITEMS) - 1))
    assert got.usage.computed_tokens == expected.usage.computed_tokens - got.usage.cached_tokens
    warm = chunked.score(LONG, ITEMS, labels=LABELS, mode=mode)  # its blocks were published at the end
    assert warm.scores == expected.scores
    assert warm.usage.cached_tokens == n // B * B * (1 if mode == "mis" else len(ITEMS))
    assert len(chunks) == -(-(n // B * B) // BUDGET)  # none more: the warm one read every block


def test_the_chunk_size_is_its_own_knob_below_the_pass_budget(model_dir, chunks):
    """Requests over the pass budget are chunked, in chunks of prefill_chunk_tokens (whole blocks); a request
    within the budget runs as one pass, however small the chunk."""
    e = engine(model_dir, max_batch_tokens=4 * B, prefill_chunk_tokens=BUDGET + B // 2)
    n = len(e.tokenize(LONG)[0])
    expected = engine(model_dir).score(LONG, ITEMS, labels=LABELS)
    assert e.score(LONG, ITEMS, labels=LABELS, bypass_prefix_cache=True).scores == expected.scores
    assert chunks[0] == BUDGET and len(chunks) == -(-(n // B * B) // BUDGET)
    within = e.prepare_score(ScoreRequest(query=LONG[: 450 * B // 64], items=ITEMS[2:3], labels=LABELS))
    assert BUDGET < within.computed_tokens <= 4 * B and e.plan_chunks(within) is None


def test_setwise_and_bypass_chunk_too_and_bypass_leaves_nothing(model_dir, chunks):
    whole, chunked = engine(model_dir), engine(model_dir, max_batch_tokens=BUDGET)
    items = [" A) ship B) cancel Scores: <|marker|> <|marker|>", "<|marker|> x <|marker|> y <|marker|>"]
    request = dict(query=LONG, items=items, labels=LABELS, score_extraction_token="<|marker|>")
    expected = whole.score(**request, bypass_prefix_cache=True)
    got = chunked.score(**request, bypass_prefix_cache=True)
    assert got.scores == expected.scores and got.usage.cached_tokens == 0 and chunks
    assert chunked.prefix_cache_stats().blocks == 0  # chunked under a salt of its own, then dropped


def test_generate_prompt_chunked_gives_the_same_tokens_and_logprobs(model_dir, chunks):
    whole, chunked = engine(model_dir), engine(model_dir, max_batch_tokens=BUDGET)
    n = len(chunked.tokenize(LONG)[0])
    request = dict(prompt=LONG, max_tokens=5, top_logprobs=3)
    expected = whole.generate(GenerateRequest(**request, bypass_prefix_cache=True))
    got = chunked.generate(GenerateRequest(**request))
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs
    assert len(chunks) == -(-((n - 1) // B * B) // BUDGET)
    assert got.usage.cached_tokens == 0 and got.usage.computed_tokens == expected.usage.computed_tokens
    assert chunked.generate(GenerateRequest(**request)).usage.cached_tokens == (n - 1) // B * B


def test_a_small_request_completes_between_chunks_of_a_big_one(model_dir):
    """What the batcher does, step by step: chunk, small request, chunk, small request, ..., the big one's last
    passes. The small one's scores are its idle scores; the big one's are its unchunked ones."""
    e = engine(model_dir, max_batch_tokens=BUDGET)
    small = ScoreRequest(query="Is the sky blue?", items=[" Yes it is", " No"], labels=LABELS)
    idle = e.score_batch([small])[0]
    big = e.prepare_score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS))
    plan = e.plan_chunks(big)
    assert plan is not None and e.plan_chunks(e.prepare_score(small)) is None
    between = 0
    while not plan.finished:
        assert e.advance_chunked(big, plan) is None  # a chunk
        assert e.score_batch([small])[0].scores == idle.scores
        between += 1
    assert between >= 3
    result = e.advance_chunked(big, plan)  # the last passes
    assert result.scores == engine(model_dir).score(LONG, ITEMS, labels=LABELS).scores


def test_given_up_between_chunks_publishes_nothing(model_dir):
    e = engine(model_dir, max_batch_tokens=BUDGET)
    big = e.prepare_score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS))
    plan = e.plan_chunks(big)
    assert e.advance_chunked(big, plan) is None and e.advance_chunked(big, plan) is None  # two chunks
    assert e.prefix_cache_stats().blocks == reserved_pages(e, len(e.tokenize(LONG)[0]))  # reserved, pending
    plan.close(ok=False)  # what the batcher does when the caller cancels or the deadline passes
    stats = e.prefix_cache_stats()
    assert stats.blocks == 0 and stats.hit_tokens == stats.miss_tokens == 0
    assert e.score(LONG, ITEMS, labels=LABELS).usage.cached_tokens == 0


def test_interrupted_inside_a_chunk_the_plan_is_as_before(model_dir):
    e = engine(model_dir, max_batch_tokens=BUDGET)
    big = e.prepare_score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS))
    plan = e.plan_chunks(big)
    assert e.advance_chunked(big, plan) is None
    done = plan.done
    e.set_boundary(lambda: Boundary.STOP)
    with pytest.raises(PassInterrupted):
        e.advance_chunked(big, plan)
    e.set_boundary(None)
    assert plan.done == done and plan.open
    while not plan.finished:
        assert e.advance_chunked(big, plan) is None
    assert e.advance_chunked(big, plan).scores == engine(model_dir).score(LONG, ITEMS, labels=LABELS).scores


def test_the_chunked_requests_blocks_survive_cache_pressure(model_dir):
    """A cache with room for the long query plus one block: other requests between its chunks evict each other,
    never its blocks (pinned / pending until it ends)."""
    probe = engine(model_dir, prefix_cache=False)
    cfg = probe.cfg
    block_mb = 2 * cfg.num_layers * B * cfg.num_kv_heads * cfg.head_dim * 4 / 2**20
    n = len(probe.tokenize(LONG)[0])
    e = engine(model_dir, max_batch_tokens=BUDGET, kv_cache_mb=(n // B + 1) * block_mb)
    big = e.prepare_score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS))
    plan = e.plan_chunks(big)
    assert plan is not None
    for k in range(4):
        e.advance_chunked(big, plan) if not plan.finished else None
        other = f"{k}: another question, with enough words to fill two cache blocks of the tiny model. " * 6
        e.score(other, ITEMS[:1], labels=LABELS)  # stores what it can: at most the one free block
    while not plan.finished:
        assert e.advance_chunked(big, plan) is None
    assert e.advance_chunked(big, plan).scores == probe.score(LONG, ITEMS, labels=LABELS).scores
    assert e.prefix_cache_stats().evicted_blocks > 0


def test_a_cache_too_small_for_the_query_runs_it_as_one_pass(model_dir, chunks):
    probe = engine(model_dir, prefix_cache=False)
    cfg = probe.cfg
    block_mb = 2 * cfg.num_layers * B * cfg.num_kv_heads * cfg.head_dim * 4 / 2**20
    e = engine(model_dir, max_batch_tokens=BUDGET, kv_cache_mb=2 * block_mb)
    got = e.score(LONG, ITEMS, labels=LABELS)
    assert not chunks and got.scores == probe.score(LONG, ITEMS, labels=LABELS).scores
    off = engine(model_dir, max_batch_tokens=BUDGET, prefix_cache=False)
    assert off.plan_chunks(off.prepare_score(ScoreRequest(query=LONG, items=ITEMS, labels=LABELS))) is None


def test_a_generation_keeps_decoding_while_another_prompt_is_chunked(model_dir):
    e = engine(model_dir, max_batch_tokens=BUDGET)
    short = e.start_generation(GenerateRequest(prompt="Hello there", max_tokens=8))
    long = e.start_generation(GenerateRequest(prompt=LONG, max_tokens=2))
    e.step([short])
    decoded_while_chunking = 0
    while long.state is SeqState.WAITING:
        before = len(short.token_ids) + short.finished
        e.step([short, long])
        decoded_while_chunking += len(short.token_ids) + short.finished > before and long.state is SeqState.WAITING
    assert decoded_while_chunking >= 3
    while not short.finished:
        e.step([short])
    assert short.result().token_ids == engine(model_dir).generate(short.request).token_ids
    while not long.finished:
        e.step([long])
    assert long.result().token_ids == engine(model_dir).generate(long.request).token_ids


def test_an_abandoned_generation_gives_its_blocks_back(model_dir):
    """What the batcher does with a generation whose caller left while its prompt was being chunked."""
    e = engine(model_dir, max_batch_tokens=BUDGET)
    long = e.start_generation(GenerateRequest(prompt=LONG, max_tokens=2))
    e.step([long])
    assert long.chunks is not None and 0 < long.chunks.done < long.chunks.end
    assert e.prefix_cache_stats().blocks == reserved_pages(e, len(long.prompt) - 1)
    long.abandon()
    assert e.prefix_cache_stats().blocks == 0


def test_reference_path_chunked_within_the_warm_cold_bound(model_dir):
    whole = engine(model_dir, backend="reference")
    chunked = engine(model_dir, backend="reference", max_batch_tokens=BUDGET)
    for mode in ("sis", "mis"):
        expected = whole.score(LONG, ITEMS, labels=LABELS, mode=mode, bypass_prefix_cache=True).scores
        got = chunked.score(LONG, ITEMS, labels=LABELS, mode=mode, bypass_prefix_cache=True).scores
        assert max_abs_diff(got, expected) <= FP32_TOL


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("q35"), "qwen3_5")


def test_hybrid_chunk_ends_are_hit_points_once_published(hybrid_dir):
    """Each chunk of a Qwen3.5 request leaves the linear layers' states at its end: published with the blocks,
    they let a later request that shares only the first chunks resume there, bitwise as a cold run."""
    e = engine(hybrid_dir, max_batch_tokens=BUDGET)
    ids = e.tokenize(LONG)[0]
    items = [e.tokenize(i, False)[0] for i in ITEMS]
    e.score(ids, items, labels=LABELS)
    other = ids[: 2 * BUDGET + 5] + ids[7:40]  # the first two chunks, then its own tokens
    warm = e.score(other, items, labels=LABELS)
    assert warm.usage.cached_tokens == 2 * BUDGET  # the blocks after the chunk end have no states: not read
    assert warm.scores == engine(hybrid_dir).score(other, items, labels=LABELS, bypass_prefix_cache=True).scores


def test_hybrid_chunks_stop_where_published_blocks_without_states_end(hybrid_dir, chunks):
    """A long Qwen3.5 query that shares blocks with a cached one beyond that one's last states (its chunk ends)
    recomputes them in its chunks without writing them again, with a chunk ending where they end: a branch point
    (pyscore.branch_points), where a third query sharing them resumes. Bitwise the cold scores throughout."""
    e = engine(hybrid_dir, max_batch_tokens=BUDGET)
    cold = engine(hybrid_dir)
    ids = e.tokenize(LONG)[0]
    items = [e.tokenize(i, False)[0] for i in ITEMS]
    shared = ids[: 2 * BUDGET + B + 3]  # past the first query's states at 2 * BUDGET, into a chunk
    queries = [shared + ids[k : k + 4 * B] for k in (40, 80, 120)]
    results = []
    for k, q in enumerate(queries):
        before = len(chunks)
        results.append(e.score(q, items, labels=LABELS))
        if k == 1:  # resumes at 2 * BUDGET; its first chunk ends at the shared blocks' end
            assert chunks[before] == B and results[-1].usage.cached_tokens == 2 * BUDGET
    assert results[2].usage.cached_tokens == 2 * BUDGET + B
    assert [r.scores for r in results] == [cold.score(q, items, labels=LABELS, bypass_prefix_cache=True).scores
                                          for q in queries]


def test_hybrid_without_room_for_the_chunks_states_runs_as_one_pass(hybrid_dir, chunks):
    probe = engine(hybrid_dir, prefix_cache=False)
    n = len(probe.tokenize(LONG)[0]) // B * B
    pages = engine(hybrid_dir)
    assert pages.prefix_cache is not None
    page_mb = pages.prefix_cache.block_bytes / 2**20
    request = ScoreRequest(query=LONG, items=ITEMS, labels=LABELS)
    sets = -(-n // BUDGET)  # chunks, each ending with a set of state pages
    roomy = engine(hybrid_dir, max_batch_tokens=BUDGET, kv_cache_mb=reserved_pages(pages, n) * page_mb)
    plan = roomy.plan_chunks(roomy.prepare_score(request))
    assert sets > 1 and plan is not None
    plan.close(ok=False)
    e = engine(hybrid_dir, max_batch_tokens=BUDGET,  # room for every block and one set of states, not one a chunk
               kv_cache_mb=(n // B + pages.prefix_cache.state_pages) * page_mb)
    assert e.plan_chunks(e.prepare_score(request)) is None
    assert e.score(LONG, ITEMS, labels=LABELS).scores == probe.score(LONG, ITEMS, labels=LABELS).scores
    assert not chunks
