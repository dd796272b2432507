"""The HTTP front door as a drop-in for the peers (issue 53, part B): the peers' own test cases for vLLM's scoring,
rerank and classify routes, its /invocations and /generative_scoring, and SGLang's /v1/score, sent to pyscore on
tiny random models (the Qwen3 causal LM, a two-class Llama classifier; fp32). Where a score is compared it is
compared with stock transformers on the tokens the peer would run, within REFERENCE_TOL (1e-5 on a probability,
1e-4 on a logit), tighter than the peers' own 1e-2; where pyscore serves a safe form instead of the peer's, the
test pins that form and the refusal, with the peer's status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from transformers import AutoTokenizer

from pyscore.client import ScorerClient
from tests.helpers import REFERENCE_TOL, load_reference, make_model_dir
from tests.server.conftest import ServerThread, make_tiny_engine
from tests.server.test_http_rerank import hf_logits, post, tokens

TOL = REFERENCE_TOL["float32"]
QUERY = "Query: which answer tells the customer where the order is?\nDocument:"
DOCS = [" The order shipped on Monday and is in transit.", " Cancel it.", " It arrives on Friday, tracked."]
CHAT = [{"role": "user", "content": "Is this review positive? The food was great."}]
VLLM_NOT_FOUND = {"error": {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}}


def serve(path: Path) -> ServerThread:
    return ServerThread(make_tiny_engine(path), max_batch_tokens=256, http_port=0)


@pytest.fixture(scope="module")
def causal(tiny_model_dir: Path) -> Iterator[tuple[str, ScorerClient, Any]]:
    server = serve(tiny_model_dir)
    with ScorerClient(server.target, timeout=30) as client:
        yield f"http://127.0.0.1:{server.app.http_port}", client, load_reference(tiny_model_dir)
    server.stop()


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Any]]:
    """A tiny random Llama with a two-class head (vLLM serves /classify for it, not /score or /rerank)."""
    path = make_model_dir(tmp_path_factory.mktemp("llama2"), "llama", classifier=True, seed=5, num_labels=2)
    server = serve(path)
    yield f"http://127.0.0.1:{server.app.http_port}", path, load_reference(path)
    server.stop()


@pytest.fixture(scope="module")
def yes_no(causal: tuple[str, ScorerClient, Any]) -> list[int]:
    base = causal[0]
    return [tokens(base, w, False)[0] for w in ("Yes", "No")]


def label_softmax(model: Any, ids: list[int], labels: list[int]) -> float:
    """The first label's share of the softmax over the labels at the sequence's last position (transformers)."""
    return float(torch.softmax(hf_logits(model, ids)[-1, labels], -1)[0])


def relevance(body: dict[str, Any]) -> list[float]:
    """/rerank's results (sorted by score) back in document order, or /score's data."""
    if "results" in body:
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        return [got[i] for i in range(len(got))]
    return [d["score"] for d in body["data"]]


# -- vLLM: truncation keeps the end ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/rerank", "/score"])
def test_truncate_prompt_tokens_keeps_each_pairs_last_tokens(causal: tuple[str, ScorerClient, Any],
                                                             yes_no: list[int], path: str) -> None:
    """truncate_prompt_tokens N keeps a pair's last N tokens (vLLM's truncation_side "left"), so the score is still
    read where the labels are asked: it equals transformers on those N tokens, not on the first N."""
    base, _, model = causal
    sides = {"query": QUERY, "documents": DOCS} if path == "/rerank" else {"text_1": QUERY, "text_2": DOCS}
    pairs = [tokens(base, QUERY + d, True) for d in DOCS]
    keep = 8  # shorter than every pair and than the query: the cut goes into the query
    assert all(len(ids) > keep for ids in pairs) and len(tokens(base, QUERY, True)) > keep
    body = post(base, path, sides | {"label_token_ids": yes_no, "truncate_prompt_tokens": keep}).json()
    want = [label_softmax(model, ids[-keep:], yes_no) for ids in pairs]
    assert relevance(body) == pytest.approx(want, abs=TOL)
    first = [label_softmax(model, ids[:keep], yes_no) for ids in pairs]
    assert max(abs(a - b) for a, b in zip(relevance(body), first, strict=True)) > 100 * TOL  # not the head kept
    assert body["usage"]["prompt_tokens"] == keep * len(DOCS)
    whole = post(base, path, sides | {"label_token_ids": yes_no}).json()
    for same in ({"truncate_prompt_tokens": -1}, {"truncate_prompt_tokens": 512}, {"truncation_side": "left"}):
        assert relevance(post(base, path, sides | {"label_token_ids": yes_no} | same).json()) == relevance(whole)
    left = post(base, path, sides | {"label_token_ids": yes_no, "truncate_prompt_tokens": keep,
                                     "truncation_side": "left"}).json()
    assert relevance(left) == relevance(body)


def test_truncation_per_side_keeps_each_sides_end(causal: tuple[str, ScorerClient, Any], yes_no: list[int]) -> None:
    """max_tokens_per_doc / max_tokens_per_query N keep a document's / the query's last N tokens, re-decoded and
    joined as vLLM joins its truncated texts: the document's end, next to where the score is read, stays."""
    base, _, model = causal

    def tail(text: str, n: int) -> str:
        ids = tokens(base, text, False)[-n:]
        return requests.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    docs = [*DOCS, " A"]  # the last within the limit: left as it is
    assert len(tokens(base, docs[-1], False)) <= 4 < min(len(tokens(base, d, False)) for d in DOCS)
    body = post(base, "/rerank", {"query": QUERY, "documents": docs, "label_token_ids": yes_no,
                                  "max_tokens_per_doc": 4}).json()
    want = [label_softmax(model, tokens(base, QUERY + tail(d, 4), True), yes_no) for d in docs]
    assert relevance(body) == pytest.approx(want, abs=TOL)
    whole = post(base, "/rerank", {"query": QUERY, "documents": docs, "label_token_ids": yes_no}).json()
    assert relevance(body)[-1] == relevance(whole)[-1] and relevance(body)[:-1] != relevance(whole)[:-1]
    by_query = post(base, "/score", {"text_1": QUERY, "text_2": DOCS, "label_token_ids": yes_no,
                                     "max_tokens_per_query": 5}).json()
    want = [label_softmax(model, tokens(base, tail(QUERY, 5) + d, True), yes_no) for d in DOCS]
    assert relevance(by_query) == pytest.approx(want, abs=TOL)


