"""One HTTP call's way through the front door, the counterpart of the gRPC interceptor: read the body under the
size limit, parse it as JSON into the endpoint's schema, run the handler while watching for the client to go
away (a disconnect cancels the handler, and so the batcher drops the job, as a gRPC cancel does), turn what it
raises into a status, and log and count the call in the same metrics as gRPC (under the gRPC method it stands
for).

Statuses map as the gRPC-HTTP convention does: INVALID_ARGUMENT and FAILED_PRECONDITION -> 400, NOT_FOUND -> 404,
RESOURCE_EXHAUSTED -> 429 (a body over --max-message-mb -> 413), UNAUTHENTICATED -> 401, UNAVAILABLE -> 503,
DEADLINE_EXCEEDED -> 504, anything else -> 500. The body is OpenAI's error object, whose `param` names the field
in the endpoint's own terms (`items[2]`, not the proto's `item_token_ids[2]`) and whose `code` is the gRPC
status; an endpoint shaped like SGLang's answers SGLang's flat error object instead (`sglang_error_body`), the same
message and `param`, its `code` the HTTP status. A route that is not there (or not for this model, `NotServed`)
answers as vLLM answers a route it does not have (`route_error_body`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyscore import errors, wire
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore.types import Usage

from .interceptors import status_for
from .metrics import Metrics

log = logging.getLogger("server.requests")

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "UNAUTHENTICATED": 401, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "INTERNAL": 500}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405:
              "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class BodyTooLarge(errors.ResourceExhausted):
    """The request body is over --max-message-mb (HTTP 413)."""


class NotServed(errors.NotFound):
    """A route the peer does not register for the served model (vLLM's /score and /rerank of a several-class
    classifier): answered as the peer answers any route it does not have."""

    def __init__(self) -> None:
        super().__init__("", "Not Found")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class JSON(JSONResponse):
    """JSON that keeps a NaN or infinite score (as Python's json writes it) rather than failing the answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error_body(status: str, message: str, param: str | None, http_status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPE.get(http_status, "server_error"), "param": param,
                      "code": status}}


SGLANG_ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
                     429: "RateLimitError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


def sglang_error_body(status: str, message: str, param: str | None, http_status: int) -> dict[str, Any]:
    """SGLang's ErrorResponse, flat (sglang/srt/entrypoints/openai/protocol.py): `code` is the HTTP status and
    `type` its class name (BadRequestError, as SGLang's create_error_response names a 400)."""
    return {"object": "error", "message": message, "type": SGLANG_ERROR_TYPE.get(http_status, "InternalServerError"),
            "param": param, "code": http_status}


def route_error_body(http_status: int) -> dict[str, Any]:
    """vLLM's answer to a route it does not have or a method a route does not take (its HTTPException handler:
    the status's phrase as message and type, the HTTP status as code), so a client of vLLM sees the same 404."""
    phrase = HTTPStatus(http_status).phrase
    return {"error": {"message": phrase, "type": phrase, "param": None, "code": http_status}}


ErrorShape = Callable[[str, str, str | None, int], dict[str, Any]]  # (gRPC status, message, param, HTTP status)


def openai_errors(data: Any) -> ErrorShape:
    """The error shape of every endpoint but SGLang's, whatever the body."""
    return error_body


def error_response(status: str, message: str, param: str | None = None, http_status: int | None = None,
                   headers: Mapping[str, str] | None = None, shape: ErrorShape = error_body) -> JSON:
    code = http_status or HTTP_STATUS.get(status, 500)
    return JSON(shape(status, message, param, code), status_code=code, headers=headers)


def http_field(name: str, renames: Mapping[str, str]) -> str:
    """An engine / proto field path (`item_token_ids[2]`) in the endpoint's terms (`items[2]`)."""
    head, bracket, rest = name.partition("[")
    return renames.get(head, head) + bracket + rest


def described(exc: BaseException, renames: Mapping[str, str]) -> tuple[str, str, str | None, int]:
    """(gRPC status name, message, param, HTTP status) for an exception raised while serving a call."""
    if isinstance(exc, ValidationError):
        return ("INVALID_ARGUMENT", *_validation_message(exc), 400)
    code, message = status_for(exc)
    param = None
    if isinstance(exc, errors.RequestError):
        param = http_field(exc.field, renames) if exc.field else None
        message = f"{param}: {exc.message}" if param else exc.message
    http_status = 413 if isinstance(exc, BodyTooLarge) else HTTP_STATUS.get(code.name, 500)
    return code.name, message, param, http_status


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first field pydantic refused, named as a client wrote it (`messages[0].content`); a value that fits
    none of a union's types lists what each type said."""
    problems = exc.errors(include_url=False, include_input=False)
    param = _field_path(problems[0]["loc"])
    said = list(dict.fromkeys(p["msg"] for p in problems if _field_path(p["loc"]) == param))
    what = said[0] if len(said) == 1 else "fits none of its types (" + "; ".join(said) + ")"
    return (f"{param}: {what}" if param else f"the body: {what}"), param


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names of a union's members


