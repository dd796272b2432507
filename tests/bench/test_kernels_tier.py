"""bench.kernels at a forced tier, in a subprocess (it re-executes itself so torch starts on the same ISA): the
header names our tier, torch's and the CPU, the dtype defaults to fp32 where bf16 has no arithmetic, and the
elementwise rows are written. One round of one call each: plumbing, not timings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyscore.ops import _ext

ROOT = Path(__file__).resolve().parents[2]


def test_forced_avx2_tier_header_and_rows(tmp_path):
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx2"]:
        pytest.skip("needs pyscore._C on a CPU with AVX2 + FMA + F16C")
    out = tmp_path / "kernels.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("PYSCORE_CPU_TIER", "ATEN_CPU_CAPABILITY")}
    run = subprocess.run([sys.executable, "-m", "bench.kernels", "--tier", "avx2", "--only", "elementwise",
                          "--reps", "1", "--rounds", "1", "--threads", "1", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    text = out.read_text()
    command, machine_line = text.splitlines()[:2]
    assert command.startswith("# python -m bench.kernels --tier avx2 --only elementwise") and "(commit " in command
    assert machine_line.startswith("machine: "), text[:200]
    assert "tier: ours avx2 (forced)" in text and "torch AVX2 (ATEN_CPU_CAPABILITY=avx2" in text, text[:600]
    assert "kernel path avx2" in text and "dtypes float32;" in text, text[:600]
    for op in ("add_rms_norm", "silu_mul", "rotary"):
        assert any(line.startswith(op) and "float32" in line for line in text.splitlines()), op
