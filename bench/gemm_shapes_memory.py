"""How the server's memory grows with the number of distinct packed lengths it has seen: torch's bf16 GEMMs
(oneDNN) create a primitive for each new row count M, kept in oneDNN's primitive cache (1024 by default), and
glibc's malloc, whose mmap threshold rises with the largest block freed, leaves the heap fragmented by the
varying activation sizes. One child process per variant runs SmolLM2's four decoder GEMMs (qkv, o, gate_up,
down) in bf16 over `--shapes` distinct M in 50..4200 (what packed batches look like), records RSS growth, then
calls malloc_trim. Variants: glibc; glibc with a fixed mmap threshold; jemalloc and tcmalloc by LD_PRELOAD
(Debian's libjemalloc2 / libtcmalloc-minimal4); oneDNN's cache cut to 64 primitives; and pyscore.ops.linear, the
prepacked kernel the decoder runs its projections on since issue 9, under plain glibc.

`--speed` instead times the engine under the allocators that bound memory (run it under /work/tools/quiet):
three 16-candidate questions in MIS, one in SIS, and a 16-token generation, bf16, variants alternated, twice.

    python -m bench.gemm_shapes_memory [--shapes 800] [--out bench/results/hardening/gemm_shapes_memory.txt]
    python -m bench.gemm_shapes_memory --speed [--out bench/results/hardening/allocator_speed.txt]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LIB = "/usr/lib/x86_64-linux-gnu"
VARIANTS = {
    "glibc": {},
    "glibc, MALLOC_MMAP_THRESHOLD_=128 KiB": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "jemalloc": {"LD_PRELOAD": f"{LIB}/libjemalloc.so.2"},
    "tcmalloc": {"LD_PRELOAD": f"{LIB}/libtcmalloc_minimal.so.4"},
    "glibc, ONEDNN_PRIMITIVE_CACHE_CAPACITY=64": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"},
    "glibc, pyscore.ops.linear (prepacked)": {"BENCH_GEMM": "pyscore"},  # what the decoder runs since issue 9
}
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) of qkv, o, gate_up, down


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(shapes: int) -> dict[str, list[float]]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    weights = [torch.randn(n, k).bfloat16() for k, n in SHAPES]
    x = {k: torch.randn(4200, k).bfloat16() for k in {k for k, _ in SHAPES}}
    gemm: Callable[[torch.Tensor, Any], torch.Tensor] = F.linear
    if os.environ.get("BENCH_GEMM") == "pyscore":  # our kernel: no per-shape primitive, no per-M workspace
        from pyscore.ops import linear, pack_linear

        weights, gemm = [pack_linear(w) for w in weights], linear
    for m in range(1, 50):  # warm the small shapes and the thread pool
        for (k, _), w in zip(SHAPES, weights, strict=True):
            gemm(x[k][:m], w)
    base = rss_mib()
    sizes = list(range(50, 4200, 3))
    random.Random(0).shuffle(sizes)
    growth = []
    for i, m in enumerate(sizes[:shapes]):
        for (k, _), w in zip(SHAPES, weights, strict=True):
            gemm(x[k][:m], w)
        if (i + 1) % (shapes // 4) == 0:
            growth.append(round(rss_mib() - base, 1))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return dict(growth=growth, after_trim=[round(rss_mib() - base, 1)])


def speed_child(label: str) -> str:

    from bench.common import median_ms, question
    from pyscore.engine import Engine
    from pyscore.types import GenerateRequest

    engine = Engine.from_pretrained(None, dtype="bfloat16", threads=2)
    questions = [question(16, seed=s) for s in range(3)]

    mis = median_ms(lambda: [engine.score(q, i, labels=[" Yes", " No"], mode="mis") for q, i in questions], 3, 1)
    sis = median_ms(lambda: [engine.score(q, i, labels=[" Yes", " No"], mode="sis") for q, i in questions[:1]], 3, 1)
    gen = median_ms(lambda: engine.generate(GenerateRequest(prompt=questions[0][0], max_tokens=16)), 3, 1)
    return f"{label:44s} {mis:12.0f} {sis:12.0f} {gen:12.0f}"


SPEED_VARIANTS = ("glibc", "glibc, MALLOC_MMAP_THRESHOLD_=128 KiB", "jemalloc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=int, default=800, help="distinct row counts M (default 800)")
    ap.add_argument("--speed", action="store_true", help="time the engine under each allocator instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child == "memory":
        print(json.dumps(child(args.shapes)))
        return
    if args.child:
        print(speed_child(args.child))
        return
    from bench.common import machine as cpu

    if args.speed:
        lines = [f"# engine ms (median of 3) under each allocator, bf16, 2 threads | {cpu()}",
                 f"{'variant':44s} {'MIS 3x16':>12s} {'SIS 1x16':>12s} {'generate 16':>12s}"]
        for _ in range(2):
            for name in SPEED_VARIANTS:
                lines.append(subprocess.run([sys.executable, "-m", "bench.gemm_shapes_memory", "--child", name],
                                            cwd=ROOT, env=dict(os.environ, **VARIANTS[name]), capture_output=True,
                                            text=True, check=True).stdout.strip().splitlines()[-1])
                print(lines[-1], flush=True)
        out = args.out or ROOT / "bench/results/hardening/allocator_speed.txt"
        out.write_text("\n".join(lines) + "\n")
        return

    lines = [f"# RSS growth (MiB) over distinct GEMM row counts M, SmolLM2's 4 decoder GEMMs in bf16, torch "
             f"{__import__('torch').__version__} | {cpu()}",
             f"{'variant':44s} " + " ".join(f"{f'{q * args.shapes // 4} M':>8s}" for q in range(1, 5))
             + "  after malloc_trim"]
    for name, env in VARIANTS.items():
        if "LD_PRELOAD" in env and not Path(env["LD_PRELOAD"]).exists():
            lines.append(f"{name:44s} (missing {env['LD_PRELOAD']})")
            continue
        out = subprocess.run([sys.executable, "-m", "bench.gemm_shapes_memory", "--child", "memory", "--shapes",
                              str(args.shapes)], cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                             text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        lines.append(f"{name:44s} " + " ".join(f"{g:8.0f}" for g in r["growth"]) + f"  {r['after_trim'][0]:8.0f}")
        print(lines[-1], flush=True)
    (args.out or ROOT / "bench/results/hardening/gemm_shapes_memory.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
