"""Prompt logprobs (GenerateRequest.prompt_logprobs): every prompt token's logprob given the tokens before it, and
the top alternatives at its position, equal stock transformers' log-softmax over one forward of the prompt, for
every family (the hybrid Qwen3.5 included); max_tokens 0 returns them alone; asking for them changes nothing else
of the generation, whatever the rows' chunking or the batch-mates. From prompt_logprobs_start on, the entries are
the full prompt's, bitwise, with the context before it read from the prefix cache when it is there."""

from __future__ import annotations

import math

import pytest
import torch

from pyscore import gen_sampling
from pyscore.engine import Engine
from pyscore.errors import InvalidArgument
from pyscore.types import GenerateRequest
from tests.helpers import load_reference, make_model_dir

PROMPT = "Context: the order 1234 was shipped on Monday. Question: where is it now?"


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2)
    e.generation.eos_ids = frozenset()  # full-length runs
    return e


def reference_logprobs(path, ids: list[int]) -> torch.Tensor:
    """[n - 1, V]: stock transformers' log-softmax at prompt positions 0 .. n - 2 (the distribution of tokens 1..)."""
    with torch.no_grad():
        logits = load_reference(path)(torch.tensor([ids])).logits[0, :-1]
    return logits.float().log_softmax(-1)


def test_prompt_logprobs_equal_transformers(engine, model_dir):
    result = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=2, prompt_logprobs=4))
    ids = engine.tokenize(PROMPT)[0]
    ref = reference_logprobs(model_dir, ids)
    lps = result.prompt_logprobs
    assert lps is not None and [lp.token_id for lp in lps] == ids
    assert math.isnan(lps[0].logprob) and lps[0].top == []
    assert [lp.token for lp in lps] == [engine.tokenizer.decode([i]) for i in ids]
    for i, lp in enumerate(lps[1:]):
        assert abs(lp.logprob - float(ref[i, ids[i + 1]])) <= 1e-4, i
        values, top = torch.topk(ref[i], 4)
        assert [t.token_id for t in lp.top] == top.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(lp.top, values, strict=True)) <= 1e-4


def test_asking_changes_nothing_else(engine):
    plain = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=4, top_logprobs=2, bypass_prefix_cache=True))
    asked = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=4, top_logprobs=2, prompt_logprobs=0))
    assert asked.token_ids == plain.token_ids and asked.logprobs == plain.logprobs
    assert asked.usage.cached_tokens == 0 and asked.usage.computed_tokens == plain.usage.computed_tokens
    assert all(lp.top == [] for lp in asked.prompt_logprobs or [])
    assert plain.prompt_logprobs is None


def test_max_tokens_0_and_chunked_rows_give_the_same_entries(engine, monkeypatch):
    whole = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=3, prompt_logprobs=2))
    alone = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=0, prompt_logprobs=2))
    assert alone.token_ids == [] and alone.text == "" and alone.finish_reason == "length"
    assert alone.usage.computed_tokens == alone.usage.prompt_tokens
    monkeypatch.setattr(gen_sampling, "PROMPT_LOGPROB_ROWS", 3)  # rows of logits three at a time
    chunked = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=0, prompt_logprobs=2))

    def bits(lps):
        return [(lp.token_id, lp.logprob, lp.top) for lp in lps[1:]]

    assert bits(alone.prompt_logprobs) == bits(whole.prompt_logprobs) == bits(chunked.prompt_logprobs)
    # without alternatives the streamed label read-out gives them, the same values
    own = engine.generate(GenerateRequest(prompt=PROMPT, max_tokens=0, prompt_logprobs=0))
    assert [lp.logprob for lp in own.prompt_logprobs[1:]] == [lp.logprob for lp in alone.prompt_logprobs[1:]]


def test_stepped_with_others_equals_alone(engine):
    requests = [GenerateRequest(prompt=PROMPT, max_tokens=3, prompt_logprobs=1),
                GenerateRequest(prompt="Another prompt, a shorter one", max_tokens=3),
                GenerateRequest(prompt="Where is my parcel?", max_tokens=0, prompt_logprobs=3)]
    alone = [engine.generate(r) for r in requests]
    gens = [engine.start_generation(r) for r in requests]
    while not all(g.finished for g in gens):
        engine.step(gens)
    together = [g.result() for g in gens]

    def key(r):
        prompt = None if r.prompt_logprobs is None else [(lp.token_id, lp.top) for lp in r.prompt_logprobs]
        return r.token_ids, prompt

    assert [key(r) for r in together] == [key(r) for r in alone]


def test_from_a_start_the_entries_are_the_whole_prompts_and_the_context_may_be_cached(engine):
    ids = engine.tokenize(PROMPT)[0]
    whole = engine.generate(GenerateRequest(prompt_token_ids=ids, max_tokens=2, prompt_logprobs=2,
                                            bypass_prefix_cache=True))

    def bits(lps):
        return [(lp.token_id, lp.logprob, lp.top) for lp in lps]

    start = len(ids) - 5
    salt = {"prefix_cache_salt": "start-test"}
    cold = engine.generate(GenerateRequest(prompt_token_ids=ids, max_tokens=2, prompt_logprobs=2,
                                           prompt_logprobs_start=start, **salt))
    warm = engine.generate(GenerateRequest(prompt_token_ids=ids, max_tokens=2, prompt_logprobs=2,
                                           prompt_logprobs_start=start, **salt))
    assert bits(cold.prompt_logprobs) == bits(warm.prompt_logprobs) == bits(whole.prompt_logprobs[start:])
    assert cold.token_ids == warm.token_ids == whole.token_ids
    block = engine.generation.store.block_tokens
    cached = (start - 1) // block * block if engine.prefix_cache is not None else 0  # hybrids run without one
    assert warm.usage.cached_tokens == cached  # the context, up to the token before the start
    end = engine.generate(GenerateRequest(prompt_token_ids=ids, max_tokens=0, prompt_logprobs=1,
                                          prompt_logprobs_start=len(ids)))
    assert end.prompt_logprobs == []


def test_bad_values_are_refused(engine):
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        engine.start_generation(GenerateRequest(prompt=PROMPT, prompt_logprobs=21))
    with pytest.raises(InvalidArgument, match="max_tokens"):
        engine.start_generation(GenerateRequest(prompt=PROMPT, max_tokens=0))
    for start in (-1, len(engine.tokenize(PROMPT)[0]) + 1):
        with pytest.raises(InvalidArgument, match="prompt_logprobs_start"):
            engine.start_generation(GenerateRequest(prompt=PROMPT, prompt_logprobs=0, prompt_logprobs_start=start))
