"""The register-tiled CPU kernels keep their tiles in registers, as compiled by the build (g++, the build's flags).

A kernel's hot loop (the innermost loop with the most multiply-adds) must store at most one vector register to the
stack per iteration: a register spilled under pressure costs a store and a load, but when GCC cannot keep a tile's
accumulators in registers (a run-time trip count, or a bounds check inside the loop) it keeps them in memory and
writes every one back on every step. The results stay bitwise the same, so no other test sees it, and the benches
see it only through this VM's noise: the AVX2 label read-out ran at 40-42 ms instead of 27-36 (R=16, one thread,
bench/results/tiers/kernels/labels_avx2_ab.txt), the AVX2 decode attention at 0.65-0.78 ms instead of 0.54-0.62
(decode_attention_avx2_ab.txt). Every instantiation of each kernel below is checked, on x86 and, for the kernel texts
NEON shares, in the aarch64 code (Debian's cross g++; no ARM machine has timed it): there a ragged load through a
stack buffer kept the fp32 read-out's tile in memory. The check can fail: a loop with a run-time accumulator count,
as the decode attention's was, is flagged."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.ops.machine_code import Instruction, functions, needs_aarch64_gcc, needs_x86_gcc

# (source, vector layer) -> the register-tiled kernels in it (function names as objdump -C gives them, by prefix)
TILED = {
    ("csrc/label_logprobs/logits_simd.h", "avx2"): ["void pyscore::(anonymous namespace)::dot_tile<"],
    ("csrc/label_logprobs/logits_simd.h", "avx512"): ["void pyscore::(anonymous namespace)::dot_tile<"],
    ("csrc/linear/linear_simd.h", "avx2"): ["void pyscore::(anonymous namespace)::micro<"],
    ("csrc/linear/linear_simd.h", "avx512"): ["void pyscore::(anonymous namespace)::micro<"],
    ("csrc/decode_attention/decode_attention_simd.h", "avx2"): [
        "void pyscore::(anonymous namespace)::attend<", "void pyscore::(anonymous namespace)::value_pass<"],
    ("csrc/decode_attention/decode_attention_simd.h", "avx512"): [
        "void pyscore::(anonymous namespace)::attend<", "void pyscore::(anonymous namespace)::value_pass<"],
    ("csrc/prefix_item_attention/attention_simd.h", "avx2"): ["void pyscore::(anonymous namespace)::attend_tile<"],
    ("csrc/prefix_item_attention/attention_simd.h", "avx512"): ["void pyscore::(anonymous namespace)::attend_tile<"],
    ("csrc/gated_delta_rule/gated_delta_rule_simd.h", "avx2"): [
        "void pyscore::(anonymous namespace)::state_columns<", "void pyscore::(anonymous namespace)::conv_tokens<"],
    ("csrc/gated_delta_rule/gated_delta_rule_simd.h", "avx512"): [
        "void pyscore::(anonymous namespace)::state_columns<", "void pyscore::(anonymous namespace)::conv_tokens<"],
    # the NEON layer's compile of the same texts (GCC inlines the read-out's tiles into logits_chunk there)
    ("csrc/label_logprobs/logits_simd.h", "neon"): [
        "void pyscore::(anonymous namespace)::dot_tile<", "void pyscore::(anonymous namespace)::logits_chunk<"],
    ("csrc/prefix_item_attention/attention_simd.h", "neon"): ["void pyscore::(anonymous namespace)::attend_tile<"],
    ("csrc/decode_attention/decode_attention_simd.h", "neon"): [
        "void pyscore::(anonymous namespace)::attend<", "void pyscore::(anonymous namespace)::value_pass<"],
    ("csrc/gated_delta_rule/gated_delta_rule_simd.h", "neon"): [
        "void pyscore::(anonymous namespace)::state_columns<", "void pyscore::(anonymous namespace)::conv_tokens<"],
    ("csrc/linear/linear_simd.h", "neon"): ["void pyscore::(anonymous namespace)::micro<"],
}

# Kernels whose whole function, not just the hot loop, keeps its tile in registers: one call per strip and K block
# (a few dozen steps), so a tile written to the stack and read back at entry and exit costs ~5-7% (linear's 6 x 4
# AVX-512 tile on a Zen 4, bench/results/tiers/kernels/linear_text_ab_recheck_avx512bf16.txt).
WHOLE = [("csrc/linear/linear_simd.h", layer) for layer in ("avx2", "avx512", "neon")]


class Isa(NamedTuple):
    """What the hot-loop check reads in one architecture's disassembly (objdump's syntax)."""
    multiply_add: re.Pattern  # a vector multiply-add's mnemonic
    jump: re.Pattern  # a branch's mnemonic
    target: re.Pattern  # its target address in the operands
    stack_store: Callable[[Instruction], int]  # vector registers the instruction stores to the stack


def x86_stack_store(x: Instruction) -> int:
    return int(x.mnemonic.startswith(("vmov", "mov")) and bool(re.search(r"%[xyz]mm\d+,\s*-?(0x[0-9a-f]+)?\(%r[sb]p\)",
                                                                        x.operands)))


def aarch64_stack_store(x: Instruction) -> int:  # str q0, [sp, #16] / stp q0, q1, [x29, #32]
    if x.mnemonic not in ("str", "stp") or not x.operands.startswith("q") or not re.search(r"\[(sp|x29)\b", x.operands):
        return 0
    return 2 if x.mnemonic == "stp" else 1


# (the int8 quads: vpdpbusd with VNNI, vpmaddwd on AVX2, sadalp on NEON)
X86 = Isa(re.compile(r"^(vfn?m(add|sub)|vdpbf16ps|vpdpbusd|vpmaddwd)"), re.compile(r"^j\w+$"),
          re.compile(r"^([0-9a-f]+)\b"), x86_stack_store)
AARCH64 = Isa(re.compile(r"^(fml[as]|bfdot|bfmmla|sadalp)$"), re.compile(r"^(b|b\.\w+|cbn?z|tbn?z)$"),
              re.compile(r"(?:^|,\s*)([0-9a-f]+) <"), aarch64_stack_store)


def loops(code: list[Instruction], isa: Isa = X86) -> list[list[Instruction]]:
    """The innermost loops: spans from a backward jump's target to the jump that hold no other such span and no return
    (GCC places some blocks after the return and jumps back from them: not loops)."""
    at = {x.address: j for j, x in enumerate(code)}
    spans = []
    for i, ins in enumerate(code):
        m = isa.jump.match(ins.mnemonic) and isa.target.search(ins.operands)
        if m and int(m.group(1), 16) < ins.address:
            start = at.get(int(m.group(1), 16))
            if start is not None and not any(x.mnemonic.startswith("ret") for x in code[start:i + 1]):
                spans.append((start, i))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [code[a:b + 1] for a, b in inner]


def multiply_adds(body: list[Instruction], isa: Isa = X86) -> int:
    return sum(bool(isa.multiply_add.match(x.mnemonic)) for x in body)


def hot_loop_stack_stores(code: list[Instruction], isa: Isa = X86) -> tuple[int, int] | None:
    """(multiply-adds, vector stores to the stack) of the innermost loop with the most multiply-adds, or None."""
    counted = [(multiply_adds(body, isa), sum(isa.stack_store(x) for x in body)) for body in loops(code, isa)]
    counted = [c for c in counted if c[0]]
    return max(counted) if counted else None


def tiled_kernels(source: str, layer: str, tmp_path: Path) -> tuple[Isa, dict[str, list[Instruction]]]:
    """The layer's ISA and the compiled source's TILED kernels (at least one: a rename must be followed here)."""
    found = functions(source, layer, tmp_path)
    kernels = {name: code for name, code in found.items() if any(name.startswith(p) for p in TILED[source, layer])}
    assert kernels, f"no {TILED[source, layer]} in {source}: the kernel was renamed, rename it here"
    return (AARCH64 if layer == "neon" else X86), kernels


@pytest.mark.parametrize("source, layer", [
    pytest.param(s, layer, id=f"{Path(s).stem}-{layer}", marks=needs_aarch64_gcc if layer == "neon" else needs_x86_gcc)
    for s, layer in TILED])
def test_hot_loops_keep_their_tiles_in_registers(source, layer, tmp_path):
    isa, kernels = tiled_kernels(source, layer, tmp_path)
    checked = {name[:110]: hot_loop_stack_stores(code, isa) for name, code in kernels.items()}
    assert any(c for c in checked.values()), f"no multiply-add loop found in {source}'s kernels"
    spilling = {name: c for name, c in checked.items() if c and c[1] > 1}
    assert not spilling, f"hot loops storing their tile to the stack, (multiply-adds, stack stores): {spilling}"


@pytest.mark.parametrize("source, layer", [
    pytest.param(s, layer, id=f"{Path(s).stem}-{layer}", marks=needs_aarch64_gcc if layer == "neon" else needs_x86_gcc)
    for s, layer in WHOLE])
def test_tiles_never_touch_the_stack(source, layer, tmp_path):
    isa, kernels = tiled_kernels(source, layer, tmp_path)
    stores = {name[:110]: sum(isa.stack_store(x) for x in code) for name, code in kernels.items()}
    assert not {n: c for n, c in stores.items() if c > 2}, f"vector stores to the stack per call: {stores}"


@needs_x86_gcc
def test_widened_bf16_tiles_share_each_broadcast_on_avx2(tmp_path):
    """AVX2's 6 x 2 tiles of widened bf16 pairs broadcast each x element once per K step (12 for 24 multiply-adds):
    with one weight vector widened per broadcast (its odd mask held in a register) the 776-row bf16 prefill ran
    1.16-1.24x slower (bench/results/tiers/kernels/linear_widen_mask_ab_1thread_avx2.txt)."""
    isa, kernels = tiled_kernels("csrc/linear/linear_simd.h", "avx2", tmp_path)
    widened = {name: code for name, code in kernels.items()
               if re.search(r"::(Bf16Widen|Bf16Weight), 6, 2, (true|false)>", name)}
    assert len(widened) == 4, f"expected Bf16Widen and Bf16Weight at 6 x 2, with and without prefetch: {list(widened)}"
    for name, code in widened.items():
        hot = max(loops(code, isa), key=lambda body: multiply_adds(body, isa))
        fmas = multiply_adds(hot, isa)
        broadcasts = sum(x.mnemonic == "vbroadcastss" for x in hot)
        assert fmas % 24 == 0 and broadcasts * 2 <= fmas, f"{name[:110]}: {broadcasts} broadcasts for {fmas} FMAs"


# A tile indexed by an outer loop's variable, starting from zero or from memory as linear's micro<> does: GCC keeps
# it an array on the stack around the loop unless the row loops carry PYSCORE_UNROLL (common/kernel_text.h).
OUTER_INDEXED = """#include <immintrin.h>
{unroll}
void tile(float* o, const float* x, const float* w, long steps, bool first) {{
  __m512 acc[6][4];
  UNROLL for (int r = 0; r < 6; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + 64 * r + 16 * j);
  for (long s = 0; s < steps; ++s) {{
    UNROLL for (int r = 0; r < 6; ++r) {{
      const __m512 b = _mm512_set1_ps(x[r * steps + s]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(b, _mm512_loadu_ps(w + 64 * s + 16 * j), acc[r][j]);
    }}
  }}
  UNROLL for (int r = 0; r < 6; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + 64 * r + 16 * j, acc[r][j]);
}}
"""


@needs_x86_gcc
@pytest.mark.parametrize("unrolled", [False, True])
def test_the_whole_function_check_flags_an_outer_indexed_tile(unrolled, tmp_path):
    unroll = '#include "common/kernel_text.h"\n#define UNROLL PYSCORE_UNROLL' if unrolled else "#define UNROLL"
    probe = tmp_path / f"outer_indexed_{unrolled}.cpp"
    probe.write_text("#define PYSCORE_VEC_ENTRY(name) name\n" + OUTER_INDEXED.format(unroll=unroll))
    code = functions(str(probe), "avx512", tmp_path)["tile(float*, float const*, float const*, long, bool)"]
    stores = sum(X86.stack_store(x) for x in code)
    assert (stores <= 2) if unrolled else (stores >= 24), stores


# The pattern the AVX2 decode attention had: accumulators over a run-time count of vectors, per vector layer.
PROBE = """{include}
void add_values(float* o, const float* p, const float* v, long v_stride, int n, int vecs) {{
  {vec} acc[8];
  for (int z = 0; z < vecs; ++z) acc[z] = {load}(o + {lanes} * z);
  for (int j = 0; j < n; ++j) {{
    const {vec} pj = {set1}(p[j]);
    for (int z = 0; z < vecs; ++z) acc[z] = {fma};
  }}
  for (int z = 0; z < vecs; ++z) {store}(o + {lanes} * z, acc[z]);
}}
"""
PROBE_LAYERS = {
    "avx2": dict(include="#include <immintrin.h>", vec="__m256", load="_mm256_loadu_ps", lanes=8,
                 set1="_mm256_set1_ps", fma="_mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * v_stride + 8 * z), acc[z])",
                 store="_mm256_storeu_ps"),
    "neon": dict(include="#include <arm_neon.h>", vec="float32x4_t", load="vld1q_f32", lanes=4, set1="vdupq_n_f32",
                 fma="vfmaq_f32(acc[z], pj, vld1q_f32(v + j * v_stride + 4 * z))", store="vst1q_f32"),
}


@pytest.mark.parametrize("layer", [pytest.param("avx2", marks=needs_x86_gcc),
                                   pytest.param("neon", marks=needs_aarch64_gcc)])
def test_the_check_flags_a_tile_kept_in_memory(layer, tmp_path):
    probe = tmp_path / f"runtime_count_{layer}.cpp"
    probe.write_text(PROBE.format(**PROBE_LAYERS[layer]))
    found = functions(str(probe), layer, tmp_path)  # an absolute path: compiled as it is
    counts = hot_loop_stack_stores(found["add_values(float*, float const*, float const*, long, int, int)"],
                                   AARCH64 if layer == "neon" else X86)
    assert counts and counts[1] > 1, counts
