"""A sequence's state is explicit (pyscore.generation.SeqState): WAITING until its prefill succeeds, RUNNING with
its KV cache while it decodes, FINISHED (cache freed) at eos / stop / length or on failure; the runner prefills
exactly the waiting ones and decodes exactly the running ones."""

from __future__ import annotations

import pytest

from pyscore.engine import Engine
from pyscore.generation import SeqState
from pyscore.types import GenerateRequest
from tests.helpers import make_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine.from_pretrained(make_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3"), dtype="float32",
                               device="cpu", threads=1)
    e.generation.eos_ids = frozenset()  # run to max_tokens
    return e


def test_states_follow_the_sequence(engine):
    gen = engine.start_generation(GenerateRequest(prompt="hello there", max_tokens=3))
    assert gen.state is SeqState.WAITING and gen.cache is None and not gen.finished
    engine.step([gen])  # prefill: the first token
    assert gen.state is SeqState.RUNNING and gen.cache is not None and len(gen.token_ids) == 1
    engine.step([gen])
    assert gen.state is SeqState.RUNNING and len(gen.token_ids) == 2
    engine.step([gen])  # max_tokens reached
    assert gen.state is SeqState.FINISHED and gen.finished and gen.cache is None
    assert gen.finish_reason == "length"


def test_the_runner_prefills_waiting_and_decodes_running(engine, monkeypatch):
    old = engine.start_generation(GenerateRequest(prompt="hello there", max_tokens=4))
    engine.step([old])
    new = engine.start_generation(GenerateRequest(prompt="another prompt", max_tokens=4))
    seen: dict[str, list] = {}
    runner = engine.generation
    prefill, decode = runner._prefill, runner._decode
    monkeypatch.setattr(runner, "_prefill", lambda gens: (seen.setdefault("prefill", list(gens)), prefill(gens)))
    monkeypatch.setattr(runner, "_decode", lambda gens: (seen.setdefault("decode", list(gens)), decode(gens)))
    engine.step([old, new])
    assert seen == {"prefill": [new], "decode": [old]}
    assert old.state is new.state is SeqState.RUNNING


def test_a_failed_sequence_is_finished(engine):
    gen = engine.start_generation(GenerateRequest(prompt="hello there", max_tokens=4))
    engine.step([gen])
    gen.fail(RuntimeError("x"))
    assert gen.state is SeqState.FINISHED and gen.cache is None and gen.finish_reason == "error"
    engine.step([gen])  # a finished sequence is neither prefilled nor decoded
    assert len(gen.token_ids) == 1
