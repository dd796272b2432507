"""The HTTP front door's plumbing on the fake engine, through real HTTP clients (`requests`, raw sockets): the
routes and their shapes, the status mapping and OpenAI error objects, limits checked before any model work, the
token, TLS, metrics, HTTP and gRPC sharing a forward pass, and a client that goes away cancelling its work."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from pyscore.client import ScorerClient
from tests.server.certs import Pki, make_pki
from tests.server.conftest import ServerThread, wait_for
from tests.server.fake_engine import FakeEngine, FakeTokenizer

TOKEN = "http-s3cret"
SCORE = {"query": "Is this right?", "items": ["a b", "c"], "labels": ["Yes", "No"], "apply_softmax": True}


def url(server: ServerThread, path: str, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{server.app.http_port}{path}"


@pytest.fixture
def http(start_server: Any, fake: FakeEngine) -> ServerThread:
    return start_server(fake, max_items=8, http_port=0, max_message_mb=1)


def post(server: ServerThread, path: str, body: Any, **kw: Any) -> requests.Response:
    return requests.post(url(server, path), json=body, timeout=30, **kw)


def error_of(response: requests.Response) -> dict[str, Any]:
    return response.json()["error"]


def test_score_shapes(http: ServerThread, fake: FakeEngine) -> None:
    r = post(http, "/v1/score", SCORE)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and body["model"] == "fake-smollm2" and body["mode"] == "mis"
    assert len(body["scores"]) == 2 and all(len(row) == 2 for row in body["scores"])  # [item][label]
    assert body["usage"]["prompt_tokens"] > body["usage"]["computed_tokens"] > 0
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    one = post(http, "/v1/score", SCORE | {"items": ["a b"]}).json()
    assert one["scores"] == body["scores"][:1]
    setwise = post(http, "/v1/score", SCORE | {"items": ["x <m> y <m>"], "score_extraction_token": "<m>"}).json()
    assert [len(rows) for rows in setwise["scores"]] == [2]  # [item][row][label]
    assert all(len(row) == 2 for row in setwise["scores"][0])


def test_generative_scoring_shape(http: ServerThread) -> None:
    score = post(http, "/v1/score", SCORE | {"labels": None, "label_token_ids": [11, 12]}).json()
    r = post(http, "/generative_scoring", {"query": SCORE["query"], "items": SCORE["items"],
                                           "label_token_ids": [11, 12], "cache_salt": "any"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("generative-scoring-")
    assert body["data"] == [{"index": i, "object": "score", "score": row[0]} for i, row in enumerate(score["scores"])]
    assert body["usage"]["prompt_tokens"] == score["usage"]["prompt_tokens"]


def test_generative_scoring_tokenizes_as_vllm_does(http: ServerThread, fake: FakeEngine) -> None:
    """vLLM tokenizes query and items apart: without special tokens when asked, and text mixed with ids."""
    query_ids = fake.tokenize(SCORE["query"], add_special_tokens=False)[0]
    item_ids = [fake.tokenize(i, add_special_tokens=False)[0] for i in SCORE["items"]]
    by_ids = post(http, "/generative_scoring", {"query": query_ids, "items": item_ids, "label_token_ids": [11]})
    no_special = post(http, "/generative_scoring", {"query": SCORE["query"], "items": SCORE["items"],
                                                    "label_token_ids": [11], "add_special_tokens": False})
    mixed = post(http, "/generative_scoring", {"query": query_ids, "items": SCORE["items"], "label_token_ids": [11]})
    assert by_ids.json()["data"] == no_special.json()["data"] == mixed.json()["data"]


def test_completions_and_stream(http: ServerThread) -> None:
    body = {"prompt": "hello there", "max_tokens": 3, "logprobs": 2, "temperature": 0}
    whole = post(http, "/v1/completions", body).json()
    choice = whole["choices"][0]
    assert whole["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == 3 and all(len(t) == 2 for t in choice["logprobs"]["top_logprobs"])
    assert whole["usage"]["completion_tokens"] == 3
    r = requests.post(url(http, "/v1/completions"), json=body | {"stream": True, "stream_options":
                                                                  {"include_usage": True}}, stream=True, timeout=30)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_completions_of_several_prompts_and_samples(http: ServerThread) -> None:
    """A list of prompts x n samples: choice index = prompt * n + sample; each choice is what its prompt alone
    gets (a seeded sample j: what seed + j alone gets); streamed, every choice's text arrives under its index."""
    body = {"prompt": ["hello there", "a much longer prompt"], "n": 2, "max_tokens": 3, "temperature": 0.5,
            "seed": 7, "logprobs": 1}
    whole = post(http, "/v1/completions", body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    alone = [post(http, "/v1/completions", body | {"prompt": p, "n": 1, "seed": 7 + j}).json()
             for p in body["prompt"] for j in range(2)]
    assert [c["text"] for c in whole["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert whole["choices"][0]["text"] != whole["choices"][1]["text"]  # seeds 7 and 8
    assert whole["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"] + alone[2]["usage"]["prompt_tokens"]
    assert whole["usage"]["completion_tokens"] == 12
    r = requests.post(url(http, "/v1/completions"), json=body | {"stream": True, "stream_options":
                                                                  {"include_usage": True}}, stream=True, timeout=30)
    events = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == k)
             for k in range(4)]
    assert texts == [c["text"] for c in whole["choices"]]
    assert chunks[-1]["usage"] == whole["usage"] | {k: chunks[-1]["usage"][k] for k in ("queue_s", "compute_s")}


def test_echo_puts_the_prompt_first(http: ServerThread, fake: FakeEngine) -> None:
    ids = [fake.tokenizer.encode_words("a b"), fake.tokenizer.encode_words("c")]
    texts = ["hello there", "hi"]
    for prompt, echoed in ((texts, texts), (ids, [fake.tokenizer.decode(i) for i in ids])):
        body = {"prompt": prompt, "max_tokens": 2, "echo": True, "temperature": 0}
        whole = post(http, "/v1/completions", body).json()
        plain = post(http, "/v1/completions", body | {"echo": False}).json()
        assert [c["text"] for c in whole["choices"]] == [p + c["text"] for p, c in zip(echoed, plain["choices"],
                                                                                     strict=True)]
        r = requests.post(url(http, "/v1/completions"), json=body | {"stream": True}, stream=True, timeout=30)
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines(decode_unicode=True)
                  if line and line != "data: [DONE]"]
        streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == k)
                    for k in range(2)]
        assert streamed == [c["text"] for c in whole["choices"]]


