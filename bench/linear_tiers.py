"""linear per CPU tier: our kernel at each tier this CPU runs (forced with PYSCORE_CPU_TIER) against torch's F.linear
in the same dtype, in one call and as pyscore's batch-invariant torch path (fixed-height row calls), at the decoder's
shapes (SmolLM2-135M, Qwen3-8B) for a prefill pass (M=776) and a decode step (M=8). Alternating, best of `reps`;
GFLOP/s per row. What pyscore/ops/tiers.py cites for `linear`. `--tiers avx2` times ours at those tiers only (default:
every runnable tier whose table entry is ours, and avx2); `--torch-isa avx2` makes torch take its AVX2 paths too (the
environment of bench.kernels --tier avx2; the bench re-executes itself so that it holds from torch's start), i.e. an
AVX2-only CPU emulated on a bigger one.
Usage: python -m bench.linear_tiers [--reps 7] [--tiers T ...] [--torch-isa avx2] [--dtypes float32 bfloat16]
       [--out bench/results/tiers/linear.txt]"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import machine
from bench.kernels import TORCH_ISA_ENV
from bench.summary import write_report
from pyscore.ops import PlainLinear, _ext, linear, pack_linear, tiers
from pyscore.ops.linear import DECODE_ROWS, PREFILL_ROWS

SHAPES = {"smollm-gate_up": (576, 3072), "smollm-down": (1536, 576), "qwen3-8b-qkv": (4096, 6144),
          "qwen3-8b-down": (12288, 4096)}
ROWS = {"prefill": (776, PREFILL_ROWS), "decode": (8, DECODE_ROWS)}


def best_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ours_tiers(dtype: torch.dtype, asked: list[str] | None) -> list[str]:
    """The runnable tiers to time ours at: those asked for, else those whose linear is ours, and avx2 (elsewhere it is
    the portable loop, which the table never picks)."""
    if asked:
        return [t for t in _ext.runnable_cpu_tiers() if t in asked]
    return [t for t in _ext.runnable_cpu_tiers()
            if t == "avx2" or tiers.cpu_choice("linear", t, dtype).path == "kernel"]


def contenders(x: torch.Tensor, w: torch.Tensor, rows: int, ours_at: list[str]) -> dict[str, Callable[[], object]]:
    packed, plain = pack_linear(w), PlainLinear(w, None)

    def ours(tier: str) -> Callable[[], object]:
        def run() -> object:
            os.environ["PYSCORE_CPU_TIER"] = tier
            return linear(x, packed, backend="kernel")
        return run

    def torch_path() -> object:
        os.environ["PYSCORE_CPU_TIER"] = "generic"  # a tier whose linear is torch's
        return linear(x, plain, rows_per_call=rows)

    # the top tier of ours after the torch path: neither it nor F.linear then runs straight after a long run at a
    # lower tier (on the AMX Xeon, ours@amx at 1.2 ms read 1.9 ms right after the 12 ms AVX-512 run).
    runs = {f"ours@{t}": ours(t) for t in ours_at[:-1]}
    runs[f"torch path ({rows}-row calls)"] = torch_path
    runs.update({f"ours@{t}": ours(t) for t in ours_at[-1:]})
    runs["torch F.linear"] = lambda: F.linear(x, w)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tiers", nargs="+", default=None, help="ours at these tiers only")
    ap.add_argument("--torch-isa", choices=sorted(TORCH_ISA_ENV), default=None, help="torch on this ISA's paths")
    ap.add_argument("--out", default="bench/results/tiers/linear.txt")
    args = ap.parse_args()
    if args.torch_isa and any(os.environ.get(k) != v for k, v in TORCH_ISA_ENV[args.torch_isa].items()):
        os.execve(sys.executable, [sys.executable, "-m", "bench.linear_tiers", *sys.argv[1:]],
                  {**os.environ, **TORCH_ISA_ENV[args.torch_isa]})
    torch_isa = " ".join(f"{k}={v}" for k, v in TORCH_ISA_ENV[args.torch_isa].items()) if args.torch_isa else ""
    lines = [f"# {machine()} | torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{torch.backends.cpu.get_cpu_capability()} {torch_isa} | hardware tier "
             f"{_ext.cpu_module().cpu_features()['hardware_tier']} | best of {args.reps}, alternating",
             "dtype     shape            pass     path                          ms      GFLOP/s  vs torch F.linear"]
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for name in args.shapes:
            k, n = SHAPES[name]
            for phase, (m, rows) in ROWS.items():
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(m, k, generator=gen).to(dtype)
                w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
                runs = contenders(x, w, rows, ours_tiers(dtype, args.tiers))
                times: dict[str, float] = {key: float("inf") for key in runs}
                for _ in range(args.reps + 1):  # the first round warms up
                    for key, fn in runs.items():
                        times[key] = min(times[key], best_ms(fn))
                os.environ.pop("PYSCORE_CPU_TIER", None)
                base = times["torch F.linear"]
                for key, ms in times.items():
                    gflops = 2 * m * k * n / ms / 1e6
                    lines.append(f"{str(dtype)[6:]:9} {name:16} {phase:8} {key:29} {ms:7.3f} {gflops:8.0f}  "
                                 f"{base / ms:5.2f}x")
                print("\n".join(lines[-len(times):]), flush=True)
    lines.append(f"command: python -m bench.linear_tiers {' '.join(sys.argv[1:])}")
    write_report(lines, Path(args.out))


if __name__ == "__main__":
    main()
