"""Tier `avx512` (AVX-512 F/BW/DQ/VL without BF16: Skylake-SP to Ice Lake) runs fp32 `linear`, the fp32 label
read-out and fp32 attention (prefill and decode) from the AVX-512 files, and add_rms_norm, rotary and silu_mul (the
avx512 units of their kernel texts) and Qwen3.5's causal conv1d and gated delta rule in both dtypes; all are
compiled with AVX512-BF16 and AMX enabled. The code it reaches must hold no instruction those CPUs lack, or they die
of SIGILL: this compiles those sources as the build does (without LTO, so that each function's code is its own),
disassembles them, and checks every function the fp32 entry points reach through calls, or every function of a
source that runs whole. No machine of that kind is at hand to run them; this is the check that stands for it."""

from __future__ import annotations

import re

import pytest

from tests.ops.machine_code import Instruction, functions, needs_x86_gcc

# file -> the fp32 entry points its launcher takes at tier avx512 (as objdump -C names them)
FP32_ENTRIES = {
    "csrc/linear/linear_avx512.cpp": [
        "void pyscore::(anonymous namespace)::rect<pyscore::(anonymous namespace)::F32>("],
    "csrc/label_logprobs/label_logprobs_avx512.cpp": [
        "void pyscore::(anonymous namespace)::logits_chunk<pyscore::(anonymous namespace)::F32>(",
        "pyscore::(anonymous namespace)::lse_update("],
    "csrc/prefix_item_attention/prefix_item_attention_avx512.cpp": [
        "pyscore::attention_ops_avx512(",
        "void pyscore::(anonymous namespace)::pack_k<pyscore::(anonymous namespace)::F32>(",
        "pyscore::pack_v_f32(",
        "void pyscore::(anonymous namespace)::attend<pyscore::(anonymous namespace)::F32>(",
        "void pyscore::(anonymous namespace)::store_row<pyscore::(anonymous namespace)::F32>("],
    "csrc/decode_attention/decode_attention_avx512.cpp": [
        "pyscore::decode_ops_avx512(",
        "void pyscore::(anonymous namespace)::attend_rows<pyscore::(anonymous namespace)::F32, 4>(",
        "void pyscore::(anonymous namespace)::attend_rows<pyscore::(anonymous namespace)::F32, 8>(",
        "void pyscore::(anonymous namespace)::store_row<pyscore::(anonymous namespace)::F32>("],
}
# sources (a kernel text: its avx512 unit) that run whole at tier avx512, every dtype (launchers: cpu_use_avx512())
WHOLE_SOURCES = ["csrc/add_rms_norm/rows_simd.h", "csrc/rotary/tokens_simd.h", "csrc/silu_mul/rows_simd.h",
                 "csrc/gated_delta_rule/gated_delta_rule_avx512.cpp"]
# AVX512-BF16 (vdpbf16ps, vcvtneps2bf16, vcvtne2ps2bf16) and AMX (tile*, tdp*, ldtilecfg, sttilecfg)
FORBIDDEN = re.compile(r"bf16|^tile|^tdp|tilecfg")
CALL_TARGET = re.compile(r"<(.+?)(\+0x[0-9a-f]+)?>$")

pytestmark = needs_x86_gcc


def reached(entries: list[str], found: dict[str, list[Instruction]]) -> set[str]:
    """The functions of this object the entries reach through direct calls (library calls are not followed)."""
    todo = [name for name in found if any(name.startswith(e) for e in entries)]
    assert len(todo) >= len(entries), f"entry points missing from the object: {entries}"
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for _, mnemonic, operands in found[name]:
            if mnemonic.startswith("call") and (m := CALL_TARGET.search(operands)) and m.group(1) in found:
                todo.append(m.group(1))
    return seen


@pytest.mark.parametrize("source", list(FP32_ENTRIES))
def test_fp32_code_of_the_avx512_files_needs_no_bf16_or_amx(source, tmp_path):
    found = functions(source, "avx512", tmp_path)
    code = reached(FP32_ENTRIES[source], found)
    bad = {name: sorted({i.mnemonic for i in found[name] if FORBIDDEN.search(i.mnemonic)}) for name in code}
    assert not any(bad.values()), {name[:120]: ops for name, ops in bad.items() if ops}
    # the check can fail: the same file's bf16 code does use those instructions
    assert any(FORBIDDEN.search(i.mnemonic) for name, body in found.items() if "F32" not in name for i in body)


@pytest.mark.parametrize("source", WHOLE_SOURCES)
def test_whole_avx512_sources_need_no_bf16_or_amx(source, tmp_path):
    found = functions(source, "avx512", tmp_path)
    assert any(name.startswith("pyscore::") and "_avx512(" in name for name in found), "the unit's entry point"
    bad = {name: sorted({i.mnemonic for i in body if FORBIDDEN.search(i.mnemonic)}) for name, body in found.items()}
    assert not any(bad.values()), {name[:120]: ops for name, ops in bad.items() if ops}
