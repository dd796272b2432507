"""Prefix cache benchmark (issue 10) on the embedded model: decision questions that share a system prompt
(--system tokens, default 1000 and 200) followed by their own ~70-token part and 2/5/9/16 candidates.

1. In process, closed loop c=1: each question is timed cold (bypass_prefix_cache: nothing read, nothing written)
   and warm (the cache as it is: the system prompt's blocks, stored by earlier questions, are read; the question's
   own part is computed), alternating cold / warm question by question, for MIS, Generate (one one-token
   completion per candidate, prefilled together, as a client of the generate path sends them) and fused (one
   chat-templated prompt listing the options, one token). p50 per cell, warm/cold, tokens computed and cached.
2. Served, open loop: Poisson ladders of MIS questions against a server of our own, bypass vs cache on, the two
   alternated level by level; p50/p95 time to decision and achieved rate.
(What the cache's pages hold beside running generations: `python -m bench.memory --kv-sharing`.) Run it alone.
Usage: python -m bench.prefix_cache [--system 1000 200] [--reps 3]
[--only closed|served]. Writes bench/results/latest/prefix_cache_cpu[_PART].json or --out (and prints the tables)."""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import prompts
from bench.common import WORDS, git_commit, machine, machine_info, sentence, spawned_server
from bench.dataset import Question
from bench.loadgen import open_loop, poisson_schedule, summarize_records
from bench.summary import default_out, percentile, write_json
from bench.targets import GrpcTarget
from pyscore.engine import Engine
from pyscore.types import GenerateRequest, Usage

LABELS = [" Yes", " No"]


# --- the workload ------------------------------------------------------------------------------------------------
def text_of_tokens(engine: Engine, tokens: int, seed: int) -> str:
    """Seeded sentences until the text is `tokens` tokens long (give or take the last sentence)."""
    rng = random.Random(seed)
    text = ""
    while len(engine.tokenize(text, add_special_tokens=False)[0]) < tokens:
        text += sentence(rng, 10) + " "
    return text


def questions(engine: Engine, system_tokens: int, candidates: int, count: int, seed: int) -> list[Question]:
    """`count` questions sharing one system prompt, each with its own ~70-token part and
    `candidates` options of ~15 words (the pointwise items are ~30 tokens)."""
    system = text_of_tokens(engine, system_tokens, seed=1)
    rng = random.Random(seed)
    out = []
    for i in range(count):
        own = text_of_tokens(engine, 60, seed=rng.randrange(1 << 30))
        options = [" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(candidates)]
        out.append(Question(id=f"s{system_tokens}-n{candidates}-{i}", source="prefix-cache", state_json=system + own,
                            question="Which action should the agent take next?", options=options,
                            target=[float(j == 0) for j in range(candidates)]))
    return out


# --- in process, closed loop ---------------------------------------------------------------------------------------
def mis(engine: Engine, q: Question, cold: bool) -> list[Usage]:
    p = prompts.pointwise(q)
    return [engine.score(p.query, p.items, labels=LABELS, apply_softmax=True, mode="mis",
                         bypass_prefix_cache=cold).usage]


def generate(engine: Engine, q: Question, cold: bool) -> list[Usage]:
    p = prompts.pointwise(q)
    gens = [engine.start_generation(GenerateRequest(prompt=p.query + item, max_tokens=1, top_logprobs=5,
                                                    bypass_prefix_cache=cold)) for item in p.items]
    while not all(g.finished for g in gens):
        engine.step(gens)
    return [g.result().usage for g in gens]


def fused(engine: Engine, q: Question, cold: bool) -> list[Usage]:
    request = GenerateRequest(prompt=prompts.fused_choice(q), apply_chat_template=True, max_tokens=1,
                              top_logprobs=20, bypass_prefix_cache=cold)
    return [engine.generate(request).usage]


PATHS: dict[str, Callable[[Engine, Question, bool], list[Usage]]] = {"mis": mis, "generate": generate,
                                                                     "fused": fused}


def closed_loop_row(engine: Engine, path: str, qs: list[Question]) -> dict[str, Any]:
    """qs[0] warms the cache (stores the system prompt); then every question cold, then warm."""
    run = PATHS[path]
    run(engine, qs[0], False)
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    usage: dict[str, list[Usage]] = {"cold": [], "warm": []}
    for q in qs[1:]:
        for kind in ("cold", "warm"):
            t0 = time.perf_counter()
            usage[kind] = run(engine, q, kind == "cold")
            times[kind].append((time.perf_counter() - t0) * 1e3)
    p50 = {k: percentile(v, 50) for k, v in times.items()}
    tokens = {k: (sum(u.computed_tokens for u in us), sum(u.cached_tokens for u in us)) for k, us in usage.items()}
    return dict(path=path, candidates=qs[0].num_candidates, cold_ms=p50["cold"], warm_ms=p50["warm"],
                speedup=p50["cold"] / p50["warm"], cold_all=times["cold"], warm_all=times["warm"],
                cold_computed=tokens["cold"][0], warm_computed=tokens["warm"][0], warm_cached=tokens["warm"][1])


def closed_loop(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print(f"\n## In process, closed loop c=1 ({args.reps} questions each, cold and warm alternated)")
    print(f"{'system':>6} {'path':>8} {'cands':>5} {'cold p50 ms':>11} {'warm p50 ms':>11} {'cold/warm':>9} "
          f"{'computed cold -> warm (cached)':>30}")
    for system in args.system:
        for path in PATHS:
            for n in args.candidates if path != "generate" else args.generate_candidates:
                # each cell its own questions: no cell finds another's question parts cached
                qs = questions(engine, system, n, args.reps + 1, seed=system * 100 + list(PATHS).index(path) * 20 + n)
                row = dict(system_tokens=system, query_tokens=len(engine.tokenize(prompts.pointwise(qs[1]).query)[0]),
                           **closed_loop_row(engine, path, qs))
                rows.append(row)
                print(f"{system:>6} {path:>8} {n:>5} {row['cold_ms']:>11.1f} {row['warm_ms']:>11.1f} "
                      f"{row['speedup']:>8.2f}x {row['cold_computed']:>12} -> {row['warm_computed']:>5} "
                      f"({row['warm_cached']})")
    return rows


# --- served, open loop ---------------------------------------------------------------------------------------------
def scrape(port: int | None) -> dict[str, float]:
    if port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.partition(" ") for line in lines)
            if name.startswith("pyscore_prefix_cache")}


