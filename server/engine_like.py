"""What the server uses of an engine (pyscore.engine.Engine, or a test's fake): the protocol, and nothing past it.
The batcher's worker thread is the only caller of its methods; the front doors reach them through
`Batcher.call`, in turn with the model work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pyscore.scoring import ModelTraits
from pyscore.types import Boundary, GenerateRequest, GenerateResult, ModelInfo, ScoreRequest, ScoreResult, TokenLogprob


class PreparedLike(Protocol):
    """What the scheduler reads of a prepared Score request (pyscore.scoring.PreparedScore)."""

    computed_tokens: int
    num_items: int


class GenerationLike(Protocol):
    """What the scheduler reads of a generation (pyscore.generation.Generation)."""

    finished: bool
    prompt: list[int]
    request: GenerateRequest
    error: Exception | None

    def take_delta(self) -> tuple[list[int], list[TokenLogprob], str]: ...
    def take_prompt_logprobs(self) -> list[TokenLogprob] | None: ...
    def result(self) -> GenerateResult: ...
    def abandon(self) -> None: ...  # the server gives up on it: free what it holds (a chunked prompt's blocks)


class ChunkPlanLike(Protocol):
    """What the scheduler reads of a chunking plan (pyscore.chunked_prefill.ChunkedPrefill)."""

    finished: bool

    def close(self, ok: bool) -> None: ...


class EngineLike(Protocol):
    """The part of pyscore.engine.Engine the server uses."""

    model_name: str
    traits: ModelTraits  # the model's limits, labels (id2label) and tokenizer facts, as request preparation sees them

    # -- model facts and text -------------------------------------------------------------------------------
    def info(self) -> ModelInfo: ...
    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]: ...
    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]: ...  # ids only, one call
    def decode(self, ids: list[int]) -> str: ...
    def token_pieces(self, ids: list[int]) -> list[str]: ...  # convert_ids_to_tokens: "ĠYes", not " Yes"
    def render_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                    add_generation_prompt: bool = True, *, add_special_tokens: bool = False) -> list[int]: ...
    def prefix_cache_stats(self) -> Any: ...  # pyscore.model.prefix_cache.PrefixCacheStats, or None when off
    def kv_store_stats(self) -> Any: ...  # pyscore.model.kv_store.KVStoreStats, or None without a store

    # -- scoring --------------------------------------------------------------------------------------------
    def prepare_score(self, request: ScoreRequest) -> PreparedLike: ...
    def run_prepared(self, prepared: list[Any]) -> list[ScoreResult | Exception]: ...

    # -- generation -----------------------------------------------------------------------------------------
    def start_generation(self, request: GenerateRequest) -> GenerationLike: ...
    def step(self, generations: list[Any]) -> None: ...
    # Admission against the one KV store: check_kv refuses (ResourceExhausted) what could never fit; reserve_kv
    # admits now (prompt + max_tokens in whole pages beside the running generations'), held until it ends.
    def check_kv(self, generation: Any) -> None: ...
    def reserve_kv(self, generation: Any) -> bool: ...
    def kv_tokens_reserved(self) -> int: ...  # safe to read from another thread (metrics)

    # -- passes ---------------------------------------------------------------------------------------------
    # At every layer boundary the engine asks decide(); on Boundary.YIELD it runs between() there, then goes on.
    def set_boundary(self, decide: Callable[[], Boundary] | None,
                     between: Callable[[], None] | None = None) -> None: ...
    # Chunked prefill: a plan (pyscore.chunked_prefill.ChunkedPrefill) or None (the request runs as one pass);
    # advance_chunked runs its next step: None while chunks remain, then the result (the plan closed).
    def plan_chunks(self, prepared: Any) -> ChunkPlanLike | None: ...
    def advance_chunked(self, prepared: Any, plan: Any) -> ScoreResult | Exception | None: ...