@pytest.mark.parametrize("fields, param", [
    ({"truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),  # vLLM: greater than max_model_len (512)
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),  # vLLM: ge=-1
    ({"truncate_prompt_tokens": 1}, "truncate_prompt_tokens"),  # pyscore reads after at least one other token
    ({"truncate_prompt_tokens": 8, "truncation_side": "right"}, "truncation_side"),  # would cut the read-out away
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"max_tokens_per_doc": -1}, "max_tokens_per_doc"),  # vLLM: non-negative, below max_model_len
    ({"max_tokens_per_doc": 512}, "max_tokens_per_doc"),
    ({"max_tokens_per_query": 600}, "max_tokens_per_query"),
])
def test_truncation_refusals(causal: tuple[str, ScorerClient, Any], yes_no: list[int], fields: dict[str, Any],
                             param: str) -> None:
    base = causal[0]
    answer = post(base, "/rerank", {"query": QUERY, "documents": DOCS, "label_token_ids": yes_no} | fields)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_classify_truncation_keeps_the_last_tokens(llama2: tuple[str, Path, Any]) -> None:
    """vLLM's own case (test_classification's truncate_prompt_tokens): a text longer than the context, truncated to
    5 tokens: one answer of 5 prompt tokens; here also the classes' softmax of transformers on the last 5."""
    base, _, model = llama2
    long_text = "hello " * 600
    ids = tokens(base, long_text, True)
    assert len(ids) > 512
    answer = post(base, "/classify", {"input": long_text, "truncate_prompt_tokens": 5})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["data"]) == 1 and body["data"][0]["index"] == 0
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 5
    want = torch.softmax(hf_logits(model, ids[-5:]), -1).tolist()  # the head's [classes]
    assert body["data"][0]["probs"] == pytest.approx(want, abs=TOL)
    too_long = post(base, "/classify", {"input": long_text})
    assert too_long.status_code == 400  # not cut silently: over the context without truncate_prompt_tokens
    over = post(base, "/classify", {"input": "hello", "truncate_prompt_tokens": 513})
    assert over.status_code == 400 and over.json()["error"]["param"] == "truncate_prompt_tokens"