async def open_ladder(address: str, qs: list[Question], args: argparse.Namespace) -> list[dict[str, Any]]:
    targets = {"cold": GrpcTarget(address, prefix_cache="off"), "warm": GrpcTarget(address, prefix_cache="shared")}
    for t in targets.values():
        await t.open()
    await targets["warm"].decide("mis", qs[0])  # the system prompt's blocks
    rows = []
    for level, qps in enumerate(args.open_qps):
        for kind, target in targets.items():
            batch = qs[1 + level * args.arrivals: 1 + (level + 1) * args.arrivals]
            result = await open_loop(target, "mis", batch, poisson_schedule(qps, len(batch), seed=level))
            s = summarize_records(result.records, result.wall_s)
            e2e = s["end_to_end_latency_ms"]
            rows.append(dict(qps=qps, kind=kind, p50_ms=e2e["p50"], p95_ms=e2e["p95"], achieved_qps=s["achieved_qps"],
                             errors=s["num_errors"], mean_computed_tokens=s["mean_computed_tokens"]))
            print(f"{qps:>6.2f} {kind:>5} {e2e['p50']:>9.0f} {e2e['p95']:>9.0f} {s['achieved_qps']:>9.2f} "
                  f"{s['mean_computed_tokens']:>9.0f} {s['num_errors']:>6}")
    for t in targets.values():
        await t.close()
    return rows


def served(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The open-loop ladder against a server of our own."""
    n = args.open_candidates
    qs = questions(engine, args.system[0], n, 1 + len(args.open_qps) * args.arrivals, seed=99)
    log = Path(tempfile.mkdtemp(prefix="prefix-cache-bench-")) / "server.log"
    with spawned_server(log, ["--threads", str(args.threads), "--dtype", args.dtype], metrics=True) as server:
        print(f"\n## Served (gRPC), open loop: MIS, system {args.system[0]} tokens, {n} candidates, "
              f"{args.arrivals} arrivals per level and kind")
        print(f"{'qps':>6} {'kind':>5} {'p50 ms':>9} {'p95 ms':>9} {'achieved':>9} {'computed':>9} {'errors':>6}")
        return dict(open_loop=asyncio.run(open_ladder(server.target, qs, args)),
                    metrics_after_open_loop=scrape(server.metrics_port))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system", type=int, nargs="+", default=[1000, 200], help="shared system prompt tokens")
    ap.add_argument("--candidates", type=int, nargs="+", default=[2, 5, 9, 16])
    ap.add_argument("--generate-candidates", type=int, nargs="+", default=[2, 5],
                    help="the generate path's candidate counts (its cold run computes the query once per candidate)")
    ap.add_argument("--reps", type=int, default=3, help="questions per cell (each timed cold and warm)")
    ap.add_argument("--only", choices=["closed", "served"], help="run one part (two short quiet runs)")
    ap.add_argument("--open-qps", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--open-candidates", type=int, default=5)
    ap.add_argument("--arrivals", type=int, default=8, help="arrivals per open-loop level and kind")
    ap.add_argument("--out", default=None, help="default bench/results/latest/prefix_cache_cpu[_PART].json")
    args = ap.parse_args()
    engine = Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads)
    print(f"# {machine()} | {engine.model_name} {args.dtype} threads={args.threads} | commit {git_commit()}")
    result: dict[str, Any] = dict(machine=machine(), cpu=machine_info(), commit=git_commit(), dtype=args.dtype,
                                  threads=args.threads, model=engine.model_name, args=vars(args))
    if args.only != "served":
        result["closed_loop"] = closed_loop(engine, args)
    if args.only != "closed":
        result.update(served(engine, args))  # the engine only tokenizes there; the servers do the work
    out = Path(args.out or default_out(f"prefix_cache_cpu{'_' + args.only if args.only else ''}.json"))
    write_json(out, result, indent=2)


if __name__ == "__main__":
    main()
