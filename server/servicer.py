"""pyscore.v1.Scorer handlers: protobuf in, pyscore.types to the batcher, protobuf out. No tensors and no
model work here — the batcher's worker thread owns the engine. Handlers raise pyscore.errors; the
interceptor turns them into statuses.

Limits checked here, before any model work, by the gate both front doors share (server/gate.py): `model` must be
empty or the served model's name (NOT_FOUND); more than --max-items items is RESOURCE_EXHAUSTED (a limit of this
server, not a malformed request; the message names `items`); so are more token ids than --max-request-tokens
(text is counted by the batcher once tokenized); a call whose deadline has already passed is DEADLINE_EXCEEDED
without being queued. Until the model is loaded and warmed every call answers UNAVAILABLE.

These handlers run on the event loop, so every repeated field is counted (len, O(1)) before anything walks it:
items against max_items, token ids against max_request_tokens, labels against the model's distinct labels (more
must repeat), stop strings against their cap. Only then does `wire` turn the message into lists.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pyscore import wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from pyscore.errors import InvalidArgument
from pyscore.types import MAX_STOP_STRINGS, ModelInfo

from .gate import Gate
from .scheduler import DeadlineExceeded, GenerationDelta


def time_left(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds until the call's deadline (None: no deadline); a deadline already past is refused here."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded("the deadline had passed when the request arrived")
    return remaining


class ScorerServicer(scorer_pb2_grpc.ScorerServicer):
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        batcher, info = self.gate.ready(request.model)
        self.gate.check_items(max(len(request.items), len(request.item_token_ids)))
        # token ids count exactly without tokenizing: query + items is what MIS computes, the least any mode does
        ids = len(request.query_token_ids) + sum(len(t.ids) for t in request.item_token_ids)
        self.gate.check_ids("item_token_ids", ids)
        _check_label_count(request, info)
        result = await batcher.score(wire.score_request_from_proto(request), time_left(context))
        return wire.score_result_to_proto(result, info.name)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        async for delta in self._generate(request, context):
            if delta.final is not None:
                return wire.generate_result_to_proto(delta.final)
        raise RuntimeError("generation ended without a result")

    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async for delta in self._generate(request, context):
            yield wire.generate_response(delta.token_ids, delta.logprobs, delta.text, delta.final,
                                         delta.prompt_logprobs)

    def _generate(self, request: pb.GenerateRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[GenerationDelta]:
        batcher, _ = self.gate.ready(request.model)
        self.gate.check_ids("prompt_token_ids", len(request.prompt_token_ids))
        if len(request.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
        return batcher.generate(wire.generate_request_from_proto(request), time_left(context))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        batcher, _ = self.gate.ready("")
        ids, tokens = await batcher.call(self.gate.engine.tokenize, request.text, request.add_special_tokens,
                                         timeout=time_left(context))
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        _, info = self.gate.ready("")
        return wire.model_info_to_proto(info)


def _check_label_count(request: pb.ScoreRequest, info: ModelInfo) -> None:
    """More labels than the model has distinct ones (tokens, or a classifier's classes) must repeat: refused as
    the engine would (a duplicate), but before millions of them are copied into a list on the event loop."""
    distinct = info.num_labels if info.kind == "classifier" else info.vocab_size
    for field in ("labels", "label_token_ids"):
        n = len(getattr(request, field))
        if distinct and n > distinct:
            raise InvalidArgument(field, f"duplicate labels: {n} labels, and the model has {distinct} distinct ones")
