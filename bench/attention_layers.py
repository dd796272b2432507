"""The attention of one whole forward pass, alone: SmolLM2's 30 layers of prefix_item_attention (9/3 heads, d 64,
bf16) over one batch's segment table, on the MIS shape of a question (270-token prefix + 16 items x 30), its SIS
twin (16 x 300), a small batch (2 items), many short items (256 x 8) and a tiny batch where per-call overhead
dominates, median ms per pass. The table is validated and attention planned once
per pass (`AttentionPlan`), as Decoder.hidden_at does; a tree from before the plan existed runs the one-shot
`prefix_item_attention` per layer instead, so `bench/ab.py` can compare the two in one run. Also prints, on trees
that have it, what planning alone costs. Usage: python -m bench.attention_layers [--threads 2] [--reps 20]"""

from __future__ import annotations

import argparse

import torch

from bench.common import fused_qkv, median_ms, segment_rows
from pyscore.ops import _ext, prefix_item_attention

try:
    from pyscore.ops import AttentionPlan, SegmentTable
except ImportError:  # a tree from before the plan/run split
    AttentionPlan = SegmentTable = None

LAYERS, HQ, HKV, HEAD_DIM = 30, 9, 3, 64
SHAPES = {"MIS 270+16x30": (270, [30] * 16), "SIS 16x300": (0, [300] * 16), "MIS 270+2x30": (270, [30] * 2),
          "MIS 270+256x8": (270, [8] * 256), "MIS 20+2x5": (20, [5] * 2)}


def one_pass(q, k, v, segments: torch.Tensor) -> None:
    if AttentionPlan is None:
        for _ in range(LAYERS):
            prefix_item_attention(q, k, v, segments)
        return
    plan = make_plan(segments, q)
    for _ in range(LAYERS):
        plan.run(q, k, v)


def make_plan(segments: torch.Tensor, q: torch.Tensor):
    return AttentionPlan(SegmentTable.of(segments, q.shape[0]), HQ, HKV, HEAD_DIM, q.dtype, q.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _ext.cpu_module().set_num_threads(args.threads)
    print(f"{'shape':<16}{'tokens':>7}{'pass ms':>10}{'per layer':>11}{'plan ms':>9}")
    for name, (prefix, items) in SHAPES.items():
        segments, num_tokens = segment_rows(prefix, items), prefix + sum(items)
        q, k, v = fused_qkv(num_tokens, HQ, HKV, HEAD_DIM, torch.bfloat16)
        ms = median_ms(lambda: one_pass(q, k, v, segments), args.reps, warmup=1)  # noqa: B023 (called at once)
        plan = ""
        if AttentionPlan is not None:
            plan = f"{median_ms(lambda: make_plan(segments, q), args.reps, warmup=1):>9.3f}"  # noqa: B023
        print(f"{name:<16}{num_tokens:>7}{ms:>10.2f}{ms / LAYERS:>11.3f}{plan}", flush=True)


if __name__ == "__main__":
    main()