def test_models_tokenize_health_metrics(http: ServerThread, fake: FakeEngine) -> None:
    models = requests.get(url(http, "/v1/models"), timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["fake-smollm2"]
    tokens = post(http, "/tokenize", {"prompt": "a b", "add_special_tokens": False, "return_token_strs": True}).json()
    assert tokens["tokens"] == fake.tokenize("a b", add_special_tokens=False)[0] and tokens["count"] == 2
    health = requests.get(url(http, "/health"), timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "SERVING"}
    post(http, "/v1/score", SCORE)
    post(http, "/v1/score", SCORE | {"labels": ["Yes", "Yes"]})
    text = requests.get(url(http, "/metrics"), timeout=10).text
    assert 'pyscore_requests_total{method="Score",status="OK"}' in text
    assert 'pyscore_requests_total{method="Score",status="INVALID_ARGUMENT"} 1.0' in text
    assert "pyscore_tokens_saved_by_mis_total" in text


class TemplatedTokenizer(FakeTokenizer):
    """The fake tokenizer with a chat template: "role: content" words, "assistant:" as the generation prompt."""

    chat_template = "role: content"

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool,
                            return_dict: bool, **kwargs: Any) -> Any:
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages) + " assistant:" * add_generation_prompt
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def test_tokenize_messages_reach_the_template(start_server: Any) -> None:
    """vLLM's /tokenize of a chat: add_generation_prompt (default true) reaches the template, add_special_tokens
    (default false) puts the tokenizer's BOS before it, token_strs are the tokenizer's pieces."""
    engine = FakeEngine(tokenizer=TemplatedTokenizer())
    http = start_server(engine, http_port=0)
    messages = [{"role": "user", "content": "where is it"}]
    words = engine.tokenizer.encode_words
    plain = post(http, "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    assert plain["tokens"] == words("user: where is it assistant:")
    assert plain["token_strs"] == ["user:", "where", "is", "it", "assistant:"]
    bare = post(http, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == words("user: where is it") and bare["token_strs"] is None
    special = post(http, "/tokenize", {"messages": messages, "add_special_tokens": True}).json()
    assert special["tokens"] == [1, *plain["tokens"]]  # BOS
    chat = post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == plain["count"]


def test_health_and_calls_before_the_model_is_loaded(start_server: Any) -> None:
    loading = start_server(None, http_port=0)
    assert requests.get(url(loading, "/health"), timeout=10).status_code == 503
    r = post(loading, "/v1/score", SCORE)
    assert r.status_code == 503 and r.json()["code"] == 503  # SGLang's flat error object
    r = post(loading, "/rerank", {"query": "q", "documents": ["a"]})
    assert r.status_code == 503 and error_of(r)["code"] == "UNAVAILABLE"


SGLANG_TYPE = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 429: "RateLimitError"}


@pytest.mark.parametrize(("body", "status", "param"), [
    (SCORE | {"labels": ["Yes", "Yes"]}, 400, "labels"),
    (SCORE | {"mode": "mis", "item_first": True}, 400, "mode"),
    (SCORE | {"model": "other"}, 400, "model"),  # SGLang's 400 ("The model ... does not exist"), not NOT_FOUND
    (SCORE | {"items": [str(i) for i in range(9)]}, 429, "items"),  # --max-items 8
    (SCORE | {"items": [[1, 2], [3]], "query": "text"}, 400, "items"),  # proto's item_token_ids
    (SCORE | {"query": 5}, 400, "query"),  # wrong type
    (SCORE | {"apply_softmax": "yes"}, 400, "apply_softmax"),
    (SCORE | {"mode": "fast"}, 400, "mode"),
    (SCORE | {"items": None}, 400, "items"),  # SGLang: "items must be provided"
    (SCORE | {"items": "not a list"}, 400, "items"),
    ({"items": ["a"], "labels": ["Yes", "No"]}, 400, "query"),  # no query (SGLang's invalid combination)
    ([1, 2], 400, None),  # not an object
])
def test_sglang_errors_are_sglang_error_objects(http: ServerThread, fake: FakeEngine, body: Any, status: int,
                                                param: str | None) -> None:
    """/v1/score answers SGLang's flat ErrorResponse (`object: "error"`, `code` the HTTP status), not OpenAI's
    nested one, with SGLang's status; the field named as in the other routes' errors."""
    calls = fake.calls
    r = post(http, "/v1/score", body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error == {"object": "error", "message": error["message"], "type": SGLANG_TYPE[status], "param": param,
                     "code": status}, error
    if param:
        assert error["message"].startswith(f"{param}:"), error
    assert fake.calls == calls  # refused before any model work
    vllm = post(http, "/v1/score", {"text_1": "q", "text_2": ["a"], "labels": ["Yes", "Yes"]})  # vLLM's body
    assert vllm.status_code == 400 and error_of(vllm)["code"] == "INVALID_ARGUMENT"  # vLLM's (OpenAI's) shape


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/generative_scoring", {"query": "q", "items": ["a"]}, 400, "label_token_ids"),  # vLLM requires them
    ("/generative_scoring", {"query": "q", "items": [], "label_token_ids": [11]}, 400, "items"),  # vLLM's 400
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # the proto's top_logprobs
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a"] * 65}, 400, "prompt"),  # MAX_CHOICES
    ("/v1/completions", {"prompt": ["a", "b"], "n": 33}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "top_p": 2}, 400, "top_p"),  # before the stream starts
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),  # no template
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    # MAX_STOP_TOKEN_IDS (128), counted before the list is copied into each of n choices
    ("/v1/completions", {"prompt": "hi", "n": 64, "stop_token_ids": list(range(129))}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [1] * 129}, 400,
     "stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": list(range(129))}}, 400,
     "sampling_params.stop_token_ids"),
])
def test_errors_are_openai_error_objects(http: ServerThread, fake: FakeEngine, path: str, body: Any, status: int,
                                         param: str | None) -> None:
    calls = fake.calls
    r = post(http, path, body)
    assert r.status_code == status, r.text
    error = error_of(r)
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}
    if param:
        assert error["message"].startswith(f"{param}:"), error
    assert fake.calls == calls  # refused before any model work
    assert post(http, "/v1/score", SCORE).status_code == 200