# -- vLLM: use_activation false on a causal-LM reranker ----------------------------------------------------------
@pytest.mark.parametrize("path", ["/rerank", "/score"])
def test_use_activation_false_is_the_two_labels_logit_difference(causal: tuple[str, ScorerClient, Any],
                                                                 yes_no: list[int], path: str) -> None:
    """vLLM serves an LLM reranker as a one-class classifier whose weight is w_yes - w_no (from_2_way_softmax):
    use_activation false answers that logit, logit(yes) - logit(no), and its sigmoid is the activated score
    (vLLM's test_use_activation: sigmoid(raw) == activated)."""
    base, _, model = causal
    sides = {"query": QUERY, "documents": DOCS} if path == "/rerank" else {"text_1": QUERY, "text_2": DOCS}
    raw = post(base, path, sides | {"label_token_ids": yes_no, "use_activation": False}).json()
    logits = [hf_logits(model, tokens(base, QUERY + d, True))[-1] for d in DOCS]
    want = [float(lg[yes_no[0]] - lg[yes_no[1]]) for lg in logits]
    assert relevance(raw) == pytest.approx(want, abs=1e-4)
    activated = post(base, path, sides | {"label_token_ids": yes_no}).json()
    sigmoid = torch.sigmoid(torch.tensor(relevance(raw), dtype=torch.float64)).tolist()
    assert sigmoid == pytest.approx(relevance(activated), abs=TOL)
    by_name = post(base, path, sides | {"labels": ["Yes", "No"], "use_activation": False}).json()
    assert relevance(by_name) == relevance(raw)
    if path == "/rerank":  # ranked by the raw score: the same order as the activated one
        assert [r["index"] for r in raw["results"]] == [r["index"] for r in activated["results"]]
    three = post(base, path, sides | {"labels": ["Yes", "No", "A"], "use_activation": False})
    assert three.status_code == 400 and three.json()["error"]["param"] == "use_activation"


# -- vLLM: a several-class classifier's /score and /rerank, its /classify chat form -------------------------------
@pytest.mark.parametrize("path, body", [
    ("/score", {"text_1": QUERY, "text_2": DOCS}), ("/v1/score", {"queries": QUERY, "documents": DOCS}),
    ("/rerank", {"query": QUERY, "documents": DOCS}), ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS}), ("/invocations", {"query": QUERY, "documents": DOCS}),
])
def test_a_two_class_classifiers_score_and_rerank_are_vllms_404(llama2: tuple[str, Path, Any], path: str,
                                                               body: dict[str, Any]) -> None:
    """vLLM registers its scoring routes for classifiers with num_labels == 1 only: for this one they are routes it
    does not have, whose 404 is its HTTPException handler's body, exactly. pyscore answers the same unless the
    request names the class that ranks (its `labels` extra)."""
    base, _, model = llama2
    answer = post(base, path, body)
    assert answer.status_code == 404, answer.text
    assert answer.json() == VLLM_NOT_FOUND, answer.text
    named = post(base, path, body | {"labels": ["class_1"]})
    assert named.status_code == 200, named.text
    want = [float(torch.softmax(hf_logits(model, tokens(base, QUERY + d, True)), -1)[1]) for d in DOCS]
    assert relevance(named.json()) == pytest.approx(want, abs=TOL)


