"""The HTTP targets (OpenAI-compatible completions, SGLang /v1/score) against a stub server on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from bench.dataset import Question
from bench.targets import OpenAIHTTPTarget, SGLangScoreTarget, TargetError, make_target

Q = Question(id="q", source="unit", state_json="{}", question="What next?",
             options=["Track it.", "Refund it.", "Close it."], target=[0.0, 1.0, 0.0])
TOKENS = {" Yes": [9230], " No": [2838]}


class Stub(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[str, dict]]] = []

    def log_message(self, *args):
        pass

    def reply(self, body, status=200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.requests.append((self.path, {}))
        if self.path == "/v1/models":
            self.reply({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        else:
            self.reply({"error": "no route"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body))
        if "boom" in json.dumps(body):
            self.reply({"error": "injected"}, 500)
        elif self.path == "/tokenize":
            self.reply({"tokens": TOKENS.get(body["prompt"], [1, 2]), "count": 1})
        elif self.path == "/v1/completions":
            yes = -0.1 if "Refund" in body["prompt"] else -3.0
            top = {" Yes": yes, " No": -0.5, "\n": -4.0}
            self.reply({"choices": [{"text": " No", "logprobs": {"tokens": [" No"], "token_logprobs": [-0.5],
                                                                   "top_logprobs": [top]}}]})
        elif self.path == "/v1/chat/completions":
            top = [{"token": "A", "logprob": -1.5}, {"token": "B", "logprob": -0.2}, {"token": "Sure", "logprob": -0.1}]
            self.reply({"choices": [{"message": {"role": "assistant", "content": "B"},
                                     "logprobs": {"content": [{"token": "B", "logprob": -0.2, "top_logprobs": top}]}}]})
        elif self.path == "/v1/score":
            self.reply({"scores": [[0.2, 0.8], [0.9, 0.1], [0.3, 0.7]][: len(body["items"])], "model": body["model"]})
        else:
            self.reply({"error": "no route"}, 404)


@pytest.fixture
def stub():
    Stub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def decide(target, path, q=Q):
    await target.open()
    try:
        return await target.decide(path, q)
    finally:
        await target.close()


def test_openai_generate_sends_one_one_token_completion_per_candidate(stub):
    target = make_target(f"openai-http://{stub}", timeout=10)
    assert isinstance(target, OpenAIHTTPTarget) and target.spec == f"openai-http://{stub}"
    d = asyncio.run(decide(target, "generate"))
    assert (d.choice, d.calls, target.info.model) == (1, 3, "stub-model")
    sent = [body for route, body in Stub.requests if route == "/v1/completions"]
    assert len(sent) == 3
    assert all(b["max_tokens"] == 1 and b["logprobs"] == 5 and b["temperature"] == 0 and b["model"] == "stub-model"
               for b in sent)
    assert sorted(b["prompt"].endswith("Answer Yes or No.") for b in sent) == [True] * 3
    assert any("Proposed answer: Refund it." in b["prompt"] for b in sent)


def test_openai_fused_reads_the_best_letter(stub):
    d = asyncio.run(decide(make_target(f"openai-http://{stub}", model="m"), "fused"))
    assert d.choice == 1
    (body,) = [b for route, b in Stub.requests if route == "/v1/chat/completions"]
    assert body["messages"][0]["content"].endswith("exactly one letter: A, B or C.")
    assert (body["max_tokens"], body["top_logprobs"], body["logprobs"], body["model"]) == (1, 20, True, "m")
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert not any(route == "/v1/models" for route, _ in Stub.requests)  # --model given: no lookup


def test_sglang_score(stub):
    target = make_target(f"sglang-score-http://{stub}")
    assert isinstance(target, SGLangScoreTarget)
    d = asyncio.run(decide(target, "mis"))
    assert d.choice == 1 and target.info.label_token_ids == [9230, 2838]
    (body,) = [b for route, b in Stub.requests if route == "/v1/score"]
    assert body["label_token_ids"] == [9230, 2838] and body["apply_softmax"] is True
    assert body["query"].startswith("Context:\n{}") and len(body["items"]) == 3
    with pytest.raises(ValueError, match="does not serve path 'setwise'"):
        asyncio.run(decide(make_target(f"sglang-score-http://{stub}", label_token_ids=[1, 2]), "setwise"))


def test_http_errors_name_the_route(stub):
    boom = Question(id="b", source="unit", state_json="boom", question="?", options=["a", "b"], target=[1.0, 0.0])
    with pytest.raises(TargetError, match=r"/v1/score: HTTP 500"):
        asyncio.run(decide(make_target(f"sglang-score-http://{stub}", label_token_ids=[1, 2]), "sis", boom))
