"""The prefix cache's kv sink, before and after cd4d241, alternated in one process: the writer before it (a gather
and an index_copy_ per layer, copied below from `git show cd4d241^:pyscore/model/prefix_cache.py`) against today's
(one slice copy per run of blocks consecutive in the stream and in the pool), on a cold salted 16-candidate MIS of
the embedded SmolLM2 (every query block written), with bypass (nothing written) as the floor; 10 rounds in ABBA
order; the scores compared bitwise, and a warm request (the same salt) against its cold one for each writer. It
wrote bench/results/tiers/engine/prefix_cache_sink_ab.txt:

    python -m bench.probes.prefix_cache_sink [DTYPE]
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from bench.common import machine, question
from pyscore.engine import Engine
from pyscore.model.prefix_cache import PrefixCache
from pyscore.types import ScoreRequest

Sink = Callable[[int, torch.Tensor, torch.Tensor], None]


def gather_writer(self: PrefixCache, writes: Sequence[tuple[int, int]]) -> Sink | None:
    """PrefixCache.writer as it was before cd4d241."""
    if not writes:
        return None
    b = self.block_tokens
    rows = torch.cat([torch.arange(start, start + b) for start, _ in writes]).to(self.pool.device)
    slots = torch.tensor([slot for _, slot in writes], device=self.pool.device)

    def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for pool, x in zip(self.layer(layer), (k, v), strict=True):
            pool.index_copy_(0, slots, x[rows].view(len(writes), b, *x.shape[1:]))

    return sink


WRITERS = {"A": gather_writer, "B": PrefixCache.writer}


def main() -> None:
    engine = Engine.from_pretrained(None, dtype=sys.argv[1] if len(sys.argv) > 1 else "auto", threads=2)
    print(machine())
    query, items = question(16, seed=16)

    def run(which: str, bypass: bool = False, salt: str = "") -> tuple[float, object]:
        PrefixCache.writer = WRITERS[which]  # type: ignore[method-assign]
        request = ScoreRequest(query=query, items=list(items), labels=["Yes", "No"], mode="mis",
                               bypass_prefix_cache=bypass, prefix_cache_salt=salt or uuid.uuid4().hex)
        start = time.perf_counter()
        result = engine.score_batch([request])[0]
        return (time.perf_counter() - start) * 1e3, result

    for which in "AB":
        run(which)
        run(which, bypass=True)
    ms: dict[str, list[float]] = {"A": [], "B": [], "bypass": []}
    scores = {}
    for i in range(10):
        for which in "AB" if i % 2 == 0 else "BA":
            t, result = run(which)
            ms[which].append(t)
            scores[which] = result.scores
        ms["bypass"].append(run("B", bypass=True)[0])
    for name, v in ms.items():
        print(f"{name:>7}: median {statistics.median(v):6.1f} ms  {[round(x, 1) for x in v]}")
    print("A/B", round(statistics.median(ms["A"]) / statistics.median(ms["B"]), 3), "scores bitwise equal:",
          scores["A"] == scores["B"])
    for which in "AB":
        salt = uuid.uuid4().hex
        cold = run(which, salt=salt)[1]
        warm = run(which, salt=salt)[1]
        print(which, "warm cached", warm.usage.cached_tokens, "warm == cold:", warm.scores == cold.scores)


if __name__ == "__main__":
    main()
