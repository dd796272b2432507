"""Where one 16-candidate MIS forward spends its time: the embedded SmolLM2 (bf16, 2 threads) scoring the bench
question in process, with wall-clock timers around every op the decoder and the read-out call (our C++ kernels are
invisible to the torch profiler) and the torch profiler's own table for the torch ops. Timers add a few
microseconds per call, so the total with timers is reported next to the plain one.
`--gemm torch` empties `linear`'s entry in the op registry while the model loads, so the decoder keeps its
projections plain and linear runs them on torch's path (F.linear in fixed-height row calls, the epilogue in torch):
the same forward with torch's GEMM, for comparison. Scores of the two are compared in the report.
`--decode B` times one decode step of B running generations instead (prompts of the bench question's shape, ~300
tokens each; the median `engine.step` once all decode), our projections against torch's, in alternating rounds.
Usage: python -m bench.profile_mis [--threads 2] [--forwards 10] [--gemm ours|torch] [--out FILE]
       python -m bench.profile_mis --decode 8 [--steps 20] [--rounds 2] [--out FILE]"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import pyscore.engine as engine_module
import pyscore.model.decoder as decoder_module
from bench.common import machine, question
from bench.summary import write_report
from pyscore.engine import Engine
from pyscore.ops import AttentionPlan, _ext
from pyscore.types import GenerateRequest

# Where the decoder and the engine look the ops up (attention runs through the batch's plan, once per layer).
TIMED = {decoder_module: ["add_rms_norm", "rotary_", "linear"], engine_module: ["label_logprobs"],
         AttentionPlan: ["run"], F: ["linear"]}
LABELS = {(AttentionPlan, "run"): "prefix_item_attention (plan.run)", (F, "linear"): "F.linear (torch GEMM)",
          (decoder_module, "linear"): "linear (GEMM + epilogue, whichever path)"}


class Timers:
    """Per-op wall time and call counts, and a torch.profiler label for each call."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with torch.profiler.record_function(f"pyscore::{name}"):
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return result
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def install(timers: Timers) -> Callable[[], None]:
    """Wraps the timed ops where the decoder and the engine look them up; returns the undo."""
    undo = []
    for module, names in TIMED.items():
        for name in names:
            original = getattr(module, name)
            setattr(module, name, timers.wrap(LABELS.get((module, name), name), original))
            undo.append((module, name, original))

    def restore() -> None:
        for module, name, original in undo:
            setattr(module, name, original)
    return restore


def load(threads: int, gemm: str) -> Engine:
    """The embedded model; with gemm="torch", loaded while the registry has no linear kernel."""
    if gemm == "ours":
        return Engine.from_pretrained(None, dtype="bfloat16", threads=threads)
    kernels, _ext.REGISTRY["linear"] = _ext.REGISTRY["linear"], {}  # no device has a linear kernel meanwhile
    try:
        return Engine.from_pretrained(None, dtype="bfloat16", threads=threads)
    finally:
        _ext.REGISTRY["linear"] = kernels


def score_change(a, b) -> float:
    return max(abs(x - y) for item_a, item_b in zip(a.scores, b.scores, strict=True)
               for row_a, row_b in zip(item_a, item_b, strict=True) for x, y in zip(row_a, row_b, strict=True))


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


def decode(args: argparse.Namespace) -> list[str]:
    engines = {gemm: load(args.threads, gemm) for gemm in ("ours", "torch")}
    query, items = question(args.decode, seed=3)
    times: dict[str, list[float]] = {gemm: [] for gemm in engines}
    length = 0
    for _ in range(args.rounds):
        for gemm, engine in engines.items():
            ms, length = step_ms(engine, [query + item for item in items], args.steps)
            times[gemm].append(ms)
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
    return [f"machine: {machine()}",
            f"SmolLM2-135M-Instruct bf16, threads {args.threads}: one decode step of {args.decode} generations "
            f"(~{length} cached tokens each at the end), median of {args.steps} steps, median over {args.rounds} "
            "alternating rounds; attention: decode_attention (one call per layer for all sequences)",
            f"projections on pyscore.ops.linear (prepacked, fused epilogues): {ours:.1f} ms",
            f"projections on F.linear + silu_mul + add_rms_norm's residual add: {theirs:.1f} ms  "
            f"(F.linear / linear = {theirs / ours:.2f}x)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forwards", type=int, default=10)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--gemm", choices=["ours", "torch"], default="ours", help="the decoder's projections")
    parser.add_argument("--decode", type=int, default=0, help="time a decode step of this many generations instead")
    parser.add_argument("--steps", type=int, default=20, help="--decode: timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="--decode: alternating rounds")
    parser.add_argument("--out", type=Path, default=None, help="default results/profile_mis.txt, decode_step.txt")
    args = parser.parse_args()
    results = Path(__file__).resolve().parent / "results"
    if args.decode:
        write_report(decode(args), args.out or results / "decode_step.txt")
        return
    engine = load(args.threads, args.gemm)
    other = load(args.threads, "torch" if args.gemm == "ours" else "ours")
    query, items = question(args.candidates, seed=args.candidates)

    def forward(e: Engine = engine):
        return e.score(query, items, labels=["Yes", "No"], mode="mis")

    change = score_change(forward(), forward(other))
    del other
    plain = []
    for _ in range(args.forwards):
        t0 = time.perf_counter()
        forward()
        plain.append((time.perf_counter() - t0) * 1e3)

    timers = Timers()
    undo = install(timers)
    try:
        result = forward()
        timers.reset()
        totals = []
        for _ in range(args.forwards):
            t0 = time.perf_counter()
            forward()
            totals.append((time.perf_counter() - t0) * 1e3)
        seconds, calls = dict(timers.seconds), dict(timers.calls)  # before the profiled forward adds to them
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward()
    finally:
        undo()

    n = args.forwards
    total = statistics.mean(totals)
    lines = [f"machine: {machine()}",
             f"{engine.model_name} bf16, threads {args.threads}, projections: {args.gemm}, {args.candidates} "
             f"candidates MIS, {result.usage.computed_tokens} computed tokens ({result.usage.prompt_tokens} prompt); "
             f"mean of {n} forwards",
             f"engine.score without timers: median {statistics.median(plain):.1f} ms (min {min(plain):.1f}); "
             f"with timers: mean {total:.1f} ms; scores vs the other projection path: max |diff| {change:.2e}", "",
             f"{'op (wall time per forward)':<36}{'calls':>7}{'ms':>9}{'share':>8}"]
    timed = 0.0
    for name, op_seconds in sorted(seconds.items(), key=lambda kv: -kv[1]):
        ms = op_seconds * 1e3 / n
        timed += ms
        lines.append(f"{name:<36}{calls[name] // n:>7}{ms:>9.2f}{ms / total:>8.1%}")
    lines.append(f"{'everything else':<36}{'':>7}{total - timed:>9.2f}{(total - timed) / total:>8.1%}")
    lines += ["", "torch profiler, one forward (self CPU time; pyscore::* rows are our timers' labels, their "
              "self time is the C++ kernel):",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
    write_report(lines, args.out or results / "profile_mis.txt")


if __name__ == "__main__":
    main()
