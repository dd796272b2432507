"""The prefix cache in the engine: a request scores the same with its query read from the cache as computed
(bitwise on the kernel path), MIS = SIS = the transformers reference with the cache warm, prefixes share exactly
their common whole blocks, requests sharing a prefix inside one batch read each other's blocks, a budget that
makes every request evict changes nothing, a failed pass publishes nothing, Generate's greedy tokens and
logprobs do not change, and Usage says what was cached."""

from __future__ import annotations

import dataclasses

import pytest

from pyscore.engine import Engine
from pyscore.model.kv_store import page_tokens
from pyscore.types import GenerateRequest, ScoreRequest
from tests.helpers import REFERENCE_TOL, count_passes, load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores

# ~300 tokens of the tiny tokenizer: four whole cache blocks and a partial one.
QUERY = ("Context: the order 1234 was shipped on Monday and is in transit. The customer asked twice. "
         "The warehouse says the stock is fine and the carrier confirms the route. ") * 3 + \
        "Question: what should the agent do next? Answer Yes or No."
ITEMS = [" Proposed answer: tell the customer the order is on its way. Is this proposed answer correct?",
         " Proposed answer: cancel the order.",
         " A",
         " Proposed answer: ask the warehouse to check the stock and the quick brown fox. Yes or No?"]
SETWISE_ITEMS = [" A) ship B) cancel Scores: <|marker|> <|marker|>", "<|marker|> x <|marker|> y <|marker|>"]
FP32_TOL = 1e-5
B = page_tokens("cpu")  # the CPU store's page: a cache block


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def block_mib(model_dir) -> float:
    """The tiny fp32 model's cache block in MiB: 2 (K, V) x layers x B tokens x kv heads x head_dim x 4 bytes."""
    cfg = engine(model_dir, prefix_cache=False).cfg
    return 2 * cfg.num_layers * B * cfg.num_kv_heads * cfg.head_dim * 4 / 2**20


def engine(path, backend="auto", dtype="float32", **kw) -> Engine:
    return Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2, op_backend=backend, **kw)


def ids(e: Engine, text: str) -> list[int]:
    return e.tokenizer(text, add_special_tokens=False)["input_ids"]


def cold_first_warm(e: Engine, **request) -> tuple:
    """The same request three times: bypassing the cache, then filling it, then reading it."""
    cold = e.score(**request, bypass_prefix_cache=True)
    first = e.score(**request)
    warm = e.score(**request)
    return cold, first, warm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_warm_scores_are_bitwise_the_cold_ones(model_dir, mode, dtype):
    """The kernel path computes cached keys exactly as a cold run would (same GEMM rows: oneDNN's bf16 rows and
    its fp32 rows for 12+ rows do not depend on M, and every pass here computes more) and reads them in the
    same key tiles: the scores do not change by a bit."""
    e = engine(model_dir, "kernel", dtype)
    query = e.tokenize(QUERY)[0]
    assert len(query) % B and len(query) >= 2 * B
    cold, first, warm = cold_first_warm(e, query=QUERY, items=ITEMS, labels=["Yes", "No"], mode=mode)
    assert cold.scores == first.scores == warm.scores
    full = len(query) // B * B
    assert cold.usage.cached_tokens == 0 and first.usage.cached_tokens == (0 if mode == "mis" else 3 * full)
    assert warm.usage.cached_tokens == full * (1 if mode == "mis" else len(ITEMS))
    assert warm.usage.computed_tokens == cold.usage.computed_tokens - warm.usage.cached_tokens
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens


