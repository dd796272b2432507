"""The HTTP front door on the real engine (tiny random Qwen3, fp32), with the peers' own clients: the `openai`
package (completions, chat, streaming, logprobs, errors), `curl`, and `requests` posting SGLang's and vLLM's
documented example payloads. The same question asked over HTTP and over gRPC gets the same bits; a concurrent
mix of both gets what each gets alone; and every bad-input case of the gRPC matrix answers over HTTP with the
mapped status, naming the field as the HTTP client wrote it."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import requests

from pyscore.client import ScorerClient
from pyscore.types import GenerateResult, TokenLogprob
from server.http_openai import COMPLETION_FIELDS
from server.http_score import SCORE_FIELDS
from server.http_sglang import finish_reason
from tests.server.conftest import ServerThread, make_tiny_engine
from tests.server.test_bad_input_matrix import GENERATE, GOOD_GENERATE, GOOD_SCORE, SCORE

QUERY = "Context: the order 1234 was shipped on Monday and is in transit.\nQuestion: what should the agent do?"
ITEMS = [" Proposed answer: tell the customer the order is on its way.", " Proposed answer: cancel the order.", " A"]
PROMPT = "The quick brown fox"
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
               grpc.StatusCode.NOT_FOUND: 404}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = ServerThread(make_tiny_engine(tiny_model_dir), max_batch_tokens=256, http_port=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base(served: ServerThread) -> str:
    return f"http://127.0.0.1:{served.app.http_port}"


@pytest.fixture(scope="module")
def client(served: ServerThread) -> Iterator[ScorerClient]:
    with ScorerClient(served.target, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def oa(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def name(client: ScorerClient) -> str:
    return client.model_info().name


@pytest.fixture(scope="module")
def labels(base: str) -> list[int]:
    ids = [requests.post(f"{base}/tokenize", json={"prompt": w, "add_special_tokens": False}, timeout=30).json()
           ["tokens"] for w in ("Yes", "No")]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def post(base: str, path: str, body: Any) -> requests.Response:
    """POST `body` as JSON; NaN and infinities as Python writes them (requests' json= refuses them)."""
    return requests.post(base + path, data=json.dumps(body), headers={"content-type": "application/json"},
                         timeout=60)


@pytest.mark.parametrize("options", [dict(apply_softmax=True), dict(apply_softmax=False), dict(mode="sis"),
                                     dict(item_first=True), dict(prefix_cache_salt="tenant-a")])
def test_score_over_http_equals_grpc_bitwise(base: str, client: ScorerClient, labels: list[int],
                                             options: dict[str, Any]) -> None:
    over_grpc = client.score(QUERY, ITEMS, label_token_ids=labels, **options)
    body = post(base, "/v1/score", {"query": QUERY, "items": ITEMS, "label_token_ids": labels, **options}).json()
    assert body["scores"] == [rows[0] for rows in over_grpc.scores]  # == on floats: the same bits
    assert body["mode"] == over_grpc.mode and body["label_token_ids"] == labels
    usage = body["usage"]  # the same tokens, read from the cache the gRPC call filled where they are whole blocks
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert (usage["prompt_tokens"], usage["computed_tokens"] + cached) == (
        over_grpc.usage.prompt_tokens, over_grpc.usage.computed_tokens + over_grpc.usage.cached_tokens)
    vllm = post(base, "/generative_scoring", {"query": QUERY, "items": ITEMS, "label_token_ids": labels,
                                              "apply_softmax": False,  # vLLM's default is True, the proto's False
                                              **{k: v for k, v in options.items() if k != "mode"}}).json()
    if "mode" not in options:
        assert [d["score"] for d in vllm["data"]] == [rows[0][0] for rows in over_grpc.scores]


def test_setwise_over_http_equals_grpc(base: str, client: ScorerClient, labels: list[int]) -> None:
    item = " first <|marker|> second <|marker|> third <|marker|>"
    over_grpc = client.score(QUERY, [item], label_token_ids=labels, score_extraction_token="<|marker|>")
    body = post(base, "/v1/score", {"query": QUERY, "items": [item], "label_token_ids": labels,
                                    "score_extraction_token": "<|marker|>"}).json()
    assert body["scores"] == over_grpc.scores and len(body["scores"][0]) == 3


def test_completions_over_http_equal_grpc(base: str, client: ScorerClient, oa: openai.OpenAI, name: str) -> None:
    over_grpc = client.generate(PROMPT, max_tokens=6, top_logprobs=3)
    c = oa.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = c.choices[0]
    assert choice.text == over_grpc.text
    assert choice.logprobs.token_logprobs == [lp.logprob for lp in over_grpc.logprobs]
    # greedy: the chosen token is the first alternative; alternatives whose texts are equal (byte tokens) share
    # the likelier one's value
    assert choice.logprobs.top_logprobs == [{t.token: t.logprob for t in reversed(lp.top)}
                                            for lp in over_grpc.logprobs]
    assert c.usage.prompt_tokens == over_grpc.usage.prompt_tokens
    assert c.usage.completion_tokens == len(over_grpc.token_ids)
    streamed = oa.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == over_grpc.text
    # sampled: the same seed and temperature (float32 on both wires) draw the same tokens
    sampled = client.generate(PROMPT, max_tokens=6, temperature=0.7, seed=11)
    c = oa.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0.7, seed=11)
    assert c.choices[0].text == sampled.text
    by_ids = oa.completions.create(model=name, prompt=client.tokenize(PROMPT)[0], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == over_grpc.text


def test_prompt_lists_and_samples_over_http_equal_grpc(client: ScorerClient, oa: openai.OpenAI, name: str) -> None:
    """vLLM's batch completion (a list of prompts) and n samples through the openai client: choice prompt * n + j
    is what gRPC gets for that prompt with seed + j; a chat's n samples likewise."""
    prompts = [PROMPT, "Context: the order 1234"]
    c = oa.completions.create(model=name, prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=21, logprobs=1)
    want = [client.generate(p, max_tokens=5, temperature=0.8, seed=21 + j, top_logprobs=1) for p in prompts
            for j in range(2)]
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in c.choices] == [w.text for w in want]
    assert [ch.logprobs.token_logprobs for ch in c.choices] == [[lp.logprob for lp in w.logprobs] for w in want]
    assert c.usage.prompt_tokens == want[0].usage.prompt_tokens + want[2].usage.prompt_tokens
    assert c.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    streamed = oa.completions.create(model=name, prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=21,
                                     stream=True)
    texts = [""] * 4
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [w.text for w in want]
    question = "Where is my order 1234?"
    chat = oa.chat.completions.create(model=name, messages=[{"role": "user", "content": question}], max_tokens=4,
                                      temperature=0.8, seed=5, n=3)
    assert [ch.message.content for ch in chat.choices] == [
        client.generate(question, apply_chat_template=True, max_tokens=4, temperature=0.8, seed=5 + j).text
        for j in range(3)]


