"""bench/peak/peak.cpp, the CPU ceilings every GEMM figure is read against: it builds, runs one round and reports a
positive rate for every loop this CPU has (AVX-512 needed; the AMX and BF16 loops only where the CPU has them)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAGS = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or "avx512f" not in FLAGS, reason="needs g++ and an AVX-512 x86-64 CPU")


def test_peak_reports_every_loop_this_cpu_has(tmp_path):
    binary = tmp_path / "peak"
    subprocess.run(["g++", "-O2", "-fopenmp", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
                    str(REPO / "bench/peak/peak.cpp"), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary), "1"], check=True, capture_output=True, text=True, timeout=120).stdout
    rates: dict[tuple[str, int], float] = {}
    for line in out.splitlines()[1:]:
        name, threads, gflops = line.split()
        rates[(name, int(threads))] = float(gflops)
    expected = {"fma"} | ({"dpbf16"} if "avx512_bf16" in FLAGS else set())
    if "amx_bf16" in FLAGS:
        expected |= {"amx", "amx+loads", "amx+stores"}
    assert {name for name, _ in rates} == expected
    assert {threads for _, threads in rates} >= {1}
    assert all(rate > 0 for rate in rates.values()), out