@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_setwise_and_classifier_warm_equal_cold(tmp_path, model_dir, mode):
    e = engine(model_dir, "kernel")
    labels = [ids(e, "Yes")[0], ids(e, "No")[0]]
    cold, _, warm = cold_first_warm(e, query=QUERY, items=SETWISE_ITEMS, label_token_ids=labels, mode=mode,
                                    score_extraction_token="<|marker|>")
    assert [len(rows) for rows in warm.scores] == [2, 3] and warm.usage.cached_tokens > 0
    assert cold.scores == warm.scores
    clf = engine(make_model_dir(tmp_path / "clf", "qwen3", classifier=True), "kernel")
    cold, _, warm = cold_first_warm(clf, query=QUERY, items=ITEMS, apply_softmax=True, mode=mode)
    assert warm.usage.cached_tokens > 0 and cold.scores == warm.scores


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_mis_equals_sis_equals_transformers_with_the_cache_warm(model_dir, backend):
    e = engine(model_dir, backend)
    ref = load_reference(model_dir)
    labels = [ids(e, "Yes")[0], ids(e, "No")[0], ids(e, " A")[0]]
    query = e.tokenize(QUERY)[0]
    expected = reference_scores(ref, query, [ids(e, i) for i in ITEMS], labels)
    for mode in ("mis", "sis", "mis", "sis"):  # the second round reads what the first stored
        result = e.score(QUERY, ITEMS, label_token_ids=labels, mode=mode)
        assert max_abs_diff(result.scores, expected) <= FP32_TOL, (mode, backend)
    assert result.usage.cached_tokens == len(query) // B * B * len(ITEMS)
    marker = e.tokenizer.convert_tokens_to_ids("<|marker|>")
    expected = reference_scores(ref, query, [ids(e, i) for i in SETWISE_ITEMS], labels, marker=marker)
    for mode in ("mis", "sis"):
        result = e.score(QUERY, SETWISE_ITEMS, label_token_ids=labels, mode=mode, score_extraction_token="<|marker|>")
        assert result.usage.cached_tokens > 0 and max_abs_diff(result.scores, expected) <= FP32_TOL


def test_prefixes_differing_mid_block_share_only_the_blocks_before(model_dir):
    e = engine(model_dir, "kernel")
    query = e.tokenize(QUERY)[0]
    other = list(query)
    other[B + B // 2] = ids(e, " fox")[0]  # one token changed in the middle of block 1
    e.score(query, [ids(e, i) for i in ITEMS], labels=["Yes", "No"])
    result = e.score(other, [ids(e, i) for i in ITEMS], labels=["Yes", "No"])
    assert result.usage.cached_tokens == B
    cold = e.score(other, [ids(e, i) for i in ITEMS], labels=["Yes", "No"], bypass_prefix_cache=True)
    assert result.scores == cold.scores
    assert e.score(other, [ids(e, i) for i in ITEMS], labels=["Yes", "No"]).usage.cached_tokens == len(other) // B * B


def test_item_first_and_bypass_never_touch_the_cache(model_dir):
    e = engine(model_dir, "kernel")
    for request in (dict(item_first=True), dict(bypass_prefix_cache=True)):
        for _ in range(2):
            assert e.score(QUERY, ITEMS, labels=["Yes"], **request).usage.cached_tokens == 0
    assert e.prefix_cache_stats().blocks == 0


def test_different_dtypes_and_salts_never_share(model_dir):
    fp32, bf16 = engine(model_dir, "kernel"), engine(model_dir, "kernel", "bfloat16")
    fp32.score(QUERY, ITEMS, labels=["Yes"])
    assert bf16.score(QUERY, ITEMS, labels=["Yes"]).usage.cached_tokens == 0  # its own cache, its own root
    assert fp32.prefix_cache._root != bf16.prefix_cache._root
    assert fp32.score(QUERY, ITEMS, labels=["Yes"], prefix_cache_salt="t1").usage.cached_tokens == 0
    assert fp32.score(QUERY, ITEMS, labels=["Yes"], prefix_cache_salt="t1").usage.cached_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_requests_sharing_a_prefix_in_one_batch(model_dir, dtype):
    """On an empty cache, the batch's first group computes the query's blocks and the later groups of the same
    pass read them as cached keys (their rows only); every request still gets bitwise what it gets alone (the
    projections are pyscore.ops.linear, whose rows do not depend on how many share the call)."""
    e = engine(model_dir, "kernel", dtype)
    requests = [ScoreRequest(QUERY, ITEMS[:2], labels=["Yes", "No"]),
                ScoreRequest(QUERY, ITEMS[2:], labels=["No"], mode="sis"),
                ScoreRequest("héllo wörld", [" A", " B"], labels=["Yes"]),
                ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], mode="mis")]
    alone = [e.score_batch([dataclasses.replace(r, bypass_prefix_cache=True)])[0] for r in requests]
    together = e.score_batch(requests)
    full = len(e.tokenize(QUERY)[0]) // B * B
    assert [r.usage.cached_tokens for r in together] == [0, 2 * full, 0, full]
    for a, t in zip(alone, together, strict=True):
        assert t.scores == a.scores, max_abs_diff(a.scores, t.scores)
        assert t.usage.computed_tokens == a.usage.computed_tokens - t.usage.cached_tokens


