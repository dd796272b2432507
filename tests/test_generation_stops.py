"""The stop-string rule of pyscore.generation, on a real byte-level BPE tokenizer and a fixed token sequence (no
model): `text` ends before the first stop string (the result's stop_string names it); `token_ids` and `logprobs`
are the fewest tokens that produce it (the last may reach into the stop string, none begins at or after it); the
stream carries exactly those tokens and that text, and each streamed chunk's text is what its tokens add. An
end-of-sequence id or a stop_token_ids entry ends the generation as its stop_token, outside text, tokens and
logprobs."""

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


def generate(tokenizer, ids: list[int], stop: list[str], stop_token_ids: list[int] | None = None,
             eos_ids: frozenset[int] = frozenset()) -> tuple[Generation, list[tuple[list[int], str]]]:
    """Feeds `ids` as the chosen tokens; returns the generation and every streamed chunk (tokens, text)."""
    request = GenerateRequest(prompt_token_ids=[1], max_tokens=len(ids), stop=stop,
                              stop_token_ids=stop_token_ids or [])
    gen = Generation(request=request, prompt=[1], tokenizer=tokenizer, eos_ids=eos_ids, generator=None)
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
    assert result.stop_string == stop and result.stop_token is None
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
    assert gen.result().text == TEXT[: TEXT.find("order")] and gen.result().stop_string == "order"
    check_stream(tokenizer, gen, chunks)


def test_without_stop_the_stream_lines_up(tokenizer, ids):
    gen, chunks = generate(tokenizer, ids, [])
    assert gen.result().text == TEXT and gen.result().token_ids == ids and gen.result().finish_reason == "length"
    assert gen.result().stop_string is None and gen.result().stop_token is None
    check_stream(tokenizer, gen, chunks)
    gen, chunks = generate(tokenizer, ids, ["xyz"])  # a stop that never matches holds back at most 2 characters
    assert gen.result().text == TEXT
    check_stream(tokenizer, gen, chunks)


@pytest.mark.parametrize("kind", ["eos", "stop_token_ids", "both"])
def test_a_stop_token_ends_outside_the_result(tokenizer, ids, kind):
    """vLLM's stop tokens: the generation ends at the first end-of-sequence id or stop_token_ids entry (an id
    in both is an end-of-sequence finish, as vLLM checks its EOS first); that token is the result's stop_token,
    with its logprob entry, and in neither text, token_ids nor logprobs, streamed or not."""
    at = next(i for i in range(5, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    stop_id = ids[at]
    gen, chunks = generate(tokenizer, ids, [], stop_token_ids=[] if kind == "eos" else [stop_id],
                           eos_ids=frozenset() if kind == "stop_token_ids" else frozenset({stop_id}))
    result = gen.result()
    assert result.finish_reason == ("stop" if kind == "stop_token_ids" else "eos")
    assert result.token_ids == ids[:at] and [lp.token_id for lp in result.logprobs] == ids[:at]
    assert result.text == tokenizer.decode(ids[:at], skip_special_tokens=True)
    assert result.stop_token is not None and result.stop_string is None
    assert (result.stop_token.token_id, result.stop_token.logprob) == (stop_id, -float(at))
    check_stream(tokenizer, gen, chunks)
