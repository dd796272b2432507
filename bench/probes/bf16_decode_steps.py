"""Decode steps of SmolLM2's bf16 checkpoint served in fp32 (projections, embedding, LM head held in bf16) at 8, 12
and 16 generations: median of 24 steps after the prefill, ms, twice in the process. It wrote section 3 of
bench/results/tiers/kernels/linear_avx2_bf16_panel_rows_ab.txt (tier avx2, before ecbc25c, after da6cf8b's change):

    python -m bench.ab --before OLD_TREE --rounds 3 -- -m bench.probes.bf16_decode_steps

(then run as an uncommitted steps_ab.py, the same code; the checkpoint, /tmp/smollm2-bf16, came from an earlier probe
and is now written on first use by bench.probes.bf16_head_engine.bf16_checkpoint).
"""

from __future__ import annotations

from bench.common import question
from bench.engine import step_ms
from bench.probes.bf16_head_engine import bf16_checkpoint
from pyscore.engine import Engine


def main() -> None:
    e = Engine.from_pretrained(bf16_checkpoint(), threads=2)
    q, items = question(16, seed=3)
    prompts = [q + it for it in items]
    for _ in range(2):
        print("decode step ms: " + " | ".join(f"B={b} {step_ms(e, prompts[:b], 24)[0]:.2f}" for b in (8, 12, 16)),
              flush=True)


if __name__ == "__main__":
    main()
