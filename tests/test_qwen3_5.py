"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) end to end on a tiny random model: the packed decoder equals
stock transformers (Qwen3_5ForCausalLM, and Qwen3_5ForConditionalGeneration through a saved image-text-to-text
directory, whose text-only mRoPE is checked to be 1-D RoPE); MIS and SIS scores equal a transformers reference in
which every item continues from a deep copy of the query's cache (items of 1-4 and 63-65 tokens, a query shorter than
the conv kernel, an empty prefix); permuting items or packing other requests alongside changes no item's scores;
greedy generation and its top logprobs equal transformers'; the classification head works.

The fp32 reference runs transformers' token-recurrent delta rule (`torch_recurrent_gated_delta_rule`, what it decodes
with) also where it would prefill with its chunked rule: the two are the same math, but on these chaotic toy models
they differ by up to ~1e-5 of the logit scale in fp32, pyscore's recurrent kernels by ~3e-6 from the former. The
default chunked path is checked too, within 1e-5 plus that disagreement. Tolerances: fp32 1e-5 of the logit scale
(scores: 1e-5 absolute); bf16 within 2x torch's own bf16 error."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from pyscore.engine import Engine
from pyscore.model.decoder import Decoder
from pyscore.model.loading import load_model
from pyscore.model.packing import Group, pack
from pyscore.types import GenerateRequest, ScoreRequest
from tests.helpers import load_reference, make_model_dir
from tests.reference_scoring import max_abs_diff, reference_scores

TEXT = "Context: the order 1234 was shipped on Monday. Proposed answer: cancel the order? Yes"
QUERY = "Context: the order 1234 was shipped on Monday and is in transit.\nQuestion: what should the agent do?"
ITEMS = [" Proposed answer: tell the customer the order is on its way. Is this proposed answer correct?", " A",
         " Proposed answer: cancel.", " Yes or No?"]
FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


@pytest.fixture(scope="module")
def text_ref(text_dir):
    return load_reference(text_dir)


@pytest.fixture(scope="module", params=[16, 32], ids=["dv16-copied", "dv32-in-place"])
def gen_dir(request, tmp_path_factory):
    """The text model with value heads of 16 or 32: 32 fills a whole block of the CPU rule's state columns, so decode
    steps run on their states where they lie (as the real models' 128 do); 16 takes the copied block."""
    return make_model_dir(tmp_path_factory.mktemp(f"qwen3_5_dv{request.param}"), "qwen3_5",
                          linear_value_head_dim=request.param)


