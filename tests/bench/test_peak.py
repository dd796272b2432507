"""bench/peak/peak.cpp, the CPU ceilings every GEMM figure is read against: it builds, runs one round and reports a
positive rate for every loop this CPU has and none other (AVX2 + FMA needed; the AVX-512, BF16, VNNI and AMX loops only
where the CPU has them: an AVX2-only CPU runs the AVX2 loop alone, and would die of SIGILL if another one ran)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAGS = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not {"avx2", "fma"} <= set(FLAGS), reason="needs g++ and an AVX2 x86-64 CPU")


def test_peak_reports_every_loop_this_cpu_has(tmp_path):
    binary = tmp_path / "peak"
    subprocess.run(["g++", "-O2", "-fopenmp", str(REPO / "bench/peak/peak.cpp"), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary), "1"], check=True, capture_output=True, text=True, timeout=120).stdout
    rates: dict[tuple[str, int], float] = {}
    for line in out.splitlines()[1:]:
        name, threads, gflops = line.split()
        rates[(name, int(threads))] = float(gflops)
    expected = {"fma256", "int8-256"} | ({"fma"} if "avx512f" in FLAGS else set())
    expected |= {"dpbf16"} if "avx512_bf16" in FLAGS else set()
    expected |= {"vnni"} if "avx512_vnni" in FLAGS else set()
    if "amx_bf16" in FLAGS:
        expected |= {"amx", "amx+loads", "amx+stores"}
    expected |= {"amx-int8"} if "amx_int8" in FLAGS else set()
    assert {name for name, _ in rates} == expected
    assert {threads for _, threads in rates} >= {1}
    assert all(rate > 0 for rate in rates.values()), out
