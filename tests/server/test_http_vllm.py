"""vLLM's own OpenAI-server test cases (tests/entrypoints/openai/completion/test_completion.py,
test_completion_text_offset.py, chat_completion/test_chat.py, serving_chat.py's stream shape, the tokenize protocol;
tests/detokenizer/test_stop_reason.py for stop_reason), their inputs and assertions ported onto the HTTP front door
over the real engine (tiny random Qwen3, fp32): a client written against vLLM must get what vLLM's tests assert.
Where pyscore refuses instead (beam search), the refusal names the field with vLLM's status."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from pyscore.client import ScorerClient
from server.http_openai import VLLM_DEFAULTS
from tests.server.conftest import ServerThread, make_tiny_engine

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
            {"role": "user", "content": "Where was it played?"}]


def serve(model_dir: Path) -> ServerThread:
    return ServerThread(make_tiny_engine(model_dir), max_batch_tokens=256, http_port=0)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = serve(tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base(served: ServerThread) -> str:
    return f"http://127.0.0.1:{served.app.http_port}"


def post(base: str, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(base + path, json=body, timeout=60)


def events(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events, parsed, after checking it ends with `data: [DONE]`."""
    r = requests.post(base + path, json=body | {"stream": True}, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    lines = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def refused(r: requests.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# -- completions: logprobs ----------------------------------------------------------------------------------
def top_entry(lp: Any, k: int) -> dict[str, float]:
    """What top_logprobs must hold for a gRPC TokenLogprob: the chosen token first, then its k alternatives (a
    text already there keeps its value: byte tokens of different ids decode alike)."""
    out = {lp.token: lp.logprob}
    for t in lp.top[:k]:
        out.setdefault(t.token, t.logprob)
    return out


@pytest.mark.parametrize("body", [
    {"temperature": 0.0, "logprobs": 0},  # test_zero_logprobs: the chosen token alone
    {"temperature": 0.0, "logprobs": 5},  # test_some_logprobs: 5 to 6 entries
    {"temperature": 1.0, "seed": 3, "logprobs": 2},  # sampled: the chosen token, when not among the 2, is a third
])
def test_top_logprobs_hold_the_chosen_token(base: str, served: ServerThread, body: dict[str, Any]) -> None:
    """OpenAI's and vLLM's top_logprobs: the chosen token's logprob beside its k most likely alternatives, the
    values gRPC's Generate gives (logprobs 0 gave an empty entry before)."""
    k = body["logprobs"]
    with ScorerClient(served.target, timeout=30) as client:
        want = client.generate(PROMPT, max_tokens=5, top_logprobs=k, temperature=body["temperature"],
                               seed=body.get("seed"))
    lps = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5} | body).json()["choices"][0]["logprobs"]
    assert lps["top_logprobs"] == [top_entry(lp, k) for lp in want.logprobs]
    assert all(top[token] == value for token, value, top in zip(lps["tokens"], lps["token_logprobs"],
                                                                 lps["top_logprobs"], strict=True))
    assert all(1 <= len(top) <= k + 1 for top in lps["top_logprobs"])
    if k == 0:
        assert all(len(top) == 1 for top in lps["top_logprobs"])


@pytest.mark.parametrize("k", [1, 0])
@pytest.mark.parametrize("ids", [False, True])
def test_echo_logprobs(base: str, k: int, ids: bool) -> None:
    """test_echo_logprob_completion: the prompt first, its first token null, every other entry max(k, 1) to
    k + 1 alternatives holding the token itself."""
    prompt: Any = post(base, "/tokenize", {"prompt": PROMPT}).json()["tokens"] if ids else PROMPT
    c = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0.0, "echo": True,
                                       "logprobs": k}).json()["choices"][0]
    lps = c["logprobs"]
    assert c["text"].startswith(PROMPT)
    assert len(lps["text_offset"]) > 5 and lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for token, top in zip(lps["tokens"][1:], lps["top_logprobs"][1:], strict=True):
        assert max(k, 1) <= len(top) <= k + 1 and token in top


@pytest.mark.parametrize("body", [{"prompt": PROMPT, "logprobs": 0},
                                  {"prompt": PROMPT, "logprobs": 1, "echo": True},
                                  {"prompt": [PROMPT, "Context: the order"], "n": 2, "logprobs": 0,
                                   "temperature": 1.0, "seed": 5}])
