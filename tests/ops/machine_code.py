"""What the compiler made of a CPU kernel source: the file compiled as the build compiles it (its vector layer's flags
and the kernels' options, read from cmake/cpu_kernels.cmake; a kernel text through the translation unit the build
generates for it), without LTO so that each function's code is its own, then disassembled: the x86 layers (avx2,
avx512) with this machine's g++, the aarch64 one (neon) with Debian's cross g++ (`make aarch64-deps`, as for
tests/ops/test_aarch64.py). For the tests that check the machine code itself: tests/ops/test_avx512_tier_isa.py (no
instruction a lower tier lacks) and tests/ops/test_register_tiles.py (register tiles kept in registers)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[2]
FUNCTION = re.compile(r"^([0-9a-f]+) <(.+)>:$")
INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$")

needs_x86_gcc = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("g++")
                                   or not shutil.which("objdump"), reason="needs x86-64 with g++ and objdump")
# (compiler, objdump) per architecture; aarch64: the cross tools on x86, the native ones on an ARM machine
ON_ARM = platform.machine() in ("aarch64", "arm64")
AARCH64_TOOLS = ("g++", "objdump") if ON_ARM else ("aarch64-linux-gnu-g++", "aarch64-linux-gnu-objdump")
needs_aarch64_gcc = pytest.mark.skipif(not all(map(shutil.which, AARCH64_TOOLS)),
                                       reason="needs g++ and objdump for aarch64 (make aarch64-deps)")


def tools(layer: str) -> tuple[str, str]:
    """The compiler and the disassembler for a vector layer's architecture."""
    return AARCH64_TOOLS if layer == "neon" else ("g++", "objdump")


class Instruction(NamedTuple):
    address: int
    mnemonic: str
    operands: str


def build_flags(layer: str) -> list[str]:
    """The kernels' options and one vector layer's ISA flags ("avx2", "avx512" or "neon"), from
    cmake/cpu_kernels.cmake."""
    text = (REPO / "cmake" / "cpu_kernels.cmake").read_text()
    isa = re.search(rf"set\(PYSCORE_{layer.upper()}_FLAGS \"([^\"]+)\"\)", text)
    options = re.search(r"set\(PYSCORE_CPU_KERNEL_OPTIONS ([^)]*)\)", text)
    assert isa and options, "cmake/cpu_kernels.cmake no longer reads as this test expects"
    return [*options.group(1).split(), *isa.group(1).split(";")]


def translation_unit(source: str, layer: str, tmp_path: Path) -> Path:
    """A .cpp source as it is; a kernel text (*_simd.h) in the unit cmake/cpu_kernels.cmake generates for `layer`."""
    if not source.endswith(".h"):
        return REPO / source
    text = Path(source).relative_to("csrc").as_posix()
    unit = tmp_path / f"{Path(source).stem}_{layer}.cpp"
    unit.write_text(f'#include "common/vec_{layer}.h"\n'
                    f"namespace pyscore {{\nnamespace {{\nnamespace V = {layer};\n}}\n}}\n"
                    f'#define PYSCORE_VEC_ENTRY(name) name##_{layer}\n#include "{text}"\n')
    return unit


def functions(source: str, layer: str, tmp_path: Path) -> dict[str, list[Instruction]]:
    """Each function of the compiled source (demangled name): its instructions in address order."""
    obj = tmp_path / f"{Path(source).stem}_{layer}.o"
    compiler, objdump = tools(layer)
    subprocess.run([compiler, "-std=c++17", *build_flags(layer), f"-I{REPO / 'csrc'}", "-c",
                    str(translation_unit(source, layer, tmp_path)), "-o", str(obj)], check=True)
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(obj)], check=True,
                             capture_output=True, text=True).stdout
    found: dict[str, list[Instruction]] = {}
    current = None
    for line in listing.splitlines():
        if m := FUNCTION.match(line):
            current = found.setdefault(m.group(2), [])
        elif (m := INSTRUCTION.match(line)) and current is not None:
            current.append(Instruction(int(m.group(1), 16), m.group(2), m.group(3)))
    return found
