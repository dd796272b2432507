"""Generation: greedy output equals transformers' greedy `generate`, reported logprobs and top-k alternatives
equal the reference log-softmax, stop strings / eos / length finish as documented, sampling is reproducible
with a seed, and several generations stepped together give what each gives alone."""

from __future__ import annotations

import pytest
import torch

from pyscore.engine import Engine
from pyscore.types import GenerateRequest
from tests.helpers import load_reference, make_model_dir

PROMPT = "Context: the order 1234 was shipped on Monday. Question:"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def engine(path) -> Engine:
    return Engine.from_pretrained(path, dtype="float32", device="cpu", threads=2)


def reference_greedy(path, prompt_ids, max_tokens):
    ref = load_reference(path)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [lg[0].log_softmax(-1) for lg in out.logits]


def test_greedy_matches_transformers_with_logprobs(model_dir):
    e = engine(model_dir)
    e.generation.eos_ids = frozenset()  # compare full-length runs; eos handling is tested separately
    result = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=12, top_logprobs=5))
    prompt_ids = e.tokenize(PROMPT)[0]
    tokens, logps = reference_greedy(model_dir, prompt_ids, 12)
    assert result.token_ids == tokens
    assert result.finish_reason == "length" and result.usage.prompt_tokens == len(prompt_ids)
    for lp, ref in zip(result.logprobs, logps, strict=True):
        assert abs(lp.logprob - float(ref[lp.token_id])) <= 1e-4
        values, ids = torch.topk(ref, 5)
        assert [t.token_id for t in lp.top] == ids.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(lp.top, values, strict=True)) <= 1e-4
    assert result.text == e.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.slow
def test_embedded_greedy_matches_transformers(smollm2_dir):
    e = Engine.from_pretrained(None, dtype="float32", threads=2)
    req = GenerateRequest(prompt="Where is my order? It shipped Monday.", apply_chat_template=True, max_tokens=8)
    result = e.generate(req)
    prompt_ids = e.start_generation(req).prompt
    tokens, _ = reference_greedy(smollm2_dir, prompt_ids, 8)
    eos = next(iter(e.generation.eos_ids & set(tokens)), None)
    assert result.token_ids == (tokens[: tokens.index(eos)] if eos is not None else tokens)


def test_stepping_together_equals_alone(model_dir):
    e = engine(model_dir)
    reqs = [GenerateRequest(prompt=PROMPT, max_tokens=6), GenerateRequest(prompt="héllo wörld", max_tokens=3),
            GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9, 10, 11], max_tokens=5)]
    alone = [e.generate(r) for r in reqs]
    gens = [e.start_generation(r) for r in reqs]
    while not all(g.finished for g in gens):
        e.step(gens)
    for a, g in zip(alone, gens, strict=True):
        assert g.result().token_ids == a.token_ids


def test_stop_string_and_streamed_deltas(model_dir):
    e = engine(model_dir)
    full = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=10))
    stop = full.text[len(full.text) // 2 :][:2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    gen = e.start_generation(GenerateRequest(prompt=PROMPT, max_tokens=10, stop=[stop]))
    streamed = ""
    while not gen.finished:
        e.step([gen])
        streamed += gen.take_delta()[2]
    streamed += gen.take_delta()[2]
    result = gen.result()
    assert result.finish_reason == "stop" and stop not in result.text
    assert result.text == full.text[: full.text.find(stop)] == streamed


def test_eos_finishes(model_dir):
    e = engine(model_dir)
    first = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=1)).token_ids[0]
    e.generation.eos_ids = frozenset({first})
    result = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=5))
    assert result.finish_reason == "eos" and result.token_ids == []


def test_seeded_sampling_is_reproducible(model_dir):
    e = engine(model_dir)
    req = GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    assert e.generate(req).token_ids == e.generate(req).token_ids


def test_one_failing_sequence_does_not_fail_its_batch_mates(model_dir):
    e = engine(model_dir)
    reqs = [GenerateRequest(prompt=PROMPT, max_tokens=5), GenerateRequest(prompt="héllo wörld", max_tokens=5),
            GenerateRequest(prompt_token_ids=[5, 6, 7, 8], max_tokens=5)]
    alone = [e.generate(r).token_ids for r in reqs]
    gens = [e.start_generation(r) for r in reqs]
    e.step(gens)  # prefill all three together
    bad = gens[1]
    decode = e.decoder.decode

    def failing_decode(tokens, caches):
        if any(c is bad.cache for c in caches):
            raise RuntimeError("injected decode failure")
        return decode(tokens, caches)

    e.decoder.decode = failing_decode
    while not all(g.finished for g in gens):
        e.step(gens)
    assert isinstance(bad.error, RuntimeError) and bad.cache is None
    assert [gens[0].result().token_ids, gens[2].result().token_ids] == [alone[0], alone[2]]
    e.decoder.decode = decode
    with pytest.raises(RuntimeError, match="injected"):
        e.decoder.decode = lambda tokens, caches: (_ for _ in ()).throw(RuntimeError("injected"))
        e.generate(reqs[0])


