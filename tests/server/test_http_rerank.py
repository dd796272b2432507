"""vLLM's reranker and classifier APIs on the real engine (tiny random models, fp32): /rerank (and /v1, /v2),
/score and vLLM's spelling of /v1/score, /classify. A causal LM's relevance equals gRPC Score's label softmax bit
for bit; a classifier's equals stock transformers' sigmoid / softmax of its head on the same tokens; N:N pairs,
1:N pairs and rerank's order agree with each other; what is not served is refused naming the field; fuzzed bodies
get documented statuses and leave the server answering."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyscore.client import ScorerClient
from tests.helpers import load_reference, make_model_dir
from tests.server.conftest import ServerThread, make_tiny_engine

QUERY = "Query: which answer tells the customer where the order is?\nDocument:"
DOCS = [" The order shipped on Monday.", " Cancel it.", " It is in transit and arrives Friday.", " A"]


def post(base: str, path: str, body: Any) -> requests.Response:
    return requests.post(base + path, data=json.dumps(body), headers={"content-type": "application/json"},
                         timeout=60)


def serve(path: Path) -> ServerThread:
    return ServerThread(make_tiny_engine(path), max_batch_tokens=256, http_port=0)


@pytest.fixture(scope="module")
def causal(tiny_model_dir: Path) -> Iterator[tuple[str, ScorerClient]]:
    server = serve(tiny_model_dir)
    with ScorerClient(server.target, timeout=30) as client:
        yield f"http://127.0.0.1:{server.app.http_port}", client
    server.stop()


@pytest.fixture(scope="module", params=[3, 1], ids=["3-classes", "1-class"])
def classifier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[str, Path, Any]]:
    path = make_model_dir(tmp_path_factory.mktemp("cls"), "qwen3", classifier=True, seed=3, num_labels=request.param)
    server = serve(path)
    yield f"http://127.0.0.1:{server.app.http_port}", path, load_reference(path)
    server.stop()


@pytest.fixture(scope="module")
def labels(causal: tuple[str, ScorerClient]) -> list[int]:
    base, _ = causal
    ids = [post(base, "/tokenize", {"prompt": w, "add_special_tokens": False}).json()["tokens"] for w in ("Yes", "No")]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def tokens(base: str, text: str, special: bool) -> list[int]:
    return post(base, "/tokenize", {"prompt": text, "add_special_tokens": special}).json()["tokens"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_of_a_causal_lm_is_the_label_softmax_of_score(causal: tuple[str, ScorerClient], labels: list[int],
                                                             path: str) -> None:
    base, client = causal
    want = [rows[0][0] for rows in client.score(QUERY, DOCS, label_token_ids=labels, apply_softmax=True).scores]
    body = post(base, path, {"model": client.model_info().name, "query": QUERY, "documents": DOCS,
                             "label_token_ids": labels}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == [want[i] for i in order]  # the same bits
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    assert body["model"] == client.model_info().name and body["id"].startswith("rerank-")
    sis = sum(len(tokens(base, QUERY, True)) + len(tokens(base, d, False)) for d in DOCS)
    assert body["usage"]["prompt_tokens"] == sis == body["usage"]["total_tokens"]
    top = post(base, path, {"query": QUERY, "documents": DOCS, "label_token_ids": labels, "top_n": 2}).json()
    assert top["results"] == body["results"][:2]
    by_name = post(base, path, {"query": QUERY, "documents": DOCS, "labels": ["Yes", "No"]}).json()
    assert by_name["results"] == body["results"]


def test_rerank_of_a_causal_lm_equals_transformers(causal: tuple[str, ScorerClient], tiny_model_dir: Path,
                                                   labels: list[int]) -> None:
    """The LLM-reranker recipe on stock transformers (Qwen3-Reranker's: the last position's logits of the two
    tokens, softmax, the first), on the same tokens: the relevance /rerank answers."""
    base, _ = causal
    model = load_reference(tiny_model_dir)
    want = [float(torch.softmax(hf_logits(model, tokens(base, QUERY + d, True))[-1, labels], -1)[0]) for d in DOCS]
    body = post(base, "/rerank", {"query": QUERY, "documents": DOCS, "label_token_ids": labels}).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(want, abs=1e-5)


def test_pairs_are_tokenized_as_one_text_as_vllm_does(causal: tuple[str, ScorerClient], tiny_model_dir: Path,
                                                      labels: list[int]) -> None:
    """vLLM's LLM reranker tokenizes query + document as one text: so does /rerank, also where that differs from
    tokenizing the two apart (a query ending in a space before a word; an empty document: the query alone)."""
    base, _ = causal
    query, docs = "Is the order late? The answer is ", ["order", "Yes", "the answer", ""]
    joint = [tokens(base, query + d, True) for d in docs]
    assert joint[0] != tokens(base, query, True) + tokens(base, docs[0], False)  # the case this test is about
    model = load_reference(tiny_model_dir)
    want = [float(torch.softmax(hf_logits(model, ids)[-1, labels], -1)[0]) for ids in joint]
    body = post(base, "/rerank", {"query": query, "documents": docs, "label_token_ids": labels}).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert [got[i] for i in range(len(docs))] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in joint)


def test_a_documents_relevance_does_not_depend_on_the_others(causal: tuple[str, ScorerClient],
                                                             labels: list[int]) -> None:
    """Documents sharing their first words: each one's relevance is the same bits alone, with the others, and as
    gRPC's Score of the query and it (the split is the query's own tokens, never the documents' common prefix)."""
    base, client = causal
    docs = [" Proposed answer: ship it today.", " Proposed answer: cancel it.", " Proposed answer: wait."]
    together = post(base, "/rerank", {"query": QUERY, "documents": docs, "label_token_ids": labels}).json()
    got = {r["index"]: r["relevance_score"] for r in together["results"]}
    for i, doc in enumerate(docs):
        alone = post(base, "/rerank", {"query": QUERY, "documents": [doc], "label_token_ids": labels}).json()
        assert alone["results"][0]["relevance_score"] == got[i]
        assert client.score(QUERY, [doc], label_token_ids=labels, apply_softmax=True).scores[0][0][0] == got[i]