def test_prompt_logprobs_over_grpc_and_http_echo(client: ScorerClient, oa: openai.OpenAI, name: str) -> None:
    """gRPC's prompt_logprobs (unary: with the result; streamed: in the first message) and OpenAI's echo with
    logprobs, lm-evaluation-harness's loglikelihood request (token-id prompts, max_tokens 1), carry the same
    entries; max_tokens 0 with echo answers the prompt alone."""
    unary = client.generate(PROMPT, max_tokens=2, prompt_logprobs=2)
    assert unary.prompt_logprobs is not None and math.isnan(unary.prompt_logprobs[0].logprob)
    ids = client.tokenize(PROMPT)[0]
    assert [lp.token_id for lp in unary.prompt_logprobs] == ids
    assert all(len(lp.top) == 2 for lp in unary.prompt_logprobs[1:])
    chunks = list(client.generate_stream(PROMPT, max_tokens=2, prompt_logprobs=2))
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    assert [(lp.token_id, lp.logprob, lp.top) for lp in chunks[0].prompt_logprobs[1:]] == [
        (lp.token_id, lp.logprob, lp.top) for lp in unary.prompt_logprobs[1:]]
    assert client.generate(PROMPT, max_tokens=2).prompt_logprobs is None
    other = client.tokenize("Context: the order 1234")[0]
    c = oa.completions.create(model=name, prompt=[ids, other], max_tokens=1, temperature=0, logprobs=1, echo=True)
    lps = c.choices[0].logprobs
    assert c.choices[0].text.endswith(client.generate(ids, max_tokens=1).text)
    assert lps.tokens[: len(ids)] == [lp.token for lp in unary.prompt_logprobs]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1 : len(ids)] == [lp.logprob for lp in unary.prompt_logprobs[1:]]
    # each entry: the prompt token itself and its 1 most likely alternative (vLLM's and OpenAI's k + 1)
    assert lps.top_logprobs[1 : len(ids)] == [{t.token: t.logprob for t in lp.top[:1]} | {lp.token: lp.logprob}
                                              for lp in unary.prompt_logprobs[1:]]
    assert len(lps.tokens) == len(ids) + 1 and len(c.choices[1].logprobs.tokens) == len(other) + 1
    alone = oa.completions.create(model=name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs[1:] == [lp.logprob for lp in unary.prompt_logprobs[1:]]


def test_cli_prints_prompt_logprobs(served: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    from pyscore import cli

    assert cli.main(["generate", PROMPT, "--max-tokens", "2", "--prompt-logprobs", "1", "--target",
                     served.target]) == 0
    out = capsys.readouterr().out
    assert "prompt (the first token has nothing before it):" in out and "nan" in out
    assert cli.main(["generate", PROMPT, "--max-tokens", "2", "--prompt-logprobs", "1", "--json", "--target",
                     served.target]) == 0
    assert len(json.loads(capsys.readouterr().out)["prompt_logprobs"]) > 1


def test_vllm_prompt_logprobs_extension(client: ScorerClient, oa: openai.OpenAI, name: str) -> None:
    """vLLM's `prompt_logprobs` (extra_body) gives each choice vLLM's prompt_logprobs: null, then per token its id ->
    {logprob, rank, decoded_token} and its alternatives', the same values as gRPC's."""
    want = client.generate(PROMPT, max_tokens=2, prompt_logprobs=2)
    c = oa.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0,
                              extra_body={"prompt_logprobs": 2})
    got = c.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for position, lp in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        assert position[str(lp.token_id)]["logprob"] == lp.logprob
        assert position[str(lp.token_id)]["decoded_token"] == lp.token
        ranks = {str(t.token_id): r + 1 for r, t in enumerate(lp.top)}
        assert position[str(lp.token_id)]["rank"] == ranks.get(str(lp.token_id))
        assert all(position[i]["rank"] == r for i, r in ranks.items())
    plain = oa.completions.create(model=name, prompt=PROMPT, max_tokens=1)
    assert plain.choices[0].prompt_logprobs is None  # type: ignore[attr-defined]  # present, null: vLLM's shape
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(model=name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 21})
    assert bad.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_sglang_generate_equals_grpc(base: str, client: ScorerClient) -> None:
    """SGLang's native /generate: a prompt's greedy text and ids as gRPC's; a batch of token-id prompts with
    return_logprob from a prompt position (SGLang's scoring request) carries gRPC's prompt and output logprobs;
    max_new_tokens 0 answers the prompt's alone; a stream's text is cumulative."""
    over_grpc = client.generate(PROMPT, max_tokens=6, top_logprobs=2)
    one = post(base, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert one["text"] == over_grpc.text and one["output_ids"] == over_grpc.token_ids
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == over_grpc.usage.prompt_tokens and "input_token_logprobs" not in meta
    # a stop string that ended it is SGLang's FINISH_MATCHED_STR: finish_reason names it
    assert len(over_grpc.text) >= 3
    stop = over_grpc.text[-3:]
    stopped = post(base, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                           "stop": [stop]}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    ids = [client.tokenize(PROMPT)[0], client.tokenize("Context: the order 1234")[0]]
    start = 2
    batch = post(base, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                                     "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True}).json()
    assert isinstance(batch, list) and len(batch) == 2
    for prompt, got in zip(ids, batch, strict=True):
        want = client.generate(prompt, max_tokens=3, top_logprobs=2, prompt_logprobs=2, prompt_logprobs_start=start)
        meta = got["meta_info"]
        assert got["output_ids"] == want.token_ids
        assert meta["input_token_logprobs"] == [[lp.logprob, lp.token_id, lp.token] for lp in want.prompt_logprobs]
        assert meta["output_token_logprobs"] == [[lp.logprob, lp.token_id, lp.token] for lp in want.logprobs]
        assert meta["input_top_logprobs"] == [[[t.logprob, t.token_id, t.token] for t in lp.top]
                                              for lp in want.prompt_logprobs]
    alone = post(base, "/generate", {"input_ids": ids[0], "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": 0}).json()
    assert alone["output_ids"] == [] and alone["meta_info"]["input_token_logprobs"][0][0] is None
    assert len(alone["meta_info"]["input_token_logprobs"]) == len(ids[0])
    r = requests.post(f"{base}/generate", json={"text": PROMPT, "stream": True,
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
                      stream=True, timeout=60)
    events = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == over_grpc.text and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(chunks))  # cumulative
    for body, param in (({"text": PROMPT, "sampling_params": {"n": 2}}, "sampling_params.n"),
                        ({"text": PROMPT, "input_ids": ids[0]}, "text"),
                        ({"text": [PROMPT, PROMPT], "stream": True}, "stream"),
                        ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
                        ({"input_ids": ids[0], "return_logprob": True, "logprob_start_len": 10**6},
                         "logprob_start_len"),
                        ({"input_ids": ids[0], "return_logprob": True, "logprob_start_len": -2},
                         "logprob_start_len")):
        bad = post(base, "/generate", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_chat_over_http_equals_grpc_with_the_template(client: ScorerClient, oa: openai.OpenAI, name: str) -> None:
    question = "Where is my order 1234?"
    over_grpc = client.generate(question, apply_chat_template=True, max_tokens=5, top_logprobs=2)
    chat = oa.chat.completions.create(model=name, messages=[{"role": "user", "content": question}], max_tokens=5,
                                      temperature=0, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == over_grpc.text
    assert [e.logprob for e in choice.logprobs.content] == [lp.logprob for lp in over_grpc.logprobs]
    assert [[t.token for t in e.top_logprobs] for e in choice.logprobs.content] == [
        [t.token for t in lp.top] for lp in over_grpc.logprobs]
    assert chat.usage.prompt_tokens == over_grpc.usage.prompt_tokens
    stream = oa.chat.completions.create(model=name, messages=[{"role": "user", "content": question}], max_tokens=5,
                                        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == over_grpc.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(over_grpc.token_ids)
    multi = oa.chat.completions.create(model=name, max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": [{"type": "text", "text": question}]}])
    assert multi.usage.prompt_tokens > chat.usage.prompt_tokens  # the system turn went through the template


def test_openai_client_sees_errors(oa: openai.OpenAI, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(model=name, prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as stream_bad:  # refused before the stream starts
        list(oa.completions.create(model=name, prompt=PROMPT, top_p=2.0, stream=True))
    assert stream_bad.value.body["param"] == "top_p"  # type: ignore[index]
    assert [m.id for m in oa.models.list()] == [name]


def curl(*args: str) -> tuple[int, Any]:
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    body, _, code = out.rpartition("\n")
    return int(code), json.loads(body)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl(base: str, client: ScorerClient) -> None:
    """curl with the docs' requests (label strings and apply_softmax; a chat), an error and /health."""
    code, scored = curl(f"{base}/v1/score", "-H", "Content-Type: application/json", "-d", json.dumps(
        {"query": QUERY, "items": ITEMS[:2], "labels": ["Yes", "No"], "apply_softmax": True}))
    assert code == 200
    assert scored["scores"] == [r[0] for r in client.score(QUERY, ITEMS[:2], labels=["Yes", "No"],
                                                           apply_softmax=True).scores]
    code, chat = curl(f"{base}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", json.dumps(
        {"messages": [{"role": "user", "content": "Where is my order?"}], "max_tokens": 4, "temperature": 0}))
    assert code == 200 and chat["object"] == "chat.completion"
    code, error = curl(f"{base}/v1/score", "-d", '{"query": "q", "items": ["a"], "label_token_ids": [7, 7]}')
    assert code == 400 and error["param"] == "label_token_ids" and error["object"] == "error"  # SGLang's shape
    code, health = curl(f"{base}/health")
    assert code == 200 and health == {"status": "SERVING"}


def test_sglang_documented_payloads(base: str, client: ScorerClient, name: str) -> None:
    """SGLang's own /v1/score tests: text query and items with label ids from the items' first tokens, the same
    with token ids, and item_first; each answer is what pyscore's gRPC Score gives."""
    query, items = "The capital of France is", ["Paris", "London", "Berlin"]
    label_ids = [client.tokenize(item, add_special_tokens=False)[0][0] for item in items]
    for item_first in (False, True):
        body = {"model": name, "query": query, "items": items, "label_token_ids": label_ids, "apply_softmax": False,
                "item_first": item_first}
        answer = post(base, "/v1/score", body).json()
        assert answer["object"] == "scoring" and len(answer["scores"]) == 3
        assert all(0 < v < 1 for row in answer["scores"] for v in row)
        expected = client.score(query, items, label_token_ids=label_ids, item_first=item_first)
        assert answer["scores"] == [rows[0] for rows in expected.scores]
    query_ids = client.tokenize(query)[0]
    item_ids = [client.tokenize(item, add_special_tokens=False)[0] for item in items]
    by_ids = post(base, "/v1/score", {"model": name, "query": query_ids, "items": item_ids,
                                      "label_token_ids": label_ids, "apply_softmax": True}).json()
    softmaxed = post(base, "/v1/score", {"query": query, "items": items, "label_token_ids": label_ids,
                                         "apply_softmax": True}).json()
    assert by_ids["scores"] == softmaxed["scores"]
    assert all(math.isclose(sum(row), 1.0, rel_tol=1e-5) for row in by_ids["scores"])


def test_vllm_documented_payloads(base: str, client: ScorerClient, labels: list[int]) -> None:
    """vLLM's /generative_scoring docstring example (a chat-tagged query, one item per city) and the request
    bench/peers.md sends it (with a cache_salt): the score is P(first label) over the labels."""
    query = "<|im_start|>Is the following city the capital of France? "
    items = ["Paris <|im_end|>", "London <|im_end|>", "Berlin <|im_end|>"]
    answer = post(base, "/generative_scoring", {"query": query, "items": items, "label_token_ids": labels,
                                                "apply_softmax": True, "item_first": False}).json()
    expected = client.score(query, items, label_token_ids=labels, apply_softmax=True)
    assert [d["score"] for d in answer["data"]] == [rows[0][0] for rows in expected.scores]
    assert [d["index"] for d in answer["data"]] == [0, 1, 2] and answer["usage"]["prompt_tokens"] > 0
    peers = post(base, "/generative_scoring", {
        "model": "", "query": "Context: order 1234 shipped on Monday.\nQuestion: what should the agent do next?\n",
        "items": ["Proposed answer: track it.\nIs this proposed answer correct? Answer Yes or No.",
                  "Proposed answer: refund it.\nIs this proposed answer correct? Answer Yes or No."],
        "label_token_ids": labels, "apply_softmax": True, "cache_salt": "any-fresh-string"})
    assert peers.status_code == 200 and len(peers.json()["data"]) == 2


def test_a_concurrent_mix_of_http_and_grpc(base: str, client: ScorerClient, labels: list[int],
                                          served: ServerThread) -> None:
    """Every call answered, each with what it gets alone, while HTTP and gRPC calls share the batcher."""
    questions = [(f"{QUERY} Case {i}.", ITEMS[: 1 + i % 3]) for i in range(12)]
    alone = [client.score(q, items, label_token_ids=labels).scores for q, items in questions]
    batches = served.batcher.stats.batches

    def ask(i: int) -> Any:
        q, items = questions[i]
        if i % 2:
            return [rows[0] for rows in client.score(q, items, label_token_ids=labels).scores]
        return post(base, "/v1/score", {"query": q, "items": items, "label_token_ids": labels}).json()["scores"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(questions))))
    assert answers == [[rows[0] for rows in a] for a in alone]
    assert served.batcher.stats.batches - batches <= len(questions)


def http_score_body(fields: dict[str, Any]) -> dict[str, Any]:
    """A gRPC ScoreRequest's fields (test_bad_input_matrix) as the /v1/score body that asks the same."""
    from pyscore._proto.pyscore.v1 import scorer_pb2 as pb

    f = GOOD_SCORE | fields
    body = {"query": f.get("query_token_ids") or f.get("query", ""),
            "items": [list(t.ids) for t in f["item_token_ids"]] if f.get("item_token_ids") else f.get("items", [])}
    for key in ("labels", "label_token_ids", "apply_softmax", "item_first", "score_extraction_token", "model"):
        if f.get(key):
            body[key] = f[key]
    if "mode" in f:
        body["mode"] = pb.ScoringMode.Name(f["mode"]).removeprefix("SCORING_MODE_").lower()
    return body


def http_completion_body(fields: dict[str, Any]) -> dict[str, Any]:
    f = GOOD_GENERATE | fields
    body = {"prompt": f.get("prompt_token_ids") or f["prompt"], "temperature": f.get("temperature", 0.0)}
    for key, name in (("max_tokens", "max_tokens"), ("top_p", "top_p"), ("top_k", "top_k"), ("stop", "stop"),
                      ("top_logprobs", "logprobs")):
        if key in f:
            body[name] = f[key]
    if body.get("top_k") == -1:
        body["top_k"] = -2  # -1 is vLLM's (and so this endpoint's) "off"; any other negative is refused
    if "prompt_logprobs" in f:  # OpenAI's way of asking for them: echo with logprobs
        body |= {"echo": True, "logprobs": f["prompt_logprobs"]}
    return body


def field_of(param: str | None) -> str:
    return (param or "").split("[")[0]


SCORE_OVER_HTTP = [c for c in SCORE if c[0] != "no query"]  # SGLang scores an empty query's items alone
SGLANG_STATUS = {"unknown model": 400}  # SGLang's "The model ... does not exist" is a 400, gRPC's a NOT_FOUND


@pytest.mark.parametrize(("case", "fields", "code", "field"), SCORE_OVER_HTTP, ids=[c[0] for c in SCORE_OVER_HTTP])
def test_bad_score_over_http(base: str, case: str, fields: dict[str, Any], code: grpc.StatusCode, field: str) -> None:
    """Every bad Score of the gRPC matrix over SGLang's /v1/score: SGLang's flat error object, the field named as
    the HTTP client wrote it, the mapped status (SGLang's where it differs)."""
    r = post(base, "/v1/score", http_score_body(fields))
    status = SGLANG_STATUS.get(case, HTTP_STATUS[code])
    assert r.status_code == status, r.text
    error = r.json()
    assert error["object"] == "error" and error["code"] == status, error
    assert field_of(error["param"]) == SCORE_FIELDS.get(field, field), error
    assert error["message"].startswith(error["param"]), error
    assert len(post(base, "/v1/score", http_score_body({})).json()["scores"]) == 2


GENERATE_OVER_HTTP = [c for c in GENERATE if not {"apply_chat_template", "prompt_logprobs_start"} & c[1].keys()]
# (no such fields in OpenAI's)


@pytest.mark.parametrize(("fields", "code", "field"), [c[1:] for c in GENERATE_OVER_HTTP],
                         ids=[c[0] for c in GENERATE_OVER_HTTP])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_generate_over_http(base: str, fields: dict[str, Any], code: grpc.StatusCode, field: str,
                                stream: bool) -> None:
    r = post(base, "/v1/completions", http_completion_body(fields) | {"stream": stream})
    assert r.status_code == HTTP_STATUS[code], r.text
    error = r.json()["error"]
    # (the proto's prompt_logprobs is asked over HTTP as echo with logprobs: its bad values are refused as logprobs)
    fields = COMPLETION_FIELDS | {"prompt_logprobs": "logprobs"}
    assert error["code"] == code.name and field_of(error["param"]) == fields.get(field, field), error
    good = post(base, "/v1/completions", http_completion_body({})).json()
    assert good["usage"]["completion_tokens"] == 3


def test_detokenize_version_and_ping(base: str) -> None:
    """vLLM's /detokenize (the inverse of /tokenize), /version and /ping (its health probe, GET or POST)."""
    text = "The quick brown fox"
    ids = requests.post(f"{base}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    back = requests.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    bad = requests.post(f"{base}/detokenize", json={"tokens": [ids[0], 10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    import pyscore

    assert requests.get(f"{base}/version", timeout=30).json() == {"version": pyscore.__version__}
    assert requests.get(f"{base}/ping", timeout=30).status_code == 200
    assert requests.post(f"{base}/ping", timeout=30).status_code == 200


@pytest.mark.parametrize("item_first", [False, True])
def test_sglang_empty_item_scores_the_querys_next_token(base: str, client: ScorerClient, labels: list[int],
                                                       item_first: bool) -> None:
    """SGLang's `"items": [""]`: query + "" is the query, read out at its end: the same bits as gRPC's Score of
    the query's last token after the rest; the other items as asked, in item order."""
    ids = requests.post(f"{base}/tokenize", json={"prompt": QUERY}, timeout=30).json()["tokens"]
    tail = client.score(ids[:-1], [[ids[-1]]], label_token_ids=labels, apply_softmax=True)
    rest = client.score(QUERY, ITEMS[:2], label_token_ids=labels, apply_softmax=True, item_first=item_first)
    body = post(base, "/v1/score", {"query": QUERY, "items": [ITEMS[0], "", ITEMS[1], ""], "label_token_ids": labels,
                                    "apply_softmax": True, "item_first": item_first}).json()
    want = [rest.scores[0][0], tail.scores[0][0], rest.scores[1][0], tail.scores[0][0]]
    assert body["scores"] == want
    assert body["usage"]["prompt_tokens"] == rest.usage.prompt_tokens + 2 * len(ids)
    by_ids = post(base, "/v1/score", {"query": ids, "items": [[]], "label_token_ids": labels,
                                      "apply_softmax": True}).json()
    assert by_ids["scores"] == [tail.scores[0][0]]
    one_token = post(base, "/v1/score", {"query": ids[:1], "items": [[]], "label_token_ids": labels})
    assert one_token.status_code == 400 and one_token.json()["param"] == "items[0]"


def test_sglang_finish_reason_names_what_matched() -> None:
    """SGLang's finish_reason: the stop string (FINISH_MATCHED_STR), else the ending token's id, its
    end-of-sequence token included (FINISH_MATCHED_TOKEN), else a length finish's length."""
    eos = GenerateResult("a", [5], [], "eos", stop_token=TokenLogprob(2, "</s>", -0.1))
    assert finish_reason(eos, 1) == {"type": "stop", "matched": 2}
    assert finish_reason(GenerateResult("ab", [5, 6], [], "stop", stop_string="b"), 2) == {"type": "stop",
                                                                                           "matched": "b"}
    assert finish_reason(GenerateResult("ab", [5, 6], [], "length"), 2) == {"type": "length", "length": 2}


def test_sglang_generate_stop_token_ids(base: str, client: ScorerClient) -> None:
    """SGLang's sampling_params.stop_token_ids: a generated id in the list ends the generation with finish_reason
    {"type": "stop", "matched": the id} (SGLang's FINISH_MATCHED_TOKEN), the token trimmed from the text and from
    output_ids (as SGLang trims a matched stop token, and as pyscore's end-of-sequence finish is), streamed or not;
    an id never said changes nothing; an id outside the vocabulary, or more than MAX_STOP_TOKEN_IDS ids, is a 400
    naming the field (any stop_token_ids was refused before)."""
    said = client.generate(PROMPT, max_tokens=6).token_ids
    j = next(j for j in range(1, len(said)) if said[j] not in said[:j])
    before = client.generate(PROMPT, max_tokens=j)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [said[j]]}}
    got = post(base, "/generate", body).json()
    assert (got["text"], got["output_ids"]) == (before.text, said[:j])
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": said[j]}
    assert got["meta_info"]["completion_tokens"] == j
    r = requests.post(f"{base}/generate", json=body | {"stream": True}, stream=True, timeout=60)
    events = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    last = json.loads(events[-2])
    assert (last["text"], last["output_ids"], last["meta_info"]["finish_reason"]) == (
        before.text, said[:j], {"type": "stop", "matched": said[j]})
    never = next(t for t in range(100) if t not in said)
    plain = post(base, "/generate", body | {"sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                "stop_token_ids": [never]}}).json()
    assert plain["output_ids"] == said and plain["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    for ids in ([10**6], [10**5000 // 10**4000], list(range(129))):
        bad = post(base, "/generate", {"text": PROMPT, "sampling_params": {"stop_token_ids": ids}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.stop_token_ids", bad.text
        assert len(bad.json()["error"]["message"]) < 400
