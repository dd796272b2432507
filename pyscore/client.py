"""Python clients of pyscore.v1.Scorer: `ScorerClient` (blocking) and `AsyncScorerClient` (asyncio). Both take
and return pyscore.types objects (`GenerateChunk` for streamed pieces); keyword options are the fields of
ScoreRequest / GenerateRequest. Failures raise grpc.RpcError carrying the server's status code and a
message that names the offending field (`field_violations(error)` reads INVALID_ARGUMENT's structured
google.rpc.BadRequest details).

    with ScorerClient("127.0.0.1:50051") as client:
        result = client.score("Is the order late?", ["Track it", "Refund it"], labels=["Yes", "No"])

Security: `tls_ca` (PEM path or bytes) switches to TLS and trusts that CA; `tls_cert` + `tls_key` add a client
certificate (mTLS); `auth_token` is sent as `authorization: Bearer <token>` on every call.

Several replicas: a target such as `ipv4:10.0.0.1:50051,10.0.0.2:50051` or `dns:///pyscore-headless.ns.svc:50051`
balances per call with round_robin, skips replicas that are not SERVING and retries UNAVAILABLE on another one
(pyscore.balancing; `balancing=True/False` forces it on or off for any target). `prefix_affinity=N` sends the
`x-pyscore-prefix` header, a hash of the first N characters (or token ids) of the query or prompt, for a gateway
that routes by it (deploy/envoy).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from pyscore import balancing as lb
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
    prompt_logprobs: list[TokenLogprob] | None = None  # the first chunk, when the request asked for them


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) of each google.rpc.BadRequest field violation in the error's status details (AIP-193;
    the server sends one with every INVALID_ARGUMENT that names a field); [] when there are none."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    violations = []
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            violations += [(v.field, v.description) for v in bad.field_violations]
    return violations


def _channel_options(target: str, max_message_mb: int, balancing: bool | None) -> list[tuple[str, Any]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            *lb.channel_options(target, balancing)]


def _pem(value: str | bytes | Path | None) -> bytes | None:
    return value if isinstance(value, bytes) or value is None else Path(value).read_bytes()


def channel_credentials(tls_ca: str | bytes | Path | None = None, tls_cert: str | bytes | Path | None = None,
                        tls_key: str | bytes | Path | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `tls_ca` (None: the system's roots), with a client certificate when given;
    None (plaintext) when no TLS option is set."""
    if tls_ca is None and tls_cert is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=_pem(tls_key),
                                        certificate_chain=_pem(tls_cert))


class _CallOptions:
    """Per-call keyword arguments shared by both clients: the deadline, the auth metadata and, for calls with a
    query or prompt, the prefix-affinity header."""

    timeout: float | None
    metadata: tuple[tuple[str, str], ...]
    prefix_affinity: int | None

    def _setup(self, timeout: float | None, auth_token: str | None, prefix_affinity: int | None) -> None:
        if prefix_affinity is not None and prefix_affinity <= 0:
            raise ValueError(f"prefix_affinity must be a positive number of characters, got {prefix_affinity}")
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.prefix_affinity = prefix_affinity

    def _kw(self, timeout: float | None, prefix: str | list[int] | None = None) -> dict[str, Any]:
        metadata = self.metadata
        if prefix is not None and self.prefix_affinity:
            metadata += ((lb.AFFINITY_HEADER, lb.prefix_key(prefix, self.prefix_affinity)),)
        return dict(timeout=self.timeout if timeout is None else timeout, metadata=metadata)


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
    finish_reason = wire.finish_reason_from_proto(msg.finish_reason)
    last = finish_reason is not None
    return GenerateChunk(text=msg.text, token_ids=list(msg.token_ids), logprobs=wire.logprobs_from_proto(msg.logprobs),
                         finish_reason=finish_reason,
                         usage=wire.usage_from_proto(msg.usage) if last else None,
                         prompt_logprobs=wire.logprobs_from_proto(msg.prompt_logprobs) if msg.prompt_logprobs else None)