def test_a_budget_so_small_that_every_request_evicts(model_dir):
    e = engine(model_dir, "kernel", kv_cache_mb=2.5 * block_mib(model_dir))
    assert e.prefix_cache.capacity == 2
    queries = [QUERY, "Preamble. " + QUERY, "Another preamble, longer. " + QUERY]
    for _ in range(2):
        for q in queries:
            result = e.score(q, ITEMS, labels=["Yes", "No"], mode="sis")
            assert result.scores == e.score(q, ITEMS, labels=["Yes", "No"], mode="sis",
                                            bypass_prefix_cache=True).scores
            # items 2..4 read the blocks item 1 wrote in the same pass; nothing survives to the next request
            assert result.usage.cached_tokens == (len(ITEMS) - 1) * 2 * B
    stats = e.prefix_cache_stats()
    assert stats.evicted_blocks >= 2 * (2 * len(queries) - 1) and stats.blocks <= 2


def test_a_failed_pass_publishes_nothing(model_dir, monkeypatch):
    e = engine(model_dir, "kernel")
    real = e.decoder.hidden_at

    def fail_after_writing(batch, **kw):
        real(batch, **kw)  # the blocks are written into the pool...
        raise RuntimeError("boom")  # ...but the pass fails

    monkeypatch.setattr(e.decoder, "hidden_at", fail_after_writing)
    with pytest.raises(RuntimeError, match="boom"):
        e.score(QUERY, ITEMS, labels=["Yes"])
    assert e.prefix_cache_stats().blocks == 0 and e.prefix_cache_stats().hit_tokens == 0
    monkeypatch.setattr(e.decoder, "hidden_at", real)
    assert e.score(QUERY, ITEMS, labels=["Yes"]).usage.cached_tokens == 0


def test_generate_greedy_tokens_and_logprobs_do_not_change(model_dir):
    e = engine(model_dir, "kernel")
    for prompt in (QUERY, "x" * 128):
        n = len(e.tokenize(prompt)[0])
        request = dict(prompt=prompt, max_tokens=6, top_logprobs=3)
        cold = e.generate(GenerateRequest(**request, bypass_prefix_cache=True))
        first = e.generate(GenerateRequest(**request))
        warm = e.generate(GenerateRequest(**request))
        assert cold.token_ids == first.token_ids == warm.token_ids and cold.text == warm.text
        assert cold.logprobs == warm.logprobs  # the chosen and the top alternatives' logprobs, bitwise
        assert warm.usage.cached_tokens == (n - 1) // B * B > 0  # the last prompt token is always computed
        assert warm.usage.computed_tokens == n - warm.usage.cached_tokens + len(warm.token_ids)
    # A Score request's query and a Generate prompt with the same tokens share blocks.
    assert e.score(QUERY, ITEMS, labels=["Yes"]).usage.cached_tokens > 0


def test_generations_prefilled_together_share_the_prompt(model_dir):
    e = engine(model_dir, "kernel")
    gens = [e.start_generation(GenerateRequest(prompt=QUERY + suffix, max_tokens=3)) for suffix in ("", " Yes", " No")]
    while not all(g.finished for g in gens):
        e.step(gens)
    cached = [g.result().usage.cached_tokens for g in gens]
    assert cached[0] == 0 and cached[1] == cached[2] > 0
    for g in gens:  # alone vs with batch-mates: the same tokens, logprobs within the batch-mate rounding
        alone = e.generate(GenerateRequest(prompt=g.request.prompt, max_tokens=3, bypass_prefix_cache=True))
        assert g.result().token_ids == alone.token_ids
        pairs = zip(g.result().logprobs, alone.logprobs, strict=True)
        assert max(abs(a.logprob - b.logprob) for a, b in pairs) <= 1e-5


