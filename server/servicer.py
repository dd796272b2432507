"""pyscore.v1.Scorer handlers: protobuf in, pyscore.types to the batcher, protobuf out. No tensors and no
model work here — the batcher's worker thread owns the engine. Handlers raise pyscore.errors; the
interceptor turns them into statuses.

Limits checked here, before any model work: `model` must be empty or the served model's name (NOT_FOUND);
more than `max_items` items is RESOURCE_EXHAUSTED (a limit of this server, not a malformed request; the
message names `items`). Until the model is loaded and warmed every call answers UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pyscore import wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from pyscore.errors import NotFound, ResourceExhausted
from pyscore.types import ModelInfo
from server.batcher import Batcher, GenerationDelta, Unavailable


class ScorerServicer(scorer_pb2_grpc.ScorerServicer):
    def __init__(self, *, max_items: int = 1024) -> None:
        self.max_items = max_items
        self._batcher: Batcher | None = None
        self._info: ModelInfo | None = None

    def attach(self, batcher: Batcher, info: ModelInfo) -> None:
        """Start answering: the engine behind `batcher` is loaded and warmed."""
        self._batcher, self._info = batcher, info

    def _ready(self, model: str) -> tuple[Batcher, ModelInfo]:
        if self._batcher is None or self._info is None:
            raise Unavailable("the model is still loading")
        if model and model != self._info.name:
            raise NotFound("model", f"this server serves {self._info.name!r}, not {model!r}")
        return self._batcher, self._info

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        batcher, info = self._ready(request.model)
        n = len(request.items) or len(request.item_token_ids)
        if n > self.max_items:
            raise ResourceExhausted("items", f"{n} items exceed this server's limit of {self.max_items} (--max-items)")
        result = await batcher.score(wire.score_request_from_proto(request), context.time_remaining())
        return wire.score_result_to_proto(result, info.name)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        async for delta in self._generate(request, context):
            if delta.final is not None:
                return wire.generate_result_to_proto(delta.final)
        raise RuntimeError("generation ended without a result")

    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async for delta in self._generate(request, context):
            yield wire.generate_response(delta.token_ids, delta.logprobs, delta.text, delta.final)

    def _generate(self, request: pb.GenerateRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[GenerationDelta]:
        batcher, _ = self._ready(request.model)
        return batcher.generate(wire.generate_request_from_proto(request), context.time_remaining())

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        batcher, _ = self._ready("")
        ids, tokens = await batcher.call(batcher.engine.tokenize, request.text, request.add_special_tokens,
                                         timeout=context.time_remaining())
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        _, info = self._ready("")
        return wire.model_info_to_proto(info)