def test_vllm_score_pairs_one_to_many_and_many_to_many(causal: tuple[str, ScorerClient], labels: list[int]) -> None:
    base, client = causal
    want = [rows[0][0] for rows in client.score(QUERY, DOCS, label_token_ids=labels, apply_softmax=True).scores]
    other = "Query: which answer cancels the order?\nDocument:"
    want_other = [rows[0][0] for rows in client.score(other, DOCS[:2], label_token_ids=labels,
                                                      apply_softmax=True).scores]
    for path, first, second in [("/score", "text_1", "text_2"), ("/v1/score", "text_1", "text_2"),
                                ("/score", "queries", "documents"), ("/v1/score", "queries", "items"),
                                ("/score", "data_1", "data_2")]:
        one_to_many = post(base, path, {first: QUERY, second: DOCS, "label_token_ids": labels}).json()
        assert [d["score"] for d in one_to_many["data"]] == want, (path, first)
        assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCS)))
        assert one_to_many["object"] == "list" and one_to_many["data"][0]["object"] == "score"
    # N:N, the queries interleaved: grouped per query, each group one MIS request, answered in pair order (a
    # group's shared prefix also takes the leading tokens its documents have in common: equal up to rounding)
    pairs = post(base, "/score", {"text_1": [QUERY, other, QUERY, other], "text_2": [DOCS[0], DOCS[0], DOCS[2],
                                                                                    DOCS[1]],
                                  "label_token_ids": labels}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([want[0], want_other[0], want[2], want_other[1]],
                                                                abs=1e-6)
    one = post(base, "/score", {"text_1": [QUERY], "text_2": DOCS[3], "label_token_ids": labels}).json()
    assert [d["score"] for d in one["data"]] == [want[3]]


def test_sglang_score_keeps_v1_score(causal: tuple[str, ScorerClient], labels: list[int]) -> None:
    base, client = causal
    body = post(base, "/v1/score", {"query": QUERY, "items": DOCS, "label_token_ids": labels}).json()
    assert body["object"] == "scoring"
    assert body["scores"] == [rows[0] for rows in client.score(QUERY, DOCS, label_token_ids=labels).scores]


@pytest.mark.parametrize("path, body, status, param", [
    ("/rerank", {"query": QUERY, "documents": DOCS}, 400, "labels[0]"),  # "yes" is not one token here
    ("/rerank", {"query": QUERY, "documents": [], "labels": ["Yes", "No"]}, 400, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "labels": ["Yes"], "use_activation": False}, 400,
     "use_activation"),  # one label: its probability over the vocabulary, not a logit
    ("/rerank", {"query": QUERY, "documents": DOCS, "labels": ["Yes"], "instruction": "Judge."}, 400,
     "instruction"),
    ("/rerank", {"query": QUERY, "documents": [{"content": []}], "labels": ["Yes"]}, 400, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "labels": ["Yes"], "top_n": -1}, 400, "top_n"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "model": "other"}, 404, "model"),
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS, "labels": ["Yes"]}, 400, "text_2"),
    ("/score", {"text_1": QUERY, "documents": DOCS, "labels": ["Yes"]}, 400, "documents"),
    ("/score", {"text_1": QUERY, "text_2": [DOCS[0], "word " * 600, DOCS[1]], "labels": ["Yes"]}, 400, "text_2[1]"),
    ("/score", {"text_1": [QUERY, "Q2", QUERY], "text_2": [DOCS[0], DOCS[1], "word " * 600], "labels": ["Yes"]}, 400,
     "text_2[2]"),
    ("/score", {"text_1": ["Q2", ""], "text_2": [DOCS[0], "A"], "labels": ["Yes"]}, 400, "text_2[1]"),
    ("/classify", {"input": "hello there"}, 400, "model"),
])
def test_refusals_name_the_field(causal: tuple[str, ScorerClient], path: str, body: dict[str, Any], status: int,
                                 param: str) -> None:
    base, _ = causal
    answer = post(base, path, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_classifier_rerank_and_classify_equal_transformers(classifier: tuple[str, Path, Any]) -> None:
    base, _, model = classifier
    n = model.config.num_labels
    sequences = [tokens(base, QUERY + d, True) for d in DOCS]  # each pair as one text, as vLLM tokenizes it
    logits = [hf_logits(model, ids) for ids in sequences]
    named = {"labels": ["good"]} if n == 3 else {}
    column = 2 if n == 3 else 0
    want = [float(torch.sigmoid(lg[column]) if n == 1 else torch.softmax(lg, -1)[column]) for lg in logits]
    body = post(base, "/rerank", {"query": QUERY, "documents": DOCS, **named}).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(want, abs=1e-5)
    raw = post(base, "/score", {"text_1": QUERY, "text_2": DOCS, "use_activation": False, **named}).json()
    assert [d["score"] for d in raw["data"]] == pytest.approx([float(lg[column]) for lg in logits], abs=1e-4)
    classified = post(base, "/classify", {"input": sequences}).json()
    for i, entry in enumerate(classified["data"]):
        probs = torch.softmax(logits[i], -1)
        assert entry["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert entry["num_classes"] == n and entry["index"] == i
        assert entry["label"] == model.config.id2label[int(np.argmax(entry["probs"]))]
        if n == 3:
            assert math.isclose(entry["probs"][2], got[i], abs_tol=1e-6)  # MIS there, one sequence here
    texts = post(base, "/classify", {"input": [QUERY + DOCS[0], QUERY]}).json()
    for entry, text in zip(texts["data"], [QUERY + DOCS[0], QUERY], strict=True):
        assert entry["probs"] == pytest.approx(torch.softmax(hf_logits(model, tokens(base, text, True)), -1).tolist(),
                                               abs=1e-5)
    logit_rows = post(base, "/classify", {"input": sequences[0], "use_activation": False}).json()
    assert logit_rows["data"][0]["probs"] == pytest.approx(logits[0].tolist(), abs=1e-4)


def test_classifier_refusals(classifier: tuple[str, Path, Any]) -> None:
    base, _, model = classifier
    cases = [({"input": "hello", "messages": [{"role": "user", "content": "hi"}]}, "/classify", "messages"),
             ({"input": []}, "/classify", "input"),
             ({"input": "hi", "labels": ["good"]}, "/classify", "labels"),
             ({"query": QUERY, "documents": DOCS, "labels": ["nope"]}, "/rerank", "labels")]
    if model.config.num_labels == 3:
        cases.append(({"query": QUERY, "documents": DOCS, "label_token_ids": [0, 1]}, "/rerank", "label_token_ids"))
    for body, path, param in cases:
        answer = post(base, path, body)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == param, (body, answer.text)


@pytest.mark.parametrize("server_labels", [("Yes", "No"), ("Yes",)], ids=["two", "one"])
def test_the_servers_rerank_labels(tiny_model_dir: Path, server_labels: tuple[str, ...]) -> None:
    """--rerank-labels: what a vLLM client that sends no labels gets (two: the label softmax; one: the label's
    probability over the vocabulary)."""
    server = ServerThread(make_tiny_engine(tiny_model_dir), max_batch_tokens=256, http_port=0,
                          rerank_labels=server_labels)
    try:
        with ScorerClient(server.target, timeout=30) as client:
            want = [rows[0][0] for rows in client.score(QUERY, DOCS, labels=list(server_labels),
                                                        apply_softmax=len(server_labels) > 1).scores]
        base = f"http://127.0.0.1:{server.app.http_port}"
        body = post(base, "/rerank", {"query": QUERY, "documents": DOCS}).json()
        assert {r["index"]: r["relevance_score"] for r in body["results"]} == dict(enumerate(want))
        assert body["results"][0]["document"] == {"text": DOCS[body["results"][0]["index"]], "multi_modal": None}
    finally:
        server.stop()


FIELDS = ["query", "documents", "top_n", "labels", "label_token_ids", "use_activation", "text_1", "text_2", "queries",
          "items", "data_1", "data_2", "input", "messages", "model", "instruction", "truncate_prompt_tokens"]
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 10**10), st.floats(allow_nan=False),
              st.sampled_from(["", "Yes", "No", "yes", " A", QUERY, DOCS[0], "héllo 🙂", "\x00"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["content", "text"]), inner,
                                                                         max_size=2)),
    max_leaves=8)