def test_cache_off_and_a_store_below_one_page(model_dir):
    e = engine(model_dir, prefix_cache=False)
    assert e.prefix_cache is None and e.prefix_cache_stats() is None
    assert e.info().prefix_cache_block_tokens == 0
    assert e.score(QUERY, ITEMS, labels=["Yes"]).usage.cached_tokens == 0
    on = engine(model_dir)
    # One KV store for the cache and generations: by default the cache may fill all of it (65536 tokens + 1 GiB).
    store = on.kv_store
    assert on.info().prefix_cache_block_tokens == B
    assert on.info().prefix_cache_bytes == store.capacity * store.block_bytes
    assert store.capacity == (65536 * on.decoder.kv_bytes_per_token + 1024 * 2**20) // store.block_bytes
    with pytest.raises(ValueError, match="--kv-cache-mb"):  # no page at all: refused, naming the budget
        engine(model_dir, kv_cache_mb=1e-6)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_warm_requests_resume_the_linear_states_bitwise(hybrid_dir, dtype, in_place, monkeypatch):
    """Qwen3.5: the cache keeps the linear layers' conv tails and recurrent states at the last block it stores of a
    query, and a later request resumes there: MIS, SIS and setwise scores are bitwise the cold ones (the delta rule
    is token-sequential: the state a cold pass passes through at a block's end is the one kept). A query that
    shares only blocks without states is computed (and then kept at its own end); a longer one resumes at the
    shorter one's states. States in consecutive pages are read and written in place, others copied: both kept."""
    e = engine(hybrid_dir, "kernel", dtype)
    assert e.prefix_cache is not None and e.prefix_cache.state_pages > 0
    if not in_place:
        monkeypatch.setattr(e.prefix_cache, "state_view", lambda pages: None)
    n = len(e.tokenize(QUERY)[0])
    full = n // B * B
    cold, first, warm = cold_first_warm(e, query=QUERY, items=ITEMS, labels=["Yes", "No"], mode="mis")
    assert cold.scores == first.scores == warm.scores
    assert (first.usage.cached_tokens, warm.usage.cached_tokens) == (0, full)
    assert warm.usage.computed_tokens == cold.usage.computed_tokens - full
    cold, first, _ = cold_first_warm(e, query=QUERY, items=ITEMS, labels=["Yes", "No"], mode="sis")
    assert cold.scores == first.scores and first.usage.cached_tokens == full * len(ITEMS)
    labels = [ids(e, "Yes")[0], ids(e, "No")[0]]
    cold, _, warm = cold_first_warm(e, query=QUERY, items=SETWISE_ITEMS, label_token_ids=labels,
                                    score_extraction_token="<|marker|>")
    assert cold.scores == warm.scores and warm.usage.cached_tokens == full
    short = QUERY[:150]
    cold, first, warm = cold_first_warm(e, query=short, items=ITEMS, labels=["Yes"])
    assert cold.scores == first.scores == warm.scores
    assert (first.usage.cached_tokens, warm.usage.cached_tokens) == (0, len(e.tokenize(short)[0]) // B * B)
    longer = QUERY + " The carrier called again."
    cold, first, _ = cold_first_warm(e, query=longer, items=ITEMS, labels=["Yes"])
    assert cold.scores == first.scores and first.usage.cached_tokens == full
    # 1-2 tokens of the query after its cached blocks, fewer than the conv window: the items' windows reach back
    # into the cached tail.
    query = e.tokenize(QUERY)[0]
    for rest in (1, 2):
        cut = query[: 2 * B + rest]
        cold, first, warm = cold_first_warm(e, query=cut, items=[ids(e, i) for i in ITEMS], labels=["Yes", "No"])
        assert cold.scores == first.scores == warm.scores and warm.usage.cached_tokens == 2 * B


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_hybrid_warm_scores_equal_transformers(hybrid_dir, backend):
    e = engine(hybrid_dir, backend)
    ref = load_reference(hybrid_dir)
    labels = [ids(e, "Yes")[0], ids(e, "No")[0]]
    query = e.tokenize(QUERY)[0]
    expected = reference_scores(ref, query, [ids(e, i) for i in ITEMS], labels)
    for mode in ("mis", "mis", "sis"):
        result = e.score(QUERY, ITEMS, label_token_ids=labels, mode=mode)
        assert max_abs_diff(result.scores, expected) <= FP32_TOL, (mode, backend)
    assert result.usage.cached_tokens == len(query) // B * B * len(ITEMS)


def test_hybrid_sis_candidates_of_one_cold_request_compute_the_query_once(hybrid_dir, monkeypatch):
    """A pass publishes a hybrid query's states only when it ends, so a cold SIS request's first candidate runs in
    a pass of its own and the others resume its query in the next one: bitwise the cold scores, the query computed
    once instead of once per candidate."""
    e = engine(hybrid_dir, "kernel")
    full = len(e.tokenize(QUERY)[0]) // B * B
    passes: list[int] = []
    real = e._run_pass
    monkeypatch.setattr(e, "_run_pass", lambda chunk, *a: (passes.append(len(chunk)), real(chunk, *a))[1])
    request = dict(labels=["Yes", "No"], mode="sis")
    cold = e.score(QUERY, ITEMS, **request, bypass_prefix_cache=True)
    assert passes == [len(ITEMS)]  # bypassing the cache: nothing to resume, one pass
    first = e.score(QUERY, ITEMS, **request, prefix_cache_salt="fresh")
    assert passes[1:] == [1, len(ITEMS) - 1] and first.scores == cold.scores
    assert first.usage.cached_tokens == full * (len(ITEMS) - 1)
    assert first.usage.computed_tokens == cold.usage.computed_tokens - full * (len(ITEMS) - 1)


def test_hybrid_generate_resumes_the_prompt_states(hybrid_dir):
    e = engine(hybrid_dir, "kernel")
    n = len(e.tokenize(QUERY)[0])
    assert n % B  # the prompt's last full block ends before its last token: a hit point for the warm prompt
    request = dict(prompt=QUERY, max_tokens=6, top_logprobs=3)
    cold = e.generate(GenerateRequest(**request, bypass_prefix_cache=True))
    first = e.generate(GenerateRequest(**request))
    warm = e.generate(GenerateRequest(**request))
    assert cold.token_ids == first.token_ids == warm.token_ids and cold.logprobs == warm.logprobs
    assert (first.usage.cached_tokens, warm.usage.cached_tokens) == (0, n // B * B)
    # A Score request's query with the prompt's tokens resumes the states the generation kept.
    assert e.score(QUERY, ITEMS, labels=["Yes"]).usage.cached_tokens == n // B * B


def run_together(e: Engine, requests: list[GenerateRequest]) -> tuple[list, list[list[str]]]:
    """The requests started at once and stepped together; their results and each step's states."""
    gens = [e.start_generation(r) for r in requests]
    states = []
    while not all(g.finished for g in gens):
        e.step([g for g in gens if not g.finished])
        states.append([g.state.value for g in gens])
    return [g.result() for g in gens], states


def test_hybrid_prompts_sharing_an_uncached_prefix_compute_it_once_in_their_step(hybrid_dir, monkeypatch):
    """New prompts of one step that share whole blocks the cache does not hold (n > 1 samples of one prompt, a
    longer continuation, one system prompt): a branch pass computes the shared blocks once and keeps the states at
    their end, then every prompt resumes there in the same step's prefill; the same tokens as alone. The prompt
    the branch was computed for reports it computed, the others that they read it."""
    e = engine(hybrid_dir, "kernel")
    n = len(e.tokenize(QUERY)[0])
    readable = (n - 1) // B * B
    cold = e.generate(GenerateRequest(prompt=QUERY, max_tokens=4, bypass_prefix_cache=True))
    passes = count_passes(e, monkeypatch)
    (a, b), states = run_together(e, [GenerateRequest(prompt=QUERY, max_tokens=4, prefix_cache_salt="n=2")] * 2)
    assert states[0] == ["running", "running"] and a.token_ids == b.token_ids == cold.token_ids
    assert (a.usage.cached_tokens, b.usage.cached_tokens) == (0, readable)
    assert passes[:2] == [readable, 2 * (n - readable)]  # the branch, then both prompts' rests
    longer = [GenerateRequest(prompt=QUERY, max_tokens=2, prefix_cache_salt="grow"),
              GenerateRequest(prompt=QUERY + " Please answer briefly.", max_tokens=2, prefix_cache_salt="grow")]
    grown, states = run_together(e, longer)  # the branch is computed for the longer: the shorter ends there
    assert states[0] == ["running", "running"] and [r.usage.cached_tokens for r in grown] == [readable, 0]
    system = e.tokenize(QUERY)[0][: 5 * B + 3]
    asks = [system + ids(e, f" Question {k}: is the order late? Answer Yes or No.") for k in range(3)]
    cold = [e.generate(GenerateRequest(prompt_token_ids=p, max_tokens=3, bypass_prefix_cache=True)) for p in asks]
    together, _ = run_together(e, [GenerateRequest(prompt_token_ids=p, max_tokens=3, prefix_cache_salt="sys")
                                   for p in asks])
    assert [r.token_ids for r in together] == [r.token_ids for r in cold]
    assert [r.usage.cached_tokens for r in together] == [0, 5 * B, 5 * B]
    again, states = run_together(e, [GenerateRequest(prompt=QUERY, max_tokens=2, prefix_cache_salt="n=2")] * 2)
    assert [r.usage.cached_tokens for r in again] == [readable] * 2  # cached now: no branch pass


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_queries_that_share_a_system_prompt_resume_at_its_end(hybrid_dir, dtype, monkeypatch):
    """A Qwen3.5 pass keeps its states at one block of its query, so a later question that shares only a system
    prompt with it finds keys and values but no states there. Its branch pass computes the shared blocks and keeps
    their states; every later question with that system prompt then resumes there. Batch-mates that share one a
    cold cache does not hold compute it once. Bitwise the scores of each request alone without the cache."""
    e = engine(hybrid_dir, "kernel", dtype)
    system = e.tokenize(QUERY)[0][: 6 * B + 5]
    questions = [system + ids(e, f" Question {k}: should the agent call the carrier? Answer Yes or No.")
                 for k in range(6)]
    items = [ids(e, i) for i in ITEMS]

    def request(k: int, **kw) -> ScoreRequest:
        return ScoreRequest(questions[k], items, label_token_ids=[ids(e, "Yes")[0], ids(e, "No")[0]], **kw)

    alone = [e.score_batch([request(k, bypass_prefix_cache=True)])[0] for k in range(6)]
    passes = count_passes(e, monkeypatch)
    first = e.score_batch([request(0)])[0]  # cold: states kept at its own last block only
    assert first.usage.cached_tokens == 0 and len(passes) == 1
    second = e.score_batch([request(1)])[0]  # the system prompt's blocks are there, their states are not
    assert second.usage.cached_tokens == 0 and passes[1] == 6 * B and len(passes) == 3
    third = e.score_batch([request(2, mode="sis")])[0]
    assert third.usage.cached_tokens == 6 * B + (len(questions[2]) // B * B) * (len(items) - 1)
    assert [first.scores, second.scores, third.scores] == [a.scores for a in alone[:3]]
    fresh = [request(k, prefix_cache_salt="batch") for k in (3, 4, 5)]
    before = len(passes)
    together = e.score_batch(fresh)
    assert passes[before] == 6 * B and len(passes) == before + 2  # the shared blocks once, then the three rests
    assert [r.usage.cached_tokens for r in together] == [0, 6 * B, 6 * B]
    assert [r.scores for r in together] == [a.scores for a in alone[3:]]


def test_hybrid_failed_branch_pass_changes_nothing_but_the_work(hybrid_dir, monkeypatch, caplog):
    """A branch pass that fails is logged and dropped with everything it wrote: the request's own pass computes the
    shared part, the scores are the same, and a later request branches there."""
    e = engine(hybrid_dir, "kernel")
    system = e.tokenize(QUERY)[0][: 4 * B]
    questions = [system + ids(e, f" Question {k}: is it late? Answer Yes or No.") for k in range(3)]
    request = dict(labels=["Yes", "No"], mode="mis")
    items = [ids(e, i) for i in ITEMS]
    alone = [e.score(q, items, **request, bypass_prefix_cache=True) for q in questions]
    e.score(questions[0], items, **request)
    real = e.decoder.hidden_at
    calls: list[int] = []

    def first_fails(batch, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("branch boom")
        return real(batch, **kw)

    monkeypatch.setattr(e.decoder, "hidden_at", first_fails)
    held = e.prefix_cache_stats().blocks
    second = e.score(questions[1], items, **request)
    assert "branch pass failed" in caplog.text and len(calls) == 2  # the branch pass, then the request's own
    assert second.scores == alone[1].scores and second.usage.cached_tokens == 0
    assert e.prefix_cache_stats().blocks > held  # its own pass stored its blocks and states as without a branch
    monkeypatch.setattr(e.decoder, "hidden_at", real)
    third = e.score(questions[2], items, **request)
    assert third.scores == alone[2].scores and third.usage.cached_tokens == 0  # the branch ran for it...
    fourth = system + ids(e, " Question 9: is it late? Answer Yes or No.")
    assert e.score(fourth, items, **request).usage.cached_tokens == 4 * B  # ...and its states stay


def test_other_families_never_hold_a_prompt_back(model_dir):
    e = engine(model_dir, "kernel")
    _, states = run_together(e, [GenerateRequest(prompt=QUERY, max_tokens=2)] * 2)
    assert states[0] == ["running", "running"]  # later groups read the blocks an earlier one writes in the pass


def test_hybrid_failed_pass_keeps_no_states_and_a_small_cache_still_serves(hybrid_dir, monkeypatch):
    e = engine(hybrid_dir, "kernel")
    real = e.decoder.hidden_at

    def fail_after_writing(batch, **kw):
        real(batch, **kw)  # keys, values and states are written into the pool...
        raise RuntimeError("boom")  # ...but the pass fails

    monkeypatch.setattr(e.decoder, "hidden_at", fail_after_writing)
    with pytest.raises(RuntimeError, match="boom"):
        e.score(QUERY, ITEMS, labels=["Yes"])
    assert e.prefix_cache_stats().blocks == 0 and e.kv_store.stats.held_pages == 0
    monkeypatch.setattr(e.decoder, "hidden_at", real)
    # A cache with room for one query's blocks and states at a time: requests evict each other, scores hold.
    cache = e.prefix_cache
    budget = (len(e.tokenize(QUERY)[0]) // B + cache.state_pages + 2) * cache.block_bytes
    small = engine(hybrid_dir, "kernel", kv_cache_mb=budget / 2**20)
    for q in (QUERY, "Preamble. " + QUERY, QUERY):
        result = small.score(q, ITEMS, labels=["Yes", "No"])
        assert result.scores == small.score(q, ITEMS, labels=["Yes", "No"], bypass_prefix_cache=True).scores
    assert small.prefix_cache_stats().evicted_blocks > 0
    assert small.prefix_cache_stats().blocks <= small.prefix_cache.capacity


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_warm_is_within_tolerance_of_cold_on_the_reference_path(model_dir, mode, dtype):
    """The reference path reads the same cached keys but sums a different key axis (its dense softmax) and its
    GEMMs block other row counts: warm = cold within REFERENCE_TOL, not bitwise (docs/guarantees.md)."""
    e = engine(model_dir, "reference", dtype)
    cold, first, warm = cold_first_warm(e, query=QUERY, items=ITEMS, labels=["Yes", "No"], mode=mode)
    assert warm.usage.cached_tokens > 0
    assert max_abs_diff(cold.scores, warm.scores) <= REFERENCE_TOL[dtype]
    assert max_abs_diff(cold.scores, first.scores) <= REFERENCE_TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_warm_passes_of_few_rows_are_bitwise_the_cold_ones(model_dir, dtype):
    """A warm pass that computes two tokens gives the cold pass's bits: torch's GEMMs (oneDNN / MKL) take other
    micro-kernels for a handful of rows, pyscore.ops.linear does not."""
    e = engine(model_dir, "kernel", dtype)
    query = e.tokenize(QUERY)[0][: 2 * B + 1]  # two whole blocks and one token
    cold, _, warm = cold_first_warm(e, query=query, items=[[5]], labels=["Yes", "No"])
    assert warm.usage.computed_tokens == 2 and warm.usage.cached_tokens == 2 * B
    assert warm.scores == cold.scores, max_abs_diff(cold.scores, warm.scores)
