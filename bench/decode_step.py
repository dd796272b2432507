"""One decode step of several running generations, in process: the embedded SmolLM2 (bf16, 2 threads), B prompts
of the bench question's shape (~300 tokens each), the median time of `engine.step` once they are all decoding.
The projections run on pyscore.ops.linear (the default on CPU) or, with linear's registry entry emptied while the
model loads, on F.linear; the two engines take turns, round by round. Attention is decode_attention either way.
Usage: python -m bench.decode_step [--batch 8] [--steps 20] [--rounds 2] [--out bench/results/decode_step.txt]"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.common import machine, question
from bench.profile_mis import load
from bench.summary import write_report
from pyscore.engine import Engine
from pyscore.types import GenerateRequest


def step_ms(engine: Engine, prompts: list[str], steps: int) -> tuple[float, int]:
    """Median ms of a decode step over `steps` steps after the prefill, and the cache length at the end."""
    engine.generation.eos_ids = frozenset()  # every generation runs its full length
    gens = [engine.start_generation(GenerateRequest(prompt=p, max_tokens=steps + 2)) for p in prompts]
    engine.step(gens)  # prefill
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step(gens)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), gens[0].cache.length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "decode_step.txt")
    args = parser.parse_args()
    engines = {gemm: load(args.threads, gemm) for gemm in ("ours", "torch")}
    query, items = question(args.batch, seed=3)
    prompts = [query + item for item in items]
    times: dict[str, list[float]] = {gemm: [] for gemm in engines}
    length = 0
    for _ in range(args.rounds):
        for gemm, engine in engines.items():
            ms, length = step_ms(engine, prompts, args.steps)
            times[gemm].append(ms)
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
    lines = [f"machine: {machine()}",
             f"SmolLM2-135M-Instruct bf16, threads {args.threads}: one decode step of {args.batch} generations "
             f"(~{length} cached tokens each at the end), median of {args.steps} steps, median over {args.rounds} "
             "alternating rounds; attention: decode_attention (one call per layer for all sequences)",
             f"projections on pyscore.ops.linear (prepacked, fused epilogues): {ours:.1f} ms",
             f"projections on F.linear + silu_mul + add_rms_norm's residual add: {theirs:.1f} ms  "
             f"(F.linear / linear = {theirs / ours:.2f}x)"]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
