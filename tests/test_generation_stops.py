"""The stop-string rule of pyscore.generation, on a real byte-level BPE tokenizer and a fixed token sequence (no
model): `text` ends before the first stop string; `token_ids` and `logprobs` are the fewest tokens that produce
it (the last may reach into the stop string, none begins at or after it); the stream carries exactly those
tokens and that text, and each streamed chunk's text is what its tokens add."""

from __future__ import annotations

import pytest

from pyscore.generation import Generation
from pyscore.types import GenerateRequest, TokenLogprob
from tests.helpers import make_tokenizer

TEXT = "Proposed answer: tell the customer the order is on its way. héllo wörld 🙂✓ done"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(len(ids)))  # some tokens split a character
    return ids


def generate(tokenizer, ids: list[int], stop: list[str]) -> tuple[Generation, list[tuple[list[int], str]]]:
    """Feeds `ids` as the chosen tokens; returns the generation and every streamed chunk (tokens, text)."""
    gen = Generation(request=GenerateRequest(prompt_token_ids=[1], max_tokens=len(ids), stop=stop), prompt=[1],
                     tokenizer=tokenizer, eos_ids=frozenset(), generator=None)
    chunks = []
    for i, token in enumerate(ids):
        gen.append(token, TokenLogprob(token, tokenizer.decode([token]), -float(i), []))
        tokens, logprobs, text = gen.take_delta()
        assert [lp.token_id for lp in logprobs] == tokens
        if tokens or text:
            chunks.append((tokens, text))
        if gen.finished:
            break
    assert gen.finished
    return gen, chunks


def check_stream(tokenizer, gen: Generation, chunks: list[tuple[list[int], str]]) -> None:
    result = gen.result()
    assert [t for c in chunks for t in c[0]] == result.token_ids  # the stream agrees with the result
    assert "".join(c[1] for c in chunks) == result.text
    tokens: list[int] = []
    text = ""
    for k, (chunk_tokens, chunk_text) in enumerate(chunks):
        tokens += chunk_tokens
        text += chunk_text
        if k < len(chunks) - 1:  # each chunk's text is exactly what its tokens add
            assert text == tokenizer.decode(tokens), (k, chunks)
    assert tokenizer.decode(tokens).startswith(result.text)


def check_stop(tokenizer, ids: list[int], stop: str) -> None:
    cut = TEXT.find(stop)
    gen, chunks = generate(tokenizer, ids, [stop])
    result = gen.result()
    assert result.finish_reason == "stop" and result.text == TEXT[:cut], (stop, result.text)
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    k = len(result.token_ids)
    assert result.token_ids == ids[:k]
    assert tokenizer.decode(ids[:k]).startswith(TEXT[:cut])  # the tokens produce the text ...
    if k:  # ... and are the fewest that do: without the last one the text is not reached
        assert not tokenizer.decode(ids[: k - 1]).startswith(TEXT[:cut]) or cut == 0
    check_stream(tokenizer, gen, chunks)


def test_stop_at_every_position(tokenizer, ids):
    """A 3-character stop string starting at every character: at token boundaries, inside tokens, across
    several tokens, next to characters split over two tokens."""
    starts = [a for a in range(len(TEXT) - 2) if TEXT.find(TEXT[a : a + 3]) == a]
    assert len(starts) > 40
    for a in starts:
        check_stop(tokenizer, ids, TEXT[a : a + 3])


def test_long_stop_spanning_many_tokens(tokenizer, ids):
    check_stop(tokenizer, ids, "the customer the order")


def test_first_of_several_stops_wins(tokenizer, ids):
    gen, chunks = generate(tokenizer, ids, ["héllo", "order", "zzz"])
    assert gen.result().text == TEXT[: TEXT.find("order")]
    check_stream(tokenizer, gen, chunks)


def test_without_stop_the_stream_lines_up(tokenizer, ids):
    gen, chunks = generate(tokenizer, ids, [])
    assert gen.result().text == TEXT and gen.result().token_ids == ids and gen.result().finish_reason == "length"
    check_stream(tokenizer, gen, chunks)
    gen, chunks = generate(tokenizer, ids, ["xyz"])  # a stop that never matches holds back at most 2 characters
    assert gen.result().text == TEXT
    check_stream(tokenizer, gen, chunks)
