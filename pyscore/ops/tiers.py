"""The CPU tier table: for each op, tier and dtype, whether our kernel or torch's own op runs in production, and the
recorded bench line that justifies it. `pyscore.ops._ext` reads it; nothing else decides. A tier missing for an op
inherits the entry of the tier below it (amx -> avx512bf16 -> avx512 -> avx2 -> generic; neon -> generic), and its
reason says so. `pyscore.ops._ext` checks the table against the kernels the CPU module built (`uncovered_entries`).

"torch" means torch's op in the model's dtype: for `linear`, F.linear over fixed-size row chunks (batch-invariant,
see pyscore/ops/linear.py); for the other ops, the op's PyTorch implementation in pyscore.ops.reference.
"kernel" means pyscore._C at that tier: the AVX-512 code at avx512 / avx512bf16 / amx (at amx, bf16 `linear` where K
is a multiple of 32, bf16 prefix_item_attention where head_dim is a multiple of 64 and the bf16 label read-out's
product where H is a multiple of 32 run on AMX tiles; at avx512 the code that needs AVX-512 F/BW/DQ/VL alone: fp32,
bf16 pairs widened to fp32, and the elementwise and Qwen3.5 kernels whole, tests/ops/test_avx512_tier_isa.py), the
AVX2 + FMA code at avx2, the NEON layer at neon (attention, prefill and decode, and the label read-out; the portable
C++, vectorized by the compiler, for the rest) and the portable C++ at generic.
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


AVX512BF16 = Choice("kernel", "ours beats torch's op (bench/results/kernels_cpu_zen4.txt)")
LINEAR_AMX = Choice("kernel", "AMX tiles, batch-invariant: 0.84-2.0x torch's F.linear at prefill, 1.6-2.0x at decode "
                              "(bench/results/tiers/kernels/linear_amx.txt, linear_amx_kblock_chunks_ab.txt, "
                              "linear_amx_mid_rows.txt, linear_amx_row_blocks.txt)")
LINEAR_FP32 = Choice("kernel", "AVX-512 FMAs in K blocks, batch-invariant: 0.98-1.07x torch's fp32 GEMM at prefill "
                               "(bench/results/tiers/kernels/linear_fp32_kblock_ab.txt)")
LINEAR_AVX2 = Choice("kernel", "AVX2 + FMA, batch-invariant: fp32 1.1-1.7x torch's batch-invariant path, bf16 "
                               "2.8-5.1x its AVX2 bf16 F.linear (bench/results/tiers/kernels/linear_avx2.txt, "
                               "linear_avx2_wide_strips_ab.txt)")
LINEAR_FP32_AVX512 = Choice("kernel", "AVX-512 FMAs in K blocks: 0.95-1.04x one unchunked F.linear at prefill, "
                                      "1.05-1.72x at decode (bench/results/tiers/kernels/linear_avx512_fp32.txt)")
LINEAR_BF16_AVX512 = Choice("kernel", "AVX-512 FMAs on widened bf16 pairs: 2.2-3.6x torch's bf16 F.linear without "
                                      "bf16 hardware (bench/results/tiers/kernels/linear_avx512_bf16_ab.txt, "
                                      "linear_widen_panel.txt)")
LINEAR_TORCH = Choice("torch", "oneDNN/MKL GEMM beats a vector-FMA GEMM without bf16 hardware "
                               "(bench/results/tiers/kernels/linear_amx.txt)")
INT8_TORCH = Choice("torch", "no int8 layer at this tier: exact fp32 batched GEMMs per group and their fold, one "
                             "elementwise pass a group (pyscore/ops/linear_int8.py; a definition, slow)")
INT8_NEON = Choice("kernel", "the NEON layer's exact widening products, checked under qemu-aarch64 and unmeasured on "
                            "an ARM CPU: torch's path folds the groups one elementwise pass each")
INT8_AVX2 = Choice("kernel", "the AVX2 layer's exact vpmaddubsw quads: 0.98-1.28x our bf16 AVX2 linear at prefill, "
                             "0.81-1.17x at one row (forced on a Zen 4; torch's int8 path is the slow definition) "
                             "(bench/results/int8/linear_int8_groups_ab_zen4.txt)")
INT8_VNNI = Choice("kernel", "AVX512-VNNI quads: 1.32-1.64x our bf16 linear at prefill, 0.92-1.58x at one row "
                             "(bench/results/int8/linear_int8_groups_ab_zen4.txt)")
AVX2 = Choice("kernel", "ours (AVX2 + FMA) beats torch's AVX2 op (bench/results/kernels_cpu_avx2.txt, "
                        "kernels_cpu_avx2_bf16.txt, kernels_linear_cpu_avx2.txt)")
BF16_AVX512 = Choice("kernel", "the AVX-512 ops on widened bf16 pairs: 1.2-2.1x the AVX2 ops "
                               "(bench/results/tiers/kernels/kernels_avx512_bf16_ab.txt)")
LABELS_AVX2 = Choice("kernel", "ours (AVX2 + FMA): 1.1-1.3x torch's AVX2 GEMM + log_softmax at R=16 "
                               "(bench/results/tiers/kernels/labels_avx2_ab.txt)")
LABELS_AVX512_FP32 = Choice("kernel", "the AVX-512 read-out: 1.8-2.0x MKL's AVX-512 GEMM at R=16 "
                                      "(bench/results/tiers/kernels/kernels_labels_avx512.txt)")
ELEMENTWISE_AVX512 = Choice("kernel", "the kernel text's AVX-512 unit: 1.1-2.1x the AVX2 unit, 1.3-13x torch's ops "
                                      "(bench/results/tiers/kernels/elementwise_avx512_ab.txt)")
LINEAR_ATTENTION_AVX512 = Choice("kernel", "the AVX-512 linear-attention ops: 4.7-10x transformers' torch fallbacks "
                                           "(bench/results/tiers/kernels/gated_delta_rule_avx512_ab.txt)")
ATTENTION_AVX512_FP32 = Choice("kernel", "the AVX-512 ops: 1.5-1.8x the AVX2 ops, 2.9-3.6x SDPA "
                                         "(bench/results/tiers/kernels/attention_avx512_fp32_ab.txt)")
ATTENTION_AMX = Choice("kernel", "Q.K^T and P.V on AMX tiles: 2.4x our AVX-512 ops, 4.0x SDPA "
                                 "(bench/results/tiers/kernels/kernels_attention_amx.txt, "
                                 "kernels_attention_avx512bf16_intel.txt)")
LABELS_AMX = Choice("kernel", "the LM head product on AMX tiles: 2.7x our AVX-512 read-out at R=16, 2.8x torch "
                              "(bench/results/tiers/kernels/kernels_labels_amx.txt, "
                              "kernels_labels_avx512bf16_intel.txt)")
NEON = Choice("kernel", "the AVX2 text on the NEON layer: no dense mask, no vocabulary-wide logits; checked under "
                        "qemu, unmeasured on an ARM CPU")
ALGORITHM = Choice("kernel", "no dense [T, T] mask / no vocabulary-wide logits; unmeasured on this tier")
TORCH_UNTUNED = Choice("torch", "no vectorized kernel at this tier: the scalar portable loop loses to torch")

# Tiers at which fp32 serving holds a bf16 checkpoint's projections, embedding and LM head in bf16
# (pyscore.ops.linear.holds_bf16_weights): the kernels widen them exactly (the same bits as fp32 weights) and read
# half the bytes. AVX2: prefill widens each K block's panel (the read-out: each column of weight rows) once, decode
# steps read the pairs. AVX-512 (avx512, and fp32 asked for at avx512bf16 / amx, whose tiles are bf16 only): every
# row count widens in registers, the fp32 weight's speed at prefill and up to 2.8x it at one row.
_AVX512_BF16_WEIGHTS = ("decode steps read half the weight bytes at the same bits; prefill at the fp32 weight's speed "
                        "(bench/results/tiers/kernels/linear_avx512_bf16_weights.txt; measured on an AMD Zen 4, "
                        "the avx512 tier forced: unmeasured on an Intel CPU)")
BF16_WEIGHT_TIERS = {"avx2": "decode steps read half the weight bytes at the same bits "
                             "(bench/results/tiers/kernels/linear_avx2_bf16_weights_ab.txt, "
                             "labels_avx2_bf16_head_ab.txt)",
                     "avx512": _AVX512_BF16_WEIGHTS, "avx512bf16": _AVX512_BF16_WEIGHTS, "amx": _AVX512_BF16_WEIGHTS}

# op -> tier -> dtype name -> Choice ("*" = every dtype).
CPU_TIERS: dict[str, dict[str, dict[str, Choice]]] = {
    "linear": {"generic": {"*": LINEAR_TORCH}, "avx2": {"*": LINEAR_AVX2},
               "avx512": {"float32": LINEAR_FP32_AVX512, "bfloat16": LINEAR_BF16_AVX512},
               "avx512bf16": {"*": AVX512BF16},
               "amx": {"bfloat16": LINEAR_AMX, "float32": LINEAR_FP32}},
    "linear_int8": {"generic": {"*": INT8_TORCH}, "avx2": {"*": INT8_AVX2}, "avx512bf16": {"*": INT8_VNNI},
                    "neon": {"*": INT8_NEON}},
    "prefix_item_attention": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2},
                              "avx512": {"float32": ATTENTION_AVX512_FP32, "bfloat16": BF16_AVX512},
                              "avx512bf16": {"*": AVX512BF16}, "amx": {"bfloat16": ATTENTION_AMX},
                              "neon": {"*": NEON}},
    "decode_attention": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2},
                         "avx512": {"float32": ATTENTION_AVX512_FP32, "bfloat16": BF16_AVX512},
                         "avx512bf16": {"*": AVX512BF16}, "neon": {"*": NEON}},
    "label_logprobs": {"generic": {"*": ALGORITHM}, "avx2": {"*": LABELS_AVX2},
                       "avx512": {"float32": LABELS_AVX512_FP32, "bfloat16": BF16_AVX512},
                       "avx512bf16": {"*": AVX512BF16}, "amx": {"bfloat16": LABELS_AMX}, "neon": {"*": NEON}},
    "add_rms_norm": {"generic": {"*": TORCH_UNTUNED}, "avx2": {"*": AVX2}, "avx512": {"*": ELEMENTWISE_AVX512},
                     "avx512bf16": {"*": AVX512BF16}, "neon": {"*": TORCH_UNTUNED}},
    "rotary": {"generic": {"*": TORCH_UNTUNED}, "avx2": {"*": AVX2}, "avx512": {"*": ELEMENTWISE_AVX512},
               "avx512bf16": {"*": AVX512BF16}, "neon": {"*": TORCH_UNTUNED}},
    "silu_mul": {"generic": {"*": TORCH_UNTUNED}, "avx2": {"*": AVX2}, "avx512": {"*": ELEMENTWISE_AVX512},
                 "avx512bf16": {"*": AVX512BF16}, "neon": {"*": TORCH_UNTUNED}},
    "causal_conv1d": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2}, "avx512": {"*": LINEAR_ATTENTION_AVX512},
                      "avx512bf16": {"*": AVX512BF16}, "neon": {"*": NEON}},
    "gated_delta_rule": {"generic": {"*": ALGORITHM}, "avx2": {"*": AVX2}, "avx512": {"*": LINEAR_ATTENTION_AVX512},
                         "avx512bf16": {"*": AVX512BF16}, "neon": {"*": NEON}},
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
            choice = entry.get(name, entry.get("*"))
            return choice if at == tier else Choice(choice.path, f"inherited from {at}: {choice.why}")
        at = BELOW.get(at)
    raise KeyError(f"the tier table has no entry for {op} at {tier} or below")


def layer_runs(layer_tier: str, tier: str) -> bool:
    """Whether a kernel layer built for `layer_tier` runs at `tier` (csrc/common/dispatch.h's rule): at or above
    it on x86, neon at neon only."""
    if "neon" in (layer_tier, tier):
        return layer_tier == tier
    return TIERS.index(layer_tier) <= TIERS.index(tier)


# The vector layer each tier's own kernels are built on (cmake/kernel_table.cmake).
TIER_LAYER = {"avx2": "avx2", "avx512": "avx512", "avx512bf16": "avx512", "amx": "amx", "neon": "neon"}


def uncovered_entries(kernel_table: list[dict], tiers: tuple[str, ...]) -> list[str]:
    """The "kernel" entries at `tiers` (those of the architecture the CPU module was built for) that the built
    kernels do not back: the op has no kernel on the tier's own layer in `kernel_table` (pyscore._C.kernel_table()),
    or none of its layers that run at the tier covers the dtype ("*": float32 and bfloat16). Inherited entries are
    not checked at the tier that inherits them; the generic tier's kernels are the portable loops, always built."""
    missing = []
    for op, by_tier in CPU_TIERS.items():
        rows = [r for r in kernel_table if r["op"] == op]
        for tier, by_dtype in by_tier.items():
            if tier not in tiers or not any(c.path == "kernel" for c in by_dtype.values()):
                continue
            if not any(r["layer"] == TIER_LAYER[tier] for r in rows):
                missing.append(f"{op} at {tier}: no {TIER_LAYER[tier]} kernel built")
                continue
            for name, choice in by_dtype.items():
                for dtype in ("float32", "bfloat16") if name == "*" else (name,):
                    if choice.path == "kernel" and not any(layer_runs(r["tier"], tier) and dtype in r["dtypes"]
                                                           for r in rows):
                        missing.append(f"{op} at {tier} for {dtype}")
    return missing
