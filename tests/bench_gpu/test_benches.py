"""The H200 kit's benchmarks in their tiny CPU modes: each writes valid JSON with the fields the summary reads,
and the summary renders them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import engine, gpu, kernels


def test_engine_kit_run_tiny_writes_json(tmp_path):
    out = tmp_path / "engine-tiny.json"
    engine.main(["--tiny", "--shape", "qwen3-0.6b", "--modes", "generate", "sis", "mis", "--no-stock", "--overhead",
                 "--candidates", "2", "16", "--reps", "2", "--questions", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["shape"] == "tiny"
    for n in ("2", "16"):
        cell = report["results"][n]
        for mode in ("generate", "sis", "mis"):
            assert cell[mode]["n"] == 2 and 0 < cell[mode]["p50"] <= cell[mode]["p95"]
        assert cell["mis_vs_sis"]["max_abs"] < 0.05
        assert cell["mis_tokens"] < cell["sis_tokens"]
        assert cell["floor_mis"]["compute_ms"] > 0
    assert report["mis16_over_mis2_p95"] > 0
    assert report["overhead_mis"]["decoder_total_ms"] > 0
    assert "MIS(16)/MIS(2) p95" in gpu.summary(tmp_path)


def test_kernel_kit_tiny_writes_json(tmp_path):
    out = tmp_path / "kernels.json"
    kernels.main(["--tiny", "--json", str(out), "--reps", "2", "--threads", "2"])
    report = json.loads(out.read_text())
    assert not report["errors"]
    assert {r["items"] for r in report["attention"]} == {2, 5}
    assert all(r["ours_ms"] > 0 and r["ours_rel_err"] < 1e-2 for r in report["attention"])
    assert report["mis_vs_sis"][0]["max_abs"] < 0.05
    assert report["label_logprobs"][0]["ours_max_abs"] < 1e-2
    assert [r["items"] for r in report["linear"]] == [2, 5]
    assert all(r["ours_ms"] > 0 and r["items_max_abs"] < 5e-2 for r in report["linear"])
    assert "label_logprobs R=16" in gpu.summary(tmp_path)


def test_grpc_kit_tiny_serves_and_stops(tmp_path):
    out = tmp_path / "grpc.json"
    gpu.main(["grpc", "--tiny", "--candidates", "2", "--modes", "mis", "--reps", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert not report["errors"] and report["server_exit_code"] == 0
    assert report["results"]["2"]["mis"]["n"] == 2


def test_gpu_check_stages_fit_one_device_command():
    """bench/gpu_check.sh runs as one device command, which the device tool stops at 600 s: its stages' limits (each
    run under `timeout`) must leave room for the wheel install and the summary."""
    script = (Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh").read_text()
    limits = {name: int(s) for name, s in re.findall(r"^stage (\w+) (\d+) ", script, re.M)}
    assert {"tests", "kernels", "engine06b", "engine8b", "engine35", "grpc"} <= set(limits), limits
    assert sum(limits.values()) <= 590, limits
    assert "-m cuda tests/ops tests/bench_gpu" in script  # the tests stage takes the engine-path module too
