"""Engine scores equal an independent one-sequence-per-item transformers reference on every execution path:
SIS and MIS, kernel and reference ops, pointwise and setwise, item_first, token-id inputs, labels as strings,
apply_softmax both ways, classification heads; and a request's scores do not depend on its batch-mates."""

from __future__ import annotations

import pytest
import torch

import pyscore.engine as engine_module
from pyscore.engine import Engine
from pyscore.types import ScoreRequest
from tests.helpers import REFERENCE_TOL, load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores

QUERY = "Context: the order 1234 was shipped on Monday and is in transit.\nQuestion: what should the agent do?"
ITEMS = [" Proposed answer: tell the customer the order is on its way. Is this proposed answer correct?",
         " Proposed answer: cancel the order.",
         " A",
         " Proposed answer: ask the warehouse to check the stock and the quick brown fox. Yes or No?"]
FP32_TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def engine(path, backend="auto", dtype="float32", **kw) -> Engine:
    return Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2, op_backend=backend, **kw)


def label_ids(e: Engine, labels=("Yes", "No", " A")) -> list[int]:
    return [e.tokenizer(label, add_special_tokens=False)["input_ids"][0] for label in labels]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("mode", ["sis", "mis"])
@pytest.mark.parametrize("apply_softmax", [False, True])
def test_pointwise_matches_reference(model_dir, reference, backend, mode, apply_softmax):
    e = engine(model_dir, backend)
    labels = label_ids(e)
    result = e.score(QUERY, ITEMS, label_token_ids=labels, apply_softmax=apply_softmax, mode=mode)
    query, items = e.prepare_score(ScoreRequest(QUERY, ITEMS, label_token_ids=labels)).query, None
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    expected = reference_scores(reference, query, items, labels, apply_softmax=apply_softmax)
    assert result.mode == mode and result.label_token_ids == labels
    assert [len(rows) for rows in result.scores] == [1] * len(ITEMS)
    assert max_abs_diff(result.scores, expected) <= FP32_TOL


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_label_softmax_reads_only_the_label_rows_of_the_lm_head(model_dir, backend, monkeypatch):
    """apply_softmax true needs the labels' logits alone: no call walks the vocabulary for such rows (one call per
    label set, over those labels' LM-head rows), and the scores are the full walk's label softmax. Rows that ask for
    probabilities still get the full walk, in the same batch."""
    e = engine(model_dir, backend)
    vocab = e.decoder.w.lm_head.shape[0]
    walked: list[int] = []
    real = engine_module.label_logprobs

    def spy(hidden, weight, labels, backend="auto"):
        walked.append(weight.shape[0])
        return real(hidden, weight, labels, backend=backend)

    monkeypatch.setattr(engine_module, "label_logprobs", spy)
    soft = ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True)
    other = ScoreRequest(QUERY, ITEMS[:2], labels=["No"], apply_softmax=True)
    (alone,) = e.score_batch([soft])
    assert walked == [2]
    walked.clear()
    probs = ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"])
    together = e.score_batch([probs, soft, other])
    assert sorted(walked) == [1, 2, vocab]  # the probability rows' walk, then one call per label set
    if backend == "kernel":  # a row's label set alone decides its call (the reference path's GEMMs are not
        assert together[1].scores == alone.scores  # batch-invariant: test_scores_alone_and_packed_with_strangers)
    # The same values as the full walk's label softmax (the vocabulary-wide log-sum-exp cancels).
    expected = [[[p / sum(row) for p in row] for row in item] for item in together[0].scores]
    assert together[0].label_token_ids == label_ids(e, ("Yes", "No"))
    assert max_abs_diff(alone.scores, expected) <= FP32_TOL


