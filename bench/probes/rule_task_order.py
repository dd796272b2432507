"""Qwen3.5's conv + gated delta rule (Qwen3.5-0.8B's linear-attention shape) and its decode rule, ours alone: three
medians of 8 (conv + rule) or 40 (decode) calls per line, so that two source trees can be compared process by
process with bench.ab. It wrote bench/results/tiers/kernels/rule_task_order_ab.txt (the rule's task order):

    python -m bench.ab --before OLD_TREE --rounds 3 -- -m bench.probes.rule_task_order
"""

from __future__ import annotations

import torch

from bench.common import median_ms
from bench.kernels import linear_attention_pair, rule_decode_pair
from pyscore.engine import set_threads


def main() -> None:
    set_threads(2)
    for prefix, items, item_len in ((0, 16, 300), (270, 16, 30)):
        for dtype in (torch.bfloat16, torch.float32):
            ours = linear_attention_pair(prefix, items, item_len, dtype)[0]
            times = [median_ms(ours, 8) for _ in range(3)]
            kind = "SIS" if not prefix else "MIS"
            print(f"conv+rule {kind} {prefix}+{items}x{item_len} {str(dtype)[6:]}: "
                  + " ".join(f"{t:.1f}" for t in times) + " ms")
    for batch in (1, 8):
        ours, _ = rule_decode_pair(batch, torch.bfloat16)
        times = [median_ms(ours, 40) for _ in range(3)]
        print(f"rule decode {batch} seqs bf16: " + " ".join(f"{t:.3f}" for t in times) + " ms a layer")


if __name__ == "__main__":
    main()
