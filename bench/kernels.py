"""CPU kernel micro-benchmark: each of our ops against torch's way of doing the same, timed alternately in one run (the
figure is the median of the per-round medians, so a noisy minute hits both sides). Sections (`--only`): attention
(prefix_item_attention, one layer's run of a plan, on the MIS shape of a SmolLM2 question and its SIS twin, vs SDPA
with a dense mask), labels (label_logprobs vs log_softmax(h @ W.T).gather, on SmolLM2's LM head and on Qwen3.5's
248k-entry one at a decode step's 1-16 rows), gemm (prepacked linear vs F.linear at SmolLM2 / Qwen3-0.6B
projections; decode rows cycle ~96 MB of weight copies, as a decode step streams its weights from DRAM), decode
(decode_attention vs one SDPA per sequence), elementwise (the fused ops vs their pyscore.ops.reference recipes),
interleave (our OpenMP kernel between torch matmuls), linear (Qwen3.5's conv + gated delta rule vs transformers'
torch fallbacks, and a decode step's rule vs their recurrent one; own file) and tiers (linear at every CPU tier this
CPU runs vs F.linear, best of --rounds: what pyscore/ops/tiers.py cites; own file) and int8 (linear_int8 against
linear in bf16 at each tier whose int8 is ours, and torch's int8 path, at the tiers section's shapes; own file).

Both sides run on the heap the engine serves from (pyscore.memory.keep_activation_pages, named in the header): with
glibc's defaults every output over 32 MiB is a fresh mapping whose page faults the call pays (a conv over 16 x 300
tokens read 32-56 ms that way, 14-15 ms on the engine's heap: bench/results/tiers/probes/conv_heap_probe_zen4.txt).

`--tier T` forces our kernels' tier (PYSCORE_CPU_TIER) and torch's matching ISA; `--torch-isa T` torch's alone.
Torch reads its ISA settings only when it starts, so the bench re-executes itself with them set. The header names
the CPU (bench.common.machine) and both tiers.

`--json OUT` runs the H200 kit's cases instead (bench/gpu_check.sh; `--device cuda`, or `--tiny` on the CPU), the
study's shapes, median of --reps calls (CUDA events on the GPU), as JSON: prefix_item_attention vs SDPA with a dense
mask on MIS streams (query 300 + 2/5/9/16 items of ~32 tokens) with Qwen3-0.6B and Qwen3-8B heads, each against the
fp32 reference, and the items' MIS-vs-SIS difference; label_logprobs at R = 16, V = 151936, H = 1024 / 4096;
Qwen3.5-4B's conv + gated delta rule vs transformers' fallbacks on the same streams. Without --out the report goes
to bench/results/latest/ (kernels_cpu.txt; kernels_linear_cpu.txt, kernels_tiers_cpu.txt for those sections). Usage:
  python -m bench.kernels [--tier avx2] [--dtypes fp32] [--threads 2] [--rounds 5] [--out FILE] [--only SECTION ...]
  python -m bench.kernels --only tiers [--tiers avx2 avx512] [--torch-isa avx2] [--shapes ...] [--rounds 7]
  python -m bench.kernels --only int8 [--tiers avx2 avx512bf16] [--shapes ...] [--rounds 7] [--out FILE]
  python -m bench.kernels --json kernels.json [--device cuda | --tiny] [--reps 50]"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import TORCH_ISA_ENV, device_info, device_ms, force_isa, git_commit, machine, median_ms
from bench.common import alternate as alternate_rounds
from bench.summary import default_out, percentile, write_json, write_report
from pyscore.engine import set_threads
from pyscore.memory import keep_activation_pages
from pyscore.model.rope import Rotary
from pyscore.ops import (
    AttentionPlan,
    PlainLinear,
    SegmentTable,
    _ext,
    add_rms_norm,
    decode_attention,
    label_logprobs,
    linear,
    pack_linear,
    plan_decode,
    prefix_item_attention,
    rotary_,
    silu_mul,
    tiers,
)
from pyscore.ops.gated_delta_rule import causal_conv1d, gated_delta_rule, plan_linear_attention
from pyscore.ops.linear import DECODE_ROWS, PREFILL_ROWS, prepare_int8
from pyscore.ops.linear_int8 import GROUP, quantize_linear
from pyscore.ops.reference import (
    add_rms_norm_ref,
    causal_conv1d_ref,
    gated_delta_rule_ref,
    label_logprobs_ref,
    prefix_item_attention_ref,
    rotary_ref,
    segment_attention_mask,
    silu_mul_ref,
)

# the sections that run alone, into their own files (the others: kernels_cpu.txt)
OUT = {"linear": "kernels_linear_cpu.txt", "tiers": "kernels_tiers_cpu.txt", "int8": "kernels_int8_cpu.txt"}
LIN_SHAPE = (16, 16, 128, 4)  # Qwen3.5-0.8B Gated DeltaNet: Hk, Hv, head dim, conv kernel
HQ, HKV, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
VOCAB, HIDDEN = 49152, 576
QWEN35_VOCAB = 248320
# (name, K, N, gated): the decoder's projections (gate_up is [2I, K] with the SiLU-mul epilogue fused).
LINEAR_SHAPES = [
    ("SmolLM2 qkv", 576, 960, False), ("SmolLM2 o", 576, 576, False), ("SmolLM2 gate_up", 576, 3072, True),
    ("SmolLM2 down", 1536, 576, False), ("Qwen3-0.6B qkv", 1024, 4096, False), ("Qwen3-0.6B o", 2048, 1024, False),
    ("Qwen3-0.6B gate_up", 1024, 6144, True), ("Qwen3-0.6B down", 3072, 1024, False),
]
LINEAR_ROWS = [1, 4, 8, 16, 776]
WEIGHT_BYTES = 96e6  # > 3x this machine's L3: decode-shaped calls read their weights from DRAM
TIER_SHAPES = {"smollm-gate_up": (576, 3072), "smollm-down": (1536, 576), "qwen3-8b-qkv": (4096, 6144),
               "qwen3-8b-down": (12288, 4096)}
TIER_ROWS = {"prefill": (776, PREFILL_ROWS), "decode": (8, DECODE_ROWS)}
FORWARD_SHAPES = [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]  # SmolLM2's (K, N)
FORWARD_LAYERS = 30
SECTIONS = ["attention", "labels", "gemm", "decode", "elementwise", "interleave", "linear", "tiers", "int8"]
DEFAULT_SECTIONS = SECTIONS[:-3]  # linear, tiers and int8 run alone, into their own files
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def alternate(fns: dict[str, Callable[[], object]], reps: int, rounds: int,
              setup: dict[str, Callable[[], None]] | None = None) -> dict[str, float]:
    """Median over `rounds` alternating rounds of each function's median time (ms) over `reps` calls."""
    times = alternate_rounds(fns, rounds, lambda fn: median_ms(fn, reps), setup)
    return {name: statistics.median(ts) for name, ts in times.items()}