def test_stream_text_offsets_are_the_answers(base: str, body: dict[str, Any]) -> None:
    """test_stream_text_offset_matches_non_stream: each chunk's offsets continue where the choice's previous
    chunk ended, so a stream's offsets, concatenated, are the non-stream answer's (0, 3, 6, ...)."""
    body = {"max_tokens": 6, "temperature": 0.0} | body
    whole = post(base, "/v1/completions", body).json()["choices"]
    streamed: dict[int, list[int]] = {}
    for e in events(base, "/v1/completions", body):
        for c in e["choices"]:
            streamed.setdefault(c["index"], []).extend(c["logprobs"]["text_offset"])
    assert [streamed[c["index"]] for c in whole] == [c["logprobs"]["text_offset"] for c in whole]
    assert all(offsets == sorted(offsets) and offsets[-1] > 0 for offsets in streamed.values())


# -- completions: streaming, usage, stream_options ----------------------------------------------------------
def test_completion_streaming(base: str) -> None:
    """test_completion_streaming: one chunk has a finish_reason, the last, the non-stream answer's; its text is
    not empty (a length finish); the chunks join to the answer."""
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0}
    single = post(base, "/v1/completions", body).json()["choices"][0]
    chunks = events(base, "/v1/completions", body)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == [single["finish_reason"]] == ["length"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == single["text"]


def test_completion_stream_options(base: str) -> None:
    """test_completion_stream_options: usage only as asked; with include_usage a last chunk (no choices) after
    the finish; with continuous_usage_stats too, every chunk's usage so far; stream_options without
    stream: true is a 400."""
    body = {"prompt": "What is the capital of France?", "max_tokens": 5, "temperature": 0.0}
    whole = post(base, "/v1/completions", body).json()["usage"]
    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all("usage" not in c for c in events(base, "/v1/completions", body | {"stream_options": options}))
    for continuous in (False, True):
        chunks = events(base, "/v1/completions", body | {"stream_options": {"include_usage": True,
                                                                            "continuous_usage_stats": continuous}})
        *choices, last = chunks
        assert choices[-1]["choices"][0]["finish_reason"] is not None
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == whole["completion_tokens"] > 0
        assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
        for c in choices:
            if not continuous:
                assert "usage" not in c
                continue
            u = c["usage"]
            assert u["prompt_tokens"] == whole["prompt_tokens"] and u["completion_tokens"] > 0
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        if continuous:
            assert choices[-1]["usage"]["completion_tokens"] == whole["completion_tokens"]
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        refused(post(base, "/v1/completions", body | {"stream": False, "stream_options": options}), "stream_options")
        refused(post(base, "/v1/chat/completions", {"messages": MESSAGES[:2], "max_tokens": 2,
                                                    "stream_options": options}), "stream_options")
    assert post(base, "/v1/completions", body | {"stream_options": None}).status_code == 200


# -- completions: n samples with a seed ---------------------------------------------------------------------
def test_parallel_sampling_with_a_seed(base: str) -> None:
    """test_parallel_no_streaming / _streaming: n=3 at temperature 1 with a seed are 3 different completions
    (each its own sample stream, seed + index as vLLM's parallel sampling derives them), the same 3 again for
    the same seed, streamed as answered, each choice's finish_reason once."""
    body = {"prompt": "What is an LLM?", "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 42, "logprobs": 0}
    first = post(base, "/v1/completions", body).json()["choices"]
    assert [c["index"] for c in first] == [0, 1, 2] and all(c["finish_reason"] for c in first)
    texts = [c["text"] for c in first]
    assert len(set(texts)) == 3
    assert [c["text"] for c in post(base, "/v1/completions", body).json()["choices"]] == texts
    streamed, finishes = [""] * 3, 0
    for e in events(base, "/v1/completions", body):
        c = e["choices"][0]
        streamed[c["index"]] += c["text"]
        finishes += c["finish_reason"] is not None
    assert streamed == texts and finishes == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_is_refused_by_name(base: str, path: str) -> None:
    """test_batch_completions asks use_beam_search with n=2; pyscore serves no beam search: 400 naming it."""
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES[:2]}
    refused(post(base, path, body | {"n": 2, "max_tokens": 3, "temperature": 0.0, "use_beam_search": True}),
            "use_beam_search")
    assert post(base, path, body | {"max_tokens": 2, "use_beam_search": False}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("name", "asked"), [("ignore_eos", True), ("min_tokens", 3),
                                              ("include_stop_str_in_output", True), ("skip_special_tokens", False),
                                              ("repetition_penalty", 1.2)])
def test_vllm_sampling_extras_are_refused_by_name_not_ignored(base: str, path: str, name: str, asked: object) -> None:
    """vLLM's sampling extras pyscore does not serve: asked for, a 400 naming the field (ignoring one would answer
    something the client did not ask for); at vLLM's default they pass."""
    body = ({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES[:2]}) | {"max_tokens": 2}
    refused(post(base, path, body | {name: asked}), name)
    assert post(base, path, body | {name: VLLM_DEFAULTS[name]}).status_code == 200


# -- stop_reason and the token that ended a choice (vLLM's tests/detokenizer/test_stop_reason.py) --------------
ROUTES = {"/v1/completions": {"prompt": PROMPT, "logprobs": 1},
          "/v1/chat/completions": {"messages": MESSAGES[:2], "logprobs": True, "top_logprobs": 1}}


def said(base: str, served: ServerThread, path: str, max_tokens: int) -> Any:
    """What the model says greedily to the route's prompt (over gRPC, from the same prompt ids)."""
    prompt: Any = PROMPT if path == "/v1/completions" else post(base, "/tokenize", {"messages": MESSAGES[:2]}).json()[
        "tokens"]
    with ScorerClient(served.target, timeout=30) as client:
        return client.generate(prompt, max_tokens=max_tokens, top_logprobs=1)


def text_of(c: dict[str, Any]) -> str:
    return c["text"] if "text" in c else c["message"]["content"]


def entries(logprobs: dict[str, Any]) -> list[tuple[str, float]]:
    """(token text, logprob) of a choice's (or chunk's) logprob entries, completions' shape or chat's."""
    if "content" in logprobs:
        return [(e["token"], e["logprob"]) for e in logprobs["content"]]
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True))