GOOD = {"/rerank": {"query": QUERY, "documents": DOCS, "labels": ["Yes", "No"]},
        "/v2/rerank": {"query": QUERY, "documents": DOCS[:2], "labels": ["Yes"], "top_n": 1},
        "/score": {"text_1": QUERY, "text_2": DOCS, "labels": ["Yes", "No"]},
        "/v1/score": {"queries": [QUERY, "Q"], "documents": DOCS[:2], "labels": ["No", "Yes"]},
        "/classify": {"input": "hello there"}}  # the causal LM: refused by /classify whatever the body


@settings(derandomize=True, database=None, deadline=None, max_examples=150,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(sorted(GOOD)), changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=2),
       drop=st.lists(st.sampled_from(FIELDS), max_size=1))
def test_fuzzed_bodies_get_documented_statuses(causal: tuple[str, ScorerClient], path: str,
                                               changes: dict[str, Any], drop: list[str]) -> None:
    """A good body with up to two fields replaced by random JSON and one removed: a documented status, an answer
    of the route's shape when it succeeds."""
    base, _ = causal
    body = {k: v for k, v in (GOOD[path] | changes).items() if k not in drop}
    answer = post(base, path, body)
    assert answer.status_code in (200, 400, 404, 429), (body, answer.text)
    if answer.status_code == 200:
        got = answer.json()
        assert "results" in got if "rerank" in path else "data" in got or "scores" in got, got
    elif "error" in answer.json():
        assert answer.json()["error"]["code"] in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND",
                                                  "RESOURCE_EXHAUSTED"), answer.text
    else:  # a body that became SGLang's (a `query` and no vLLM side): SGLang's flat error object
        assert path == "/v1/score" and answer.json()["object"] == "error", answer.text
        assert answer.json()["code"] == answer.status_code, answer.text


def test_the_server_survived_the_fuzz(causal: tuple[str, ScorerClient], labels: list[int]) -> None:
    base, client = causal
    body = post(base, "/rerank", {"query": QUERY, "documents": DOCS, "label_token_ids": labels}).json()
    assert len(body["results"]) == len(DOCS)
    assert client.score(QUERY, DOCS, label_token_ids=labels).scores


def test_many_distinct_queries_stay_within_the_queue(classifier: tuple[str, Path, Any]) -> None:
    """N:N pairs with 300 distinct queries and 300 classify inputs (each its own Score request) answer in full:
    a call keeps a bounded number of its requests in the server's queue (--max-queue 256 here)."""
    base, _, model = classifier
    named = {"labels": ["good"]} if model.config.num_labels == 3 else {}
    queries = [f"Query {i}: is this relevant?" for i in range(300)]
    answer = post(base, "/score", {"text_1": queries, "text_2": [" Document."] * 300, **named})
    assert answer.status_code == 200, answer.text[:300]
    assert len(answer.json()["data"]) == 300
    classified = post(base, "/classify", {"input": queries})
    assert classified.status_code == 200, classified.text[:300]
    assert len(classified.json()["data"]) == 300
