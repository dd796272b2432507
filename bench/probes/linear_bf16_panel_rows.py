"""linear with bf16 weights under fp32 x at 4-16 rows (SmolLM2's and Qwen3-0.6B's projections, the weights cycled over
12 packed copies, 4 for Qwen3-0.6B, so that they come from DRAM: median of 3 x median of 40 calls, us), then decode
steps of SmolLM2's bf16 checkpoint served in fp32 at 8, 12 and 16 generations (median of 24 steps after the prefill,
ms). It wrote section 2 of bench/results/tiers/kernels/linear_avx2_bf16_panel_rows_ab.txt (tier avx2, before ecbc25c,
after da6cf8b's change):

    python -m bench.ab --before OLD_TREE --rounds 2 -- -m bench.probes.linear_bf16_panel_rows

(then run as an uncommitted panel_ab.py, the same code, its per-row closure now built by cycled(); the checkpoint,
/tmp/smollm2-bf16, came from an earlier probe and is now written on first use by
bench.probes.bf16_head_engine.bf16_checkpoint).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from bench.common import median_ms, question
from bench.engine import step_ms
from bench.probes.bf16_head_engine import bf16_checkpoint
from pyscore.engine import Engine, set_threads
from pyscore.ops import LinearWeight, linear, pack_linear

SHAPES = {"smollm gate_up": (576, 3072, True, 12), "smollm down": (1536, 576, False, 12),
          "smollm qkv": (576, 960, False, 12), "qwen3-0.6b gate_up": (1024, 6144, True, 4),
          "qwen3-0.6b down": (3072, 1024, False, 4), "qwen3-0.6b qkv": (1024, 4096, False, 4)}


def cycled(x: torch.Tensor, ws: list[LinearWeight]) -> Callable[[], None]:
    """One call of linear(x, w) per call, w the next of the copies in turn."""
    it = [0]

    def f() -> None:
        it[0] = (it[0] + 1) % len(ws)
        linear(x, ws[it[0]], backend="kernel")
    return f


def main() -> None:
    set_threads(2)
    for name, (k, n, gated, copies) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        ws = [pack_linear((torch.randn(n, k, generator=gen) * k**-0.5).bfloat16(), gated=gated) for _ in range(copies)]
        cells = []
        for m in (4, 8, 10, 11, 12, 16):
            f = cycled(torch.randn(m, k), ws)
            cells.append(f"M={m} {statistics.median(median_ms(f, 40, 5) for _ in range(3)) * 1e3:7.1f}")
        print(f"{name:19} " + " | ".join(cells), flush=True)
    e = Engine.from_pretrained(bf16_checkpoint(), threads=2)
    q, items = question(16, seed=3)
    prompts = [q + it for it in items]
    print("decode step ms: " + " | ".join(f"B={b} {step_ms(e, prompts[:b], 24)[0]:.2f}" for b in (8, 12, 16)),
          flush=True)


if __name__ == "__main__":
    main()
