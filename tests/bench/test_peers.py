"""The side-by-side run (bench.peers): blocks alternate between a real gRPC server (the fake engine) and a stub
vLLM, one server at a time; the report's ratios, targets and token counts follow from the phases."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json

import pytest

from bench import peers
from bench.peers import Plan
from bench.targets import make_target
from tests.bench.test_http_targets import CACHED_TOKENS, PROMPT_TOKENS, stub  # noqa: F401 (a fixture)
from tests.server import fake_engine
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine


def test_blocks_alternate_one_server_at_a_time_and_report_both_sides(stub, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(fake_engine, "MAX_CONTEXT", 4096)
    events, running = [], []

    @contextlib.contextmanager
    def servers(block, side):
        assert not running, f"{side} started while {running} still runs"
        running.append(side)
        events.append((block, side))
        server = ServerThread(FakeEngine(delay_s=0.001)) if side == "pyscore" else None
        try:
            if server is not None:
                yield {"spec": server.target, "ready_s": 0.1}
            else:
                yield {"spec": f"vllm-http://{stub}", "ready_s": 0.2, "version": "stub", "args": [],
                       "threads_bind": "0-1"}
        finally:
            if server is not None:
                server.stop()
            running.remove(side)

    plan = Plan(rounds=1, concurrency=(1, 2), candidates=(5, 2), num_questions=2, warmup=1, smoke=True)
    report = peers.run(plan, servers, tmp_path, idle=lambda: 1.0, log=lambda _: None)

    assert events == [(0, "pyscore"), (1, "vllm"), (2, "pyscore")]
    data = json.loads((tmp_path / "peers.json").read_text())
    phases = data["phases"]
    assert len(phases) == 2 * (2 * 2 * 5) + 2 * 2 * 4  # two pyscore blocks of 5 paths, one vLLM block of 4
    assert all(p["num_errors"] == 0 for p in phases), [p["errors"] for p in phases if p["num_errors"]]
    assert {p["num_questions"] for p in phases if p["concurrency"] == 1} == {2}
    assert {p["num_questions"] for p in phases if p["concurrency"] == 2} == {4}  # max(2, 2c)
    lines = gzip.decompress((tmp_path / "records.jsonl.gz").read_bytes()).decode().splitlines()
    assert len(lines) == sum(p["num_questions"] for p in phases)

    by = {(p["block"], p["label"], p["concurrency"], p["candidates"]): p for p in phases}
    gen = by[(1, "completions", 1, 5)]
    # 5 one-token completions per question with one salt: the first computes, four find the query cached
    assert gen["prompt_tokens_per_q"] == 5 * PROMPT_TOKENS
    assert gen["computed_tokens_per_q"] == 5 * PROMPT_TOKENS - 4 * CACHED_TOKENS
    assert gen["counters_per_q"]["computed_tokens"] == gen["computed_tokens_per_q"]
    scoring = by[(1, "generative_scoring", 2, 5)]
    assert scoring["counters_per_q"] == {"prompt_tokens": PROMPT_TOKENS, "prefix_cache_queries": PROMPT_TOKENS,
                                         "prefix_cache_hits": 0, "computed_tokens": PROMPT_TOKENS}
    assert scoring["computed_tokens_per_q"] is None  # its usage has no cached-token details
    ours = by[(2, "mis", 1, 5)]
    assert ours["prompt_tokens_per_q"] > ours["computed_tokens_per_q"] > 0 and ours["counters_per_q"] is None

    md = report.read_text()
    assert "**SMOKE RUN**" in md and "family" in md and "pyscore → vllm → pyscore" in md
    assert "| 1 | 5 | mis |" in md and "| 2 | 2 | generate |" in md
    computed = 5 * PROMPT_TOKENS - 4 * CACHED_TOKENS
    assert f"| 5 | vllm | completions | {5 * PROMPT_TOKENS} | {computed} | /metrics |" in md
    assert data["meta"]["vllm_version"] == "stub" and [b["side"] for b in data["meta"]["blocks"]] == [
        "pyscore", "vllm", "pyscore"]


def phase(side, label, c, n, p50, qps, block=0):
    return {"block": block, "side": side, "label": label, "path": label, "concurrency": c, "candidates": n,
            "num_questions": 8, "num_errors": 0, "errors": [], "achieved_qps": qps, "p50_ms": p50, "p95_ms": p50,
            "prompt_tokens_per_q": 100, "computed_tokens_per_q": 50, "counters_per_q": None, "idle_before": 1.0}


def test_ratios_use_medians_over_blocks_and_the_peers_best_path():
    plan = Plan(concurrency=(1, 8), candidates=(16,), labels={"pyscore": ("mis", "generate"),
                                                              "vllm": ("generative_scoring", "completions")})
    phases = [phase("pyscore", "mis", 1, 16, p50, 0, block) for block, p50 in ((0, 90), (2, 100), (4, 400))]
    phases += [phase("vllm", "generative_scoring", 1, 16, 300, 0), phase("vllm", "completions", 1, 16, 250, 0)]
    phases += [phase("pyscore", "mis", 8, 16, 2000, 3.0), phase("vllm", "generative_scoring", 8, 16, 1500, 4.0),
               phase("vllm", "completions", 8, 16, 1400, 3.5)]
    phases.append(phase("pyscore", "generate", 8, 16, 2000, 1.0))
    rows = {(r["label"], r["concurrency"]): r for r in peers.comparisons(peers.aggregate(phases), plan)}
    mis1 = rows[("mis", 1)]
    assert mis1["ours"]["p50_ms"] == 100 and mis1["ours"]["p50_range"] == (90, 400)  # median of three brackets
    assert mis1["peer_p50_path"] == "completions" and mis1["speedup_p50"] == pytest.approx(2.5)
    mis8 = rows[("mis", 8)]
    assert mis8["peer_qps_path"] == "generative_scoring" and mis8["qps_ratio"] == pytest.approx(0.75)
    assert rows[("generate", 8)]["peer_p50_path"] == "completions"  # never the scoring endpoint
    assert rows[("generate", 8)]["speedup_p50"] == pytest.approx(0.7)
    lines = peers.targets(list(rows.values()), plan)
    assert lines[0].endswith(": met") and "2.50×" in lines[0]
    assert lines[1].endswith("NOT met") and "0.75×" in lines[1]
    assert lines[2].endswith(": met")  # 0.70 >= 1/1.5


def test_question_sets_are_the_same_for_every_call():
    a, b = peers.question_sets((16, 2), 3), peers.question_sets((16, 2), 3)
    assert [q.options for q in a[16]] == [q.options for q in b[16]]
    assert {len(q.options) for q in a[16]} == {16} and {len(q.options) for q in a[2]} == {2}
    assert len({q.state_json for q in a[16]}) == 3


def test_the_pyscore_block_serves_a_target_the_bench_can_open(tmp_path):
    """The real server a pyscore block starts (the embedded model) gives a spec that make_target opens."""
    with peers.pyscore_server(tmp_path / "server.log", threads=1) as server:
        assert isinstance(server["spec"], str) and server["ready_s"] > 0
        target = make_target(server["spec"])
        info = asyncio.run(_open_and_close(target))
    assert info.model == "SmolLM2-135M-Instruct"


async def _open_and_close(target):
    try:
        return await target.open()
    finally:
        await target.close()
