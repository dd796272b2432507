"""The engine's execution paths on the GPU (marked cuda, skipped elsewhere), for Qwen3 and the Qwen3.5 hybrid: what
the CPU suite checks bitwise on the CPU kernels and the CUDA kernels met only under the SIMT emulator. Each path's
scores and logprobs agree with the fp32 CPU engine on the same weights (drawn in fp32 on the CPU) within 2x torch's
own bf16 error on the GPU, and the paths take the shortcuts they promise (cached tokens, chunk and branch passes):

- MIS and SIS (MIS = SIS within that bound), and a batch whose requests have different label counts (the label
  read-out's softmax over each row's valid labels, padding ignored);
- the prefix cache: a cold request stores its blocks (the kv sink's slice copies) and a repeat reads them; SIS
  candidates share their query (a hybrid model's in two passes, the later resuming the linear layers' states);
- chunked prefill of a query over --max-batch-tokens;
- branch points: a hybrid question that shares only a system prompt with a cached one resumes at its end after a
  branch pass;
- Generate: prompt logprobs, and greedy decode steps of two sequences of different lengths stepped together (one
  DecodePlan of two block tables), each token's logprob against the fp32 engine's on the same tokens.

Where no GPU is usable they run on the CPU instead, unmarked (PYSCORE_GPU_TESTS_DEVICE=cpu|cuda forces either):
`make test` and bench/gpu_check.sh --cpu-dry-run keep the checks themselves working between the sessions that have a
GPU, so such a session does not spend its minutes on a broken test."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from bench.models import build_random_model, id_questions, labels_for
from pyscore.engine import Engine
from pyscore.model.kv_store import page_tokens
from pyscore.types import GenerateRequest, ScoreRequest
from tests.conftest import cuda_available
from tests.helpers import count_passes

DEVICE = torch.device(os.environ.get("PYSCORE_GPU_TESTS_DEVICE") or ("cuda" if cuda_available() else "cpu"))
pytestmark = [pytest.mark.cuda] if DEVICE.type == "cuda" else []
B = page_tokens(DEVICE)  # a cache block on this device
FAMILIES = ["tiny", "tiny-qwen3.5"]


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request):
    def model(dtype: torch.dtype, device: torch.device):  # the same weights (drawn in fp32 on the CPU) on each
        return build_random_model(request.param, dtype, device, cpu_draws=True)

    return dict(ref=Engine(model(torch.float32, torch.device("cpu"))), kernel=Engine(model(torch.bfloat16, DEVICE)),
                torch_bf16=Engine(model(torch.bfloat16, DEVICE), op_backend="reference"),
                chunking=Engine(model(torch.bfloat16, DEVICE), max_batch_tokens=2 * B),
                hybrid=request.param.endswith("qwen3.5"))


def ids(n: int, seed: int, vocab: int = 1024) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab // 2, vocab) for _ in range(n)]  # the low ids are the tokenizer's


def scores(result) -> torch.Tensor:  # [items, rows, labels]
    if isinstance(result, Exception):  # score_batch hands a failed request's error back: raise it as it is
        raise result
    return torch.tensor(result.scores, dtype=torch.float64)


class Bound:
    """A request's fp32 CPU scores and the bound a bf16 GPU path must meet: 2x what torch's bf16 ops miss by."""

    def __init__(self, engines: dict, request: ScoreRequest):
        plain = dataclasses.replace(request, bypass_prefix_cache=True)
        self.ref = scores(engines["ref"].score_batch([plain])[0])
        torch_err = float((scores(engines["torch_bf16"].score_batch([plain])[0]) - self.ref).abs().max())
        self.tol = 2 * torch_err + 1e-4

    def check(self, result, what: str) -> None:
        err = float((scores(result) - self.ref).abs().max())
        assert err <= self.tol, f"{what}: {err:.3g} > {self.tol:.3g}"


def request(query: list[int], items: list[list[int]], **kw) -> ScoreRequest:
    return ScoreRequest(query, items, label_token_ids=labels_for(1024), apply_softmax=True, **kw)


ITEMS = [ids(5, 100 + k) for k in range(3)]


@pytest.mark.parametrize("mode", ["mis", "sis"])
def test_scores_match_the_fp32_engine(engines, mode):
    query = ids(2 * B + 9, 1)
    target = request(query, ITEMS, mode=mode, bypass_prefix_cache=True)
    Bound(engines, target).check(engines["kernel"].score_batch([target])[0], mode)


def test_mis_equals_sis_for_many_short_items(engines):
    for q in id_questions(9, 2, 1024, tiny=True):
        bound = Bound(engines, request(q.query, q.items, mode="sis"))
        mis, sis = (engines["kernel"].score_batch([request(q.query, q.items, mode=m, bypass_prefix_cache=True)])[0]
                    for m in ("mis", "sis"))
        bound.check(mis, "mis")
        bound.check(sis, "sis")
        assert float((scores(mis) - scores(sis)).abs().max()) <= bound.tol


def test_rows_with_fewer_labels_ignore_the_padding(engines):
    # One batch, two label counts: the read-out's label tensor pads the shorter rows with -1.
    two = request(ids(40, 2), ITEMS, bypass_prefix_cache=True)
    three = ScoreRequest(ids(33, 3), ITEMS, label_token_ids=[300, 700, 901], apply_softmax=True,
                         bypass_prefix_cache=True)
    together = engines["kernel"].score_batch([two, three])
    for r, result in zip((two, three), together, strict=True):
        Bound(engines, r).check(result, f"{len(r.label_token_ids)} labels")
        totals = scores(result).sum(-1)  # [items, rows]: each row's softmax over its own labels
        assert torch.allclose(totals, torch.ones_like(totals), atol=1e-5)


@pytest.mark.parametrize("mode", ["mis", "sis"])
def test_a_repeat_reads_the_blocks_its_first_call_stored(engines, mode):
    query = ids(3 * B + 17, 4 if mode == "mis" else 5)
    salt = f"repeat-{mode}"
    bound = Bound(engines, request(query, ITEMS, mode=mode))
    first = engines["kernel"].score_batch([request(query, ITEMS, mode=mode, prefix_cache_salt=salt)])[0]
    again = engines["kernel"].score_batch([request(query, ITEMS, mode=mode, prefix_cache_salt=salt)])[0]
    whole = len(query) // B * B
    # SIS: the later candidates read the query the first one stored in the same call (a hybrid model in two passes)
    assert first.usage.cached_tokens == (0 if mode == "mis" else whole * (len(ITEMS) - 1))
    assert again.usage.cached_tokens == whole * (1 if mode == "mis" else len(ITEMS))
    bound.check(first, "cold, storing")
    bound.check(again, "warm")


@pytest.mark.parametrize("mode", ["mis", "sis"])
def test_a_query_over_the_batch_budget_is_prefilled_in_chunks(engines, mode):
    query = ids(5 * B + 11, 6)
    bound = Bound(engines, request(query, ITEMS, mode=mode))
    chunked = engines["chunking"].score_batch([request(query, ITEMS, mode=mode, prefix_cache_salt=mode)])[0]
    whole = len(query) // B * B
    assert chunked.usage.cached_tokens == (0 if mode == "mis" else whole * (len(ITEMS) - 1))
    bound.check(chunked, "chunked")
    warm = engines["chunking"].score_batch([request(query, ITEMS, mode=mode, prefix_cache_salt=mode)])[0]
    assert warm.usage.cached_tokens == whole * (1 if mode == "mis" else len(ITEMS))
    bound.check(warm, "chunked, then warm")


def test_a_hybrid_question_resumes_at_a_shared_system_prompt(engines, monkeypatch):
    if not engines["hybrid"]:
        pytest.skip("branch points are the hybrid model's (a plain model reads any cached block)")
    e = engines["kernel"]
    system = ids(3 * B + 5, 7)
    questions = [system + ids(B + 10 + k, 10 + k) for k in range(3)]  # each ends past the system prompt's blocks
    passes = count_passes(e, monkeypatch)
    results = [e.score_batch([request(q, ITEMS, prefix_cache_salt="system")])[0] for q in questions]
    # the first keeps states at its own last block only; the second finds the system prompt's blocks without
    # states, branches there (one pass of its 3 blocks) and stores them; the third resumes at the branch
    assert [r.usage.cached_tokens for r in results] == [0, 0, 3 * B]
    assert passes[1] == 3 * B and len(passes) == 4
    for q, r in zip(questions, results, strict=True):
        Bound(engines, request(q, ITEMS)).check(r, "branch")


def logprob_error(engines: dict, prompt: list[int], result) -> tuple[float, float]:
    """(max |kernel - fp32| over the generated tokens' logprobs, 2x torch bf16's own on the same tokens + 1e-4)."""
    tokens = prompt + result.token_ids

    def teacher_forced(e: Engine) -> torch.Tensor:
        asked = GenerateRequest(prompt_token_ids=tokens, max_tokens=0, prompt_logprobs=0,
                                prompt_logprobs_start=len(prompt), bypass_prefix_cache=True)
        return torch.tensor([t.logprob for t in e.generate(asked).prompt_logprobs])

    ref = teacher_forced(engines["ref"])
    torch_err = float((teacher_forced(engines["torch_bf16"]) - ref).abs().max())
    got = torch.tensor([t.logprob for t in result.logprobs])
    return float((got - ref).abs().max()), 2 * torch_err + 1e-4


def test_prompt_logprobs_match_the_fp32_engine(engines):
    prompt = ids(2 * B + 3, 8)
    asked = GenerateRequest(prompt_token_ids=prompt, max_tokens=0, prompt_logprobs=2, bypass_prefix_cache=True)
    ref, torch_bf16, got = (torch.tensor([t.logprob for t in engines[k].generate(asked).prompt_logprobs[1:]])
                            for k in ("ref", "torch_bf16", "kernel"))
    tol = 2 * float((torch_bf16 - ref).abs().max()) + 1e-4
    assert float((got - ref).abs().max()) <= tol


def test_decode_steps_of_two_sequences_match_the_fp32_engine(engines, monkeypatch):
    e = engines["kernel"]
    monkeypatch.setattr(e.generation, "eos_ids", frozenset())  # random weights: all 12 steps, whatever they choose
    prompts = [ids(B + 7, 9), ids(2 * B + 30, 10)]  # two block tables of different lengths in one DecodePlan
    gens = [e.start_generation(GenerateRequest(prompt_token_ids=p, max_tokens=12, top_logprobs=1,
                                               prefix_cache_salt="decode")) for p in prompts]
    while not all(g.finished for g in gens):
        e.step([g for g in gens if not g.finished])
    for prompt, g in zip(prompts, gens, strict=True):
        result = g.result()
        assert len(result.token_ids) == 12
        err, tol = logprob_error(engines, prompt, result)
        assert err <= tol, f"decode logprobs: {err:.3g} > {tol:.3g}"
