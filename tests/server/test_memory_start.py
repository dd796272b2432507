"""`python -m server` and memory: a model whose pools cannot fit exits 1 at start, before loading, with the numbers
(never an OOM kill halfway); `--plan-memory` prints the plan and the memory request without loading anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyscore.ops import _ext
from tests.helpers import make_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


def run_server(*flags: str, tier: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if tier is not None:
        env["PYSCORE_CPU_TIER"] = tier
    return subprocess.run([sys.executable, "-m", "server", "--port", "0", "--threads", "1", "--device", "cpu",
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def plan_memory(model_dir: Path, tier: str | None = None) -> subprocess.CompletedProcess[str]:
    """`--plan-memory` for the tiny model with a small KV budget and no prefix cache (optionally at a forced tier)."""
    return run_server("--model", str(model_dir), "--kv-cache-mb", "16", "--no-prefix-cache",
                      "--plan-memory", tier=tier)


def test_a_kv_budget_beyond_the_machine_exits_before_loading(model_dir: Path) -> None:
    done = run_server("--model", str(model_dir), "--kv-cache-mb", str(10**7))
    assert done.returncode == 1, done.stderr[-2000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("pyscore: ")]
    assert "does not fit" in line and "KV budget" in line and "Lower --kv-cache-mb (now 1e+07)" in line
    assert "pyscore: serving" not in done.stdout and "Traceback" not in done.stderr


def test_plan_memory_prints_the_plan_and_the_request(model_dir: Path) -> None:
    done = plan_memory(model_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    plan, request = done.stdout.strip().splitlines()[-2:]
    dtype = str(_ext.default_cpu_dtype()[0]).removeprefix("torch.")  # bf16, or fp32 on a CPU without bf16 arithmetic
    assert plan.startswith(f"pyscore: {model_dir.name} in {dtype} on cpu takes ") and "weights" in plan
    assert "prefix cache" not in plan and request == "memory request: 1Gi"  # a tiny model: mostly the runtime
    assert "listening" not in done.stdout


@pytest.mark.parametrize("tier", ["generic", "avx2"])
def test_plan_memory_at_a_tier_without_bf16_arithmetic_plans_float32(model_dir: Path, tier: str) -> None:
    """What a CPU without bf16 arithmetic (an AVX2-only AMD Zen 3, an old x86) serves by default, checked on any
    CPU that can run the tier: the plan, and so the memory request, is for float32 weights."""
    if tier not in _ext.runnable_cpu_tiers():
        pytest.skip(f"this CPU cannot run tier {tier}")
    done = plan_memory(model_dir, tier)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = done.stdout.strip().splitlines()[-2]
    assert plan.startswith(f"pyscore: {model_dir.name} in float32 on cpu takes "), plan
