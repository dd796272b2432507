"""Greedy decoding in bf16 on the CPU must not depend on what else the server is decoding: the same prompts,
generated alone and inside batches of every size 1..16, give bitwise equal tokens and logprobs."""

from __future__ import annotations

import pytest

from pyscore.engine import Engine
from pyscore.types import GenerateRequest
from tests.helpers import make_model_dir

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def e(tmp_path_factory) -> Engine:
    """SmolLM2's widths (576 hidden, 1536 MLP, 9/3 heads of 64) in two layers, bf16."""
    path = make_model_dir(tmp_path_factory.mktemp("wide"), "qwen3", hidden_size=576, intermediate_size=1536,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    engine = Engine.from_pretrained(path, dtype="bfloat16", device="cpu", threads=2)
    engine.generation.eos_ids = frozenset()  # full-length runs: every step is compared
    return engine


def prompts() -> list[GenerateRequest]:
    return [GenerateRequest(prompt_token_ids=[5 + (7 * i + 3 * j) % 390 for j in range(3 + 5 * i % 23)],
                            max_tokens=MAX_TOKENS) for i in range(16)]


def run_together(e: Engine, requests: list[GenerateRequest]) -> list[tuple[list[int], list[float]]]:
    gens = [e.start_generation(r) for r in requests]
    while not all(g.finished for g in gens):
        e.step(gens)
    assert all(g.error is None for g in gens)
    return [(g.result().token_ids, [lp.logprob for lp in g.result().logprobs]) for g in gens]


def test_greedy_bf16_decoding_is_batch_invariant(e):
    requests = prompts()
    alone = [run_together(e, [r])[0] for r in requests]
    differing = []
    for size in range(1, 17):
        for start in range(0, len(requests), size):
            group = list(range(start, min(start + size, len(requests))))
            for i, got in zip(group, run_together(e, [requests[i] for i in group]), strict=True):
                if got != alone[i]:
                    differing.append((size, i))
    assert differing == [], f"(batch size, prompt) differing from alone: {differing}"
