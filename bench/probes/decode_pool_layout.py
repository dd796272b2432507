"""Decode attention at 32 generations (SmolLM2's heads 9/3, d 64, ~330 keys, 16-token pages, interleaved page
tables), bf16: the engine's page-major pool [pages, 2, L, 16, Hkv, D] against a layer-major one
[2, L, pages, 16, Hkv, D] (the same kernel, other page and layer strides), alternated call by call in one process,
one layer's call, the layers in turn; the outputs asserted bitwise equal. It wrote the pool-layout section of
bench/results/tiers/probes/decode_attention_memory_probes.txt:

    python -m bench.probes.decode_pool_layout THREADS [B]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.probes.decode_layer import BLOCK, HEAD_DIM, KEYS, KV_HEADS, LAYERS, Q_HEADS, tables_for
from pyscore.engine import set_threads
from pyscore.ops import decode_attention, plan_decode


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    set_threads(threads)
    pages_per = -(-(KEYS + BLOCK) // BLOCK)
    src = torch.randn(batch * pages_per, 2, LAYERS, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    page_major = src.clone()
    layer_major = src.permute(1, 2, 0, 3, 4, 5).contiguous()  # [2, L, pages, T, Hkv, D]
    del src
    tables = tables_for(batch, pages_per, "interleaved")
    lengths = [KEYS + (b % 7) for b in range(batch)]
    q = torch.randn(batch, Q_HEADS, HEAD_DIM).bfloat16()
    plans = {"page-major": plan_decode(page_major[:, 0], page_major[:, 1], tables, lengths),
             "layer-major": plan_decode(layer_major[0].transpose(0, 1), layer_major[1].transpose(0, 1), tables,
                                        lengths)}
    times: dict[str, list[float]] = {k: [] for k in plans}
    for rep in range(60):
        outs = {}
        for name, plan in plans.items():
            start = time.perf_counter()
            outs[name] = decode_attention(q, plan, rep % LAYERS, backend="kernel")
            times[name].append(time.perf_counter() - start)
        assert torch.equal(outs["page-major"], outs["layer-major"])
    kv_bytes = sum(lengths) * 2 * KV_HEADS * HEAD_DIM * 2
    for name, v in times.items():
        m = statistics.median(v)
        print(f"threads {threads} B={batch} {name:12} median {m * 1e3:.3f} ms per layer ({m * 1e3 * LAYERS:.1f} ms "
              f"per step), {kv_bytes / m / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
