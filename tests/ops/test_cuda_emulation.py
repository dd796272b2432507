"""The CUDA kernels' own sources run on the CPU: tests/emu/emu_check.cpp compiles the *_kernels.cuh headers with
g++ against a small SIMT emulator (one OS thread per CUDA thread; ldmatrix / mma.sync / cp.async implemented
from the PTX fragment layouts) and compares them with float64 references. This checks tile and fragment index
arithmetic, masks, GQA stacking, the work planner and reductions on machines without a GPU; it does not check
the inline PTX itself, timing-dependent races, or performance (those need the GPU tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EMU = ROOT / "tests" / "emu"
# "attention" (the full attention matrix, ~3 minutes on 2 cores) runs when PYSCORE_EMU_FULL=1.
FULL = ["attention"] if os.environ.get("PYSCORE_EMU_FULL") else []
PARTS = ["labels", "attention-quick", "linear", "decode", *FULL]


@pytest.fixture(scope="module")
def emu_binary(tmp_path_factory) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    out = tmp_path_factory.mktemp("emu") / "emu_check"
    cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-w", "-include", str(EMU / "cuda_emu.h"),
           f"-I{EMU / 'include'}", f"-I{ROOT / 'csrc'}", str(EMU / "emu_check.cpp"), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"emulator build failed:\n{result.stderr[-4000:]}"
    return out


@pytest.mark.parametrize("part", PARTS)
def test_cuda_kernels_under_emulation(emu_binary, part):
    result = subprocess.run([str(emu_binary), part], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{part}:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