@contextmanager
def recurrent_rule() -> Iterator[None]:
    """transformers' Qwen3.5 layers run the token-recurrent delta rule where they would run the chunked one."""
    chunked = modeling_qwen3_5.torch_chunk_gated_delta_rule

    def recurrent(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        return modeling_qwen3_5.torch_recurrent_gated_delta_rule(
            query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    modeling_qwen3_5.torch_chunk_gated_delta_rule = recurrent
    try:
        yield
    finally:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = chunked


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the recurrent rule, logits with transformers' default chunked rule) of one sequence."""
    with recurrent_rule():
        recurrent = model(input_ids=torch.tensor([ids])).logits[0]
    return recurrent, model(input_ids=torch.tensor([ids])).logits[0]


def engine(path, dtype="float32", backend="auto", **kw) -> Engine:
    return Engine.from_pretrained(path, dtype=dtype, device="cpu", threads=2, op_backend=backend, **kw)


def decoder_logits(path, dtype, groups: list[Group], backend="auto") -> torch.Tensor:
    m = load_model(path, dtype, torch.device("cpu"))
    hidden = Decoder(m.cfg, m.weights, m.rotary, backend).hidden_at(pack(groups))
    return hidden.float() @ m.weights.lm_head.float().T  # [R, V]


def assert_logits_close(ours: torch.Tensor, expected: torch.Tensor, what: str = "", slack: float = 0.0) -> None:
    diff = (ours - expected).abs().max().item()
    assert diff <= FP32_TOL * max(1.0, expected.abs().max().item()) + slack, f"{what}: max diff {diff}"


def assert_matches_transformers(ours: torch.Tensor, model, ids: list[int]) -> None:
    recurrent, chunked = reference_logits(model, ids)
    assert_logits_close(ours, recurrent, "vs the recurrent rule")
    assert_logits_close(ours, chunked, "vs the chunked rule", slack=(chunked - recurrent).abs().max().item())


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_fp32_logits_match_transformers(text_dir, text_ref, backend):
    ids = load_model(text_dir, torch.float32, torch.device("cpu")).tokenizer(TEXT)["input_ids"]
    ours = decoder_logits(text_dir, torch.float32, [Group(prefix=[], items=[ids], readouts=[list(range(len(ids)))])],
                          backend)
    assert_matches_transformers(ours, text_ref, ids)


def test_image_text_checkpoint_serves_its_language_model(tmp_path):
    """A saved Qwen3_5ForConditionalGeneration directory (vision tower, tied head) reloads as its text model and
    equals the full transformers model on text-only input."""
    path = make_model_dir(tmp_path / "vl", "qwen3_5_vl")
    ref = load_reference(path)
    assert type(ref).__name__ == "Qwen3_5ForConditionalGeneration"
    m = load_model(path, torch.float32, torch.device("cpu"))
    assert m.cfg.architecture == "Qwen3_5ForConditionalGeneration" and not m.cfg.is_classifier
    assert m.cfg.tie_word_embeddings and m.weights.lm_head is m.weights.embed
    ids = m.tokenizer(TEXT)["input_ids"]
    ours = decoder_logits(path, torch.float32, [Group(prefix=[], items=[ids], readouts=[list(range(len(ids)))])])
    assert_matches_transformers(ours, ref, ids)
    e = engine(path)
    result = e.score(QUERY, ITEMS[:2], labels=["Yes", "No"])
    assert result.mode == "mis" and len(result.scores) == 2


def test_text_only_mrope_is_one_dimensional_rope(tmp_path):
    """The image-text model's own M-RoPE index of a text-only prompt is three equal rows 0..T-1 (no offset), and its
    multimodal rotary embedding over them equals pyscore's 1-D tables for the rotating dims; a different height row
    would not (so the comparison sees the interleaved sections)."""
    path = make_model_dir(tmp_path / "vl", "qwen3_5_vl")
    ref = load_reference(path)
    m = load_model(path, torch.float32, torch.device("cpu"))
    ids = torch.tensor([m.tokenizer(TEXT)["input_ids"]])
    positions, deltas = ref.model.get_rope_index(ids, mm_token_type_ids=torch.zeros_like(ids))
    arange = torch.arange(ids.shape[1])
    assert positions.shape == (3, 1, ids.shape[1]) and deltas.tolist() == [[0]]
    assert all(torch.equal(row[0], arange) for row in positions)
    rotary = ref.model.language_model.rotary_emb
    x = torch.zeros(1, ids.shape[1], 8)
    cos, sin = rotary(x, positions)
    assert cos.shape[-1] == m.cfg.rotary_dims == 8
    torch.testing.assert_close(cos[0], m.rotary.cos[: ids.shape[1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], m.rotary.sin[: ids.shape[1]], rtol=0, atol=1e-6)
    shifted = positions.clone()
    shifted[1] += 3  # an image-like height offset
    assert not torch.allclose(rotary(x, shifted)[0][0], m.rotary.cos[: ids.shape[1]], atol=1e-3)


def test_bf16_logits_within_torch_bf16_error(text_dir, text_ref):
    ids = load_model(text_dir, torch.float32, torch.device("cpu")).tokenizer(TEXT)["input_ids"]
    ours = decoder_logits(text_dir, torch.bfloat16, [Group(prefix=[], items=[ids], readouts=[list(range(len(ids)))])])
    with torch.no_grad():
        expected = text_ref(torch.tensor([ids])).logits[0]
        torch_bf16 = load_reference(text_dir).to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    ours_err, torch_err = (ours - expected).abs().max().item(), (torch_bf16 - expected).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3, f"ours {ours_err} vs torch bf16 {torch_err}"


@torch.no_grad()
def continued_logits(model, prefix: list[int], items: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits at each item's last token, the item continuing from a deep copy of the prefix's cache
    (KV cache of the attention layers, conv + recurrent state of the linear ones); an empty prefix runs the items
    alone."""
    with recurrent_rule():
        if not prefix:
            return [model(torch.tensor([item])).logits[0, -1] for item in items]
        cache = model(torch.tensor([prefix]), use_cache=True).cache
        return [model(torch.tensor([item]), cache=copy.deepcopy(cache), use_cache=True).logits[0, -1]
                for item in items]


def test_mis_items_continue_from_the_prefix_state_like_transformers(text_dir, text_ref):
    """One packed pass of awkward groups: items of 1-4 tokens after a long query, a query shorter than the conv
    kernel, items of 63/64/65 tokens, an empty prefix; every item's read-out equals transformers continuing it from a
    deep copy of its query's cache."""
    gen = torch.Generator().manual_seed(0)
    vocab = load_model(text_dir, torch.float32, torch.device("cpu")).cfg.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    groups = [(ids(23), [ids(1), ids(2), ids(3), ids(4)]), (ids(2), [ids(1), ids(5)]),
              (ids(9), [ids(63), ids(64), ids(65)]), ([], [ids(7)]), (ids(1), [ids(3)])]
    batch = [Group(prefix=p, items=items, readouts=[[len(i) - 1] for i in items]) for p, items in groups]
    ours = iter(decoder_logits(text_dir, torch.float32, batch))
    for prefix, items in groups:
        for item, expected in zip(items, continued_logits(text_ref, prefix, items), strict=True):
            assert_logits_close(next(ours), expected, f"prefix {len(prefix)} item {len(item)}")


@pytest.mark.parametrize("mode", ["sis", "mis"])
def test_scores_match_the_one_sequence_reference(text_dir, text_ref, mode):
    """Cold, and warm: the second request resumes the query's linear states from the prefix cache (and a cold SIS
    request's later candidates its first candidate's)."""
    e = engine(text_dir)
    labels = [e.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("Yes", "No", " A")]
    query = e.tokenize(QUERY)[0]
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    with recurrent_rule():
        expected = reference_scores(text_ref, query, items, labels)
    full = len(query) // e.prefix_cache.block_tokens * e.prefix_cache.block_tokens
    for warm in (False, True):
        result = e.score(QUERY, ITEMS, label_token_ids=labels, mode=mode)
        assert result.mode == mode and len(query) >= 16
        readers = (1 if mode == "mis" else len(ITEMS)) - (not warm)  # cold: MIS none, SIS all but the first
        assert result.usage.cached_tokens == full * readers
        assert max_abs_diff(result.scores, expected) <= FP32_TOL


def test_mis_equals_sis_in_bf16_within_torch_error(text_dir, text_ref):
    e = engine(text_dir, dtype="bfloat16")
    labels = [e.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("Yes", "No")]
    query = e.tokenize(QUERY)[0]
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    expected = reference_scores(text_ref, query, items, labels)
    torch_err = max_abs_diff(reference_scores(load_reference(text_dir).to(torch.bfloat16), query, items, labels),
                             expected)
    scores = {}
    for mode in ("sis", "mis"):
        scores[mode] = ours = e.score(QUERY, ITEMS, label_token_ids=labels, mode=mode).scores
        assert max_abs_diff(ours, expected) <= 2 * torch_err + 1e-4, (mode, max_abs_diff(ours, expected), torch_err)
    # SIS continues each item from its own query's end state, as MIS does from the shared one: the same bits
    assert scores["sis"] == scores["mis"], max_abs_diff(scores["sis"], scores["mis"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_item_order_and_batch_mates_change_no_scores(text_dir, dtype):
    e = engine(text_dir, dtype=dtype)
    target = ScoreRequest(QUERY, ITEMS, labels=["Yes", "No"], apply_softmax=True)
    alone = e.score_batch([target])[0]
    permuted = e.score(QUERY, ITEMS[::-1], labels=["Yes", "No"], apply_softmax=True)
    tol = 1e-6 if dtype == "float32" else 2e-3
    assert max_abs_diff(alone.scores, permuted.scores[::-1]) <= tol
    others = [ScoreRequest("Question: B?", [" x", " the quick brown fox"], labels=["No", "Yes"], mode="sis"),
              ScoreRequest("héllo wörld", [" A", " B", " C"], labels=["Yes"]),
              ScoreRequest(QUERY + QUERY, ITEMS[:2], labels=["Yes", "No"], item_first=True),
              ScoreRequest("A B", [" <|marker|> x <|marker|>"], labels=["Yes"], score_extraction_token="<|marker|>")]
    for batch in ([others[0], target, others[1]], [*others, target], [target, others[2], others[3]]):
        together = e.score_batch(batch)[batch.index(target)]
        assert max_abs_diff(alone.scores, together.scores) <= tol


def test_greedy_generation_matches_transformers(gen_dir):
    reference = load_reference(gen_dir)
    e = engine(gen_dir)
    e.generation.eos_ids = frozenset()
    prompt = "Context: the order 1234 was shipped on Monday. Question:"
    result = e.generate(GenerateRequest(prompt=prompt, max_tokens=10, top_logprobs=5))
    prompt_ids = e.tokenize(prompt)[0]
    with torch.no_grad(), recurrent_rule():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert result.token_ids == out.sequences[0, len(prompt_ids):].tolist()
    for lp, logits in zip(result.logprobs, out.logits, strict=True):
        ref = logits[0].log_softmax(-1)
        assert abs(lp.logprob - float(ref[lp.token_id])) <= 1e-4
        values, ids = torch.topk(ref, 5)
        assert [t.token_id for t in lp.top] == ids.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(lp.top, values, strict=True)) <= 1e-4


def test_generations_stepped_together_equal_alone_and_a_failed_step_retries_cleanly(gen_dir):
    e = engine(gen_dir)
    reqs = [GenerateRequest(prompt="Context: the order", max_tokens=6),
            GenerateRequest(prompt_token_ids=[5, 6], max_tokens=4),  # shorter than the conv kernel
            GenerateRequest(prompt="héllo wörld ünïcode", max_tokens=5)]
    alone = [e.generate(r).token_ids for r in reqs]
    gens = [e.start_generation(r) for r in reqs]
    e.step(gens)  # prefill together
    decode, calls = e.decoder.decode, {"n": 0}

    def flaky_decode(tokens, caches):  # fails once, after the linear layers have written their next states
        calls["n"] += 1
        if calls["n"] == 2:
            decode(tokens, [copy.copy(c) for c in caches])  # runs every layer on shallow copies, commits nothing
            raise RuntimeError("injected failure after the layers ran")
        return decode(tokens, caches)

    e.decoder.decode = flaky_decode
    while not all(g.finished for g in gens):
        e.step(gens)
    e.decoder.decode = decode
    assert [g.result().token_ids for g in gens] == alone


def test_classifier_head_matches_transformers(tmp_path):
    path = make_model_dir(tmp_path / "cls", "qwen3_5", classifier=True)
    ref = load_reference(path)
    assert type(ref).__name__ == "Qwen3_5TextForSequenceClassification"
    e = engine(path)
    query = e.tokenize(QUERY)[0]
    items = [e.tokenizer(i, add_special_tokens=False)["input_ids"] for i in ITEMS]
    for mode in ("sis", "mis"):
        result = e.score(QUERY, ITEMS, apply_softmax=True, mode=mode)
        with recurrent_rule():
            expected = reference_scores(ref, query, items, [0, 1, 2], apply_softmax=True, classifier=True)
        assert max_abs_diff(result.scores, expected) <= FP32_TOL
