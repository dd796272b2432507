"""bench.engine's stock-transformers contender runs the very tokens MIS runs: with one item, its last-position
logits give MIS's scores; with many, one causal sequence of the same length."""

from __future__ import annotations

import re

import pytest
import torch

from bench import engine as bench_engine
from bench.common import alternate
from pyscore.engine import Engine
from pyscore.types import ScoreRequest
from tests.helpers import make_model_dir

QUERY = "Context: the order 1234 was shipped on Monday. Question: what should the agent do next?"
ITEMS = ["Proposed answer: cancel the order. Answer Yes or No.", "Proposed answer: ask the warehouse. Yes or No"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.from_pretrained(make_model_dir(tmp_path_factory.mktemp("llama"), "llama"), dtype="float32",
                                  threads=1)


def test_stock_forward_runs_the_tokens_mis_runs(engine):
    stock = bench_engine.stock_model(engine)
    labels = [engine.tokenize(w, add_special_tokens=False)[0][-1] for w in (" Yes", " No")]
    prepared = engine.prepare_score(ScoreRequest(QUERY, ITEMS, label_token_ids=labels))
    ids = bench_engine.mis_input_ids(prepared)
    assert ids.shape == (1, len(prepared.query) + sum(map(len, prepared.items)))
    assert ids[0, : len(prepared.query)].tolist() == prepared.query
    assert ids[0, -len(prepared.items[1]):].tolist() == prepared.items[1]

    one = bench_engine.mis_input_ids(engine.prepare_score(ScoreRequest(QUERY, ITEMS[:1], label_token_ids=labels)))
    full, keep1 = bench_engine.stock_forward(stock, one, None), bench_engine.stock_forward(stock, one, 1)
    assert full.shape[1] == one.shape[1] and keep1.shape[1] == 1
    torch.testing.assert_close(full[:, -1], keep1[:, -1])
    expected = torch.softmax(keep1[0, -1, labels].float(), -1)
    got = engine.score(QUERY, ITEMS[:1], label_token_ids=labels, apply_softmax=True).scores[0][0]
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)


def test_alternate_interleaves_and_sets_up_each_turn():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times = alternate(fns, 2, setup={"b": lambda: order.append("setup b")})
    assert order == ["a", "setup b", "b"] * 2 and [len(v) for v in times.values()] == [2, 2]


def test_contenders_by_mode(engine):
    """`--modes`: MIS and SIS by default, MIS alone for big shapes, Generate on request; each takes the questions
    in turn."""
    labels = {"label_token_ids": [5, 6]}
    questions = [(QUERY, ITEMS), (QUERY, ITEMS[:1])]
    assert set(bench_engine.contenders(engine, None, questions, labels)) == {"mis", "sis"}
    assert set(bench_engine.contenders(engine, None, questions, labels, ("mis",))) == {"mis"}
    runs = bench_engine.contenders(engine, None, questions, labels, ("mis", "generate"))
    assert [len(runs["mis"]().scores) for _ in range(3)] == [2, 1, 2]
    runs["generate"]()


def test_greedy_generations_do_the_same_work(engine):
    """`--generate`: both contenders generate n tokens per prompt, eos or not, and (fp32) the same greedy tokens."""
    stock = bench_engine.stock_model(engine)
    ids = [engine.tokenize(QUERY)[0][:12], engine.tokenize(ITEMS[0])[0][:12]]
    runs = bench_engine.greedy_generations(engine, stock, ids, 6)
    ours, theirs = runs["ours"](), runs["stock"]()
    assert [len(t) for t in ours] == [len(t) for t in theirs] == [6, 6]
    assert ours == theirs


def test_prompt_logprob_runs_give_the_same_values(engine):
    """`--prompt-logprobs`: both contenders return every prompt token's logprob after the first, equal in fp32."""
    ids = engine.tokenize(QUERY)[0]
    runs = bench_engine.prompt_logprob_runs(engine, bench_engine.stock_model(engine), ids, 2)
    ours, theirs = runs["ours"](), runs["stock"]()
    assert len(ours) == len(theirs) == len(ids) - 1
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-4


def test_generate_runs_a_shape_and_reports_its_decode_step(tmp_path):
    """`--generate B --shape S`: a random-weight model against stock's init of the same config, ours' prefill and
    decode step reported apart."""
    out = tmp_path / "generate.txt"
    bench_engine.main(["--shape", "qwen3.5-0.8b", "--tiny", "--generate", "2", "--new-tokens", "3", "--rounds", "1",
                       "--threads", "1", "--out", str(out)])
    text = out.read_text()
    assert "random-tiny-qwen3.5" in text and "2 greedy generation(s) of 3 tokens" in text
    assert re.search(r"the prefill and first token \d+ ms, then [\d.]+ ms a decode step", text)
    assert "tokens not compared" in text
