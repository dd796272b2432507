"""One layer's decode attention at SmolLM2's heads (9 query / 3 kv heads, d 64), B sequences of ~330 keys in
16-token pages of a [pages, 2, L=30, 16, Hkv, D] bf16 pool, the layers called in turn (so the KV is read cold, as
in a decode step): the median of 60 calls. Page tables: 'interleaved' (every page dealt round-robin) or 'engine'
(each prompt's pages one sequence after another, the generated ones interleaved, as the engine's). It prints one
row, so that two source trees can be compared process by process with bench.ab; it wrote the bench.ab rows of
bench/results/tiers/kernels/decode_attention_heads_together.txt:

    python -m bench.ab --before OLD_TREE --rounds 3 -- -m bench.probes.decode_layer THREADS B LAYOUT
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyscore.engine import set_threads
from pyscore.ops import decode_attention, plan_decode

LAYERS, BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM, KEYS = 30, 16, 3, 9, 64, 330


def tables_for(batch: int, pages_per: int, layout: str) -> list[list[int]]:
    """Each sequence's pages: dealt round-robin, or the prompt's pages contiguous and the last two interleaved."""
    if layout == "interleaved":
        return [[p * batch + b for p in range(pages_per)] for b in range(batch)]
    prompt = pages_per - 2
    return [[b * prompt + p for p in range(prompt)] + [batch * prompt + 2 * b, batch * prompt + 2 * b + 1]
            for b in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("threads", type=int)
    parser.add_argument("batch", type=int)
    parser.add_argument("layout", choices=("interleaved", "engine"))
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    pages_per = -(-(KEYS + BLOCK) // BLOCK)
    pool = torch.randn(args.batch * pages_per, 2, LAYERS, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    lengths = [KEYS + (b % 7) for b in range(args.batch)]
    plan = plan_decode(pool[:, 0], pool[:, 1], tables_for(args.batch, pages_per, args.layout), lengths)
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM).bfloat16()
    times = []
    for call in range(args.calls):
        start = time.perf_counter()
        decode_attention(q, plan, call % LAYERS, backend="kernel")
        times.append(time.perf_counter() - start)
    print(f"decode layer threads {args.threads} B={args.batch} {args.layout} {statistics.median(times) * 1e3:.3f} "
          f"ms per layer")


if __name__ == "__main__":
    main()