def section(header: list[str], dtypes: list[torch.dtype], rows_of: Callable[[torch.dtype], list[str]]) -> list[str]:
    """A section's lines: its header, then rows_of(dtype) per dtype, each printed as it comes."""
    lines = list(header)
    print("\n".join(header), flush=True)
    for dtype in dtypes:
        rows = rows_of(dtype)
        print("\n".join(rows), flush=True)
        lines += rows
    return lines


def dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vs_row(label: str, dtype: torch.dtype, times: dict[str, float]) -> str:
    """A row of ours against torch: the label, the dtype, both median ms and torch / ours."""
    ours, theirs = times["ours"], times["torch"]
    return f"{label:<26}{dt(dtype):<10}{ours:>9.3f}{theirs:>11.3f}{theirs / ours:>11.1f}x"


# ---- attention and label scores -------------------------------------------------------------------------------
def segment_rows(prefix: int, items: Sequence[int]) -> torch.Tensor:
    """A packed batch's segment table (pyscore/ops/segments.py, int32 [S, 4]): one group of a `prefix`-token prefix
    and items that each see it (MIS); with no prefix, independent causal sequences of the items' lengths (SIS)."""
    rows, start = ([[0, prefix, 0, 0]], prefix) if prefix else ([], 0)
    for n in items:
        rows.append([start, n, 0, prefix])
        start += n
    return torch.tensor(rows, dtype=torch.int32)


def fused_qkv(num_tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """q/k/v ([T, H, D]) as views into one seeded [T, (Hq + 2 Hkv) D] projection output, as the decoder has them."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g, device=device).to(dtype)
    return tuple(t.view(num_tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], 1))


def smollm_qkv(num_tokens: int, dtype: torch.dtype):
    return fused_qkv(num_tokens, HQ, HKV, HEAD_DIM, dtype, seed=num_tokens)


def planned(segments: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    """One layer's attention as the decoder runs it: the plan made once per batch (untimed), each call runs it."""
    plan = AttentionPlan(SegmentTable.of(segments, q.shape[0]), HQ, HKV, HEAD_DIM, q.dtype, "cpu", backend="kernel")
    return lambda: plan.run(q, k, v)


def heads_first(q, k, v):
    """[Hq, T, D] contiguous copies, kv heads repeated for GQA: torch SDPA's fastest layout (made untimed)."""
    group = q.shape[1] // k.shape[1]
    return tuple(x.transpose(0, 1).repeat_interleave(n, 0).contiguous() for x, n in ((q, 1), (k, group), (v, group)))


def bf16_paths(dtype: torch.dtype, default: str) -> list[str]:
    """The bf16 product paths to time, the CPU's default first ("fma" for fp32; "widen" alone on tiers without
    AVX512-BF16, whose kernels always widen)."""
    if dtype != torch.bfloat16:
        return ["fma"]
    if _ext.cpu_module().cpu_features()["tier"] not in ("avx512bf16", "amx"):
        return ["widen"]
    return [default, "widen" if default == "dpbf16" else "dpbf16"]


def path_setup(paths: list[str]) -> dict[str, Callable[[], None]]:
    """Per bf16 path, what selects it before its turn (PYSCORE_BF16_DOT)."""
    return {p: (lambda p=p: os.environ.__setitem__("PYSCORE_BF16_DOT", p)) for p in paths if p != "fma"}


def paths_row(label: str, dtype: torch.dtype, paths: list[str], times: dict[str, float], torch_ms: float,
              ref_ms: float) -> list[str]:
    return [f"{label:<26}{dt(dtype):<10}{p:<8}{times[p]:>9.3f}{torch_ms:>11.3f}{ref_ms:>11.3f}"
            f"{torch_ms / times[p]:>11.1f}x{ref_ms / times[p]:>10.1f}x" for p in paths]


def attention_rows(name: str, segments: torch.Tensor, dtype: torch.dtype, reps: int, rounds: int,
                   default: str) -> list[str]:
    num_tokens = int(segments[:, 1].sum())
    q, k, v = smollm_qkv(num_tokens, dtype)
    mask = segment_attention_mask(segments, num_tokens)
    qh, kh, vh = (x[None] for x in heads_first(q, k, v))  # [1, H, T, D]: 4-d takes torch's fused CPU kernel
    paths = bf16_paths(dtype, default)
    times = alternate(dict.fromkeys(paths, planned(segments, q, k, v)), reps, rounds, path_setup(paths))
    os.environ["PYSCORE_BF16_DOT"] = default
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask), max(3, reps // 10), 1)
    ref = median_ms(lambda: prefix_item_attention_ref(q, k, v, segments), 3, warmup=1)
    return paths_row("attention " + name, dtype, paths, times, sdpa, ref)


def sis_batched_rows(dtype: torch.dtype, reps: int, default: str) -> list[str]:
    """SIS against torch at its best: the 16 sequences as a pad-free batch [16, Hq, 300, D], is_causal."""
    segments = segment_rows(0, [300] * 16)
    q, k, v = smollm_qkv(int(segments[:, 1].sum()), dtype)
    qb, kb, vb = (x.view(HQ, 16, 300, HEAD_DIM).transpose(0, 1).contiguous() for x in heads_first(q, k, v))
    times = alternate({"ours": planned(segments, q, k, v),
                       "torch": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)}, reps, 2)
    return [f"{'  (torch batched causal)':<26}{dt(dtype):<10}{bf16_paths(dtype, default)[0]:<8}{times['ours']:>9.3f}"
            f"{times['torch']:>11.3f}{'':>11}{times['torch'] / times['ours']:>11.1f}x"]


def label_rows(rows: int, dtype: torch.dtype, reps: int, rounds: int, default: str, vocab: int = VOCAB,
               hidden: int = HIDDEN, name: str = "label_logprobs") -> list[str]:
    h = torch.randn(rows, hidden).to(dtype)
    w = (torch.randn(vocab, hidden) * hidden**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (rows, 2), dtype=torch.int32)
    paths = bf16_paths(dtype, default)
    fns: dict[str, Callable[[], object]] = {p: (lambda: label_logprobs(h, w, labels, backend="kernel")) for p in paths}
    fns["torch"] = lambda: torch.log_softmax((h @ w.T).float(), -1).gather(1, labels.long())
    times = alternate(fns, reps, rounds, path_setup(paths))
    os.environ["PYSCORE_BF16_DOT"] = default
    ref = median_ms(lambda: label_logprobs_ref(h, w, labels), 3, warmup=1)
    return paths_row(f"{name} R={rows}", dtype, paths, times, times["torch"], ref)


