"""Tier `avx512` (AVX-512 F/BW/DQ/VL without BF16: Skylake-SP to Ice Lake) runs `linear`, prefill attention, the
label read-out and decode attention from their kernel texts' avx512 units, in fp32 and in bf16 with pairs widened to
fp32 (Bf16Dot kWiden, which cpu_bf16_dot() answers below tier avx512bf16), and add_rms_norm,
rotary and silu_mul (the avx512 units of their kernel texts) and Qwen3.5's causal conv1d and gated delta rule in both
dtypes; all are compiled with AVX512-BF16 and AMX enabled. The code it reaches must hold no instruction those CPUs
lack, or they die of SIGILL: this compiles those sources as the build does (without LTO, so that each function's code
is its own), disassembles them, and checks every function the entry points that tier takes reach through calls, or
every function of a source that runs whole. No machine of that kind is at hand to run them; this is the check that
stands for it."""

from __future__ import annotations

import re

import pytest

from tests.ops.machine_code import Instruction, functions, needs_x86_gcc

NS = "pyscore::(anonymous namespace)::"
# file -> the entry points its launcher takes at tier avx512, fp32 and widened bf16 (as objdump -C names them)
TIER_AVX512_ENTRIES = {
    "csrc/linear/linear_simd.h": [  # its avx512 unit (Bf16Pairs' ops: tier avx512bf16 up)
        f"void {NS}rect<{NS}F32>(", f"{NS}rect_widen(", f"void {NS}rect<{NS}Bf16Weight>(",
        f"void {NS}epilogue<float>(", f"void {NS}epilogue<unsigned short>("],
    "csrc/label_logprobs/logits_simd.h": [  # on the avx512 layer; its Bf16Pairs ops (vdpbf16ps) are not reached
        f"void {NS}logits_chunk<{NS}F32Of<float> >(", f"void {NS}logits_chunk<{NS}F32Of<unsigned short> >(",
        f"void {NS}logits_chunk<{NS}Bf16>(", f"{NS}lse_update("],
    "csrc/prefix_item_attention/attention_simd.h": [  # its avx512 unit (Bf16Pairs' ops: tier avx512bf16 up)
        "pyscore::attention_ops_avx512(", f"void {NS}pack_k<{NS}F32>(", "pyscore::pack_v_f32(",
        f"void {NS}attend<{NS}F32>(", f"void {NS}store_row<float>(",
        f"void {NS}pack_k<{NS}Bf16>(", f"{NS}pack_v_bf16(", f"void {NS}attend<{NS}Bf16>(",
        f"void {NS}store_row<unsigned short>("],
    "csrc/decode_attention/decode_attention_simd.h": [  # its avx512 unit (Bf16Dpbf16's ops: tier avx512bf16 up)
        "pyscore::decode_ops_avx512(", f"void {NS}attend_rows<{NS}F32, 4>(", f"void {NS}attend_rows<{NS}F32, 8>(",
        f"void {NS}store_row<float>(", f"void {NS}attend_rows<{NS}Bf16Widen, 4>(",
        f"void {NS}attend_rows<{NS}Bf16Widen, 8>(", f"void {NS}store_row<unsigned short>("],
}
# sources (a kernel text: its avx512 unit) that run whole at tier avx512, every dtype (the avx512 layer serves it)
WHOLE_SOURCES = ["csrc/add_rms_norm/rows_simd.h", "csrc/rotary/tokens_simd.h", "csrc/silu_mul/rows_simd.h",
                 "csrc/gated_delta_rule/gated_delta_rule_simd.h"]
# AVX512-BF16 (vdpbf16ps, vcvtneps2bf16, vcvtne2ps2bf16), AVX512-VNNI (vpdpbusd, vpdpwssd) and AMX (tile*, tdp*,
# ldtilecfg, sttilecfg)
FORBIDDEN = re.compile(r"bf16|^tile|^tdp|tilecfg|^vpdp")
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


@pytest.mark.parametrize("source", list(TIER_AVX512_ENTRIES))
def test_code_tier_avx512_reaches_needs_no_bf16_or_amx(source, tmp_path):
    found = functions(source, "avx512", tmp_path)
    code = reached(TIER_AVX512_ENTRIES[source], found)
    bad = {name: sorted({i.mnemonic for i in found[name] if FORBIDDEN.search(i.mnemonic)}) for name in code}
    assert not any(bad.values()), {name[:120]: ops for name, ops in bad.items() if ops}
    # the check can fail: the same file's other code (vdpbf16ps, AMX tiles) does use those instructions
    assert any(FORBIDDEN.search(i.mnemonic) for name, body in found.items() if name not in code for i in body)


@pytest.mark.parametrize("source", WHOLE_SOURCES)
def test_whole_avx512_sources_need_no_bf16_or_amx(source, tmp_path):
    found = functions(source, "avx512", tmp_path)
    assert any(name.startswith("pyscore::") and "_avx512(" in name for name in found), "the unit's entry point"
    bad = {name: sorted({i.mnemonic for i in body if FORBIDDEN.search(i.mnemonic)}) for name, body in found.items()}
    assert not any(bad.values()), {name[:120]: ops for name, ops in bad.items() if ops}
