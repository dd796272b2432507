"""In-process engine benchmark: time to decision for one question at concurrency 1 on the embedded model,
Generate-free paths only (SIS vs MIS), across candidate counts, and MIS against stock transformers: the same
query+items tokens as ONE plain causal forward of AutoModelForCausalLM (same dtype, same process, so the same
thread settings), once with logits for every position (the default) and once with logits_to_keep=1. All four
are timed alternately (SIS, MIS, stock, stock keep-1, SIS, ...) so the machine's drift hits each alike.
Prints a table and writes bench/results/engine_cpu.json. `--shape qwen3.5-0.8b` (any bench.gpu.models shape) times
a random-weight model of that shape instead, on token-id questions of the same lengths (bench.gpu.workload; no
stock comparison: the random model has no checkpoint).
`--tier avx2` forces a lower CPU tier (PYSCORE_CPU_TIER) for the whole run; the header names the tier and the dtype
(`--dtype auto`, the default, is the tier's: bf16 where the CPU multiplies bf16, else fp32; stock runs in the same).
Every option: python -m bench.engine --help."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch

from bench.common import elapsed_ms, machine, machine_info, question
from bench.summary import percentile, write_json
from pyscore.engine import Engine
from pyscore.scoring import PreparedScore
from pyscore.types import ScoreRequest


def stock_model(engine: Engine) -> Any:
    """The engine's own weights as stock transformers, in the engine's dtype (default attention: sdpa)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.model.path, dtype=engine.decoder.dtype).eval()


def mis_input_ids(prepared: PreparedScore) -> torch.Tensor:
    """[1, T]: the query's tokens then every item's, the tokens MIS runs, as one causal sequence."""
    return torch.tensor([list(prepared.query) + [t for item in prepared.items for t in item]])


def stock_forward(model: Any, ids: torch.Tensor, keep: int | None) -> torch.Tensor:
    """Logits [1, T or keep, V] of one plain causal forward (no KV cache kept, as MIS keeps none)."""
    with torch.inference_mode():
        if keep is None:
            return model(input_ids=ids, use_cache=False).logits
        return model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits


def contenders(engine: Engine, stock: Any, query: Any, items: list[Any], labels: dict[str, Any]
                ) -> dict[str, Callable[[], Any]]:
    """What one row times: SIS and MIS through the engine, and (with `stock`) the stock forward both ways. The
    engine bypasses its prefix cache: every round is the question's first sight (bench.prefix_cache times warm)."""
    labels = {**labels, "bypass_prefix_cache": True}
    runs: dict[str, Callable[[], Any]] = {"sis": lambda: engine.score(query, items, mode="sis", **labels),
                                          "mis": lambda: engine.score(query, items, mode="mis", **labels)}
    if stock is not None:
        ids = mis_input_ids(engine.prepare_score(ScoreRequest(query, items, **labels)))
        runs["stock"] = lambda: stock_forward(stock, ids, None)
        runs["stock_keep1"] = lambda: stock_forward(stock, ids, 1)
    return runs


def alternate(runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """One warm-up of each, then `reps` rounds timing each in turn: {name: [ms per round]}."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            times[name].append(elapsed_ms(fn))
    return times


def load(args: argparse.Namespace) -> tuple[Engine, Callable[[int], tuple[Any, list[Any]]], dict[str, Any]]:
    """(engine, n -> (query, items), label arguments): the embedded model on text questions, or a random-weight
    model of --shape on token-id questions of the suite's lengths."""
    if args.shape is None:
        return (Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads), lambda n: question(n, seed=n),
                dict(labels=["Yes", "No"]))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tier", default=None, help="force this CPU tier (PYSCORE_CPU_TIER), at or below the CPU's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--candidates", type=int, nargs="+", default=[2, 5, 9, 16])
    ap.add_argument("--no-stock", action="store_true", help="skip stock transformers")
    ap.add_argument("--out", default="bench/results/engine_cpu.json")
    ap.add_argument("--shape", default=None, help="a bench.gpu.models shape with random weights (token-id questions)")
    args = ap.parse_args()
    if args.tier:
        os.environ["PYSCORE_CPU_TIER"] = args.tier
    engine, ask, labels = load(args)
    dtype = str(engine.decoder.dtype).removeprefix("torch.")
    stock = None if args.no_stock or args.shape else stock_model(engine)
    rows = []
    print(f"# {machine()} | CPU tier {engine.cpu_tier or '-'} | {engine.model_name} {dtype} threads={args.threads} "
          f"(torch {torch.get_num_threads()}) reps={args.reps}, alternating")
    print(f"{'items':>5} {'tokens q/item':>14} {'SIS p50 ms':>11} {'MIS p50 ms':>11} {'MIS/SIS':>8}"
          + ("" if stock is None else f" {'stock ms':>9} {'keep-1 ms':>10} {'stock/MIS':>10} {'keep-1/MIS':>11}"))
    for n in args.candidates:
        query, items = ask(n)
        prepared = engine.prepare_score(ScoreRequest(query, items, **labels))
        item_len = sum(map(len, prepared.items)) / n
        times = alternate(contenders(engine, stock, query, items, labels), args.reps)
        p50 = {name: percentile(ts, 50) for name, ts in times.items()}
        row: dict[str, Any] = dict(items=n, query_tokens=len(prepared.query), item_tokens=item_len,
                                   sis_ms=p50["sis"], mis_ms=p50["mis"], sis_all=times["sis"], mis_all=times["mis"])
        line = (f"{n:>5} {len(prepared.query):>6}/{item_len:<7.1f} {row['sis_ms']:>11.1f} {row['mis_ms']:>11.1f} "
                f"{row['mis_ms'] / row['sis_ms']:>8.3f}")
        if stock is not None:
            row.update(mis_tokens=len(prepared.query) + sum(map(len, prepared.items)), stock_ms=p50["stock"],
                       stock_keep1_ms=p50["stock_keep1"],
                       stock_all=times["stock"], stock_keep1_all=times["stock_keep1"],
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
    write_json(args.out, dict(machine=machine(), cpu=machine_info(), tier=engine.cpu_tier, dtype=dtype,
                              threads=args.threads, model=engine.model_name,
                              ratio_uses="stock (default forward) / MIS", rows=rows),
               indent=2)


if __name__ == "__main__":
    main()
