"""The CPU tier table: for each op, tier and dtype, whether our kernel or torch's own op runs in production, and the
recorded bench line that justifies it. `pyscore.ops._ext` reads it; nothing else decides. A tier missing for an op
inherits the entry of the tier below it (amx -> avx512bf16 -> avx512 -> avx2 -> generic; neon -> generic).

"torch" means torch's op in the model's dtype: for `linear`, F.linear over fixed-size row chunks (batch-invariant,
see pyscore/ops/linear.py); for the other ops, the op's PyTorch implementation in pyscore.ops.reference.
"kernel" means pyscore._C at that tier: the AVX-512 code at avx512 / avx512bf16 / amx (at amx, bf16 `linear` where K
is a multiple of 32, bf16 prefix_item_attention where head_dim is a multiple of 64 and the bf16 label read-out's
product where H is a multiple of 32 run on AMX tiles; at avx512 the code that needs AVX-512 F/BW/DQ/VL alone: fp32,
bf16 pairs widened to fp32, and the elementwise and Qwen3.5 kernels whole, tests/ops/test_avx512_tier_isa.py), the
AVX2 + FMA code at avx2, the NEON layer at neon (attention and the label read-out; the portable C++, vectorized by
the compiler, for the rest) and the portable C++ at generic.
Unmeasured pairs say so."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIERS = ("generic", "avx2", "avx512", "avx512bf16", "amx", "neon")
BELOW = {"amx": "avx512bf16", "avx512bf16": "avx512", "avx512": "avx2", "avx2": "generic", "neon": "generic"}


@dataclass(frozen=True)
class Choice:
    path: str  # "kernel" | "torch"
    why: str  # the bench line behind it


KERNEL_ZEN4 = Choice("kernel", "ours beats torch (bench/results/kernels_cpu_zen4.txt, Zen 4)")
LINEAR_AMX = Choice("kernel", "AMX tiles, batch-invariant, the fastest batch-invariant GEMM here: 0.84-2.0x torch's "
                              "F.linear (not batch-invariant) at single prefill shapes (Qwen3-8B's 0.84-1.01x: "
                              "linear_amx_kblock_chunks_ab.txt), 1.19-1.27x over a forward's projections in order, "
                              "1.6-2.0x at decode, 1.7-3.5x torch's batch-invariant row calls "
                              "(bench/results/tiers/linear_amx.txt); 17-192 rows on the 1 x 4 tiles, 1.06-1.38x the "
                              "2 x 2 ones there (linear_amx_mid_rows.txt); at K <= 2048 all rows in one row block, "
                              "1.09-1.14x 256-row blocks at Qwen3-0.6B's projections (linear_amx_row_blocks.txt)")
LINEAR_FP32 = Choice("kernel", "AVX-512 FMAs in K blocks, batch-invariant; 0.98-1.07x torch's fp32 GEMM at prefill "
                               "(Qwen3-8B's K = 12288 down included: 0.45x before the K blocks), 1.4-1.9x at decode "
                               "(bench/results/tiers/linear_fp32_kblock_ab.txt)")
LINEAR_AVX2 = Choice("kernel", "AVX2 + FMA, batch-invariant; fp32 1.1-1.7x torch's batch-invariant (chunked) path "
                               "and 0.90-1.20x one unchunked MKL AVX2 F.linear, bf16 (widened to fp32) 2.8-5.1x "
                               "torch's AVX2 bf16 F.linear (bench/results/tiers/linear_avx2.txt); at 1-3 rows "
                               "(decode) 1.2-3.1x faster with wide strips: bf16 0.80-1.24x torch's AVX2 GEMV at one "
                               "row, fp32 2.6x (linear_avx2_wide_strips_ab.txt)")
LINEAR_FP32_AVX512 = Choice("kernel", "ours, AVX-512 FMAs in K blocks (0.95-1.04x one unchunked F.linear at prefill, "
                                      "1.00x over a forward's projections, 1.05-1.72x at decode, 1.4-1.5x torch's "
                                      "batch-invariant row calls) (bench/results/tiers/linear_avx512_fp32.txt)")
LINEAR_BF16_AVX512 = Choice("kernel", "ours, AVX-512 FMAs on bf16 pairs widened to fp32: 1.2-2.4x the AVX2 kernel at "
                                      "prefill, 2.2-3.6x torch's AVX-512 bf16 F.linear without bf16 hardware there "
                                      "and 2.0-3.1x at M = 4-16 (its batch-invariant row calls: 2.9-4.4x); at M = 1 "
                                      "1.1-1.5x, but 0.83-0.95x (the AVX2 kernel's 0.69-0.78x) for Qwen3-0.6B's o "
                                      "and down, N = 1024 (bench/results/tiers/linear_avx512_bf16_ab.txt); from 64 "
                                      "rows on through a weight panel widened once, 1.21-1.34x that on two threads "
                                      "(bench/results/tiers/linear_widen_panel.txt)")
LINEAR_TORCH = Choice("torch", "oneDNN/MKL GEMM beats a vector-FMA GEMM without bf16 hardware "
                               "(bench/results/tiers/linear_amx.txt)")
AVX2 = Choice("kernel", "ours (AVX2 + FMA) beats torch's AVX2 op (bench/results/kernels_cpu_avx2.txt, "
                        "kernels_cpu_avx2_bf16.txt, kernels_linear_cpu_avx2.txt)")
BF16_AVX512 = Choice("kernel", "ours, the AVX-512 ops on bf16 pairs widened to fp32: prefill attention 1.6-2.1x the "
                               "AVX2 ops (3.3-3.9x SDPA with a dense mask), the read-out 1.6-2.1x at R=16 (3.2-3.3x "
                               "torch) and 1.0-1.4x at R=1 (1.3-1.4x torch, where the AVX2 text was 1.0x), decode "
                               "attention 1.2-1.7x (15-17x one SDPA per sequence) "
                               "(bench/results/tiers/kernels_avx512_bf16_ab.txt)")
LABELS_AVX2 = Choice("kernel", "ours (AVX2 + FMA): at R=16 1.1-1.3x torch's AVX2 GEMM + log_softmax on 2 threads, "
                               "1.4-1.6x on one, bf16 (widened) 2.9-3.3x (bench/results/tiers/labels_avx2_ab.txt)")
LABELS_AVX512_FP32 = Choice("kernel", "ours, the AVX-512 read-out (fp32 code without BF16 instructions: "
                                      "tests/ops/test_avx512_tier_isa.py): 1.8-2.0x MKL's AVX-512 GEMM at R=16, "
                                      "where the AVX2 text was 1.0x (bench/results/tiers/kernels_labels_avx512.txt)")
ELEMENTWISE_AVX512 = Choice("kernel", "ours, the kernel text's AVX-512 unit (no BF16 instruction in it: "
                                      "tests/ops/test_avx512_tier_isa.py): 1.1-2.1x the AVX2 unit, 1.3-13x torch's "
                                      "AVX-512 ops, bf16 silu_mul 1.3-1.6x where the AVX2 unit was 0.9x "
                                      "(bench/results/tiers/elementwise_avx512_ab.txt)")
LINEAR_ATTENTION_AVX512 = Choice("kernel", "ours, gated_delta_rule_avx512.cpp (no BF16 instruction in it: "
                                           "tests/ops/test_avx512_tier_isa.py): conv + rule 0.9-1.5x the AVX2 file "
                                           "(11 of 12 pairs faster), 4.7-10x transformers' torch fallbacks "
                                           "(bench/results/tiers/gated_delta_rule_avx512_ab.txt)")
ATTENTION_AVX512_FP32 = Choice("kernel", "ours, the AVX-512 ops (fp32 code without BF16 instructions: "
                                         "tests/ops/test_avx512_tier_isa.py): prefill 1.6-1.8x the AVX2 ops and "
                                         "3.3-3.6x SDPA with a dense mask, decode 1.5-1.7x the AVX2 ops and 2.9-3.2x "
                                         "one SDPA per sequence (bench/results/tiers/attention_avx512_fp32_ab.txt)")
ATTENTION_AMX = Choice("kernel", "Q.K^T and P.V on AMX tiles: 2.4x our AVX-512 attend() on this Intel CPU, 4.0x "
                                 "SDPA with a dense mask (bench/results/tiers/kernels_attention_amx.txt vs "
                                 "kernels_attention_avx512bf16_intel.txt)")
LABELS_AMX = Choice("kernel", "the LM head product on AMX tiles: 2.7x our AVX-512 read-out at R=16 (0.9x at R=1, where "
                              "both stream the weight from memory; one path for every R keeps rows batch-invariant), "
                              "2.8x torch (bench/results/tiers/kernels_labels_amx.txt vs "
                              "kernels_labels_avx512bf16_intel.txt)")
NEON = Choice("kernel", "the AVX2 kernel's text on the NEON layer: no dense [T, T] mask / no vocabulary-wide logits; "
                        "checked under qemu, unmeasured on an ARM CPU")
ALGORITHM = Choice("kernel", "no dense [T, T] mask / no vocabulary-wide logits; unmeasured on this tier")
TORCH_UNTUNED = Choice("torch", "no vectorized kernel at this tier: the scalar portable loop loses to torch")

# Tiers at which fp32 serving holds a bf16 checkpoint's projections, embedding and LM head in bf16
# (pyscore.ops.linear.holds_bf16_weights): the kernels widen them exactly (the same bits as fp32 weights) and read
# half the bytes. AVX2: prefill widens each K block's panel (the read-out: each column of weight rows) once, decode
# steps read the pairs. AVX-512 (avx512, and fp32 asked for at avx512bf16 / amx, whose tiles are bf16 only): every
# row count widens in registers, the fp32 weight's speed at prefill and up to 2.8x it at one row.
_AVX512_BF16_WEIGHTS = ("decode steps read half the weight bytes at the same bits; prefill at the fp32 weight's speed "
                        "(bench/results/tiers/linear_avx512_bf16_weights.txt; measured on an AMD Zen 4, the avx512 "
                        "tier forced: unmeasured on an Intel CPU)")
BF16_WEIGHT_TIERS = {"avx2": "decode steps read half the weight bytes at the same bits "
                             "(bench/results/tiers/linear_avx2_bf16_weights_ab.txt, "
                             "labels_avx2_bf16_head_ab.txt)",
                     "avx512": _AVX512_BF16_WEIGHTS, "avx512bf16": _AVX512_BF16_WEIGHTS, "amx": _AVX512_BF16_WEIGHTS}

# op -> tier -> dtype name -> Choice ("*" = every dtype).
CPU_TIERS: dict[str, dict[str, dict[str, Choice]]] = {
    "linear": {"generic": {"*": LINEAR_TORCH}, "avx2": {"*": LINEAR_AVX2},
               "avx512": {"float32": LINEAR_FP32_AVX512, "bfloat16": LINEAR_BF16_AVX512},
               "avx512bf16": {"*": KERNEL_ZEN4},
               "amx": {"bfloat16": LINEAR_AMX, "float32": LINEAR_FP32}},
    "prefix_item_attention": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2},
                              "avx512": {"float32": ATTENTION_AVX512_FP32, "bfloat16": BF16_AVX512},
                              "avx512bf16": {"*": KERNEL_ZEN4}, "amx": {"bfloat16": ATTENTION_AMX},
                              "neon": {"*": NEON}},
    "decode_attention": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2},
                         "avx512": {"float32": ATTENTION_AVX512_FP32, "bfloat16": BF16_AVX512},
                         "avx512bf16": {"*": KERNEL_ZEN4}},
    "label_logprobs": {"generic": {"*": ALGORITHM}, "avx2": {"*": LABELS_AVX2},
                       "avx512": {"float32": LABELS_AVX512_FP32, "bfloat16": BF16_AVX512},
                       "avx512bf16": {"*": KERNEL_ZEN4}, "amx": {"bfloat16": LABELS_AMX}, "neon": {"*": NEON}},
    "add_rms_norm": {"generic": {"*": TORCH_UNTUNED}, "avx2": {"*": AVX2}, "avx512": {"*": ELEMENTWISE_AVX512},
                     "avx512bf16": {"*": KERNEL_ZEN4}, "neon": {"*": TORCH_UNTUNED}},
    "rotary": {"generic": {"*": TORCH_UNTUNED}, "avx2": {"*": AVX2}, "avx512": {"*": ELEMENTWISE_AVX512},
               "avx512bf16": {"*": KERNEL_ZEN4}, "neon": {"*": TORCH_UNTUNED}},
    "silu_mul": {"generic": {"*": TORCH_UNTUNED}, "avx2": {"*": AVX2}, "avx512": {"*": ELEMENTWISE_AVX512},
                 "avx512bf16": {"*": KERNEL_ZEN4}, "neon": {"*": TORCH_UNTUNED}},
    "causal_conv1d": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2}, "avx512": {"*": LINEAR_ATTENTION_AVX512},
                      "avx512bf16": {"*": KERNEL_ZEN4}},
    "gated_delta_rule": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2}, "avx512": {"*": LINEAR_ATTENTION_AVX512},
                         "avx512bf16": {"*": KERNEL_ZEN4}},
}


def cpu_choice(op: str, tier: str, dtype: torch.dtype) -> Choice:
    """The table's entry for (op, tier, dtype), inherited from the tiers below where the tier has none."""
    if tier not in TIERS:
        raise ValueError(f"unknown CPU tier {tier!r}; expected one of {', '.join(TIERS)}")
    name = str(dtype).removeprefix("torch.")
    entries = CPU_TIERS[op]
    at: str | None = tier
    while at is not None:
        entry = entries.get(at, {})
        if name in entry or "*" in entry:
            return entry.get(name, entry.get("*"))
        at = BELOW.get(at)
    raise KeyError(f"the tier table has no entry for {op} at {tier} or below")