def test_mis_equals_sis_and_computes_less(model_dir):
    e = engine(model_dir)
    cold = dict(labels=["Yes", "No"], bypass_prefix_cache=True)  # the query is whole cache blocks: none read here
    sis = e.score(QUERY, ITEMS, mode="sis", **cold)
    mis = e.score(QUERY, ITEMS, mode="mis", **cold)
    auto = e.score(QUERY, ITEMS, **cold)
    assert auto.mode == "mis"
    assert max_abs_diff(sis.scores, mis.scores) <= FP32_TOL
    assert mis.usage.prompt_tokens == sis.usage.prompt_tokens == sis.usage.computed_tokens
    assert mis.usage.computed_tokens < sis.usage.computed_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mis_and_sis_are_bitwise_equal_on_the_kernel_path(model_dir, dtype):
    """SIS runs each query+item as its own sequence whose query is its prefix, so the attention kernel splits key
    tiles where MIS does: same arithmetic, same bits, in bf16 too (setwise and apply_softmax alike)."""
    e = engine(model_dir, "kernel", dtype)
    for kw in (dict(labels=["Yes", "No"]), dict(labels=["Yes"], apply_softmax=True)):
        sis, mis = (e.score(QUERY, ITEMS, mode=m, **kw) for m in ("sis", "mis"))
        assert sis.scores == mis.scores, max_abs_diff(sis.scores, mis.scores)
    items = [" first <|marker|> then <|marker|> end", " one <|marker|>"]
    sis, mis = (e.score(QUERY, items, labels=["Yes"], score_extraction_token="<|marker|>", mode=m)
                for m in ("sis", "mis"))
    assert sis.scores == mis.scores and [len(r) for r in mis.scores] == [2, 1]


def test_bf16_within_torch_bf16_error(model_dir, reference):
    e = engine(model_dir, dtype="bfloat16")
    labels = label_ids(e)
    query = e.prepare_score(ScoreRequest(QUERY, ITEMS, label_token_ids=labels)).query
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    expected = reference_scores(reference, query, items, labels)
    torch_bf16 = reference_scores(load_reference(model_dir).to(torch.bfloat16), query, items, labels)
    torch_err = max_abs_diff(torch_bf16, expected)
    for mode in ("sis", "mis"):
        ours = e.score(QUERY, ITEMS, label_token_ids=labels, mode=mode).scores
        assert max_abs_diff(ours, expected) <= 2 * torch_err + 1e-4, (mode, max_abs_diff(ours, expected), torch_err)


@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_setwise_rows_at_every_marker(model_dir, reference, mode):
    e = engine(model_dir)
    labels = label_ids(e, ("Yes", "No"))
    items = [" A) ship B) cancel Scores: <|marker|> <|marker|>", " one <|marker|>",
             "<|marker|> x <|marker|> y <|marker|>"]
    result = e.score(QUERY, items, label_token_ids=labels, score_extraction_token="<|marker|>", mode=mode)
    marker = e.tokenizer.convert_tokens_to_ids("<|marker|>")
    query = e.tokenize(QUERY)[0]
    item_ids = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in items]
    expected = reference_scores(reference, query, item_ids, labels, marker=marker)
    assert [len(rows) for rows in result.scores] == [2, 1, 3]
    assert max_abs_diff(result.scores, expected) <= FP32_TOL


def test_item_first_runs_sis_and_matches(model_dir, reference):
    e = engine(model_dir)
    labels = label_ids(e)
    result = e.score(QUERY, ITEMS, label_token_ids=labels, item_first=True)
    query = e.tokenize(QUERY)[0]
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    assert result.mode == "sis"
    assert max_abs_diff(result.scores, reference_scores(reference, query, items, labels, item_first=True)) <= FP32_TOL


def test_token_ids_and_label_strings_equal_text_and_ids(model_dir):
    e = engine(model_dir)
    labels = label_ids(e, ("Yes", "No"))
    by_text = e.score(QUERY, ITEMS, label_token_ids=labels)
    query = e.tokenize(QUERY)[0]
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    by_ids = e.score(query, items, labels=["Yes", "No"])
    assert by_ids.label_token_ids == labels
    assert max_abs_diff(by_text.scores, by_ids.scores) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_do_not_depend_on_batch_mates(model_dir, dtype):
    e = engine(model_dir, dtype=dtype)
    target = ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True)
    others = [ScoreRequest("Question: B?", [" x", " the quick brown fox"], labels=["No", "Yes"], mode="sis"),
              ScoreRequest("héllo wörld", [" A", " B", " C"], labels=["Yes"]),
              ScoreRequest(QUERY + QUERY, ITEMS[:2], labels=["Yes", "No"], item_first=True)]
    alone = e.score_batch([target])[0]
    for batch in ([others[0], target, others[1]], [*others, target], [target, others[2]]):
        together = e.score_batch(batch)[batch.index(target)]
        # Same tokens, same positions, same keys: only the GEMM row blocking can differ (bitwise: below).
        assert max_abs_diff(alone.scores, together.scores) <= (1e-6 if dtype == "float32" else 2e-3)


