"""The CPU kernels on aarch64, checked from an x86 machine: tests/cpu/kernel_check.cpp (every op's launcher against
a naive C++ reference) is cross-compiled with Debian's g++-aarch64-linux-gnu and run under qemu-aarch64, and the _C
module is cross-built through CMakeLists.txt, which must keep x86 flags and sources to x86. The same harness runs
natively too (this CPU's tier, and forced lower), which checks the harness itself. Correctness only: qemu says
nothing about speed on ARM. The tools come from `make aarch64-deps` (scripts/debian_packages.sh); without them the
aarch64 tests skip and say so. Builds go to build/kernel-check/ and are incremental."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "kernel-check"
TOOLCHAIN = ROOT / "tests" / "cpu" / "aarch64-toolchain.cmake"
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
ELF_MACHINE_AARCH64 = 183


def cmake_build(source: Path, build: Path, *args: str) -> None:
    """Configures (once) and builds `source` in `build`; a failure shows the compiler's last words."""
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (build / "CMakeCache.txt").exists():
        configure = subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator,
                                    "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *args], capture_output=True, text=True)
        assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    done = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def missing_cross_tools() -> list[str]:
    return [tool for tool in (CROSS_CXX, QEMU) if shutil.which(tool) is None]


def skip_without_cross_tools() -> None:
    missing = missing_cross_tools()
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: `make aarch64-deps` installs Debian's g++-aarch64-linux-gnu and "
                    "qemu-user (as root)")


def run_checks(command: list[str], env: dict[str, str] | None = None) -> str:
    # the tier is what `env` asks, never one forced on the whole test run (PYSCORE_CPU_TIER=avx2 pytest ...)
    inherited = {k: v for k, v in os.environ.items() if k not in ("PYSCORE_CPU_TIER", "PYSCORE_DISABLE_AVX512")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**inherited, **(env or {})})
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAIL", "     "))]
    assert result.returncode == 0, "\n".join(failed) + "\n" + result.stdout[-3000:] + result.stderr[-2000:]
    assert "passed: 0 failed" in result.stdout
    return result.stdout


def elf_machine(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[18:20], "little")


def compile_flags(build: Path) -> dict[str, str]:
    """Source file name -> its compile command, from CMake's compile_commands.json."""
    entries = json.loads((build / "compile_commands.json").read_text())
    return {Path(e["file"]).name: e["command"] for e in entries}


@pytest.fixture(scope="module")
def native_harness() -> Path:
    cmake_build(ROOT / "tests" / "cpu", BUILD / "native")
    return BUILD / "native" / "kernel_check"


# Forced tiers: a tier above this CPU's runs the CPU's own (cpu_features.h), so every entry is safe anywhere.
@pytest.mark.parametrize("tier", ["hardware", "generic", "avx2", "avx512"])
def test_kernel_checks_native(native_harness, tier):
    env = {} if tier == "hardware" else {"PYSCORE_CPU_TIER": tier}
    out = run_checks([str(native_harness)], env)
    if tier == "generic":
        assert out.startswith("cpu tier generic")


def test_kernel_checks_aarch64_under_qemu():
    skip_without_cross_tools()
    build = BUILD / "aarch64"
    cmake_build(ROOT / "tests" / "cpu", build, f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}")
    harness = build / "kernel_check"
    assert elf_machine(harness) == ELF_MACHINE_AARCH64
    # Two threads, as the CI machine has: the OpenMP splits run as they would on a 2-core Graviton. The neon tier
    # (the *_neon.cpp kernels, the portable ones elsewhere), then the portable code alone.
    out = run_checks([QEMU, "-L", SYSROOT, str(harness)], {"OMP_NUM_THREADS": "2"})
    assert out.startswith("cpu tier neon (hardware neon)")
    out = run_checks([QEMU, "-L", SYSROOT, str(harness)], {"OMP_NUM_THREADS": "2", "PYSCORE_CPU_TIER": "generic"})
    assert out.startswith("cpu tier generic (hardware neon)")
    # The x86 ISA files are not part of an aarch64 build at all (cmake/cpu_kernels.cmake).
    flags = compile_flags(build)
    assert not [name for name in flags if name.endswith(("_avx512.cpp", "_avx2.cpp"))]
    assert not [name for name, command in flags.items() if " -mavx" in command or " -mf16c" in command]


def test_neon_vector_layer_under_qemu():
    """csrc/common/vec_neon.h, the NEON back-end of the vector layer: its exp formulas give the x86 layers' bits, bf16
    rounds as torch does, ragged loads and stores stop at n, select and the bf16 row interleave are exact
    (tests/cpu/simd_check_neon.cpp)."""
    skip_without_cross_tools()
    binary = BUILD / "aarch64-simd" / "simd_check_neon"
    binary.parent.mkdir(parents=True, exist_ok=True)
    source = ROOT / "tests" / "cpu" / "simd_check_neon.cpp"
    build = subprocess.run([CROSS_CXX, "-std=c++17", "-O2", "-ffp-contract=off", f"-I{ROOT / 'csrc'}", str(source),
                            "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run_checks([QEMU, "-L", SYSROOT, str(binary)])


def stand_in_python_headers(include: Path, shim: Path) -> list[str]:
    """CMake flags that let this machine's Python headers stand in for aarch64 ones. Debian's pyconfig.h picks a
    per-architecture file (<aarch64-linux-gnu/python3.X/pyconfig.h> for the cross compiler, absent without the arm64
    dev package); a shim of that name includes this machine's one."""
    flags = [f"-DPython_INCLUDE_DIR={include}"]
    if "aarch64-linux-gnu/" not in (include / "pyconfig.h").read_text():
        return flags  # a self-contained pyconfig.h (pyenv, python.org builds)
    host = include.parent / sysconfig.get_config_var("MULTIARCH") / include.name / "pyconfig.h"
    (shim / "aarch64-linux-gnu" / include.name).mkdir(parents=True, exist_ok=True)
    (shim / "aarch64-linux-gnu" / include.name / "pyconfig.h").write_text(f'#include "{host}"\n')
    return [*flags, f"-DCMAKE_CXX_FLAGS=-I{shim}"]


def test_module_cross_builds_for_aarch64():
    """CMakeLists.txt builds pyscore._C for aarch64. This machine's Python headers stand in for aarch64 ones (the
    same LP64 layout; pyconfig.h differs only in names), so this checks compiling and linking, not importing."""
    skip_without_cross_tools()
    pybind11 = pytest.importorskip("pybind11")
    build = BUILD / "aarch64-module"
    cmake_build(ROOT, build, f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}", "-DCMAKE_FIND_ROOT_PATH_MODE_INCLUDE=BOTH",
                "-DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=BOTH", f"-DPython_EXECUTABLE={sys.executable}",
                *stand_in_python_headers(Path(sysconfig.get_paths()["include"]), build / "pyconfig-shim"),
                f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", "-DPYSCORE_BUILD_CUDA=OFF")
    modules = list(build.glob("_C*.so"))
    assert len(modules) == 1, modules
    assert elf_machine(modules[0]) == ELF_MACHINE_AARCH64
    assert "bindings_cpu.cpp" in compile_flags(build)
    # The generated dispatch table names this architecture's entry points only: no x86 stand-ins are needed.
    table = (build / "pyscore_vec" / "kernel_table.cpp").read_text()
    rows = set(re.findall(r"\{CpuTier::k(\w+), (\w+)\}", table))
    assert rows == {("Neon", f"{family}_neon") for family in ("attention_ops", "label_ops", "state_columns",
                                                               "conv_tokens", "decode_ops", "linear_ops",
                                                               "linear_int8_ops")}, rows