def _field_path(loc: tuple[Any, ...]) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.lower() not in TYPE_TAGS and not part[0].isupper():
            path += f".{part}" if path else part
    return path or None


def fp32(values: list[float]) -> list[float]:
    """Values rounded to float32, the proto's `float`: HTTP answers what gRPC answers, bit for bit."""
    import numpy as np

    return np.asarray(values, dtype=np.float32).tolist()


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge("", f"the body is {int(declared)} bytes, over this server's limit of {limit} "
                               "(--max-message-mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge("", f"the body is over this server's limit of {limit} bytes (--max-message-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


Schema = type[BaseModel] | Callable[[Any], type[BaseModel]]  # a model, or one picked by the parsed JSON


def json_of(body: bytes) -> Any:
    """The body's JSON; not JSON is INVALID_ARGUMENT, and so is JSON that Python will not read: an integer of
    more than 4,300 digits (a ValueError, not a JSONDecodeError) or arrays nested past the recursion limit (a
    few kilobytes of "[" under --max-message-mb), which were answered 500."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        why = errors.elide(str(e), errors.QUOTE_LIMIT)
        raise errors.InvalidArgument("", f"the body is not valid JSON: {why}") from None


def parse(schema: Schema, data: Any) -> Any:
    """The JSON as `schema` (or as the schema it picks from the JSON: a route two peers shape differently); not of
    the schema's shape and types is INVALID_ARGUMENT."""
    model = schema if isinstance(schema, type) else schema(data)
    return model.model_validate(data)


T = TypeVar("T")
IN_FLIGHT = 16  # a call's Score requests in the server's queue at once: many distinct sequences (N:N pairs, classify
# inputs, SGLang items without a query; up to --max-items) must not fill --max-queue, which other callers share


async def bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int = IN_FLIGHT) -> list[T]:
    """Every call's result in order, at most `limit` running at once; the first failure cancels the rest."""
    gate = asyncio.Semaphore(limit)

    async def run(call: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await call()

    tasks = [asyncio.ensure_future(run(call)) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # the first failure is the call's answer: the others are dropped, not left running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; if the client disconnects first, `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Call:
    """One call's bookkeeping: the gRPC method it counts as, the usage for the metrics, the log line."""

    method: str
    path: str
    metrics: Metrics | None
    summary: str = ""  # "items=3 " etc., for the log line
    usage: Usage | None = None
    started: float = field(default_factory=time.perf_counter)
    done: bool = False

    def __post_init__(self) -> None:
        if self.metrics is not None:
            self.metrics.call_started(self.method)

    def finish(self, status: str, http_status: int) -> None:
        if self.done:
            return
        self.done = True
        seconds = time.perf_counter() - self.started
        response = None
        if self.usage is not None:  # the metrics read token counts from a message with a `usage`
            response = pb.ScoreResponse(usage=wire.usage_to_proto(self.usage))
        if self.metrics is not None:
            self.metrics.observe_call(self.method, status, seconds, response)
        tokens = f"tokens={self.usage.prompt_tokens}/{self.usage.computed_tokens} " if self.usage else ""
        log.info("http %s %s%slatency_ms=%.1f status=%s http=%d", self.path, self.summary, tokens, seconds * 1e3,
                 status, http_status)


Handler = Callable[[Call, Any], Awaitable[Response]]


def endpoint(method: str, schema: Schema | None, handle: Handler, *, limit: int, metrics: Metrics | None,
             renames: Mapping[str, str] = {}, error_shape: Callable[[Any], ErrorShape] = openai_errors
             ) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint: body -> schema -> handle(call, body), racing the client's disconnect; errors become
    error objects of the shape `error_shape` picks from the body's JSON (None when it has none): OpenAI's unless told.
    A handler that streams takes over `call.finish` (it finishes when the stream ends)."""

    async def run(request: Request) -> Response:
        call, data = Call(method, request.url.path, metrics), None
        try:
            if schema is not None:
                data = json_of(await read_body(request, limit))
            body = parse(schema, data) if schema is not None else None
            response = await unless_disconnected(request, handle(call, body))
        except ClientGone:
            call.finish("CANCELLED", 499)
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except NotServed:
            call.finish("NOT_FOUND", 404)
            return JSON(route_error_body(404), status_code=404)
        except Exception as e:
            status, message, param, http_status = described(e, renames)
            if status == "INTERNAL":
                log.exception("http %s failed unexpectedly", call.path, exc_info=e)
            call.finish(status, http_status)
            return error_response(status, message, param, http_status, shape=error_shape(data))
        if not getattr(response, "streaming", False):
            call.finish("OK", response.status_code)
        return response

    return run
