"""In-process engine benchmark on the embedded model (or, with `--shape`, a random-weight model of a bench.gpu.models
shape on token-id questions of the same lengths), three measurements:

- default: time to decision of one question at concurrency 1 across candidate counts, SIS vs MIS and, for MIS, stock
  transformers' one plain causal forward over the same tokens (all positions' logits, and logits_to_keep=1), all
  four timed alternately; a table, and bench/results/engine_cpu.json;
- `--profile`: where one MIS forward spends its time: wall-clock timers around every op the decoder and the read-out
  call (our C++ kernels are invisible to the torch profiler), then the torch profiler's table; `--gemm torch` loads
  the model with no linear kernel registered, so the projections run on torch's path (bench/results/profile_mis.txt);
- `--decode B`: one decode step of B running generations, our projections against torch's, alternating
  (bench/results/decode_step.txt).

`--tier T` forces a CPU tier (PYSCORE_CPU_TIER); `--dtype auto` is the tier's (bf16 where the CPU multiplies bf16).
The engine bypasses its prefix cache: every round is the question's first sight (bench.prefix_cache times warm;
`--profile --warm` profiles the forward whose query blocks hit the cache)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import pyscore.engine as engine_module
import pyscore.model.decoder as decoder_module
from bench.common import REPO, alternate, elapsed_ms, machine, machine_info, question
from bench.summary import percentile, write_json, write_report
from pyscore.engine import Engine
from pyscore.ops import AttentionPlan, _ext
from pyscore.scoring import PreparedScore
from pyscore.types import GenerateRequest, ScoreRequest

RESULTS = REPO / "bench" / "results"
LABELS = ["Yes", "No"]


# --- time to decision, against stock transformers ---------------------------------------------------------------
def stock_model(engine: Engine) -> Any:
    """The engine's own weights as stock transformers, in the engine's dtype (default attention: sdpa); for a
    --shape model, stock transformers' own random init of the same config (the same work, other weights: its time
    is comparable, its scores are not)."""
    from transformers import AutoModelForCausalLM

    if str(engine.model.path).startswith("random:"):
        return AutoModelForCausalLM.from_config(engine.model.hf_config, dtype=engine.decoder.dtype).eval()
    return AutoModelForCausalLM.from_pretrained(engine.model.path, dtype=engine.decoder.dtype).eval()


def mis_input_ids(prepared: PreparedScore) -> torch.Tensor:
    """[1, T]: the query's tokens then every item's, the tokens MIS runs, as one causal sequence."""
    return torch.tensor([list(prepared.query) + [t for item in prepared.items for t in item]])


def stock_forward(model: Any, ids: torch.Tensor, keep: int | None) -> torch.Tensor:
    """Logits [1, T or keep, V] of one plain causal forward (no KV cache kept, as MIS keeps none)."""
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False, **({} if keep is None else {"logits_to_keep": keep})).logits


def contenders(engine: Engine, stock: Any, query: Any, items: list[Any], labels: dict[str, Any], sis: bool = True
               ) -> dict[str, Callable[[], Any]]:
    labels = {**labels, "bypass_prefix_cache": True}
    runs: dict[str, Callable[[], Any]] = {"mis": lambda: engine.score(query, items, mode="mis", **labels)}
    if sis:
        runs["sis"] = lambda: engine.score(query, items, mode="sis", **labels)
    if stock is not None:
        ids = mis_input_ids(engine.prepare_score(ScoreRequest(query, items, **labels)))
        runs["stock"] = lambda: stock_forward(stock, ids, None)
        runs["stock_keep1"] = lambda: stock_forward(stock, ids, 1)
    return runs


def load(args: argparse.Namespace) -> tuple[Engine, Callable[[int], tuple[Any, list[Any]]], dict[str, Any]]:
    """(engine, n -> (query, items), label arguments): the embedded model on text questions, or a random-weight
    model of --shape on token-id questions of the suite's lengths."""
    if args.shape is None:
        return (Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads), lambda n: question(n, seed=n),
                dict(labels=LABELS))
    from bench.gpu.models import build_random_engine
    from bench.gpu.workload import id_question, labels_for
    from pyscore.engine import set_threads

    set_threads(args.threads)
    engine = build_random_engine(args.shape, device="cpu", dtype=args.dtype)
    vocab = engine.cfg.vocab_size

    def ask(n: int) -> tuple[list[int], list[list[int]]]:
        q = id_question(n, seed=n, vocab=vocab)
        return q.query, q.items

    return engine, ask, dict(label_token_ids=labels_for(vocab))


