"""The AVX-512 helpers whose contract is bitwise (csrc/common/vec_math_avx512.h): exp2_ps equals the earlier
unmasked formula with denormals flushed to zero, and the widened bf16 product equals vdpbf16ps. tests/cpu/simd_check.cpp
runs the instructions themselves, so it needs an AVX512-BF16 CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pyscore.ops import _ext

ROOT = Path(__file__).resolve().parents[2]


def test_simd_helpers_bitwise(tmp_path):
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path / "simd_check"
    flags = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mfma"]
    source = ROOT / "tests" / "cpu" / "simd_check.cpp"
    build = subprocess.run([cxx, "-std=c++17", "-O2", *flags, f"-I{ROOT / 'csrc'}", str(source), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
