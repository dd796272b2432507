"""Where one 16-candidate MIS forward spends its time: the embedded SmolLM2 (bf16, 2 threads) scoring the bench
question in process, with wall-clock timers around every op the decoder and the read-out call (our C++ kernels are
invisible to the torch profiler) and the torch profiler's own table for the torch ops. Timers add a few
microseconds per call, so the total with timers is reported next to the plain one. `--linear ours` is an
experiment: the decoder's F.linear calls run pyscore.ops.linear on weights packed once (no fused epilogue), to
measure what the prepacked GEMM gives inside a real forward before the decoder adopts it.
Usage: python -m bench.profile_mis [--threads 2] [--forwards 10] [--linear torch|ours] [--out FILE]"""

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
from pyscore.engine import Engine
from pyscore.ops import AttentionPlan, linear, pack_linear

# Where the decoder and the engine look the ops up (attention runs through the batch's plan, once per layer).
TIMED = {decoder_module: ["add_rms_norm", "rotary_", "silu_mul"], engine_module: ["label_logprobs"],
         AttentionPlan: ["run"]}


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


def packed_linear_for_decoder() -> Callable:
    """F.linear's signature over pyscore.ops.linear, each weight packed on first use (keyed by the tensor)."""
    packed: dict[int, tuple[torch.Tensor, object]] = {}
    torch_linear = F.linear

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            return torch_linear(x, weight, bias)
        if id(weight) not in packed:
            packed[id(weight)] = (weight, pack_linear(weight, bias))
        return linear(x, packed[id(weight)][1])
    return run


def install(timers: Timers, gemm_name: str) -> Callable[[], None]:
    """Wraps the timed ops where the decoder and the engine look them up; returns the undo."""
    undo = []
    for module, names in TIMED.items():
        for name in names:
            original = getattr(module, name)
            label = "prefix_item_attention (plan.run)" if module is AttentionPlan else name
            setattr(module, name, timers.wrap(label, original))
            undo.append((module, name, original))
    undo.append((F, "linear", F.linear))
    F.linear = timers.wrap(gemm_name, F.linear)

    def restore() -> None:
        for module, name, original in undo:
            setattr(module, name, original)
    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forwards", type=int, default=10)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--linear", choices=["torch", "ours"], default="torch", help="the GEMM the decoder calls")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "profile_mis.txt")
    args = parser.parse_args()
    engine = Engine.from_pretrained(None, dtype="bfloat16", threads=args.threads)
    query, items = question(args.candidates, seed=args.candidates)

    def forward():
        return engine.score(query, items, labels=["Yes", "No"], mode="mis")

    torch_linear = F.linear
    with_torch_gemm = forward()
    if args.linear == "ours":
        F.linear = packed_linear_for_decoder()
    gemm_name = "linear (ours, prepacked GEMM)" if args.linear == "ours" else "F.linear (torch GEMM)"

    result = forward()
    score_change = max(abs(a - b) for x, y in zip(result.scores, with_torch_gemm.scores, strict=True)
                       for row_a, row_b in zip(x, y, strict=True) for a, b in zip(row_a, row_b, strict=True))
    plain = []
    for _ in range(args.forwards):
        t0 = time.perf_counter()
        forward()
        plain.append((time.perf_counter() - t0) * 1e3)

    timers = Timers()
    undo = install(timers, gemm_name)
    try:
        forward()
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
        F.linear = torch_linear

    n = args.forwards
    total = statistics.mean(totals)
    lines = [f"machine: {machine()}",
             f"{engine.model_name} bf16, threads {args.threads}, GEMM {args.linear}, {args.candidates} candidates MIS, "
             f"{result.usage.computed_tokens} computed tokens ({result.usage.prompt_tokens} prompt); "
             f"mean of {n} forwards",
             f"engine.score without timers: median {statistics.median(plain):.1f} ms (min {min(plain):.1f}); "
             f"with timers: mean {total:.1f} ms; scores vs the torch-GEMM forward: max |diff| {score_change:.2e}", "",
             f"{'op (wall time per forward)':<32}{'calls':>7}{'ms':>9}{'share':>8}"]
    timed = 0.0
    for name, op_seconds in sorted(seconds.items(), key=lambda kv: -kv[1]):
        ms = op_seconds * 1e3 / n
        timed += ms
        lines.append(f"{name:<32}{calls[name] // n:>7}{ms:>9.2f}{ms / total:>8.1%}")
    lines.append(f"{'everything else':<32}{'':>7}{total - timed:>9.2f}{(total - timed) / total:>8.1%}")
    lines += ["", "torch profiler, one forward (self CPU time; pyscore::* rows are our timers' labels, their "
              "self time is the C++ kernel):",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
