"""Engine.set_boundary: a forward pass asks its decision at every layer boundary and, told STOP, stops there
(PassInterrupted) having committed nothing — no prefix-cache block is published, no generation advances — so the
same requests run afterwards exactly as if the interrupted pass had never been (bitwise on the kernel path)."""

from __future__ import annotations

import pytest

from pyscore.engine import Engine
from pyscore.errors import PassInterrupted
from pyscore.types import Boundary, GenerateRequest, ScoreRequest
from tests.helpers import make_model_dir
from tests.test_engine_prefix_cache import ITEMS, QUERY


class StopAt:
    """A decision that says STOP at the `at`-th layer boundary it is asked about (1-based), and counts."""

    def __init__(self, at: int) -> None:
        self.at, self.asked = at, 0

    def __call__(self) -> Boundary:
        self.asked += 1
        return Boundary.STOP if self.asked >= self.at else Boundary.CONTINUE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", num_hidden_layers=4,
                          layer_types=["full_attention"] * 4)


def engine(path, backend: str) -> Engine:
    return Engine.from_pretrained(path, dtype="float32", device="cpu", threads=2, op_backend=backend)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_an_interrupted_score_pass_stops_at_a_layer_and_commits_nothing(model_dir, backend: str) -> None:
    e = engine(model_dir, backend)
    request = ScoreRequest(query=QUERY, items=ITEMS, labels=["Yes", "No"])
    stop = StopAt(3)
    e.set_boundary(stop)
    with pytest.raises(PassInterrupted):
        e.run_prepared([e.prepare_score(request)])
    assert stop.asked == 3  # asked before each layer; stopped before the third of four
    stats = e.prefix_cache_stats()
    assert stats.blocks == 0 and stats.bytes == 0  # the blocks the pass wrote were never published
    e.set_boundary(None)
    after = e.score_batch([request])[0]
    cold = engine(model_dir, backend).score_batch([request])[0]
    assert after.usage.cached_tokens == 0 and after.usage == cold.usage
    assert after.scores == cold.scores  # the same arithmetic as a fresh engine: bitwise on both paths here


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_an_interrupted_generation_step_leaves_the_generations_as_they_were(model_dir, backend: str) -> None:
    e = engine(model_dir, backend)
    # cold every time: a warm prefill on the reference path differs from a cold one in the last bits (guarantees)
    request = GenerateRequest(prompt=QUERY, max_tokens=4, top_logprobs=2, bypass_prefix_cache=True)
    expected = engine(model_dir, backend).generate(request)
    gen = e.start_generation(request)
    e.step([gen])  # prefilled: one token
    e.set_boundary(StopAt(2))
    with pytest.raises(PassInterrupted):
        e.step([gen])  # a decode step, stopped before its second layer
    assert len(gen.token_ids) == 1 and gen.cache is not None and gen.cache.length == len(gen.prompt)
    fresh = e.start_generation(request)
    e.set_boundary(StopAt(1))
    with pytest.raises(PassInterrupted):
        e.step([fresh])  # a prefill, stopped before its first layer
    assert fresh.cache is None and not fresh.token_ids and not fresh.finished
    e.set_boundary(None)
    while not gen.finished:
        e.step([gen])
    while not fresh.finished:
        e.step([fresh])
    for got in (gen.result(), fresh.result()):
        assert got.token_ids == expected.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in expected.logprobs]
