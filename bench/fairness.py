"""Fairness under one long request (issue 23's target): the p95 time of a 3-candidate Score while a long request
is always in flight, against its idle p95, for one-pass prefill and for several --prefill-chunk-tokens.

A request is chunked when it computes more than --max-batch-tokens (the default 8192 is more than SmolLM2 can
take: its one-pass row is what serving did before chunked prefill); a chunk has --prefill-chunk-tokens tokens.
For each server configuration (SmolLM2, the make-serve model, on the kernel path; one server each): an idle phase
of short Scores one after another, then the same short Scores while a second client sends long MIS requests back
to back (each a fresh query, so none is read from the prefix cache; the first long one is a warm-up). A short
Score counts in the loaded phase only if a long request was in flight when it was sent. The long request is as
long as the model's context allows (SmolLM2: 8192 tokens; issue 23 asks for 16k, which it cannot take).
Percentiles: bench.summary's. Run it alone (under the machine lock): `python -m bench.fairness
--out bench/results/fairness.txt` (the record; without --out, bench/results/latest/fairness.txt)."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench.common import cpu, git_commit, question, spawned_server
from bench.summary import Summary, default_out, write_report
from pyscore.client import AsyncScorerClient

LABELS = ["Yes", "No"]
LONG_WORDS = 7000  # ~7.8k tokens with its item: SmolLM2's context is 8192
TARGET_RATIO = 3.0


async def short_latencies(client: AsyncScorerClient, n: int, seed: int,
                          in_flight: list[tuple[float, float]] | None = None) -> list[float]:
    """n short 3-candidate Scores one after another (fresh queries); seconds each. With `in_flight` (the long
    requests' [start, end) windows, an open one ending at inf), only those sent while a long one ran."""
    out = []
    for i in range(n):
        query, items = question(3, seed=seed + i)
        start = time.monotonic()
        await client.score(query, items, labels=LABELS, timeout=600)
        if in_flight is None or any(a <= start < b for a, b in in_flight):
            out.append(time.monotonic() - start)
    return out


async def long_requests(client: AsyncScorerClient, windows: list[tuple[float, float]], stop: asyncio.Event,
                        tokens: list[int]) -> None:
    """Long MIS requests back to back until `stop`; each one's [start, end) goes to `windows`."""
    seed = 10_000
    while not stop.is_set():
        query, items = question(1, seed=seed, query_words=LONG_WORDS)
        seed += 1
        start = time.monotonic()
        windows.append((start, float("inf")))
        result = await client.score(query, items, labels=LABELS, timeout=900)
        windows[-1] = (start, time.monotonic())
        tokens.append(result.usage.prompt_tokens)


async def measure(target: str, n_idle: int, n_loaded: int) -> tuple[Summary, Summary, Summary, int]:
    """The short Scores' latencies idle and under load (ms), the long requests' and their longest prompt."""
    async with AsyncScorerClient(target) as short, AsyncScorerClient(target) as long:
        await short_latencies(short, 5, seed=1)  # warm-up
        idle = await short_latencies(short, n_idle, seed=100)
        windows: list[tuple[float, float]] = []
        tokens: list[int] = []
        stop = asyncio.Event()
        background = asyncio.create_task(long_requests(long, windows, stop, tokens))
        while not windows:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # the first long request is in its prefill
        loaded = await short_latencies(short, n_loaded, seed=1000, in_flight=windows)
        stop.set()
        await background
    done = [b - a for a, b in windows if b != float("inf")]
    return (Summary.of(idle, scale=1e3), Summary.of(loaded, scale=1e3), Summary.of(done, scale=1e3),
            max(tokens, default=0))


def run(configs: list[tuple[str, list[str]]], n_idle: int, n_loaded: int, logs: Path) -> list[str]:
    lines = [f"# bench.fairness: a 3-candidate Score's latency with a long request always in flight "
             f"(issue 23 target: loaded p95 <= {TARGET_RATIO:g} x idle p95)",
             f"# cpu: {cpu()}; commit {git_commit()}; SmolLM2-135M-Instruct (bf16 where the CPU multiplies bf16), "
             "kernel path, --threads 2; short Score ~360 tokens (3 items), fresh query each",
             f"# {'config':<26} {'idle p50':>9} {'idle p95':>9} {'load p50':>9} {'load p95':>9} {'ratio':>6} "
             f"{'n':>4} {'long ms p50':>12} {'long tokens':>12}  target"]
    for name, flags in configs:
        with spawned_server(logs / f"fairness_{name}.log", ["--threads", "2", *flags]) as server:
            idle, loaded, long, long_tokens = asyncio.run(
                measure(server.target, n_idle, n_loaded if "one-pass" not in name else n_loaded // 3))
        ratio = loaded.p95 / idle.p95
        lines.append(f"  {name:<26} {idle.p50:9.1f} {idle.p95:9.1f} {loaded.p50:9.1f} {loaded.p95:9.1f} "
                     f"{ratio:6.2f} {loaded.count:4d} {long.p50:12.0f} {long_tokens:12d}  "
                     f"{'met' if ratio <= TARGET_RATIO else 'MISSED'}")
        print(lines[-1], flush=True)
    return lines


CONFIGS = {
    "one-pass (default flags)": [],
    "budget 1024, chunks 1024": ["--max-batch-tokens", "1024"],
    "budget 1024, chunks 256": ["--max-batch-tokens", "1024", "--prefill-chunk-tokens", "256"],
    "budget 1024, chunks 128": ["--max-batch-tokens", "1024", "--prefill-chunk-tokens", "128"],
    "budget 1024, chunks 64": ["--max-batch-tokens", "1024", "--prefill-chunk-tokens", "64"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-idle", type=int, default=60)
    p.add_argument("--n-loaded", type=int, default=60, help="short Scores under load (a third for one-pass)")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", type=Path, default=default_out("fairness.txt"))
    p.add_argument("--logs", type=Path, default=Path("/tmp/pyscore-fairness"), help="the servers' logs")
    a = p.parse_args()
    lines = run([(c, CONFIGS[c]) for c in a.configs], a.n_idle, a.n_loaded, a.logs)
    write_report(lines, a.out, echo=False)


if __name__ == "__main__":
    main()