class ScorerClient(_CallOptions):
    """Blocking client. `timeout` (seconds) is the default deadline of every call."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, max_message_mb: int = 64,
                 channel: grpc.Channel | None = None, tls_ca: str | bytes | Path | None = None,
                 tls_cert: str | bytes | Path | None = None, tls_key: str | bytes | Path | None = None,
                 auth_token: str | None = None, balancing: bool | None = None,
                 prefix_affinity: int | None = None) -> None:
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        options = _channel_options(target, max_message_mb, balancing)
        self.channel = channel or (grpc.secure_channel(target, creds, options=options) if creds
                                   else grpc.insecure_channel(target, options=options))
        self.stub = scorer_pb2_grpc.ScorerStub(self.channel)
        self._setup(timeout, auth_token, prefix_affinity)

    def __enter__(self) -> ScorerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def score(self, query: str | list[int], items: list[str] | list[list[int]], *, model: str = "",
              timeout: float | None = None, **options: Any) -> ScoreResult:
        """options: labels, label_token_ids, apply_softmax, item_first, score_extraction_token, mode,
        bypass_prefix_cache, prefix_cache_salt."""
        msg = score_message(query, items, model, **options)
        return wire.score_result_from_proto(self.stub.Score(msg, **self._kw(timeout, query)))

    def generate(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                 **options: Any) -> GenerateResult:
        """options: max_tokens, temperature, top_p, top_k, seed, stop, top_logprobs, apply_chat_template,
        bypass_prefix_cache, prefix_cache_salt, prompt_logprobs."""
        msg = generate_message(prompt, model, **options)
        return wire.generate_result_from_proto(self.stub.Generate(msg, **self._kw(timeout, prompt)),
                                               msg.HasField("prompt_logprobs"))

    def generate_stream(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                        **options: Any) -> Iterator[GenerateChunk]:
        """Chunks as they are generated; closing the iterator early cancels the call (the server stops)."""
        call = self.stub.GenerateStream(generate_message(prompt, model, **options), **self._kw(timeout, prompt))
        try:
            for response in call:
                yield chunk_from_proto(response)
        finally:
            call.cancel()

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 timeout: float | None = None) -> tuple[list[int], list[str]]:
        response = self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                      **self._kw(timeout))
        return list(response.token_ids), list(response.tokens)

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return wire.model_info_from_proto(self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._kw(timeout)))

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


class AsyncScorerClient(_CallOptions):
    """asyncio client; the same methods and options as ScorerClient, awaited (generate_stream is an async
    iterator)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, max_message_mb: int = 64,
                 channel: grpc.aio.Channel | None = None, tls_ca: str | bytes | Path | None = None,
                 tls_cert: str | bytes | Path | None = None, tls_key: str | bytes | Path | None = None,
                 auth_token: str | None = None, balancing: bool | None = None,
                 prefix_affinity: int | None = None) -> None:
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        options = _channel_options(target, max_message_mb, balancing)
        self.channel = channel or (grpc.aio.secure_channel(target, creds, options=options) if creds
                                   else grpc.aio.insecure_channel(target, options=options))
        self.stub = scorer_pb2_grpc.ScorerStub(self.channel)
        self._setup(timeout, auth_token, prefix_affinity)

    async def __aenter__(self) -> AsyncScorerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def score(self, query: str | list[int], items: list[str] | list[list[int]], *, model: str = "",
                    timeout: float | None = None, **options: Any) -> ScoreResult:
        msg = score_message(query, items, model, **options)
        return wire.score_result_from_proto(await self.stub.Score(msg, **self._kw(timeout, query)))

    async def generate(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                       **options: Any) -> GenerateResult:
        msg = generate_message(prompt, model, **options)
        return wire.generate_result_from_proto(await self.stub.Generate(msg, **self._kw(timeout, prompt)),
                                               msg.HasField("prompt_logprobs"))

    async def generate_stream(self, prompt: str | list[int], *, model: str = "", timeout: float | None = None,
                              **options: Any) -> AsyncIterator[GenerateChunk]:
        call = self.stub.GenerateStream(generate_message(prompt, model, **options), **self._kw(timeout, prompt))
        try:
            async for response in call:
                yield chunk_from_proto(response)
        finally:
            call.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = True,
                       timeout: float | None = None) -> tuple[list[int], list[str]]:
        response = await self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                            **self._kw(timeout))
        return list(response.token_ids), list(response.tokens)

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        response = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._kw(timeout))
        return wire.model_info_from_proto(response)
