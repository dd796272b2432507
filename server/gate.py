"""The admission both front doors (gRPC's servicer, the HTTP endpoints) check before any model work: UNAVAILABLE
until the model is loaded and warmed, NOT_FOUND for another model's name, RESOURCE_EXHAUSTED over --max-items or
--max-request-tokens (token ids counted as given, before anything is tokenized). Once open it hands out the
batcher, the served engine (every call on it through `batcher.call`, on the engine thread) and the model info."""

from __future__ import annotations

from pyscore.errors import NotFound, ResourceExhausted, quoted
from pyscore.types import ModelInfo

from .batcher import Batcher
from .engine_like import EngineLike
from .scheduler import Unavailable


class Gate:
    def __init__(self, *, max_items: int = 1024, max_request_tokens: int | None = None) -> None:
        self.max_items = max_items
        self.max_request_tokens = max_request_tokens  # None = no limit
        self._batcher: Batcher | None = None
        self._engine: EngineLike | None = None
        self._info: ModelInfo | None = None

    def open(self, batcher: Batcher, engine: EngineLike, info: ModelInfo) -> None:
        """Start admitting: `engine` is loaded and warmed, and `batcher`'s worker owns it."""
        self._batcher, self._engine, self._info = batcher, engine, info

    def ready(self, model: str | None) -> tuple[Batcher, ModelInfo]:
        """The batcher and the model info, once loaded; `model` must be empty or the served model's name."""
        if self._batcher is None or self._info is None:
            raise Unavailable("the model is still loading")
        if model and model != self._info.name:
            raise NotFound("model", f"this server serves {self._info.name!r}, not {quoted(model)}")
        return self._batcher, self._info

    @property
    def engine(self) -> EngineLike:
        """The served engine (for `batcher.call`: its methods run on the engine thread only)."""
        if self._engine is None:
            raise Unavailable("the model is still loading")
        return self._engine

    def check_items(self, n: int) -> None:
        if n > self.max_items:
            raise ResourceExhausted("items", f"{n} items exceed this server's limit of {self.max_items} (--max-items)")

    def check_ids(self, field: str, n: int) -> None:
        if self.max_request_tokens is not None and n > self.max_request_tokens:
            raise ResourceExhausted(field, f"{n} token ids, over this server's limit of {self.max_request_tokens} "
                                           "per request (--max-request-tokens)")