def streamed_choice(base: str, path: str, body: dict[str, Any]) -> tuple[str, list[tuple[str, float]],
                                                                           dict[str, Any]]:
    """A one-choice stream's joined text, its logprob entries in order and its finish chunk's choice, after
    checking vLLM's keys: every completion chunk has stop_reason (null before the finish), a chat chunk only
    the finish one."""
    text, got, finish = "", [], None
    for e in events(base, path, body):
        c = e["choices"][0]
        text += c.get("text", c.get("delta", {}).get("content", ""))
        got += entries(c["logprobs"]) if c["logprobs"] else []
        if c["finish_reason"] is not None:
            finish = c
        elif path == "/v1/completions":
            assert c["stop_reason"] is None
        else:
            assert "stop_reason" not in c
    assert finish is not None
    return text, got, finish


@pytest.mark.parametrize("path", list(ROUTES))
def test_stop_reason_of_a_stop_token(base: str, served: ServerThread, path: str) -> None:
    """test_stop_reason, stop_token_ids: finish "stop", stop_reason the token id; as vLLM, the token counts
    and is listed last in the logprobs (its own text, its logprob the model's there), not in the text; the
    stream's finish chunk says the same."""
    whole = said(base, served, path, 6)
    ids = whole.token_ids
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])
    body = ROUTES[path] | {"max_tokens": 6, "temperature": 0.0, "stop_token_ids": [ids[j]]}
    answer = post(base, path, body).json()
    c = answer["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", ids[j])
    before = said(base, served, path, j)
    assert text_of(c) == before.text and answer["usage"]["completion_tokens"] == j + 1
    want = [(lp.token, lp.logprob) for lp in whole.logprobs[: j + 1]]
    assert entries(c["logprobs"]) == want
    text, got, finish = streamed_choice(base, path, body)
    assert text == before.text and got == want
    assert (finish["finish_reason"], finish["stop_reason"]) == ("stop", ids[j])
    refused(post(base, path, body | {"stop_token_ids": [10**6]}), "stop_token_ids")


@pytest.mark.parametrize("path", list(ROUTES))
def test_stop_reason_of_a_stop_string_and_of_length(base: str, served: ServerThread, path: str) -> None:
    """test_stop_reason, stop: stop_reason the stop string that ended the choice (of those given); a length
    finish's is null, streamed or not."""
    whole = said(base, served, path, 6)
    cut = len(said(base, served, path, 2).text)
    stop = whole.text[cut : cut + 2]
    assert whole.text.find(stop) == cut and len(stop) == 2
    body = ROUTES[path] | {"max_tokens": 6, "temperature": 0.0, "stop": ["never said at all", stop]}
    c = post(base, path, body).json()["choices"][0]
    assert (text_of(c), c["finish_reason"], c["stop_reason"]) == (whole.text[:cut], "stop", stop)
    assert streamed_choice(base, path, body)[2]["stop_reason"] == stop
    body = ROUTES[path] | {"max_tokens": 3, "temperature": 0.0}
    c = post(base, path, body).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)
    assert streamed_choice(base, path, body)[2]["stop_reason"] is None


