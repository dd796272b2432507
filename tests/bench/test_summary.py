"""bench/'s one percentile (numpy's default, linear interpolation between closest ranks) and its one summary
type: every bench command's summary path, fed the same latencies, reports the same p95."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench import deploy, hardening, loadgen, peers
from bench.loadgen import Record
from bench.summary import LATEST, Summary, default_out, percentile, timings, write_json, write_report

# 20 latencies (s) where the nearest rank (what overload/soak/deploy used to take) and linear interpolation differ
LATENCIES_S = [0.010 * ((7 * k) % 20 + 1) ** 2 for k in range(20)]  # 10 ms ... 4 s, out of order
LATENCIES_MS = [x * 1e3 for x in LATENCIES_S]


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(100, n).tolist()
        for p in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert np.isnan(percentile([], 95))


def test_summary_counts_errors_and_throughput():
    s = Summary.of([0.1, 0.2, 0.3], errors=2, wall_s=1.5, scale=1e3)
    assert (s.count, s.errors, s.min, s.max) == (3, 2, pytest.approx(100), pytest.approx(300))
    assert s.p50 == pytest.approx(200) and s.mean == pytest.approx(200) and s.throughput == 2.0
    assert Summary.of([], wall_s=0.0).throughput == 0.0
    assert Summary.of([]).pick("p95", "max", empty=None) == {"p95": None, "max": None}
    assert Summary.of([1.23456]).pick("p50", digits=2) == {"p50": 1.23}


def test_every_bench_summary_path_reports_the_same_p95():
    expected = float(np.percentile(LATENCIES_MS, 95))
    nearest = sorted(LATENCIES_MS)[round(0.95 * (len(LATENCIES_MS) - 1))]
    assert abs(expected - nearest) > 0.1  # the records tell the two definitions apart

    records = [Record(f"q{i}", 2, 2, None, 0.0, x, ok=True) for i, x in enumerate(LATENCIES_S)]
    records.append(Record("bad", 2, 2, None, 0.0, 9.9, ok=False, status="RESOURCE_EXHAUSTED"))  # not a latency
    got = {
        "loadgen (serving, sweep, ...)": loadgen.summarize_records(records, 1.0)["end_to_end_latency_ms"]["p95"],
        "peers": peers.phase_summary(records, 1.0)["p95_ms"],
        "overload": hardening.summarize(records)["accepted_latency_ms"]["p95"],
        "soak": hardening.soak_summary(records, 1.0)["latency_ms"]["p95"],
        "deploy": deploy.summary(records, 1.0)["latency_ms"]["p95"],
        "in-process (engine, gpu grpc)": timings(LATENCIES_MS)["p95"],
    }
    for name, p95 in got.items():
        assert p95 == pytest.approx(expected, abs=0.05), name  # overload and soak round to 0.1 ms


def test_writers_print_record_and_make_folders(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "report.txt"
    assert write_report(["x", "y", ""], out) == "x\ny\n"
    assert out.read_text() == "x\ny\n" and capsys.readouterr().out == "x\ny\n"
    write_report("quiet", tmp_path / "q.md", echo=False)
    assert capsys.readouterr().out == "" and (tmp_path / "q.md").read_text() == "quiet\n"
    write_json(tmp_path / "c" / "d.json", {"p95": 1.5, "path": tmp_path})
    assert json.loads((tmp_path / "c" / "d.json").read_text()) == {"p95": 1.5, "path": str(tmp_path)}
    assert not list(tmp_path.glob("**/*.tmp"))


def test_no_bench_command_writes_a_cited_record_by_default():
    """A bench command run without --out writes under bench/results/latest/ (git ignores it): no code in bench/
    names a path into bench/results/ but summary.LATEST (bench/results/latest/), so a re-run never overwrites a
    record the README cites. Docstrings and help texts may name records; a string that builds a path may not."""
    repo = Path(__file__).resolve().parents[2]
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default_out("x.txt"))], cwd=repo)
    assert ignored.returncode == 0, f"{LATEST} is not ignored by git"
    offenders = []
    for path in sorted((repo / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)}
        helps = {id(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                 for kw in node.keywords if kw.arg == "help"}
        for node in ast.walk(tree):
            named = (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | helps
                     and "bench/results" in node.value)
            joined = (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                      and isinstance(node.right, ast.Constant) and node.right.value == "results")
            if (named or joined) and path.name != "summary.py":
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
