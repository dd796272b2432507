"""The HTTP targets (OpenAI-compatible completions, vLLM /generative_scoring, SGLang /v1/score) against a stub
server on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from bench.dataset import Question
from bench.targets import (
    OpenAIHTTPTarget,
    SGLangScoreTarget,
    TargetError,
    VLLMHTTPTarget,
    generative_scoring_scores,
    make_target,
    prometheus_counters,
)

Q = Question(id="q", source="unit", state_json="{}", question="What next?",
             options=["Track it.", "Refund it.", "Close it."], target=[0.0, 1.0, 0.0])
TOKENS = {" Yes": [9230], " No": [2838]}
PROMPT_TOKENS, CACHED_TOKENS = 100, 64
METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="stub-model"}} {queries}
vllm:prefix_cache_queries_created{{engine="0",model_name="stub-model"}} 1.7e9
vllm:prefix_cache_hits_total{{engine="0",model_name="stub-model"}} {hits}
vllm:prompt_tokens_total{{engine="0",model_name="stub-model"}} {queries}
vllm:prompt_tokens_total{{engine="1",model_name="stub-model"}} 0.0
vllm:prompt_tokens_by_source_total{{engine="0",model_name="stub-model",source="local_compute"}} {computed}
vllm:prompt_tokens_by_source_total{{engine="0",model_name="stub-model",source="local_cache_hit"}} {hits}
"""


def text_id(text):
    """The stub tokenizer: any text but the labels is one token, its id a function of the text."""
    return sum(map(ord, text)) % 40000 + 10


def usage(body, details=True):
    """vLLM-like usage: with a cache salt, the first request of that salt computes everything and the others
    find CACHED_TOKENS of their prompt cached (as one question's candidates sharing the query's blocks).
    /generative_scoring's usage has no cached-token details (details=False)."""
    out = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
    salt = body.get("cache_salt")
    with Stub.lock:
        cached = CACHED_TOKENS if salt is not None and salt in Stub.salts else 0
        Stub.salts.add(salt)
        for key, n in (("queries", PROMPT_TOKENS), ("hits", cached), ("computed", PROMPT_TOKENS - cached)):
            Stub.counts[key] += n
    if salt is not None and details:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