def test_stop_reason_of_the_end_of_sequence_token(base: str, tiny_model_dir: Path) -> None:
    """test_stop_reason, no stop given: every sample ends by "length" or by "stop" with stop_reason null (the
    tokenizer's end-of-sequence token, <|im_end|> here). A stopped sample lists that token last in its logprobs
    with its text as vLLM decodes a logprob's token (special tokens kept); every sample's logprob entries are
    its completion tokens, as vLLM's cover its token_ids."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token
    stopped = 0
    for seed in (0, 64):  # 128 samples of 16 tokens: a few draw the end-of-sequence token
        body = {"prompt": PROMPT, "max_tokens": 16, "n": 64, "temperature": 1.0, "seed": seed, "logprobs": 0}
        answer = post(base, "/v1/completions", body).json()
        lengths = 0
        for c in answer["choices"]:
            lps = c["logprobs"]
            lengths += len(lps["tokens"])
            assert c["stop_reason"] is None and c["finish_reason"] in ("length", "stop")
            if c["finish_reason"] == "stop":
                stopped += 1
                assert lps["tokens"][-1] == eos and eos not in c["text"] and lps["token_logprobs"][-1] < 0
                assert lps["text_offset"][-1] == sum(len(t) for t in lps["tokens"][:-1])
            else:
                assert len(lps["tokens"]) == 16 and eos not in lps["tokens"]
        assert lengths == answer["usage"]["completion_tokens"]
    assert stopped > 0


# -- an end-of-sequence finish --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eos_base(served: ServerThread, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[str, list[int]]]:
    """The tiny model with its end-of-sequence id set to the second token it says greedily after PROMPT: the
    model ends there (finish "stop") after one token. Yields the base URL and those first tokens."""
    with ScorerClient(served.target, timeout=30) as client:
        said = client.generate(PROMPT, max_tokens=2).token_ids
    assert said[0] != said[1]
    model = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("eos") / "qwen3"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"eos_token_id": said[1]}))
    server = serve(model)
    yield f"http://127.0.0.1:{server.app.http_port}", said
    server.stop()


def test_an_end_of_sequence_finish_counts_as_vllm_counts(eos_base: tuple[str, list[int]]) -> None:
    """vLLM's token_ids hold the end-of-sequence token that ended a choice, so its completion_tokens count it
    (one token said + the EOS = 2) and its logprobs list it last; the stream agrees with the answer: finish
    "stop" once, in its last chunk (text "", as vLLM's for an EOS), and the same usage; a chat's stream
    likewise. The model's config names this end-of-sequence id, not its tokenizer (whose is <|im_end|>): vLLM
    stops on such an id as a stop token, so stop_reason is the id, not null."""
    base, said_ids = eos_base
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0}
    whole = post(base, "/v1/completions", body).json()
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 2
    assert whole["choices"][0]["stop_reason"] == said_ids[1]
    lps = post(base, "/v1/completions", body | {"logprobs": 0}).json()["choices"][0]["logprobs"]
    assert len(lps["tokens"]) == 2 and lps["text_offset"] == [0, len(lps["tokens"][0])]
    assert whole["choices"][0]["text"] == lps["tokens"][0]
    chunks = events(base, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    *choices, last = chunks
    assert [c["choices"][0]["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    assert choices[-1]["choices"][0]["text"] == ""
    assert "".join(c["choices"][0]["text"] for c in choices) == whole["choices"][0]["text"]
    assert last["usage"]["completion_tokens"] == 2
    chat = {"messages": MESSAGES[:2], "max_tokens": 5, "temperature": 0.0}
    answer = post(base, "/v1/chat/completions", chat).json()
    streamed = events(base, "/v1/chat/completions", chat | {"stream_options": {"include_usage": True}})
    assert streamed[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
    finish = streamed[-2]["choices"][0]
    assert finish["finish_reason"] == answer["choices"][0]["finish_reason"]
    assert finish["stop_reason"] == answer["choices"][0]["stop_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[:-1]) == \
        answer["choices"][0]["message"]["content"]


# -- chat ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 0, None])
def test_prompt_logprobs_chat(base: str, k: int | None) -> None:
    """test_prompt_logprobs_chat: the response's top-level prompt_logprobs (null unless asked): null for the first
    prompt token, then {token id: {logprob, rank, decoded_token}}; the values the completions route gives the
    same token ids (the chat as /tokenize renders it); n samples share one list."""
    chat = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0.0}
    answer = post(base, "/v1/chat/completions", chat | ({} if k is None else {"prompt_logprobs": k})).json()
    got = answer["prompt_logprobs"]
    if k is None:
        assert got is None
        return
    ids = post(base, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert len(got) == len(ids) == answer["usage"]["prompt_tokens"] and got[0] is None
    assert all(str(t) in position for t, position in zip(ids[1:], got[1:], strict=True))
    assert all(len(position) <= k + 1 for position in got[1:])
    completion = post(base, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": k}).json()
    assert completion["choices"][0]["prompt_logprobs"] == got
    samples = post(base, "/v1/chat/completions", chat | {"prompt_logprobs": k, "n": 2, "temperature": 1.0}).json()
    assert len(samples["choices"]) == 2 and samples["prompt_logprobs"] == got


def test_prompt_logprobs_chat_refusals(base: str) -> None:
    """Negative prompt_logprobs (vLLM's -1, the whole vocabulary, is not served) and, as vLLM, a stream with
    prompt_logprobs > 0 are 400s naming prompt_logprobs; 0 with a stream is accepted (it carries none)."""
    chat = {"messages": MESSAGES[:2], "max_tokens": 2}
    for value in (-1, -2, 21):
        refused(post(base, "/v1/chat/completions", chat | {"prompt_logprobs": value}), "prompt_logprobs")
    refused(post(base, "/v1/chat/completions", chat | {"prompt_logprobs": 1, "stream": True}), "prompt_logprobs")
    assert all("prompt_logprobs" not in e for e in events(base, "/v1/chat/completions",
                                                          chat | {"prompt_logprobs": 0}))


def test_chat_stream_shape(base: str) -> None:
    """serving_chat.py's stream: a role chunk (content ""), content chunks, and the last delta's content with the
    finish_reason in one chunk; one finish_reason a choice; the contents join to the answer."""
    chat = {"messages": MESSAGES[:2], "max_tokens": 4, "temperature": 0.0, "n": 2}
    answer = post(base, "/v1/chat/completions", chat).json()["choices"]
    chunks = events(base, "/v1/chat/completions", chat)
    for k in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(c["delta"]) == {"content"} for c in mine[1:])
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [answer[k]["finish_reason"]]
        assert mine[-1]["delta"]["content"]  # a length finish: its last token's text rides with it
        assert "".join(c["delta"]["content"] for c in mine) == answer[k]["message"]["content"]


# -- tokenize -----------------------------------------------------------------------------------------------
def test_tokenize_token_strs(base: str, tiny_model_dir: Path) -> None:
    """vLLM's /tokenize: token_strs are the tokenizer's pieces (convert_ids_to_tokens) when asked, null
    otherwise; count and max_model_len beside the tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    asked = post(base, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert asked["tokens"] == tok(PROMPT)["input_ids"] and asked["count"] == len(asked["tokens"])
    assert asked["token_strs"] == tok.convert_ids_to_tokens(asked["tokens"]) and asked["max_model_len"] == 512
    assert any(piece.startswith("Ġ") for piece in asked["token_strs"])  # pieces, not decoded texts
    plain = post(base, "/tokenize", {"prompt": PROMPT}).json()
    assert plain == asked | {"token_strs": None}


def test_tokenize_messages(base: str, tiny_model_dir: Path) -> None:
    """vLLM's TokenizeChatRequest: the messages under the model's chat template (add_generation_prompt default
    true; continue_final_message with it false; both true is a 400), the ids a chat completion's prompt has;
    a request's own chat_template, and tools, are refused by name."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = post(base, "/tokenize", {"messages": MESSAGES, "return_token_strs": True}).json()
    assert chat["tokens"] == tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    assert chat["token_strs"] == tok.convert_ids_to_tokens(chat["tokens"])
    usage = post(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    bare = post(base, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert bare == tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert len(bare) < chat["count"]
    open_ended = post(base, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    assert open_ended == tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False,
                                                 continue_final_message=True, return_dict=False)
    refused(post(base, "/tokenize", {"messages": MESSAGES, "continue_final_message": True}),
            "continue_final_message")
    refused(post(base, "/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}), "chat_template")
    refused(post(base, "/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}), "tools")
    refused(post(base, "/tokenize", {}), "prompt")