def _three(e: Engine) -> tuple[list[GenerateRequest], list[list[int]]]:
    reqs = [GenerateRequest(prompt=PROMPT, max_tokens=6), GenerateRequest(prompt="héllo wörld", max_tokens=6),
            GenerateRequest(prompt_token_ids=[5, 6, 7, 8], max_tokens=6)]
    return reqs, [e.generate(r).token_ids for r in reqs]


def test_retry_after_a_failure_past_the_kv_write_keeps_batch_mates_exact(model_dir, monkeypatch):
    """Token choice fails for the whole batch after decode wrote every sequence's KV slot; the one-by-one retry
    must rewrite the same slots, so the survivors generate exactly what they generate alone."""
    from pyscore import generation

    e = engine(model_dir)
    e.generation.eos_ids = frozenset()
    reqs, alone = _three(e)
    gens = [e.start_generation(r) for r in reqs]
    e.step(gens)  # prefill all three together
    bad, choose = gens[1], generation.choose_tokens

    def failing_choice(logits, batch, tokenizer, logz=None):
        if any(g is bad for g in batch):
            raise RuntimeError("injected token-choice failure")
        return choose(logits, batch, tokenizer, logz)

    monkeypatch.setattr(generation, "choose_tokens", failing_choice)
    while not all(g.finished for g in gens):
        e.step(gens)
    assert isinstance(bad.error, RuntimeError) and bad.cache is None
    assert [gens[0].result().token_ids, gens[2].result().token_ids] == [alone[0], alone[2]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_fail_that_sequence_alone(model_dir, temperature):
    """A NaN hidden row (after the KV write) fails its sequence with a clear error, greedy or sampled; the
    batch-mates go on, exact."""
    e = engine(model_dir)
    e.generation.eos_ids = frozenset()
    reqs, alone = _three(e)
    reqs[1] = GenerateRequest(prompt="héllo wörld", max_tokens=6, temperature=temperature, seed=3)
    gens = [e.start_generation(r) for r in reqs]
    e.step(gens)
    bad, decode = gens[1], e.decoder.decode

    def poisoned_decode(tokens, caches):
        hidden = decode(tokens, caches).clone()  # an inference tensor: write to a copy
        for row, cache in enumerate(caches):
            if cache is bad.cache:
                hidden[row] = float("nan")
        return hidden

    e.decoder.decode = poisoned_decode
    while not all(g.finished for g in gens):
        e.step(gens)
    assert bad.error is not None and "not finite" in str(bad.error), bad.error
    assert len(bad.token_ids) == 1  # the token from the prefill; nothing chosen from the NaN row
    assert [gens[0].result().token_ids, gens[2].result().token_ids] == [alone[0], alone[2]]


@pytest.mark.parametrize("filters", [{}, dict(top_p=0.5, top_k=3)])
@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_tiny_temperature_samples_the_argmax(model_dir, temperature, filters):
    """logits / 1e-38 overflows fp32; sampling must still be defined: the limit of T -> 0 is greedy."""
    e = engine(model_dir)
    greedy = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=6))
    cold = e.generate(GenerateRequest(prompt=PROMPT, max_tokens=6, temperature=temperature, seed=1, **filters))
    assert cold.token_ids == greedy.token_ids


def test_prefill_is_capped_by_the_token_budget(model_dir):
    """New sequences are prefilled in arrival order while their prompts fit max_batch_tokens (one larger than
    the budget alone); the rest wait for the next step. Tokens are the same as alone."""
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2, max_batch_tokens=24)
    reqs = [GenerateRequest(prompt_token_ids=list(range(5, 5 + n)), max_tokens=3, bypass_prefix_cache=True)
            for n in (10, 12, 9, 30)]
    alone = [e.generate(r).token_ids for r in reqs]
    passes, hidden_at = [], e.decoder.hidden_at

    def counting_hidden_at(batch, **kw):
        passes.append(int(batch.tokens.numel()))
        return hidden_at(batch, **kw)

    e.decoder.hidden_at = counting_hidden_at
    gens = [e.start_generation(r) for r in reqs]
    while not all(g.finished for g in gens):
        e.step(gens)
    assert passes == [22, 9, 30]
    assert [g.result().token_ids for g in gens] == alone