def time_to_decision(args: argparse.Namespace) -> None:
    engine, ask, labels = load(args)
    dtype = str(engine.decoder.dtype).removeprefix("torch.")
    stock = None if args.no_stock else stock_model(engine)
    print(f"# {machine()} | CPU tier {engine.cpu_tier or '-'} | {engine.model_name} {dtype} threads={args.threads} "
          f"(torch {torch.get_num_threads()}) reps={args.reps}, alternating")
    print(f"{'items':>5} {'tokens q/item':>14} {'SIS p50 ms':>11} {'MIS p50 ms':>11} {'MIS/SIS':>8}"
          + ("" if stock is None else f" {'stock ms':>9} {'keep-1 ms':>10} {'stock/MIS':>10} {'keep-1/MIS':>11}"))
    rows = []
    for n in args.candidates:
        query, items = ask(n)
        prepared = engine.prepare_score(ScoreRequest(query, items, **labels))
        item_len = sum(map(len, prepared.items)) / n
        runs = contenders(engine, stock, query, items, labels, sis=not args.no_sis)
        for fn in runs.values():  # one warm-up each
            fn()
        times = alternate(runs, args.reps)
        p50 = {name: percentile(ts, 50) for name, ts in times.items()}
        p50.setdefault("sis", float("nan"))  # --no-sis
        row: dict[str, Any] = dict(items=n, query_tokens=len(prepared.query), item_tokens=item_len,
                                   sis_ms=p50["sis"], mis_ms=p50["mis"], sis_all=times.get("sis", []),
                                   mis_all=times["mis"])
        line = (f"{n:>5} {len(prepared.query):>6}/{item_len:<7.1f} {row['sis_ms']:>11.1f} {row['mis_ms']:>11.1f} "
                f"{row['mis_ms'] / row['sis_ms']:>8.3f}")
        if stock is not None:
            row.update(mis_tokens=len(prepared.query) + sum(map(len, prepared.items)), stock_ms=p50["stock"],
                       stock_keep1_ms=p50["stock_keep1"], stock_all=times["stock"],
                       stock_keep1_all=times["stock_keep1"],
                       stock_over_mis=p50["stock"] / p50["mis"], stock_keep1_over_mis=p50["stock_keep1"] / p50["mis"])
            line += (f" {row['stock_ms']:>9.1f} {row['stock_keep1_ms']:>10.1f} {row['stock_over_mis']:>9.2f}x "
                     f"{row['stock_keep1_over_mis']:>10.2f}x")
        rows.append(row)
        print(line)
    by_n = {r["items"]: r for r in rows}
    if 2 in by_n and 16 in by_n:
        print(f"MIS(16)/MIS(2) = {by_n[16]['mis_ms'] / by_n[2]['mis_ms']:.2f}")
    if stock is not None:
        print("stock = one AutoModelForCausalLM forward over the query+items tokens (use_cache=False); stock/MIS, "
              "the ratio issue #9 sets its target on, uses the default forward (logits at every position); "
              "keep-1/MIS the forward with logits_to_keep=1 (no LM head over the other positions)")
    write_json(args.out or RESULTS / "engine_cpu.json", dict(
        machine=machine(), cpu=machine_info(), tier=engine.cpu_tier, dtype=dtype, threads=args.threads,
        model=engine.model_name, ratio_uses="stock (default forward) / MIS", rows=rows), indent=2)


# --- where the time goes ------------------------------------------------------------------------------------------
# Where the decoder and the engine look the ops up (attention runs through the batch's plan, once per layer).
TIMED = {decoder_module: ["add_rms_norm", "rotary_", "linear"], engine_module: ["label_logprobs"],
         AttentionPlan: ["run"], F: ["linear"]}
OP_LABELS = {(AttentionPlan, "run"): "prefix_item_attention (plan.run)", (F, "linear"): "F.linear (torch GEMM)",
             (decoder_module, "linear"): "linear (GEMM + epilogue, whichever path)"}


class Timers:
    """Per-op wall time and call counts, and a torch.profiler label for each call."""

    def __init__(self) -> None:
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

    def install(self) -> Callable[[], None]:
        """Wraps the timed ops where the decoder and the engine look them up; returns the undo."""
        undo = []
        for module, names in TIMED.items():
            for name in names:
                original = getattr(module, name)
                setattr(module, name, self.wrap(OP_LABELS.get((module, name), name), original))
                undo.append((module, name, original))

        def restore() -> None:
            for module, name, original in undo:
                setattr(module, name, original)
        return restore


def load_gemm(args: argparse.Namespace, gemm: str) -> Engine:
    """The embedded model; with gemm="torch", loaded while the registry has no linear kernel (plain projections)."""
    kernels = _ext.REGISTRY["linear"]
    if gemm == "torch":
        _ext.REGISTRY["linear"] = {}
    try:
        return Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads)
    finally:
        _ext.REGISTRY["linear"] = kernels


