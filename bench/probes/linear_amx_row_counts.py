"""30 layers' SmolLM2 projections (qkv 576->960, o 576->576, gate_up 576->2x1536 with the SiLU-mul, down 1536->576;
distinct packed bf16 weights, read from memory as a decode step or a small batch reads them) at M = 8-64 rows, two
threads: the median of 7 passes over all 30 layers, one process. It wrote section 0 of
bench/results/tiers/kernels/linear_amx_mid_rows.txt (tier amx, on 2c591b6's parent: 17 rows cost 1.83x 16 rows):

    python -m bench.probes.linear_amx_row_counts

(then run as an uncommitted probe_m.py, the same code). It times the CPU's own tier; the record's figures are tier
amx (an Intel CPU with AMX); elsewhere it runs, at that CPU's tier.
"""

from __future__ import annotations

import statistics
import time

import torch

from pyscore.engine import set_threads
from pyscore.ops import linear, pack_linear


def main() -> None:
    set_threads(2)
    shapes = {"qkv": (576, 960, False), "o": (576, 576, False), "gate_up": (576, 3072, True),
              "down": (1536, 576, False)}
    g = torch.Generator().manual_seed(0)
    layers = [{n: pack_linear((torch.randn(N, K, generator=g) * K**-0.5).bfloat16(), gated=gt)
               for n, (K, N, gt) in shapes.items()} for _ in range(30)]
    for M in (8, 16, 17, 24, 32, 48, 64):
        xs = {n: torch.randn(M, K).bfloat16() for n, (K, _, _) in shapes.items()}
        ts = []
        for _ in range(7):
            a = time.perf_counter()
            for L in layers:
                for n, p in L.items():
                    linear(xs[n], p, backend="kernel")
            ts.append(time.perf_counter() - a)
        print(f"M={M:3}: 30 layers' projections {statistics.median(ts) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