def test_malformed_and_oversize_bodies(http: ServerThread, fake: FakeEngine) -> None:
    calls = fake.calls
    r = requests.post(url(http, "/v1/score"), data=b'{"query": "q", "items": [', timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["message"]  # SGLang's flat error object
    r = requests.post(url(http, "/v1/score"), data=b"\xff\xfe", timeout=10)
    assert r.status_code == 400
    big = json.dumps(SCORE | {"items": ["x " * 600_000]}).encode()  # over --max-message-mb 1
    r = requests.post(url(http, "/v1/score"), data=big, timeout=30)
    assert r.status_code == 413 and r.json()["code"] == 413
    r = requests.post(url(http, "/generative_scoring"), data=big, timeout=30)
    assert r.status_code == 413 and error_of(r)["code"] == "RESOURCE_EXHAUSTED"

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused while reading
        for _ in range(40):
            yield b" " * 65536

    r = requests.post(url(http, "/v1/score"), data=chunked(), timeout=30)
    assert r.status_code == 413
    assert fake.calls == calls


@pytest.mark.parametrize("path", ["/v1/score", "/v1/completions", "/generate"])
@pytest.mark.parametrize("body", [b'{"prompt": 1' + b"0" * 5000 + b"}",  # past Python's 4,300-digit int limit
                                  b"[" * 100_000])  # past the recursion limit
def test_json_python_will_not_read_is_a_400(http: ServerThread, fake: FakeEngine, path: str, body: bytes) -> None:
    """A body json.loads refuses with a ValueError other than JSONDecodeError, or a RecursionError, is malformed
    JSON (400, a bounded message), as any other; it was a 500."""
    calls = fake.calls
    r = requests.post(url(http, path), data=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["message"] if path == "/v1/score" else error_of(r)["message"]
    assert message.startswith("the body is not valid JSON") and len(message) < 300, message
    assert fake.calls == calls


VLLM_ROUTE_ERROR = {404: "Not Found", 405: "Method Not Allowed"}


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/nope", 404), ("POST", "/v1/nope", 404),
                                                        ("POST", "/score/extra", 404), ("GET", "/v1/score", 405),
                                                        ("GET", "/v1/completions", 405)])
