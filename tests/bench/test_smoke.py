"""A short benchmark against a real in-process gRPC server (the fake engine: only the plumbing is under test):
closed and open loop over every path, then the report. Checks summary.json and the plots."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from bench import report, serving
from bench.dataset import Dataset
from bench.serving import LoadPoint, Settings
from tests.server import fake_engine
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine

SUMMARY_FIELDS = {"path", "target", "model", "concurrency", "target_qps", "num_questions", "num_errors",
                  "num_workers", "achieved_qps", "end_to_end_latency_ms", "service_latency_ms", "queueing_delay_ms",
                  "server_compute_ms", "p95_by_candidates", "machine", "git_commit"}


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(fake_engine, "MAX_CONTEXT", 4096)  # a 16-option setwise prompt is ~600 fake words
    s = ServerThread(FakeEngine(delay_s=0.002))
    yield s
    s.stop()


def test_smoke_run_writes_summaries_and_plots(server, tmp_path):
    dataset = Dataset.synthetic(8, seed=1)
    settings = Settings(reps=2, num_questions=8, duration_s=0.3, warmup=1, progress=True)
    points = [LoadPoint(concurrency=1), LoadPoint(concurrency=4), LoadPoint(qps=30), LoadPoint(qps=60)]
    paths = ["mis", "sis", "generate", "setwise", "fused"]
    summaries = asyncio.run(serving.run(server.target, paths, points, dataset, settings, tmp_path, timeout=10))
    assert len(summaries) == len(paths) * len(points) * 2
    collected = serving.collect(tmp_path)
    assert len(collected) == len(summaries)

    files = sorted(tmp_path.glob("runs/*/*/*/rep*/summary.json"))
    assert len(files) == len(summaries)
    s = json.loads((tmp_path / f"runs/grpc_{server.target.replace(':', '_')}/mis/open-q30/rep1/summary.json")
                   .read_text())
    assert set(s) >= SUMMARY_FIELDS
    assert (s["path"], s["model"], s["loop"], s["target_qps"], s["concurrency"]) == ("mis", "fake-smollm2", "open",
                                                                                      30, None)
    assert s["num_questions"] == 9 and s["num_errors"] == 0 and s["num_workers"] == 9
    assert s["target"] == f"grpc://{server.target}" and s["machine"]["cores"] >= 1
    assert set(s["end_to_end_latency_ms"]) == {"p50", "p90", "p95", "p99", "mean"}
    assert set(s["p95_by_candidates"]) == {"2", "5", "9", "16"}
    assert 0 < s["achieved_qps"] <= 60
    answered = [json.loads(f.read_text()) for f in files]
    answered = [a for a in answered if a["num_errors"] < a["num_questions"]]  # fused: the fake has no chat template
    assert {a["path"] for a in answered} == {"mis", "sis", "generate", "setwise"}
    for summary in answered:  # the server-side queue wait and compute time, as the server reported them
        queue, compute, service = (summary[k]["p50"] for k in ("queueing_delay_ms", "server_compute_ms",
                                                               "service_latency_ms"))
        assert queue >= 0 and compute > 0 and queue + compute <= service, summary["path"]
    assert s["marker"] == "<empty_output>"
    records = gzip.decompress((files[0].parent / "records.jsonl.gz").read_bytes()).decode().splitlines()
    assert len(records) == json.loads(files[0].read_text())["num_questions"]

    by_path = {(x["path"], x["concurrency"]): x for x in summaries if x["rep"] == 0}
    assert by_path[("setwise", 1)]["num_errors"] == 0
    assert by_path[("generate", 4)]["num_errors"] == 0
    # The fake engine has no chat template: every fused question fails, and is counted, not fatal.
    assert by_path[("fused", 1)]["num_errors"] == 8
    assert "FAILED_PRECONDITION" in by_path[("fused", 1)]["errors"][0]

    md = report.report(tmp_path).read_text()
    for name in ("p95_vs_qps.png", "p95_by_candidates.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    assert "## Targets" in md and "| mis | 1 | 2 |" in md
