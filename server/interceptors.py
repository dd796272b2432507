"""The one server interceptor: for every pyscore.v1.Scorer call it logs one line (method, items, tokens, mode,
latency, and the status the client saw — DEADLINE_EXCEEDED, not CANCELLED, when grpc ended the call at its
deadline), records it in the metrics, and turns exceptions into gRPC statuses — pyscore.errors by kind
(the message names the field), batcher refusals, and anything else as INTERNAL, after which the server simply
goes on serving. INVALID_ARGUMENT also carries a google.rpc.BadRequest in the status details (AIP-193) whose
field violation names the field. Bytes that do not parse as the request message (e.g. a string field that is
not UTF-8) are INVALID_ARGUMENT naming the field, not grpc's UNKNOWN. Health and reflection calls pass through
untouched."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from pyscore import errors, wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb

from .metrics import Metrics
from .scheduler import DeadlineExceeded, Unavailable

log = logging.getLogger("server.requests")

SERVICE_PREFIX = "/pyscore.v1.Scorer/"
DEADLINE_SLACK_S = 0.1  # a call ended this close to its deadline ended because of it
# A status message's UTF-8 bytes at most. It travels percent-encoded in grpc-message (non-ASCII bytes x3) and
# twice more (message and field violation) in the base64 grpc-status-details-bin: < 6 KiB in all, within the
# 8 KiB "soft limit" above which a default gRPC client starts refusing metadata (and 16 KiB, where it always does).
MAX_STATUS_BYTES = 1000

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a client sees for an exception raised while serving its call. Messages quote client
    input through pyscore.errors.quoted; this cap is the backstop for any that does not (an unexpected exception's
    text), so that no status outgrows a default client's metadata limit."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code, bounded(str(exc))
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(exc).__name__}: {exc}")


def bounded(message: str) -> str:
    """message, elided in the middle until it is at most MAX_STATUS_BYTES of UTF-8."""
    text, limit = message, MAX_STATUS_BYTES
    while len(text.encode()) > MAX_STATUS_BYTES:
        limit //= 2
        text = errors.elide(message, limit)
    return text


def bad_request_metadata(exc: BaseException) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata with the google.rpc.Status of an InvalidArgument naming a field: its BadRequest field
    violation (field path, description), as AIP-193 asks; () for anything else."""
    if not isinstance(exc, errors.InvalidArgument) or not exc.field:
        return ()
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=exc.field,
                                                    description=bounded(exc.message))]))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=status_for(exc)[1], details=[detail])
    return tuple(rpc_status.to_status(status).trailing_metadata)


class Malformed:
    """What the lenient deserializer returns for bytes that are not a valid request message."""

    def __init__(self, error: DecodeError, field: str) -> None:
        self.error, self.field = error, field


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)  # Message.FromString

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return Malformed(e, wire.undecodable_field(descriptor, data) if descriptor is not None else "")

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, Malformed):
        what = "is not valid UTF-8" if request.field else f"does not parse: {request.error}"
        raise errors.InvalidArgument(request.field, f"the request {what}")
    return request


def _status_name(code: Any) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    known = {c.value[0]: c.name for c in grpc.StatusCode}
    return known.get(code, str(code))


def _request_summary(request: Any) -> str:
    if not hasattr(request, "DESCRIPTOR") or "items" not in request.DESCRIPTOR.fields_by_name:
        return ""
    return f"items={len(request.items) or len(request.item_token_ids)} "


def _response_summary(response: Any) -> str:
    if response is None:
        return ""
    fields = response.DESCRIPTOR.fields_by_name
    parts = []
    if "usage" in fields and response.HasField("usage"):
        parts.append(f"tokens={response.usage.prompt_tokens}/{response.usage.computed_tokens}")
    elif "token_ids" in fields and "text" not in fields:  # Tokenize
        parts.append(f"tokens={len(response.token_ids)}")
    if "mode" in fields:
        parts.append(f"mode={pb.ScoringMode.Name(response.mode).removeprefix('SCORING_MODE_').lower()}")
    return " ".join(parts) + " " if parts else ""


class LoggingErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        name = method[len(SERVICE_PREFIX) :]
        parse = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(name, handler.unary_unary, self.metrics), parse, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(name, handler.unary_stream, self.metrics), parse, handler.response_serializer
            )
        return handler


class _Call:
    """One call's bookkeeping: `serving()` wraps the handler, maps what it raises to a status, and logs."""

    def __init__(self, name: str, request: Any, context: grpc.aio.ServicerContext, metrics: Metrics | None) -> None:
        self.name, self.request, self.context, self.metrics = name, request, context, metrics
        self.response: Any = None  # the (last streamed) response, for the log line

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        start, status = time.perf_counter(), "OK"
        if self.metrics is not None:
            self.metrics.call_started(self.name)
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):  # client cancelled, deadline passed, or stream closed
            status = self._ended_early()
            raise
        except grpc.aio.AbortError:
            status = _status_name(self.context.code())
            raise
        except Exception as e:
            code, message = status_for(e)
            status = code.name
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed unexpectedly", self.name, exc_info=e)
            await self.context.abort(code, message, bad_request_metadata(e))
        finally:
            seconds = time.perf_counter() - start
            if self.metrics is not None:
                self.metrics.observe_call(self.name, status, seconds, self.response)
            ms = seconds * 1e3
            log.info("%s %s%slatency_ms=%.1f status=%s", self.name, _request_summary(self.request),
                     _response_summary(self.response), ms, status)


    def _ended_early(self) -> str:
        """What the client saw when grpc ended the call under the handler: DEADLINE_EXCEEDED at its deadline,
        else CANCELLED (the client cancelled or went away). At the deadline either side may end the call first:
        the client cancels when its own clock says so, which reaches the server up to a network latency before
        the server's copy of the deadline (set on arrival) passes — hence the slack."""
        remaining = self.context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


def _wrap_unary(name: str, behavior: Callable[..., Awaitable[Any]],
                metrics: Metrics | None) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = _Call(name, request, context, metrics)
        async with call.serving():
            call.response = await behavior(_parsed(request), context)
        return call.response

    return wrapper


def _wrap_stream(name: str, behavior: Callable[..., AsyncIterator[Any]],
                 metrics: Metrics | None) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call = _Call(name, request, context, metrics)
        async with call.serving():
            async for response in behavior(_parsed(request), context):
                call.response = response
                yield response

    return wrapper