def test_missing_routes_and_methods_answer_as_vllm(http: ServerThread, method: str, path: str, status: int) -> None:
    """vLLM's HTTPException handler answers a route it does not have, or a method a route does not take, with
    ErrorInfo: the status's phrase as message and type, the status as code (405 with Allow, as Starlette sets)."""
    r = requests.request(method, url(http, path), json={}, timeout=10)
    phrase = VLLM_ROUTE_ERROR[status]
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": phrase, "type": phrase, "param": None, "code": status}}
    if status == 405:
        assert "POST" in r.headers["allow"]


def test_http_and_grpc_share_a_forward_pass(http: ServerThread, fake: FakeEngine) -> None:
    fake.pause()
    with ScorerClient(http.target, timeout=30) as client:
        blocker = client.stub.Score.future(_score_message("blocker"), timeout=30)
        assert fake.wait_entered()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            over_http = pool.submit(post, http, "/v1/score", SCORE | {"query": "over http"})
            wait_for(lambda: http.batcher.waiting() == 1, what="the HTTP request waiting")
            over_grpc = client.stub.Score.future(_score_message("over grpc"), timeout=30)
            wait_for(lambda: http.batcher.waiting() == 2, what="both waiting")
            fake.resume()
            blocker.result()
            assert over_http.result().status_code == 200
            over_grpc.result()
    assert fake.batches[-2:] == [["blocker"], ["over http", "over grpc"]]