STRANGERS = [ScoreRequest("Question: B?", [" x", " the quick brown fox"], labels=["No", "Yes"], mode="sis"),
             ScoreRequest("héllo wörld", [" A", " B", " C"], labels=["Yes"]),
             ScoreRequest(QUERY + QUERY, ITEMS[:2], labels=["Yes", "No"], item_first=True),
             ScoreRequest("Yes", [" No"] * 9, labels=["Yes"], mode="mis"),
             ScoreRequest(QUERY, [" " + "fox " * 40], labels=["No"], apply_softmax=True, mode="sis")]


@pytest.fixture(scope="module", params=["tiny", "smollm2-wide"])
def shaped_dir(request, tmp_path_factory):
    """The tiny Qwen3, and one with SmolLM2's widths (576 hidden, 1536 MLP, 9/3 heads) where oneDNN's bf16 GEMM
    was seen to change a row's bits with the row count (K=1536) in decoding."""
    overrides = {} if request.param == "tiny" else dict(hidden_size=576, intermediate_size=1536,
                                                        num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    return make_model_dir(tmp_path_factory.mktemp(request.param), "qwen3", **overrides)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_scores_alone_and_packed_with_strangers(shaped_dir, backend, dtype):
    """A request's scores, alone and packed with strangers of several shapes (SIS, MIS, item_first, many short
    items, one long item; before and after it). On the kernel path they are bitwise equal: nothing a row computes
    depends on its batch-mates. On the reference path torch's GEMMs block rows by the row count and the dense
    softmax sums the whole stream's keys, so they agree within REFERENCE_TOL (the guarantees page, the proto)."""
    e = engine(shaped_dir, backend, dtype)
    for target in (ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True),
                   ScoreRequest(QUERY, ITEMS[1:3], labels=["Yes"], mode="sis")):
        alone = e.score_batch([target])[0]
        for k in range(len(STRANGERS) + 1):
            batch = [*STRANGERS[:k], target, *STRANGERS[k:]]
            together = e.score_batch(batch)[k]
            if backend == "kernel":
                assert together.scores == alone.scores, (k, max_abs_diff(alone.scores, together.scores))
            else:
                assert max_abs_diff(alone.scores, together.scores) <= REFERENCE_TOL[dtype], k


def test_small_token_budget_splits_passes_without_changing_scores(model_dir):
    big = engine(model_dir)
    small = engine(model_dir, max_batch_tokens=40)
    requests = [ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], mode=m) for m in ("sis", "mis")]
    for a, b in zip(big.score_batch(requests), small.score_batch(requests), strict=True):
        assert max_abs_diff(a.scores, b.scores) <= 1e-6


def test_empty_items_give_empty_result(model_dir):
    result = engine(model_dir).score(QUERY, [], labels=["Yes"])
    assert result.scores == [] and result.usage.computed_tokens == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_classifier_head_matches_transformers(tmp_path, arch, mode):
    path = make_model_dir(tmp_path / arch, arch, classifier=True)
    ref = load_reference(path)
    e = engine(path)
    query = e.tokenize(QUERY)[0]
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    for soft in (False, True):
        result = e.score(QUERY, ITEMS, apply_softmax=soft, mode=mode)
        assert result.label_token_ids == [0, 1, 2]
        expected = reference_scores(ref, query, items, [0, 1, 2], apply_softmax=soft, classifier=True)
        assert max_abs_diff(result.scores, expected) <= FP32_TOL
    picked = e.score(QUERY, ITEMS, labels=["good", "bad"], mode=mode)
    assert picked.label_token_ids == [2, 0]
    expected = reference_scores(ref, query, items, [2, 0], classifier=True)
    assert max_abs_diff(picked.scores, expected) <= FP32_TOL