def attention_section(reps: int, rounds: int, default: str, dtypes: list[torch.dtype]) -> list[str]:
    header = ["times: median ms; 'torch' = SDPA with a dense [T, T] bool mask (attention) or "
              "log_softmax((h @ W.T).float()).gather (labels); path = the bf16 product", "",
              f"{'op / shape':<26}{'dtype':<10}{'path':<8}{'ours':>9}{'torch':>11}{'reference':>11}{'torch/ours':>12}"
              f"{'ref/ours':>11}"]
    return section(header, dtypes, lambda dtype: [
        *attention_rows("MIS 270+16x30", segment_rows(270, [30] * 16), dtype, reps, rounds, default),
        *attention_rows("SIS 16x300", segment_rows(0, [300] * 16), dtype, max(3, reps // 3), 2, default),
        *sis_batched_rows(dtype, max(3, reps // 3), default)])


def label_section(reps: int, rounds: int, default: str, dtypes: list[torch.dtype]) -> list[str]:
    big = dict(vocab=QWEN35_VOCAB, hidden=1024, name="labels V=248k")  # Qwen3.5's LM head, from DRAM
    return section([], dtypes, lambda dtype: label_rows(16, dtype, reps, rounds, default)
                   + label_rows(1, dtype, reps, rounds, default)
                   + [row for r in (1, 8, 16) for row in label_rows(r, dtype, reps, rounds, default, **big)])


# ---- gemm (the linear op) -----------------------------------------------------------------------------------
def linear_row(name: str, x: torch.Tensor, weights: list[torch.Tensor], packed: list, gated: bool,
               rounds: int) -> str:
    """ours (prepacked, gated = fused SiLU-mul) vs F.linear (gated: + silu(gate) * up in torch) at one M;
    decode-sized M cycles through all weight copies."""
    (m, k), n = x.shape, weights[0].shape[0]
    cycle = len(weights) if m <= 16 else 1  # prefill is compute bound: one weight, as one layer's call
    turn = [0]

    def ours():
        turn[0] = (turn[0] + 1) % cycle
        return linear(x, packed[turn[0]])

    def torch_linear():
        turn[0] = (turn[0] + 1) % cycle
        y = F.linear(x, weights[turn[0]])
        return F.silu(y[:, : n // 2]) * y[:, n // 2 :] if gated else y

    times = alternate({"ours": ours, "torch": torch_linear}, 30 if m <= 16 else 5, rounds)
    flop, o, t = 2 * m * n * k, times["ours"], times["torch"]
    return (f"{name:<20}{m:>5}{k:>6}{n:>6}{o:>10.3f}{flop / o / 1e9:>8.3f}{t:>10.3f}{flop / t / 1e9:>8.3f}"
            f"{t / o:>8.2f}x")


def gemm_section(rounds: int) -> list[str]:
    lines = ["linear (bf16, prepacked) vs F.linear; gate_up: ours fuses silu(gate) * up, torch runs it after; "
             "decode rows (M <= 16) cycle ~96 MB of weights; TF/s = 2 M N K / time",
             f"{'shape':<20}{'M':>5}{'K':>6}{'N':>6}{'ours ms':>10}{'TF/s':>8}{'torch ms':>10}{'TF/s':>8}"
             f"{'t/ours':>9}"]
    print("\n".join(lines), flush=True)
    for name, k, n, gated in LINEAR_SHAPES:
        weights = [(torch.randn(n, k) * k**-0.5).bfloat16() for _ in range(max(1, int(WEIGHT_BYTES // (n * k * 2))))]
        packed = [pack_linear(w, gated=gated) for w in weights]
        for m in LINEAR_ROWS:
            lines.append(linear_row(name, torch.randn(m, k).bfloat16(), weights, packed, gated, rounds))
            print(lines[-1], flush=True)
    return lines


# ---- linear per CPU tier ---------------------------------------------------------------------------------------
def ours_tiers(dtype: torch.dtype, asked: list[str] | None) -> list[str]:
    """The runnable tiers to time ours at: those asked for, else those whose linear is ours, and avx2 (elsewhere
    it is the portable loop, which the table never picks)."""
    runnable = _ext.runnable_cpu_tiers()
    if asked:
        return [t for t in runnable if t in asked]
    return [t for t in runnable if t == "avx2" or tiers.cpu_choice("linear", t, dtype).path == "kernel"]


def at_tier(tier: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with our kernels forced to `tier` (PYSCORE_CPU_TIER, read at each call)."""
    def run() -> object:
        os.environ["PYSCORE_CPU_TIER"] = tier
        return fn()
    return run


def timed_tier_rows(dtype: torch.dtype, name: str, phase: str, runs: dict[str, Callable], rounds: int,
                    flop: float) -> list[str]:
    """Best of `rounds` alternating rounds of each run, a table row each, against torch's F.linear."""
    times = {key: min(ts) for key, ts in alternate_rounds(runs, rounds).items()}
    os.environ.pop("PYSCORE_CPU_TIER", None)
    rows = [f"{dt(dtype):9} {name:16} {phase:8} {key:29} {ms:7.3f} {flop / ms / 1e6:8.0f}  "
            f"{times['torch F.linear'] / ms:5.2f}x" for key, ms in times.items()]
    print("\n".join(rows), flush=True)
    return rows


def tier_contenders(x: torch.Tensor, w: torch.Tensor, rows: int, ours_at: list[str]) -> dict[str, Callable]:
    packed, plain = pack_linear(w), PlainLinear(w, None)

    def ours(tier: str) -> Callable[[], object]:
        return at_tier(tier, lambda: linear(x, packed, backend="kernel"))

    torch_path = at_tier("generic", lambda: linear(x, plain, rows_per_call=rows))  # generic: linear is torch's

    # the top tier of ours after the torch path: neither it nor F.linear then runs straight after a long run at a
    # lower tier (on the AMX Xeon, ours@amx at 1.2 ms read 1.9 ms right after the 12 ms AVX-512 run).
    runs = {f"ours@{t}": ours(t) for t in ours_at[:-1]}
    runs[f"torch path ({rows}-row calls)"] = torch_path
    runs.update({f"ours@{t}": ours(t) for t in ours_at[-1:]})
    runs["torch F.linear"] = lambda: F.linear(x, w)
    return runs


def tiers_section(args: argparse.Namespace, dtypes: list[torch.dtype]) -> list[str]:
    lines = [f"linear per tier: best of {args.rounds} alternating rounds; ours at each tier by PYSCORE_CPU_TIER",
             "dtype     shape            pass     path                          ms      GFLOP/s  vs torch F.linear"]
    for dtype in dtypes:
        for name in args.shapes:
            k, n = TIER_SHAPES[name]
            for phase, (m, rows) in TIER_ROWS.items():
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(m, k, generator=gen).to(dtype)
                w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
                runs = tier_contenders(x, w, rows, ours_tiers(dtype, args.tiers))
                lines += timed_tier_rows(dtype, name, phase, runs, args.rounds, 2 * m * k * n)
        if not args.no_forward:
            lines += forward_rows(dtype, args)
    return [*lines, f"command: python -m bench.kernels {' '.join(sys.argv[1:])}",
            f"smollm-forward: {FORWARD_LAYERS} layers' qkv, o, gate_up (ours: + the fused SiLU-mul) and down at "
            "M=776 with distinct weights, in a forward's order, so each weight comes from memory as in the engine"]


def forward_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[str]:
    """A prefill forward's projections: FORWARD_LAYERS layers of SmolLM2's four, distinct weights (more than the
    L3 holds), ours at each tier against F.linear, alternating."""
    gen = torch.Generator().manual_seed(1)
    layers = [[((torch.randn(n, k, generator=gen) * k**-0.5).to(dtype), gated) for k, n, gated in FORWARD_SHAPES]
              for _ in range(FORWARD_LAYERS)]
    xs = {k: torch.randn(TIER_ROWS["prefill"][0], k, generator=gen).to(dtype) for k, _, _ in FORWARD_SHAPES}
    packed = [[pack_linear(w, gated=gated) for w, gated in layer] for layer in layers]

    def ours() -> None:
        for layer in packed:
            for (k, _, _), p in zip(FORWARD_SHAPES, layer, strict=True):
                linear(xs[k], p, backend="kernel")

    def torch_linear() -> None:
        for layer in layers:
            for (k, _, _), (w, _) in zip(FORWARD_SHAPES, layer, strict=True):
                F.linear(xs[k], w)

    runs = {f"ours@{t}": at_tier(t, ours) for t in ours_tiers(dtype, args.tiers)}
    runs["torch F.linear"] = torch_linear
    flop = 2 * TIER_ROWS["prefill"][0] * FORWARD_LAYERS * sum(k * n for k, n, _ in FORWARD_SHAPES)
    return timed_tier_rows(dtype, "smollm-forward", "prefill", runs, args.rounds, flop)


# ---- linear in int8 (W8A8) ---------------------------------------------------------------------------------------
def int8_tiers(asked: list[str] | None) -> list[str]:
    """The runnable tiers whose linear_int8 is our kernel (or those asked for among the runnable)."""
    runnable = _ext.runnable_cpu_tiers()
    if asked:
        return [t for t in runnable if t in asked]
    return [t for t in runnable if tiers.cpu_choice("linear_int8", t, torch.bfloat16).path == "kernel"]


def int8_contenders(x: torch.Tensor, w: torch.Tensor, at: list[str]) -> dict[str, Callable]:
    """At each tier: our int8 kernel and our bf16 kernel on the same x (bf16) and W; then F.linear in bf16. (torch's
    int8 path, linear_int8_path's fallback, folds the groups one elementwise pass each: a definition, not a
    contender.)"""
    packed, bf16 = prepare_int8(quantize_linear(w), backend="kernel"), pack_linear(w)
    runs: dict[str, Callable] = {}
    for t in at:
        runs[f"int8 ours@{t}"] = at_tier(t, lambda: linear(x, packed))
        runs[f"bf16 ours@{t}"] = at_tier(t, lambda: linear(x, bf16, backend="kernel"))
    runs["bf16 torch F.linear"] = lambda: F.linear(x, w)
    return runs


def int8_section(args: argparse.Namespace) -> list[str]:
    """linear_int8 against linear in bf16, per tier, at the tiers section's shapes: best of --rounds alternating."""
    at = int8_tiers(args.tiers)
    lines = [f"linear_int8 (bf16 activations, scales per {GROUP} channels, the activations' quantized in the call) "
             f"vs linear bf16, ours at tiers {', '.join(at)} (PYSCORE_CPU_TIER); best of {args.rounds} alternating "
             "rounds; GOP/s = 2 M N K / time; decode rows read a weight the L3 may hold",
             f"{'shape':<16} {'M':>4} {'path':<32} {'ms':>8} {'GOP/s':>7}  vs bf16 ours at the tier"]
    print("\n".join(lines), flush=True)
    for name in args.shapes:
        k, n = TIER_SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
        for m in (TIER_ROWS["prefill"][0], 1, TIER_ROWS["decode"][0]):
            x = torch.randn(m, k, generator=gen).bfloat16()
            times = {key: min(ts) for key, ts in alternate_rounds(int8_contenders(x, w, at), args.rounds).items()}
            os.environ.pop("PYSCORE_CPU_TIER", None)
            for key, ms in times.items():
                tier = key.partition("@")[2]
                versus = f"{times[f'bf16 ours@{tier}'] / ms:5.2f}x" if tier and key.startswith("int8") else ""
                lines.append(f"{name:<16} {m:>4} {key:<32} {ms:8.3f} {2 * m * k * n / ms / 1e6:7.0f}  {versus}")
                print(lines[-1], flush=True)
    return [*lines, f"command: python -m bench.kernels {' '.join(sys.argv[1:])}"]


# ---- Qwen3.5's linear attention ----------------------------------------------------------------------------------
def linear_inputs(num_tokens: int, dtype: torch.dtype, heads: tuple[int, int, int, int] = LIN_SHAPE,
                  device: str = "cpu"):
    """(x [T, C] conv input, conv weight [C, K], the rule's inputs as views into one projection output) for a
    Gated DeltaNet layer of (Hk, Hv, D, K)."""
    hk, hv, d, taps = heads
    channels = 2 * hk * d + hv * d
    g = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, channels, generator=g, device=device).to(dtype)
    weight = (torch.randn(channels, taps, generator=g, device=device) * 0.5).to(dtype)
    y = torch.randn(num_tokens, channels + 2 * hv, generator=g, device=device).to(dtype)
    q, k, v = (t.view(num_tokens, -1, d) for t in y[:, :channels].split([hk * d, hk * d, hv * d], 1))
    a, b = y[:, channels:].split(hv, 1)
    a_log, dt_bias = torch.randn(2, hv, generator=g, device=device).unbind(0)
    return x, weight, (q, k, v, a, b, a_log * 0.5, dt_bias)


def transformers_linear(x, weight, rule_args, prefix: int, items: int, item_len: int):
    """The same work on transformers' Qwen3.5 torch fallbacks: MIS as the prefix (final state and conv tail kept),
    then the items batched [n, L] continuing from it; SIS (prefix 0) as a batch of n sequences. Returns the items'
    rule outputs [n L, Hv, Dv]."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

    q, k, v, a, b, a_log, dt_bias = rule_args
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()

    def rule(sl, batch, length, state=None):
        parts = [t[sl].reshape(batch, length, *t.shape[1:]) for t in (q, k, v, g, beta)]
        return torch_chunk_gated_delta_rule(*parts, initial_state=state, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)

    def conv(sl, batch, length, tail=None):
        xs = x[sl].reshape(batch, length, -1).transpose(1, 2)
        if tail is not None:
            xs = torch.cat([tail.expand(batch, -1, -1), xs], dim=-1)
        return causal_conv1d_fn(xs, weight, None, activation="silu")[..., -length:]

    if not prefix:
        conv(slice(None), items, item_len)
        return rule(slice(None), items, item_len)[0].flatten(0, 1)
    conv(slice(0, prefix), 1, prefix)
    _, state = rule(slice(0, prefix), 1, prefix)
    conv(slice(prefix, None), items, item_len, x[prefix - weight.shape[1] + 1 : prefix].T[None])
    return rule(slice(prefix, None), items, item_len, state.expand(items, -1, -1, -1).contiguous())[0].flatten(0, 1)


def linear_attention_pair(prefix: int, items: int, item_len: int, dtype: torch.dtype,
                          heads: tuple[int, int, int, int] = LIN_SHAPE, device: str = "cpu"):
    """One Gated DeltaNet layer (conv + rule) over a MIS stream (`prefix`, then `items` items of `item_len`) or,
    with no prefix, SIS: (ours, transformers', our reference, the items' max |ours - transformers' in fp32|, the
    largest |value| of the latter). Ours is planned once per batch; the kit's `linear_case` times the same pair."""
    segments = segment_rows(prefix, [item_len] * items)
    num_tokens = prefix + items * item_len
    x, weight, rule_args = linear_inputs(num_tokens, dtype, heads, device)
    table = SegmentTable.of(segments, num_tokens, device)
    plan = plan_linear_attention(table)

    def ours():
        causal_conv1d(x, weight, table, plan, backend="kernel")
        return gated_delta_rule(*rule_args, table, plan, backend="kernel")

    def reference():
        causal_conv1d_ref(x, weight, segments)
        gated_delta_rule_ref(*rule_args, segments)

    want = transformers_linear(x.float(), weight.float(), [t.float() for t in rule_args], prefix, items, item_len)
    diff = float((ours()[prefix:].float() - want).abs().max())
    return (ours, lambda: transformers_linear(x, weight, rule_args, prefix, items, item_len), reference, diff,
            float(want.abs().max()))


def linear_attention_rows(name: str, prefix: int, items: int, item_len: int, dtype: torch.dtype,
                          reps: int, rounds: int = 3) -> list[str]:
    ours, theirs, reference, diff, _ = linear_attention_pair(prefix, items, item_len, dtype)
    calls = {ours: (reps, 3), theirs: (max(3, reps // 5), 1)}  # (timed, untimed) calls a round: theirs are slow
    times = alternate_rounds({"ours": ours, "transformers": theirs}, rounds, lambda fn: median_ms(fn, *calls[fn]))
    mine, slow = (statistics.median(times[side]) for side in ("ours", "transformers"))
    ref = median_ms(reference, 1, warmup=0)  # the oracle, a Python loop: once, to show the kernel's distance
    return [f"{'conv+rule ' + name:<26}{dt(dtype):<10}{mine:>9.3f}{slow:>13.3f}{ref:>11.1f}{slow / mine:>11.1f}x"
            f"{ref / mine:>10.0f}x{diff:>11.1e}"]


def rule_decode_pair(batch: int, dtype: torch.dtype, layers: int = 18
                     ) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(ours, transformers'): one decode step's gated delta rule for `batch` sequences (a token each; fp32 states read
    from one buffer and written to another, the decoder's double buffering), each call on the next of `layers`
    layers' states, so that they come from memory as a step's do; transformers' = its recurrent fallback (its decode
    path) on the same. Each returns the rule's output [B, Hv, Dv]."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    _, hv, d, _ = LIN_SHAPE
    _, _, (q, k, v, a, b, a_log, dt_bias) = linear_inputs(batch, dtype)
    table = SegmentTable.of(segment_rows(0, [1] * batch), batch, "cpu")
    plan = plan_linear_attention(table)
    states = torch.randn(layers, 2, batch, hv, d, d) * 0.1
    turn = itertools.count()

    def ours():
        i = next(turn) % layers
        return gated_delta_rule(q, k, v, a, b, a_log, dt_bias, table, plan, state_in=list(states[i, 0]),
                                state_out=list(states[i, 1]), backend="kernel")

    g = (-a_log.exp() * F.softplus(a.float() + dt_bias))[:, None]  # [B, 1, Hv]
    parts = [t[:, None] for t in (q, k, v)]

    def theirs():
        i = next(turn) % layers
        return torch_recurrent_gated_delta_rule(*parts, g, b.sigmoid()[:, None], initial_state=states[i, 0],
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)[0][:, 0]

    return ours, theirs


def rule_decode_row(batch: int, dtype: torch.dtype, reps: int, rounds: int = 3) -> list[str]:
    ours, theirs = rule_decode_pair(batch, dtype)
    times = alternate({"ours": ours, "transformers": theirs}, reps, rounds)
    mine, slow = times["ours"], times["transformers"]
    return [f"{f'rule decode {batch} seqs':<26}{dt(dtype):<10}{mine:>9.3f}{slow:>13.3f}{'':>11}{slow / mine:>11.1f}x"]


def linear_attention_section(reps: int, rounds: int, dtypes: list[torch.dtype]) -> list[str]:
    header = [
        "Qwen3.5-0.8B linear-attention layer: Hk {}, Hv {}, Dk = Dv = {}, conv kernel {}; ".format(*LIN_SHAPE) +
        "ours = causal_conv1d + gated_delta_rule (segment table)",
        "'transformers' = causal_conv1d_fn + torch_chunk_gated_delta_rule (their torch fallbacks; MIS: the prefix, "
        "then the items batched from its final state and conv tail), alternated with ours; times: median ms; max "
        "diff: the items' rule outputs, ours vs transformers' in fp32 on the same inputs; 'rule decode': one token "
        "per sequence from and to fp32 states (18 layers' cycled), transformers' = torch_recurrent_gated_delta_rule, "
        "alternated", "",
        f"{'op / shape':<26}{'dtype':<10}{'ours':>9}{'transformers':>13}{'reference':>11}{'tf/ours':>12}"
        f"{'ref/ours':>11}{'max diff':>11}",
    ]
    return section(header, dtypes, lambda dtype: [
        *linear_attention_rows("MIS 270+16x30", 270, 16, 30, dtype, reps, rounds),
        *linear_attention_rows("SIS 16x300", 0, 16, 300, dtype, reps, rounds),
        *(row for batch in (1, 8) for row in rule_decode_row(batch, dtype, reps, rounds))])


# ---- decode attention, elementwise ops, thread pools ---------------------------------------------------------------
def decode_row(reps: int, rounds: int, dtype: torch.dtype) -> list[str]:
    lengths = [200, 350, 500, 650, 800, 900, 1000, 1100]
    layers, layer = 30, 17
    # Every sequence's pages in one pool [pages, 2, L, 64, Hkv, D], as the engine's KV store holds them.
    counts = [-(-(n + 16) // 64) for n in lengths]
    pool = torch.randn(sum(counts), 2, layers, 64, HKV, HEAD_DIM).to(dtype)
    firsts = [sum(counts[:b]) for b in range(len(lengths))]
    tables = [list(range(f, f + c)) for f, c in zip(firsts, counts, strict=True)]
    caches = [pool[f : f + c].transpose(0, 2).reshape(layers, 2, -1, HKV, HEAD_DIM)
              for f, c in zip(firsts, counts, strict=True)]  # [L, 2, tokens, Hkv, D] per sequence
    q = torch.randn(len(lengths), HQ, HEAD_DIM).to(dtype)
    plan = plan_decode(pool[:, 0], pool[:, 1], tables, lengths)

    def per_sequence_sdpa():  # the decoder's decode attention before decode_attention: one SDPA per sequence
        return torch.stack([F.scaled_dot_product_attention(
            q[b].unsqueeze(1)[None], *(caches[b][layer, kv, :n].transpose(0, 1)[None] for kv in (0, 1)),
            enable_gqa=True)[0, :, 0] for b, n in enumerate(lengths)])

    times = alternate({"ours": lambda: decode_attention(q, plan, layer, backend="kernel"),
                       "torch": per_sequence_sdpa}, reps, rounds)
    return [vs_row("decode_attention 8 seqs", dtype, times) + "   (200..1100 cached tokens, 9/3 heads, d 64; torch = "
            "one SDPA per sequence)"]


def elementwise_rows(dtype: torch.dtype, reps: int, rounds: int) -> list[str]:
    """Each op on the MIS prefill shape (776 tokens of SmolLM2) against its torch recipe, alternately."""
    tokens, inter = 776, 1536
    x, delta = torch.randn(tokens, HIDDEN).to(dtype), (torch.randn(tokens, HIDDEN) * 1e-3).to(dtype)
    weight = (torch.randn(HIDDEN) * 0.1 + 1).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter).to(dtype)
    qkv = torch.randn(tokens, HQ + 2 * HKV, HEAD_DIM).to(dtype)
    q, k = qkv[:, :HQ], qkv[:, HQ : HQ + HKV]
    positions = torch.arange(tokens)
    rope = Rotary(1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)), 1.0, 4096,
                  torch.device("cpu"))
    ops = {  # name: (ours, torch); the residual adds and rotations repeat in place, as every layer does
        "add_rms_norm 776x576": (lambda: add_rms_norm(x, weight, 1e-5, delta=delta, backend="kernel"),
                                 lambda: add_rms_norm_ref(x, weight, 1e-5, delta=delta)),
        "silu_mul 776x1536": (lambda: silu_mul(gate_up, backend="kernel"), lambda: silu_mul_ref(gate_up)),
        "rotary 776x(9+3)x64": (lambda: rotary_(q, k, positions, rope.cos, rope.sin, backend="kernel"),
                                lambda: rotary_ref(q, k, positions, rope.cos, rope.sin)),
    }
    return [vs_row(name, dtype, alternate({"ours": ours, "torch": theirs}, reps, rounds))
            for name, (ours, theirs) in ops.items()]


def interleave_rows(reps: int) -> list[str]:
    """Our OpenMP kernel between torch matmuls, as in the decoder (qkv projection -> attention -> o projection):
    if the two thread pools fought (spin-waiting on 2 cores), the interleaved step would cost more than the sum
    of its parts measured alone."""
    segments = segment_rows(270, [30] * 16)
    num_tokens = int(segments[:, 1].sum())
    x = torch.randn(num_tokens, 576).bfloat16()
    w_qkv = torch.randn((HQ + 2 * HKV) * HEAD_DIM, 576).bfloat16()
    w_o = torch.randn(576, HQ * HEAD_DIM).bfloat16()
    kernel = planned(segments, *smollm_qkv(num_tokens, torch.bfloat16))

    def step():
        qkv = x @ w_qkv.T
        return kernel().view(num_tokens, -1) @ w_o.T + qkv[:, :576]

    alone = median_ms(lambda: (x @ w_qkv.T)[:, : HQ * HEAD_DIM] @ w_o.T, reps) + median_ms(kernel, reps)
    both = median_ms(step, reps)
    return ["thread pools: torch matmuls and our kernel alternating (one decoder layer's pattern, MIS shape)",
            f"{'matmul+attention step':<26}{'bfloat16':<10}{'sum of parts alone':>20}{alone:>9.3f}"
            f"{'interleaved':>13}{both:>9.3f}{both / alone:>9.2f}x"]


# ---- the H200 kit's cases (--json) --------------------------------------------------------------------------------
KIT_HEADS = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128), "tiny": (4, 2, 64)}
KIT_HIDDEN = {"qwen3-0.6b": 1024, "qwen3-8b": 4096, "tiny": 128}
KIT_LINEAR = {"qwen3.5-4b": (16, 32, 128, 4), "tiny": (2, 4, 32, 4)}  # Hk, Hv, head dim, conv kernel


def p50_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    return percentile(device_ms(fn, device, reps), 50)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_case(model: str, query: int, items: list[int], dtype: torch.dtype, device: str, reps: int,
                   ref_check: bool) -> dict[str, Any]:
    """One layer's run of a plan (made once, as a forward pass does) vs SDPA at its best (heads first, kv heads
    repeated, made untimed) with the stream's dense mask; with `ref_check`, both against the fp32 reference."""
    hq, hkv, d = KIT_HEADS[model]
    segments = segment_rows(query, items)
    t = int(segments[:, 1].sum())
    q, k, v = fused_qkv(t, hq, hkv, d, dtype, device, seed=t)
    mask = segment_attention_mask(segments, t).to(device)
    qh, kh, vh = (x[None] for x in heads_first(q, k, v))
    plan = AttentionPlan(SegmentTable.of(segments, t, device), hq, hkv, d, dtype, device, backend="kernel")
    ours = p50_ms(lambda: plan.run(q, k, v), device, reps)
    sdpa = p50_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask), device, reps)
    out: dict[str, Any] = dict(model=model, query=query, items=len(items), tokens=t, dtype=str(dtype), ours_ms=ours,
                               sdpa_dense_mask_ms=sdpa, sdpa_over_ours=sdpa / ours)
    if ref_check:
        ref = prefix_item_attention_ref(q, k, v, segments.to(device))
        ours_out = plan.run(q, k, v)
        sdpa_out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)[0].transpose(0, 1)
        out.update(ours_rel_err=rel_err(ours_out, ref), sdpa_rel_err=rel_err(sdpa_out, ref),
                   ours_max_abs=float((ours_out.float() - ref).abs().max()))
    return out


def mis_vs_sis_attention(model: str, query: int, items: list[int], dtype: torch.dtype, device: str) -> dict[str, Any]:
    """The items' tokens attended in the MIS layout vs the same tokens (same q/k/v rows) in SIS layout."""
    hq, hkv, d = KIT_HEADS[model]
    q, k, v = fused_qkv(query + sum(items), hq, hkv, d, dtype, device, seed=1)
    # SIS stream: query rows then item i's rows, per item
    index, item_rows_sis, item_rows_mis, start_mis, start_sis = [], [], [], query, 0
    for n in items:
        index += list(range(query)) + list(range(start_mis, start_mis + n))
        item_rows_sis += range(start_sis + query, start_sis + query + n)
        item_rows_mis += range(start_mis, start_mis + n)
        start_mis += n
        start_sis += query + n
    idx = torch.tensor(index, device=device)
    seg_mis, seg_sis = segment_rows(query, items).to(device), segment_rows(0, [query + n for n in items]).to(device)
    mis = prefix_item_attention(q, k, v, seg_mis, backend="kernel")
    sis = prefix_item_attention(q[idx], k[idx], v[idx], seg_sis, backend="kernel")
    a = mis[torch.tensor(item_rows_mis, device=device)].float()
    b = sis[torch.tensor(item_rows_sis, device=device)].float()
    return dict(model=model, items=len(items), max_abs=float((a - b).abs().max()), max_value=float(b.abs().max()))


def label_case(hidden: int, vocab: int, rows: int, dtype: torch.dtype, device: str, reps: int) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(hidden)
    h = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (rows, 2), generator=g, device=device, dtype=torch.int32)
    labels_cpu, index = labels.cpu(), labels.long()

    def plain() -> torch.Tensor:
        return torch.log_softmax((h @ w.T).float(), -1).gather(1, index)

    ours, theirs = (p50_ms(fn, device, reps) for fn in (lambda: label_logprobs(h, w, labels_cpu, backend="kernel"),
                                                        plain))
    ref, _ = label_logprobs_ref(h, w, labels)
    got, _ = label_logprobs(h, w, labels_cpu, backend="kernel")
    return dict(hidden=hidden, vocab=vocab, rows=rows, dtype=str(dtype), ours_ms=ours, torch_ms=theirs,
                torch_over_ours=theirs / ours, ours_max_abs=float((got - ref).abs().max()),
                torch_max_abs=float((plain() - ref).abs().max()), weight_read_ms_at_4_3TBs=2 * vocab * hidden / 4.3e9)


def linear_case(model: str, query: int, items: list[int], dtype: torch.dtype, device: str, reps: int
                ) -> dict[str, Any]:
    """conv + rule over one MIS stream, ours vs transformers' fallbacks (items of equal length, so they batch)."""
    ours, theirs, _, diff, scale = linear_attention_pair(query, len(items), items[0], dtype, KIT_LINEAR[model], device)
    mine, slow = p50_ms(ours, device, reps), p50_ms(theirs, device, max(3, reps // 10))
    return dict(model=model, query=query, items=len(items), tokens=query + sum(items), dtype=str(dtype),
                ours_ms=mine, transformers_ms=slow, transformers_over_ours=slow / mine, items_max_abs=diff,
                items_max_value=scale)


def kit(args: argparse.Namespace) -> dict[str, Any]:
    """Every case, the JSON rewritten after each (a stage killed by its timeout keeps what it measured); a case
    that raises is recorded in `errors` and costs the others nothing."""
    device, tiny, out = args.device, args.tiny, args.json
    report: dict[str, Any] = dict(env=device_info(device), attention=[], mis_vs_sis=[], label_logprobs=[], linear=[],
                                  errors=[])
    if (_ext.cuda_module() if device != "cpu" else _ext.cpu_module()) is None:
        report["errors"].append(f"no kernel module for {device}: {_ext.import_error(_ext.CUDA_MODULE)}")
        write_json(out, report)
        return report

    def record(key: str, what: str, fn: Callable[..., dict[str, Any]], *fn_args: Any, **kwargs: Any) -> None:
        try:
            report[key].append(fn(*fn_args, **kwargs))
        except Exception as e:
            report["errors"].append(f"{what}: {type(e).__name__}: {e}")
        write_json(out, report)

    query, item_len = (24, 5) if tiny else (300, 32)
    counts = [2, 5] if tiny else [2, 5, 9, 16]
    dtype = torch.bfloat16
    for model in ["tiny"] if tiny else ["qwen3-0.6b", "qwen3-8b"]:
        for n in counts:
            record("attention", f"attention {model} n={n}", attention_case, model, query,
                   [item_len + (i % 3) for i in range(n)], dtype, device, args.reps, ref_check=n in (2, 16) or tiny)
        record("mis_vs_sis", f"mis_vs_sis {model}", mis_vs_sis_attention, model, query,
               [item_len + (i % 3) for i in range(16)], dtype, device)
    for model in ["tiny"] if tiny else ["qwen3-0.6b", "qwen3-8b"]:
        hidden = KIT_HIDDEN[model]
        record("label_logprobs", f"label_logprobs H={hidden}", label_case, hidden, 1000 if tiny else 151936, 16,
               dtype, device, args.reps)
    for n in counts:
        record("linear", f"linear n={n}", linear_case, "tiny" if tiny else "qwen3.5-4b", query, [item_len] * n, dtype,
               device, args.reps)
    return report


KIT_LINES = {  # the kit's report key: the line of each of its rows
    "mis_vs_sis": "MIS vs SIS attention {model} n={items}: max abs {max_abs:.2e} (values up to {max_value:.2f})",
    "label_logprobs": "label_logprobs R={rows} V={vocab} H={hidden}: ours {ours_ms:.3f} ms, torch {torch_ms:.3f} ms "
                      "({torch_over_ours:.1f}x), max abs vs fp32 ours {ours_max_abs:.1e} torch {torch_max_abs:.1e}",
    "linear": "conv+gated_delta_rule {model} {query}+{items}x: ours {ours_ms:.3f} ms, transformers "
              "{transformers_ms:.3f} ms ({transformers_over_ours:.1f}x), items max abs {items_max_abs:.1e} (values up "
              "to {items_max_value:.2f})",
}


def kit_table(report: dict[str, Any]) -> str:
    lines = [f"# kernels on {report['env'].get('gpu', report['env']['device'])}: median ms",
             f"{'attention (MIS stream)':<28}{'T':>6}{'ours':>9}{'sdpa+mask':>11}{'ratio':>8}{'rel err':>10}"]
    for r in report["attention"]:
        lines.append(f"{r['model'] + ' n=' + str(r['items']):<28}{r['tokens']:>6}{r['ours_ms']:>9.3f}"
                     f"{r['sdpa_dense_mask_ms']:>11.3f}{r['sdpa_over_ours']:>7.1f}x"
                     f"{r.get('ours_rel_err', float('nan')):>10.1e}")
    lines += [template.format(**r) for key, template in KIT_LINES.items() for r in report.get(key, [])]
    return "\n".join(lines + [f"error: {e}" for e in report["errors"]])


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=None, help="timed calls per round (default 20; --json: 50, "
                        "3 with --tiny)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per comparison")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=DEFAULT_SECTIONS)
    parser.add_argument("--out", type=Path,
                        help="default: bench/results/latest/kernels_cpu.txt (linear, tiers: their own files)")
    parser.add_argument("--tier", choices=[*TORCH_ISA_ENV, "avx512bf16", "amx"],
                        help="force our kernels' CPU tier, and torch's ISA to match (default: the hardware's)")
    parser.add_argument("--torch-isa", choices=sorted(TORCH_ISA_ENV), help="torch on this ISA's paths alone")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                        help="default: fp32 on tiers avx2, avx512 and generic; bf16 and fp32 elsewhere")
    parser.add_argument("--tiers", nargs="+", help="tiers section: ours at these tiers only")
    parser.add_argument("--shapes", nargs="+", choices=list(TIER_SHAPES), default=list(TIER_SHAPES),
                        help="tiers section: the shapes")
    parser.add_argument("--no-forward", action="store_true", help="tiers section: skip the smollm-forward row")
    parser.add_argument("--json", type=Path, help="run the H200 kit's cases instead, into this JSON file")
    parser.add_argument("--device", default=None, help="--json: cuda | cpu (default: cpu with --tiny, else cuda)")
    parser.add_argument("--tiny", action="store_true", help="--json: small shapes on the CPU (plumbing tests)")
    args = parser.parse_args(argv)
    force_isa("bench.kernels", args.tier, args.torch_isa)
    torch.manual_seed(0)
    set_threads(args.threads)
    heap = keep_activation_pages()
    if args.json:
        args.device = args.device or ("cpu" if args.tiny else "cuda")
        args.reps = args.reps or (3 if args.tiny else 50)
        report = kit(args)
        write_json(args.json, report)
        print(kit_table(report), flush=True)
        return report
    args.reps = args.reps or 20
    module = _ext.cpu_module()
    if module is None:
        raise SystemExit("pyscore._C is not built: python setup.py build_ext --inplace")
    features = module.cpu_features()
    default = features["bf16_dot"]
    if args.tier and features["tier"] != args.tier:
        raise SystemExit(f"tier {args.tier} asked for, but this CPU runs {features['tier']} at most")
    slow_bf16 = features["tier"] in ("avx2", "avx512", "generic")
    dtypes = [DTYPES[d] for d in args.dtypes or (["fp32"] if slow_bf16 else ["bf16", "fp32"])]
    torch_env = ", ".join(f"{k}={v}" for k, v in TORCH_ISA_ENV.get(args.torch_isa or args.tier or "", {}).items())
    lines = [f"# python -m bench.kernels {' '.join(sys.argv[1:] if argv is None else argv)}   (commit {git_commit()})",
             f"machine: {machine()}",
             f"tier: ours {features['tier']}{' (forced)' if args.tier else ''} (hardware {features['hardware_tier']}),"
             f" torch {torch.backends.cpu.get_cpu_capability()}{f' ({torch_env})' if torch_env else ''}",
             f"torch {torch.__version__}, threads {args.threads}, kernel path {features['path']}, bf16 product "
             f"{default} by default; dtypes {', '.join(dt(d) for d in dtypes)}; cpu features {features}", heap, ""]
    print("\n".join(lines), flush=True)
    sections = {
        "attention": lambda: attention_section(args.reps, args.rounds, default, dtypes),
        "labels": lambda: label_section(args.reps, args.rounds, default, dtypes),
        "gemm": lambda: gemm_section(args.rounds),
        "decode": lambda: section([f"{'op':<26}{'dtype':<10}{'ours':>9}{'torch':>11}{'torch/ours':>12}"], dtypes,
                                  lambda dtype: decode_row(args.reps, args.rounds, dtype)),
        "elementwise": lambda: section(["fused elementwise ops vs their torch recipes (pyscore.ops.reference); "
                                        "times: median ms", f"{'op / shape':<26}{'dtype':<10}{'ours':>9}"
                                        f"{'torch':>11}{'torch/ours':>12}"], dtypes,
                                       lambda dtype: elementwise_rows(dtype, args.reps, args.rounds)),
        "interleave": lambda: interleave_rows(args.reps),
        "linear": lambda: linear_attention_section(args.reps, args.rounds, dtypes),
        "tiers": lambda: tiers_section(args, dtypes),
        "int8": lambda: int8_section(args),
    }
    out = args.out or default_out(OUT.get(args.only[0] if len(args.only) == 1 else "", "kernels_cpu.txt"))
    for name in args.only:
        lines += [*sections[name](), ""]
        print(flush=True)
    write_report(lines, out, echo=False)
    print(f"written to {out}")
    return None


if __name__ == "__main__":
    main()
