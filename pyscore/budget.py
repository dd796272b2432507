"""The token-budget cut, written once: the server's batcher uses it to choose which waiting requests join one
engine call, and the engine to choose which packed groups share one forward pass. Work is taken in arrival
order while it fits; the first piece always goes, so a piece larger than the budget runs alone. Also the prefix
cache's default byte budget and the other defaults of the pools, which the engine and the server's flags share."""

from __future__ import annotations

from collections.abc import Iterable

# The prefix cache's default budget (MiB): ~45k tokens of SmolLM2-135M's keys and values in bf16 (23 KiB a token),
# ~9k of a Qwen3-0.6B's; its pool's pages take memory only once written.
DEFAULT_PREFIX_CACHE_MB = 1024.0
# The server's other defaults that memory grows into (pyscore.memory plans with them): the token budget of one
# forward pass, the KV-cache tokens running generations may reserve, and how many may run at once.
DEFAULT_MAX_BATCH_TOKENS = 8192
DEFAULT_MAX_KV_TOKENS = 65536
DEFAULT_MAX_RUNNING_GENERATIONS = 64


def count_within_budget(sizes: Iterable[int], budget: int) -> int:
    """How many of the leading `sizes` (tokens, in arrival order) one batch of at most `budget` tokens takes:
    at least one when there is any."""
    taken = used = 0
    for size in sizes:
        if taken and used + size > budget:
            break
        taken, used = taken + 1, used + size
    return taken
