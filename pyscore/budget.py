"""The token-budget cut, written once: the server's batcher uses it to choose which waiting requests join one
engine call, and the engine to choose which packed groups share one forward pass. Work is taken in arrival
order while it fits; the first piece always goes, so a piece larger than the budget runs alone. Also the KV store's
byte budget (one budget, --kv-cache-mb, for the prefix cache and running generations) and the other defaults of
the pools, which the engine and the server's flags share."""

from __future__ import annotations

from collections.abc import Iterable

# The KV store's default, when --kv-cache-mb is not given: 65536 tokens of keys and values + 1024 MiB (what the two
# budgets it replaced held together by default), so a server started as before holds no more memory than before
# (SmolLM2-135M in bf16: 23 KiB a token, 2.4 GiB in all). Its pages take memory only once written.
DEFAULT_KV_STORE_TOKENS = 65536
DEFAULT_KV_STORE_EXTRA_MB = 1024.0
# The server's other defaults that memory grows into (pyscore.memory plans with them): the token budget of one
# forward pass and how many generations may run at once.
DEFAULT_MAX_BATCH_TOKENS = 8192
DEFAULT_MAX_RUNNING_GENERATIONS = 64


def kv_store_bytes(kv_cache_mb: float | None, bytes_per_token: int) -> int:
    """The KV store's byte budget: kv_cache_mb MiB when given, else the default (DEFAULT_KV_STORE_TOKENS tokens'
    worth + DEFAULT_KV_STORE_EXTRA_MB)."""
    if kv_cache_mb is not None:
        return int(kv_cache_mb * 2**20)
    return DEFAULT_KV_STORE_TOKENS * bytes_per_token + int(DEFAULT_KV_STORE_EXTRA_MB * 2**20)


def count_within_budget(sizes: Iterable[int], budget: int) -> int:
    """How many of the leading `sizes` (tokens, in arrival order) one batch of at most `budget` tokens takes:
    at least one when there is any."""
    taken = used = 0
    for size in sizes:
        if taken and used + size > budget:
            break
        taken, used = taken + 1, used + size
    return taken
