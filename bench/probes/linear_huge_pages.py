"""linear at a decode step's rows (M = 8), bf16, SmolLM2's gate_up shape (K 576, 2 x 1536 rows), over 30 packed
weight copies (~106 MB, more than the caches, read as a decode step reads its weights): the packed weights in 4 KiB
pages against the same bits in 2 MiB pages (madvise(MADV_HUGEPAGE)), alternated call by call; results asserted
bitwise equal. It wrote the decode-projections section of
bench/results/tiers/probes/decode_attention_memory_probes.txt:

    python -m bench.probes.linear_huge_pages THREADS
"""

from __future__ import annotations

import dataclasses
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

from pyscore.engine import set_threads
from pyscore.ops import linear, pack_linear

K, N, COPIES = 576, 3072, 30
HUGE = 2 << 20


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in an anonymous mapping advised as 2 MiB pages, aligned to one (the mapping lives with it)."""
    size = t.numel() * t.element_size()
    mapping = mmap.mmap(-1, size + 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-base.data_ptr()) % HUGE
    out = base[offset : offset + size].view(t.dtype).view(t.shape)
    out.copy_(t)
    out._mapping = mapping  # type: ignore[attr-defined]
    return out


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    set_threads(threads)
    g = torch.Generator().manual_seed(0)
    packs: dict[str, list] = {"4k": [], "huge": []}
    for _ in range(COPIES):
        p = pack_linear((torch.randn(N, K, generator=g) * K**-0.5).bfloat16(), gated=True)
        packs["4k"].append(p)
        packs["huge"].append(dataclasses.replace(p, packed=in_huge_pages(p.packed)))
    smaps = Path("/proc/self/smaps_rollup").read_text().splitlines()
    print([line.strip() for line in smaps if "AnonHuge" in line])
    x = torch.randn(8, K).bfloat16()
    times: dict[str, list[float]] = {k: [] for k in packs}
    for _ in range(20):
        for name, ps in packs.items():
            start = time.perf_counter()
            for p in ps:
                linear(x, p, backend="kernel")
            times[name].append((time.perf_counter() - start) / COPIES)
        assert torch.equal(linear(x, packs["4k"][0], backend="kernel"), linear(x, packs["huge"][0], backend="kernel"))
    weight_bytes = N * K * 2
    for name, v in times.items():
        m = statistics.median(v)
        print(f"threads {threads} {name:5} {m * 1e3:.3f} ms per call, {weight_bytes / m / 1e9:.1f} GB/s of weight")


if __name__ == "__main__":
    main()