def step_ms(engine: Engine, prompts: list[str], steps: int) -> tuple[float, int]:
    """Median ms of a decode step over `steps` steps after the prefill, and the cache length at the end."""
    engine.generation.eos_ids = frozenset()  # every generation runs its full length
    gens = [engine.start_generation(GenerateRequest(prompt=p, max_tokens=steps + 2)) for p in prompts]
    engine.step(gens)  # prefill
    times = [elapsed_ms(lambda: engine.step(gens)) for _ in range(steps)]
    return statistics.median(times), gens[0].cache.length


def decode(args: argparse.Namespace) -> list[str]:
    engines = {gemm: load_gemm(args, gemm) for gemm in ("ours", "torch")}
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


def profile(args: argparse.Namespace) -> list[str]:
    engine = load_gemm(args, args.gemm)
    n = args.candidates[-1]
    query, items = question(n, seed=n)

    def forward(e: Engine = engine):
        return e.score(query, items, labels=LABELS, mode="mis", bypass_prefix_cache=not args.warm)

    other = forward(load_gemm(args, "torch" if args.gemm == "ours" else "ours"))
    change = max(abs(x - y) for a, b in zip(forward().scores, other.scores, strict=True)
                 for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    plain = [elapsed_ms(forward) for _ in range(args.forwards)]
    timers = Timers()
    undo = timers.install()
    try:
        result = forward()
        timers.seconds.clear()
        timers.calls.clear()
        totals = [elapsed_ms(forward) for _ in range(args.forwards)]
        seconds, calls = dict(timers.seconds), dict(timers.calls)  # before the profiled forward adds to them
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward()
    finally:
        undo()
    total = statistics.mean(totals)
    lines = [f"machine: {machine()}",
             f"{engine.model_name} {str(engine.decoder.dtype).removeprefix('torch.')}, threads {args.threads}, "
             f"projections: {args.gemm}, {n} candidates MIS, {result.usage.computed_tokens} computed tokens "
             f"({result.usage.prompt_tokens} prompt); mean of {args.forwards} forwards",
             f"engine.score without timers: median {statistics.median(plain):.1f} ms (min {min(plain):.1f}); "
             f"with timers: mean {total:.1f} ms; scores vs the other projection path: max |diff| {change:.2e}", "",
             f"{'op (wall time per forward)':<36}{'calls':>7}{'ms':>9}{'share':>8}"]
    timed = 0.0
    for name, op_seconds in sorted(seconds.items(), key=lambda kv: -kv[1]):
        ms = op_seconds * 1e3 / args.forwards
        timed += ms
        lines.append(f"{name:<36}{calls[name] // args.forwards:>7}{ms:>9.2f}{ms / total:>8.1%}")
    return [*lines, f"{'everything else':<36}{'':>7}{total - timed:>9.2f}{(total - timed) / total:>8.1%}", "",
            "torch profiler, one forward (self CPU time; pyscore::* rows are our timers' labels, their self time is "
            "the C++ kernel):", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tier", default=None, help="force this CPU tier (PYSCORE_CPU_TIER), at or below the CPU's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--candidates", type=int, nargs="+", default=[2, 5, 9, 16], help="--profile: the last")
    ap.add_argument("--no-stock", action="store_true", help="skip stock transformers")
    ap.add_argument("--no-sis", action="store_true", help="skip SIS (big --shape models: MIS alone)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default=None, help="a bench.gpu.models shape with random weights (token-id questions)")
    ap.add_argument("--profile", action="store_true", help="where one MIS forward spends its time")
    ap.add_argument("--gemm", choices=["ours", "torch"], default="ours", help="--profile: the projections' path")
    ap.add_argument("--forwards", type=int, default=10, help="--profile: timed forwards")
    ap.add_argument("--warm", action="store_true", help="--profile: with the prefix cache (the query's blocks hit)")
    ap.add_argument("--decode", type=int, default=0, help="time a decode step of this many generations")
    ap.add_argument("--steps", type=int, default=20, help="--decode: timed steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="--decode: alternating rounds")
    args = ap.parse_args()
    if args.tier:
        os.environ["PYSCORE_CPU_TIER"] = args.tier
    if args.decode:
        write_report(decode(args), args.out or RESULTS / "decode_step.txt")
    elif args.profile:
        write_report(profile(args), args.out or RESULTS / "profile_mis.txt")
    else:
        time_to_decision(args)


if __name__ == "__main__":
    main()
