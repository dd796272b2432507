"""Who may come in: TLS (optionally mutual) credentials and bearer-token auth.

Token auth (`--auth-token-file`): every call must carry `authorization: Bearer <token>` metadata (the scheme
case-insensitive, RFC 7235), the token compared in constant time (hmac.compare_digest); anything else answers
UNAUTHENTICATED before any handler runs. grpc.health.v1.Health stays open — load balancers and orchestrators
probe it without secrets, and it reveals nothing but SERVING / NOT_SERVING. Reflection without the token
describes the health service alone (so `grpcurl … grpc.health.v1.Health/Check` works without a token): the
schema is public in the repo, but a locked server should not even confirm what else it serves to a stranger."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
DENIED = "missing or wrong `authorization: Bearer <token>` metadata"


def read_token(path: str | Path) -> str:
    """The token in `path` (surrounding whitespace stripped); it must be non-empty printable ASCII."""
    token = Path(path).read_text().strip()
    if not token or not token.isascii() or not token.isprintable():
        raise ValueError(f"{path}: the auth token must be non-empty printable ASCII")
    return token


def server_credentials(cert: str | Path, key: str | Path,
                       client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with `client_ca`, clients must present a certificate it signed."""
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())], root_certificates=ca,
                                       require_client_auth=ca is not None)


def bearer_credentials(metadata: Any) -> bytes | None:
    """The credentials of the one `authorization: Bearer <credentials>` entry in `metadata` (the scheme matched
    case-insensitively); None when there is no such single entry."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if len(values) != 1:
        return None
    value = values[0] if isinstance(values[0], bytes) else values[0].encode("utf-8", "replace")
    scheme, _, credentials = value.partition(b" ")
    return credentials.lstrip(b" ") if scheme.lower() == b"bearer" else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Denies calls without the token; `open_handlers` (method path -> handler) answer such calls instead of a
    denial (the health-only reflection)."""

    def __init__(self, token: str, open_handlers: dict[str, grpc.RpcMethodHandler] | None = None) -> None:
        self._token = token.encode()
        self._open_handlers = open_handlers or {}

    def authorized(self, metadata: Any) -> bool:
        given = bearer_credentials(metadata)
        return given is not None and hmac.compare_digest(given, self._token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_PREFIXES) or self.authorized(handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return await continuation(handler_call_details)
        if method in self._open_handlers:
            return self._open_handlers[method]
        handler = await continuation(handler_call_details)
        return _denying(handler) if handler is not None else None  # type: ignore[return-value]


def _ignore(data: bytes) -> None:
    return None


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without running it."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
        yield  # never reached: makes this an async generator, as streaming handlers are

    de, ser = _ignore, handler.response_serializer  # never parse a stranger's bytes
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, de, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, de, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny, de, ser)
    return grpc.stream_stream_rpc_method_handler(deny_stream, de, ser)
