"""Python clients of pyscore.v1.Scorer: `ScorerClient` (blocking) and `AsyncScorerClient` (asyncio). Both take
and return pyscore.types objects (`GenerateChunk` for streamed pieces); keyword options are the fields of
ScoreRequest / GenerateRequest. Failures raise grpc.RpcError carrying the server's status code and a
message that names the offending field.

    with ScorerClient("127.0.0.1:50051") as client:
        result = client.score("Is the order late?", ["Track it", "Refund it"], labels=["Yes", "No"])
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pyscore import wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from pyscore.types import GenerateRequest, GenerateResult, ModelInfo, ScoreRequest, ScoreResult, TokenLogprob, Usage

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass
class GenerateChunk:
    """One streamed piece: the tokens and text added since the previous chunk; the last chunk also has
    finish_reason and usage (None before)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    usage: Usage | None = None


def _channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def score_message(query: str | list[int], items: list[str] | list[list[int]], model: str,
                  **options: Any) -> pb.ScoreRequest:
    return wire.score_request_to_proto(ScoreRequest(query=query, items=items, **options), model)


def generate_message(prompt: str | list[int], model: str, **options: Any) -> pb.GenerateRequest:
    request = GenerateRequest(**options)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids = list(prompt)
    return wire.generate_request_to_proto(request, model)


def chunk_from_proto(msg: pb.GenerateResponse) -> GenerateChunk:
    last = bool(msg.finish_reason)
    return GenerateChunk(text=msg.text, token_ids=list(msg.token_ids), logprobs=wire.logprobs_from_proto(msg.logprobs),
                         finish_reason=msg.finish_reason if last else None,
                         usage=wire.usage_from_proto(msg.usage) if last else None)


class ScorerClient:
    """Blocking client. `timeout` (seconds) is the default deadline of every call."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, max_message_mb: int = 64,
                 channel: grpc.Channel | None = None) -> None:
        self.channel = channel or grpc.insecure_channel(target, options=_channel_options(max_message_mb))
        self.stub = scorer_pb2_grpc.ScorerStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> ScorerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def score(self, query: str | list[int], items: list[str] | list[list[int]], *, model: str = "",
              timeout: float | None = None, **options: Any) -> ScoreResult:
        """options: labels, label_token_ids, apply_softmax, item_first, score_extraction_token, mode."""
        msg = score_message(query, items, model, **options)
        return wire.score_result_from_proto(self.stub.Score(msg, timeout=self._t(timeout)))

    def generate(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                 **options: Any) -> GenerateResult:
        """options: max_tokens, temperature, top_p, top_k, seed, stop, top_logprobs, apply_chat_template."""
        msg = generate_message(prompt, model, **options)
        return wire.generate_result_from_proto(self.stub.Generate(msg, timeout=self._t(timeout)))

    def generate_stream(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                        **options: Any) -> Iterator[GenerateChunk]:
        """Chunks as they are generated; closing the iterator early cancels the call (the server stops)."""
        call = self.stub.GenerateStream(generate_message(prompt, model, **options), timeout=self._t(timeout))
        try:
            for response in call:
                yield chunk_from_proto(response)
        finally:
            call.cancel()

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 timeout: float | None = None) -> tuple[list[int], list[str]]:
        response = self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                      timeout=self._t(timeout))
        return list(response.token_ids), list(response.tokens)

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return wire.model_info_from_proto(self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout)))

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server's health check says SERVING (the model is loaded and warmed)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == serving:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not SERVING within {timeout} s")
            time.sleep(0.05)


class AsyncScorerClient:
    """asyncio client; the same methods as ScorerClient, awaited (generate_stream is an async iterator)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, max_message_mb: int = 64,
                 channel: grpc.aio.Channel | None = None) -> None:
        self.channel = channel or grpc.aio.insecure_channel(target, options=_channel_options(max_message_mb))
        self.stub = scorer_pb2_grpc.ScorerStub(self.channel)
        self.timeout = timeout

    async def __aenter__(self) -> AsyncScorerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def score(self, query: str | list[int], items: list[str] | list[list[int]], *, model: str = "",
                    timeout: float | None = None, **options: Any) -> ScoreResult:
        msg = score_message(query, items, model, **options)
        return wire.score_result_from_proto(await self.stub.Score(msg, timeout=self._t(timeout)))

    async def generate(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                       **options: Any) -> GenerateResult:
        msg = generate_message(prompt, model, **options)
        return wire.generate_result_from_proto(await self.stub.Generate(msg, timeout=self._t(timeout)))

    async def generate_stream(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                              **options: Any) -> AsyncIterator[GenerateChunk]:
        call = self.stub.GenerateStream(generate_message(prompt, model, **options), timeout=self._t(timeout))
        try:
            async for response in call:
                yield chunk_from_proto(response)
        finally:
            call.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = True,
                       timeout: float | None = None) -> tuple[list[int], list[str]]:
        response = await self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                            timeout=self._t(timeout))
        return list(response.token_ids), list(response.tokens)

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        response = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout))
        return wire.model_info_from_proto(response)
