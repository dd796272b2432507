"""The AVX-512 helpers whose contract is bitwise (csrc/common/vec_math_avx512.h): exp2_ps equals the earlier
unmasked formula with denormals flushed to zero, and the widened bf16 product equals vdpbf16ps. tests/cpu/simd_check.cpp
runs the instructions themselves, so it needs an AVX512-BF16 CPU. The AVX2 layer (csrc/common/vec_avx2.h,
tests/cpu/simd_check_avx2.cpp): exp2 and exp accurate, never a denormal from exp2, bf16 rounded as torch, partial
loads and stores exact, lane-mask select and the bf16 row interleave exact (tests/cpu/layer_select_check.h, shared
with the NEON layer's check), and on an AVX512-BF16 CPU the same exp2 / exp bits as the AVX-512 layer."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pyscore.ops import _ext

ROOT = Path(__file__).resolve().parents[2]


AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mfma"]
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]


def run_check(tmp_path: Path, name: str, flags: list[str]) -> None:
    """Builds tests/cpu/<name>.cpp with `flags` and runs it; its exit status is the verdict."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path / name
    source = ROOT / "tests" / "cpu" / f"{name}.cpp"
    build = subprocess.run([cxx, "-std=c++17", "-O2", *flags, f"-I{ROOT / 'csrc'}", str(source), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_simd_helpers_bitwise(tmp_path):
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    run_check(tmp_path, "simd_check", AVX512_FLAGS)


def test_avx2_layer(tmp_path):
    module = _ext.cpu_module()
    if module is None or not module.cpu_features()["avx2"]:
        pytest.skip("needs pyscore._C on a CPU with AVX2 + FMA + F16C")
    # With the AVX-512 flags too where the CPU has them: then it also compares the two layers bit for bit.
    extra = AVX512_FLAGS if module.cpu_features()["avx512bf16"] else []
    run_check(tmp_path, "simd_check_avx2", AVX2_FLAGS + extra)