def test_a_full_queue_is_429(start_server: Any, fake: FakeEngine) -> None:
    server = start_server(fake, http_port=0, max_queue=1)
    fake.pause()
    with ScorerClient(server.target, timeout=30) as client:
        running = client.stub.Score.future(_score_message("running"), timeout=30)
        assert fake.wait_entered()
        waiting = client.stub.Score.future(_score_message("waiting"), timeout=30)
        wait_for(lambda: server.batcher.waiting() == 1, what="one waiting")
        r = post(server, "/v1/score", SCORE)
        assert r.status_code == 429 and r.json()["type"] == "RateLimitError", r.text
        assert "--max-queue" in r.json()["message"]
        fake.resume()
        running.result()
        waiting.result()


def _score_message(query: str) -> Any:
    from pyscore._proto.pyscore.v1 import scorer_pb2 as pb

    return pb.ScoreRequest(query=query, items=["a"], labels=["Yes"])


def raw_post(server: ServerThread, path: str, body: dict[str, Any]) -> socket.socket:
    """A POST written on a raw socket, left open (the test closes it to play a client that goes away)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.app.http_port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_client_that_goes_away_is_dropped(http: ServerThread, fake: FakeEngine,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.requests")
    fake.pause()
    with ScorerClient(http.target, timeout=30) as client:
        first = client.stub.Score.future(_score_message("first"), timeout=30)
        assert fake.wait_entered()
        doomed = raw_post(http, "/v1/score", SCORE | {"query": "doomed"})
        wait_for(lambda: http.batcher.waiting() == 1, what="the HTTP request waiting")
        doomed.close()
        wait_for(lambda: any("/v1/score" in r.getMessage() and "status=CANCELLED" in r.getMessage()
                             for r in caplog.records), what="the server saw the disconnect")
        fake.resume()
        first.result()
        client.score("after", ["a"], labels=["Yes"])
    assert fake.batches[-2:] == [["first"], ["after"]]
    assert http.batcher.stats.dropped == 1


@pytest.mark.parametrize(("choices", "sequences"), [(dict(prompt="long one"), 1),
                                                     (dict(prompt=["long one", "another"], n=2), 4)])
def test_a_stream_whose_client_goes_away_frees_its_sequence(http: ServerThread, fake: FakeEngine,
                                                            choices: dict[str, Any], sequences: int) -> None:
    """Every choice's sequence is freed (one, or a list of prompts x n)."""
    fake.delay_s = 0.01  # 500 steps take 5 s: the disconnect surely comes first
    sock = raw_post(http, "/v1/completions", choices | {"max_tokens": 500, "stream": True})
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    wait_for(lambda: http.batcher.running_generations() == sequences, what="every choice running")
    sock.close()
    wait_for(lambda: http.batcher.running_generations() == 0, what="the sequence freed")
    assert len(fake.steps) < 500
    metrics = requests.get(url(http, "/metrics"), timeout=10).text  # counted once, as cancelled, and done
    assert 'pyscore_requests_total{method="Generate",status="CANCELLED"} 1.0' in metrics
    assert 'pyscore_requests_in_flight{method="Generate"} 0.0' in metrics


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_token_and_tls(start_server: Any, pki: Pki, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    server = start_server(FakeEngine(), http_port=0, auth_token_file=str(token), tls_cert=str(pki.server_cert),
                          tls_key=str(pki.server_key))
    https = url(server, "/v1/score", "https")
    ca = str(pki.ca)
    assert requests.get(url(server, "/health", "https"), verify=ca, timeout=10).status_code == 200  # open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = requests.post(https, json=SCORE, headers=headers, verify=ca, timeout=10)
        assert r.status_code == 401 and error_of(r)["code"] == "UNAUTHENTICATED"
        assert r.headers["www-authenticate"] == "Bearer"
    assert requests.get(url(server, "/metrics", "https"), verify=ca, timeout=10).status_code == 401
    assert requests.get(url(server, "/ping", "https"), verify=ca, timeout=10).status_code == 200  # open, as /health
    for locked in ("/version", "/rerank", "/classify", "/detokenize"):
        r = requests.request("GET" if locked == "/version" else "POST", url(server, locked, "https"), json={},
                             verify=ca, timeout=10)
        assert r.status_code == 401, locked
    r = requests.post(https, json=SCORE, headers={"Authorization": f"bearer {TOKEN}"}, verify=ca, timeout=10)
    assert r.status_code == 200, r.text
    with pytest.raises(requests.exceptions.ConnectionError):  # no plaintext on the TLS port
        requests.post(url(server, "/v1/score"), json=SCORE, timeout=10)


def test_mutual_tls(start_server: Any, pki: Pki) -> None:
    server = start_server(FakeEngine(), http_port=0, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                          tls_client_ca=str(pki.ca))
    https = url(server, "/v1/score", "https")
    r = requests.post(https, json=SCORE, verify=str(pki.ca), cert=(str(pki.client_cert), str(pki.client_key)),
                      timeout=10)
    assert r.status_code == 200
    with pytest.raises(requests.exceptions.ConnectionError):  # TLS 1.3 refuses after the handshake: no SSLError
        requests.post(https, json=SCORE, verify=str(pki.ca), timeout=10)


def test_cli_flag_and_the_address_line() -> None:
    from server.__main__ import parse_args

    assert parse_args([])[0].http_port is None
    assert parse_args(["--http-port", "0"])[0].http_port == 0


def test_responses_are_not_held_back_by_nagle(http: ServerThread) -> None:
    """Every connection has TCP_NODELAY: without it each response waits out the client's delayed ACK (~40 ms)."""
    with requests.Session() as session:
        assert session.get(url(http, "/health"), timeout=10).status_code == 200  # the connection stays open
        assert http.app.http is not None
        connections = list(http.app.http._server.server_state.connections)  # type: ignore[union-attr]
        assert connections
        for connection in connections:
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_python_m_server_with_http_drains_on_sigterm_and_exits_0() -> None:
    """The front door in `python -m server`: its address line, and SIGTERM (the app's, not uvicorn's) lets an
    HTTP request in flight finish, then the process exits 0."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, FAKE_ENGINE_DELAY_S="0.5", PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, "-m", "server", "--engine", "tests.server.fake_engine:FakeEngine",
                             "--port", "0", "--http-port", "0", "--grace-s", "5"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("pyscore: listening on ") and lines[2].startswith("pyscore: serving "), lines
        assert lines[1].startswith("pyscore: HTTP on http://127.0.0.1:"), lines
        base = lines[1].split()[3]
        assert requests.get(f"{base}/health", timeout=10).status_code == 200
        answers: list[requests.Response] = []
        worker = threading.Thread(target=lambda: answers.append(requests.post(f"{base}/v1/score", json=SCORE,
                                                                               timeout=10)))
        worker.start()

        def in_flight() -> float:  # the front door counts its calls in the gRPC metrics, on its own /metrics
            text = requests.get(f"{base}/metrics", timeout=10).text
            return sum(float(line.split()[1]) for line in text.splitlines()
                       if line.startswith('pyscore_requests_in_flight{method="Score"}'))

        # at the server (inside its 0.5 s model call), not still on its way: a loaded machine can take longer
        # than any fixed sleep to deliver it, and a request that arrives after SIGTERM is refused, not drained
        wait_for(lambda: in_flight() == 1, what="the request at the server")
        proc.send_signal(signal.SIGTERM)
        worker.join(10)
        assert answers and answers[0].status_code == 200
        assert proc.wait(15) == 0
        assert "http /v1/score items=2 tokens=" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