def test_classify_messages_apply_the_chat_template(llama2: tuple[str, Path, Any]) -> None:
    """vLLM's chat form of /classify (ClassificationChatRequest): the conversation under the model's chat template,
    its defaults no generation prompt and no extra special tokens; one answer for the conversation."""
    base, path, model = llama2
    tokenizer = AutoTokenizer.from_pretrained(path)

    def rendered(**kw: Any) -> list[int]:
        return list(tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False, **kw))

    for fields, ids in [({}, rendered(add_generation_prompt=False)),
                        ({"add_generation_prompt": True}, rendered(add_generation_prompt=True)),
                        ({"continue_final_message": True}, rendered(continue_final_message=True))]:
        answer = post(base, "/classify", {"messages": CHAT} | fields)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == len(ids), (fields, body)
        want = torch.softmax(hf_logits(model, ids), -1).tolist()
        assert body["data"][0]["probs"] == pytest.approx(want, abs=TOL), fields
        assert body["data"][0]["label"] == model.config.id2label[int(np.argmax(want))]
    assert rendered(add_generation_prompt=True) != rendered(add_generation_prompt=False)  # the case is meaningful
    for fields, param in [({"add_special_tokens": True}, "add_special_tokens"),
                          ({"chat_template": "{{ messages }}"}, "chat_template"),
                          ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                          ({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": 3}]},
                                                            "messages[0].content")]:
        answer = post(base, "/classify", {"messages": CHAT} | fields)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (fields, answer.text)
    raw = post(base, "/classify", {"messages": CHAT, "use_activation": False}).json()
    logits = hf_logits(model, rendered(add_generation_prompt=False)).tolist()
    assert raw["data"][0]["probs"] == pytest.approx(logits, abs=1e-4)


# -- vLLM: /invocations -----------------------------------------------------------------------------------------
def same_answer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two answers alike but for what differs between any two calls: ids, times, measured seconds, and what the
    first call left in the prefix cache (the second reads it: fewer tokens computed, the same answer)."""
    varying = ("id", "created", "queue_s", "compute_s", "computed_tokens", "prompt_tokens_details")

    def stable(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: stable(v) for k, v in x.items() if k not in varying}
        return [stable(v) for v in x] if isinstance(x, list) else x

    return stable(a) == stable(b)


def test_invocations_dispatch_by_shape_as_vllm_does(causal: tuple[str, ScorerClient, Any], yes_no: list[int],
                                                    llama2: tuple[str, Path, Any]) -> None:
    """vLLM's test_invocations: the same body to its route and to /invocations gets the same answer; the body's
    shape picks the route (chat, completion, classification, rerank, score); none fits: 400."""
    base = causal[0]
    for path, body in [("/rerank", {"query": QUERY, "documents": DOCS, "label_token_ids": yes_no}),
                       ("/score", {"text_1": QUERY, "text_2": DOCS, "label_token_ids": yes_no}),
                       ("/score", {"queries": [QUERY], "documents": DOCS[:1], "labels": ["Yes", "No"]}),
                       ("/v1/completions", {"prompt": "The order", "max_tokens": 3, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})]:
        direct, invoked = post(base, path, body), post(base, "/invocations", body)
        assert direct.status_code == invoked.status_code == 200, (path, invoked.text)
        assert same_answer(direct.json(), invoked.json()), (path, direct.json(), invoked.json())
    refused = post(base, "/invocations", {"input": "hello there"})  # /classify's own refusal on a causal LM
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    nothing = post(base, "/invocations", {"text": "hello"})
    assert nothing.status_code == 400 and "Cannot find suitable handler" in nothing.json()["error"]["message"]
    bad = requests.post(f"{base}/invocations", data=b"{", timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    classifier = llama2[0]
    for body in ({"input": ["hello there", "bye now"]}, {"messages": CHAT}):  # a chat is classified here
        direct, invoked = post(classifier, "/classify", body), post(classifier, "/invocations", body)
        assert direct.status_code == invoked.status_code == 200, invoked.text
        assert same_answer(direct.json(), invoked.json())


# -- vLLM: /generative_scoring's usage and empty items ------------------------------------------------------------
def test_generative_scoring_counts_one_completion_token_per_item(causal: tuple[str, ScorerClient, Any],
                                                                 yes_no: list[int]) -> None:
    """vLLM generates one token per item (max_tokens=1) and counts it: completion_tokens = items, total = prompt +
    items; no items is its 400 ("items must contain at least one item")."""
    base = causal[0]
    body = post(base, "/generative_scoring", {"query": QUERY, "items": DOCS, "label_token_ids": yes_no}).json()
    usage = body["usage"]
    assert usage["completion_tokens"] == len(DOCS)
    assert usage["total_tokens"] == usage["prompt_tokens"] + len(DOCS)
    empty = post(base, "/generative_scoring", {"query": QUERY, "items": [], "label_token_ids": yes_no})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "items"


# -- SGLang's /v1/score ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(query="I pledge allegiance", items=["", " to"], item_first=False),  # SGLang's test_score_consistency
    dict(query=" is a city", items=["Tokyo", "Japan"], item_first=True),
    dict(query="", items=["Option A", "Option B"], item_first=False),  # test_multi_item_scoring_different_queries
    dict(query="", items=["Option A", "Option B"], item_first=True),
], ids=["default", "item_first", "empty query", "empty query, item_first"])
def test_sglang_scores_equal_transformers(causal: tuple[str, ScorerClient, Any], case: dict[str, Any]) -> None:
    """SGLang's own cases: query + item (item + query with item_first) as one text, the labels' softmax at its
    last position, as transformers gives it (SGLang compares within 0.01); an empty query is no query, the item
    alone; each row sums to 1 (SGLang's places=6)."""
    base, _, model = causal
    labels = [tokens(base, t, False)[0] for t in (" to", " the")]
    answer = post(base, "/v1/score", case | {"label_token_ids": labels, "apply_softmax": True})
    assert answer.status_code == 200, answer.text
    scores = answer.json()["scores"]
    texts = [i + case["query"] if case["item_first"] else case["query"] + i for i in case["items"]]
    want = [torch.softmax(hf_logits(model, tokens(base, t, True))[-1, labels], -1).tolist() for t in texts]
    assert len(scores) == len(case["items"])
    for got, row in zip(scores, want, strict=True):
        assert got == pytest.approx(row, abs=TOL)
        assert sum(got) == pytest.approx(1.0, abs=1e-6)


def test_sglang_empty_query_scores_each_item_alone(causal: tuple[str, ScorerClient, Any]) -> None:
    """query "": SGLang's query + item is the item: by text (SGLang's label ids 1, 2, unnormalised too) and by
    token ids, the same bits as gRPC's Score of the item's tokens read at its last; no items: the empty answer;
    a one-token item cannot be read after another token: refused by name (pyscore's safe form)."""
    base, client, _ = causal
    items = ["Option A", "Option B", "Is this true? Yes"]
    for softmax in (True, False):
        by_text = post(base, "/v1/score", {"query": "", "items": items, "label_token_ids": [1, 2],
                                           "apply_softmax": softmax}).json()
        ids = [tokens(base, i, True) for i in items]
        by_ids = post(base, "/v1/score", {"query": [], "items": ids, "label_token_ids": [1, 2],
                                          "apply_softmax": softmax}).json()
        grpc = [client.score(i[:-1], [i[-1:]], label_token_ids=[1, 2], apply_softmax=softmax).scores[0][0]
                for i in ids]
        assert by_text["scores"] == by_ids["scores"] == grpc
        assert by_text["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    empty = post(base, "/v1/score", {"query": "", "items": [], "label_token_ids": [1, 2]})
    assert empty.status_code == 200 and empty.json()["scores"] == []  # SGLang's test_multi_item_scoring_empty_items
    one = post(base, "/v1/score", {"query": "", "items": ["Option A", "Yes"], "label_token_ids": [1, 2]})
    assert one.status_code == 400 and one.json()["param"] == "items[1]", one.text
    outside = post(base, "/v1/score", {"query": [], "items": [[5, 6], [5, 10**6]], "label_token_ids": [1, 2]})
    assert outside.status_code == 400 and outside.json()["param"] == "items[1]", outside.text


@pytest.mark.parametrize("body, param", [
    ({"query": "Test query", "items": None, "label_token_ids": [1, 2]}, "items"),  # test_multi_item_scoring_error..
    ({"query": "Test query", "items": ["Item 1"], "label_token_ids": "invalid"}, "label_token_ids"),
    ({"query": "Test query", "items": "not a list", "label_token_ids": [1, 2]}, "items"),
    ({"query": "Test query", "label_token_ids": [1, 2]}, "items"),
    ({"items": ["Item 1"], "label_token_ids": [1, 2]}, "query"),
    ({"query": "Test query", "items": ["Item 1"], "label_token_ids": [1, 2], "model": "wrong_model_name"}, "model"),
    ({"query": "", "items": [[5, 6]], "label_token_ids": [1, 2]}, "query"),  # a text query, token-id items
])
def test_sglang_refusals_are_sglangs(causal: tuple[str, ScorerClient, Any], body: dict[str, Any], param: str) -> None:
    """What SGLang's /v1/score refuses, refused with its status (400) and its flat ErrorResponse."""
    base = causal[0]
    answer = post(base, "/v1/score", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["object"] == "error" and error["type"] == "BadRequestError" and error["code"] == 400, error
    assert error["param"] == param, error
    if param == "model":
        assert "The model `wrong_model_name` does not exist" in error["message"]