class Stub(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[str, dict]]] = []
    salts: ClassVar[set[str | None]] = set()
    counts: ClassVar[dict[str, int]] = {}
    lock = threading.Lock()

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
        elif self.path == "/metrics":
            data = METRICS.format(**{k: float(v) for k, v in self.counts.items()}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.reply({"error": "no route"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body))
        if "boom" in json.dumps(body):
            self.reply({"error": "injected"}, 500)
        elif self.path == "/tokenize":
            self.reply({"tokens": TOKENS.get(body["prompt"], [text_id(body["prompt"])]), "count": 1})
        elif self.path == "/v1/completions" and body.get("echo"):
            # each option's continuation token: -0.1 after the context for " Refund it.", -2.0 for the others
            best = text_id(" Refund it.")
            choices = [{"index": i, "text": "?", "logprobs": {
                "tokens": ["t"] * (len(ids) + 1),
                "token_logprobs": [None, *(-0.1 if t == best else -2.0 for t in ids[1:]), -0.7]}}
                for i, ids in enumerate(body["prompt"])]
            self.reply({"choices": choices[::-1], "usage": usage(body)})
        elif self.path == "/v1/completions":
            yes = -0.1 if "Refund" in body["prompt"] else -3.0
            top = {" Yes": yes, " No": -0.5, "\n": -4.0}
            self.reply({"choices": [{"text": " No", "logprobs": {"tokens": [" No"], "token_logprobs": [-0.5],
                                                                   "top_logprobs": [top]}}], "usage": usage(body)})
        elif self.path == "/v1/chat/completions":
            top = [{"token": "A", "logprob": -1.5}, {"token": "B", "logprob": -0.2}, {"token": "Sure", "logprob": -0.1}]
            self.reply({"choices": [{"message": {"role": "assistant", "content": "B"},
                                     "logprobs": {"content": [{"token": "B", "logprob": -0.2, "top_logprobs": top}]}}]})
        elif self.path == "/generative_scoring":
            assert len(body["label_token_ids"]) == 2 and body["apply_softmax"] is True
            data = [{"index": i, "object": "score", "score": 0.9 if i == 1 else 0.2} for i in range(len(body["items"]))]
            self.reply({"object": "list", "model": body["model"], "data": data[::-1],
                        "usage": usage(body, details=False)})
        elif self.path == "/rerank":
            assert set(body) == {"model", "query", "documents"}
            results = [{"index": i, "document": {"text": d}, "relevance_score": 0.9 if i == 1 else 0.2}
                       for i, d in enumerate(body["documents"])]
            self.reply({"id": "rerank-1", "model": body["model"], "results": sorted(results, key=lambda r: -r[
                "relevance_score"]), "usage": {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS}})
        elif self.path == "/v1/score":
            self.reply({"scores": [[0.2, 0.8], [0.9, 0.1], [0.3, 0.7]][: len(body["items"])], "model": body["model"]})
        else:
            self.reply({"error": "no route"}, 404)


@pytest.fixture
def stub():
    Stub.requests, Stub.salts, Stub.counts = [], set(), dict.fromkeys(("queries", "hits", "computed"), 0)
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


@pytest.mark.parametrize("scheme", ["openai-http", "vllm-http"])
def test_loglik_sends_every_option_in_one_echo_request(stub, scheme):
    """lm-evaluation-harness's multiple choice: one /v1/completions of every option's token-id prompt (context +
    continuation), echo with logprobs; the option whose continuation sums highest wins."""
    d = asyncio.run(decide(make_target(f"{scheme}://{stub}", model="m", label_token_ids=[1, 2]), "loglik"))
    assert d.choice == 1
    (body,) = [b for route, b in Stub.requests if route == "/v1/completions"]
    assert body["echo"] is True and body["logprobs"] == 1 and body["max_tokens"] == 1
    assert [ids[1] for ids in body["prompt"]] == [text_id(" " + o) for o in Q.options]
    assert ("cache_salt" in body) == (scheme == "vllm-http")


def test_http_errors_name_the_route(stub):
    boom = Question(id="b", source="unit", state_json="boom", question="?", options=["a", "b"], target=[1.0, 0.0])
    with pytest.raises(TargetError, match=r"/v1/score: HTTP 500"):
        asyncio.run(decide(make_target(f"sglang-score-http://{stub}", label_token_ids=[1, 2]), "sis", boom))


async def decide_twice(target, path):
    await target.open()
    try:
        return [await target.decide(path, Q) for _ in range(2)]
    finally:
        await target.close()


def test_openai_generate_records_prompt_tokens_and_sends_no_salt(stub):
    d = asyncio.run(decide(make_target(f"openai-http://{stub}"), "generate"))
    assert (d.prompt_tokens, d.computed_tokens) == (3 * PROMPT_TOKENS, 0)  # no cache details: computed unknown
    assert not any("cache_salt" in b for route, b in Stub.requests if route == "/v1/completions")


def test_vllm_generate_salts_each_dispatch_and_counts_cached_tokens(stub):
    target = make_target(f"vllm-http://{stub}", timeout=10)
    assert isinstance(target, VLLMHTTPTarget) and target.spec == f"vllm-http://{stub}"
    first, second = asyncio.run(decide_twice(target, "generate"))
    sent = [b for route, b in Stub.requests if route == "/v1/completions"]
    assert len(sent) == 6 and all(b["max_tokens"] == 1 and b["logprobs"] == 5 for b in sent)
    salts = [b["cache_salt"] for b in sent]
    # One salt per dispatch, shared by its candidates: the repetition cannot reuse the first one's blocks.
    assert len(set(salts[:3])) == 1 and len(set(salts[3:])) == 1 and salts[0] != salts[3]
    for d in (first, second):
        assert (d.choice, d.calls, d.prompt_tokens) == (1, 3, 3 * PROMPT_TOKENS)
        assert d.computed_tokens == 3 * PROMPT_TOKENS - 2 * CACHED_TOKENS


@pytest.mark.parametrize("path", ["mis", "sis"])
def test_vllm_scoring_paths_send_generative_scoring(stub, path):
    target = make_target(f"vllm-http://{stub}", model="m")
    first, second = asyncio.run(decide_twice(target, path))
    assert target.info.label_token_ids == [9230, 2838]
    bodies = [b for route, b in Stub.requests if route == "/generative_scoring"]
    assert len(bodies) == 2 and bodies[0]["cache_salt"] != bodies[1]["cache_salt"]
    body = bodies[0]
    assert (body["model"], body["label_token_ids"], body["apply_softmax"]) == ("m", [9230, 2838], True)
    assert body["query"].startswith("Context:\n{}") and len(body["items"]) == 3
    assert body["items"][1].startswith("Proposed answer: Refund it.")
    # results arrive out of order; the rows follow `index`
    # its usage says no cached tokens: computed stays unknown (0); the /metrics counters say it per run
    assert (first.choice, first.calls, first.prompt_tokens, first.computed_tokens) == (1, 1, PROMPT_TOKENS, 0)
    assert second.choice == 1


def test_vllm_rerank_path_reads_relevance_by_index(stub):
    target = make_target(f"vllm-http://{stub}", model="m")
    first, second = asyncio.run(decide_twice(target, "rerank"))
    bodies = [b for route, b in Stub.requests if route == "/rerank"]
    assert len(bodies) == 2 and len(bodies[0]["documents"]) == 3
    assert bodies[0]["query"].startswith("Context:\n{}")
    assert bodies[0]["documents"][1].startswith("Proposed answer: Refund it.")
    # sorted by relevance, read back by index; usage without cached tokens: computed unknown (0)
    assert (first.choice, first.calls, first.prompt_tokens, first.computed_tokens) == (1, 1, PROMPT_TOKENS, 0)
    assert second.choice == 1


def test_generative_scoring_scores_check_the_answer():
    answer = {"data": [{"index": 1, "object": "score", "score": 0.9}, {"index": 0, "object": "score", "score": 0.3}]}
    assert generative_scoring_scores(answer, 2) == [0.3, 0.9]
    with pytest.raises(TargetError, match="no per-item scores"):
        generative_scoring_scores({"data": [{"index": 0}]}, 1)
    with pytest.raises(TargetError, match="expected 3 scores, got 2"):
        generative_scoring_scores(answer, 3)


def test_vllm_counters_sum_label_sets(stub):
    async def run():
        target = make_target(f"vllm-http://{stub}", label_token_ids=[1, 2])
        await target.open()
        try:
            before = await target.counters()
            await target.decide("generate", Q)
            return before, await target.counters()
        finally:
            await target.close()

    before, after = asyncio.run(run())
    assert before == {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prompt_tokens": 0, "computed_tokens": 0}
    assert after == {"prefix_cache_queries": 300, "prefix_cache_hits": 128, "prompt_tokens": 300,
                     "computed_tokens": 300 - 2 * CACHED_TOKENS}
    assert prometheus_counters("# only comments\n", {"x": ("x_total", ())}) == {}


def test_our_generate_shares_one_salt_per_dispatch():
    """pyscore's one-token generations of one question carry one prefix_cache_salt, so its candidates share the
    query's cached blocks (as vLLM's completions share their cache_salt); the next dispatch gets a fresh one."""
    from bench.targets import OurPaths
    from pyscore.types import Usage

    class Recorder(OurPaths):
        def __init__(self) -> None:
            self.caches: list[dict] = []

        async def _top_call(self, prompt, chat, top, cache=None):
            self.caches.append(cache)
            return [(" Yes", -0.1)], Usage(prompt_tokens=10, computed_tokens=10, cached_tokens=0)

    target = Recorder()

    async def twice() -> None:
        await target._generate(Q)
        await target._generate(Q)

    asyncio.run(twice())
    salts = [c["prefix_cache_salt"] for c in target.caches]
    n = len(Q.options)
    assert len(salts) == 2 * n
    assert len(set(salts[:n])) == 1 and len(set(salts[n:])) == 1 and salts[0] != salts[n]
