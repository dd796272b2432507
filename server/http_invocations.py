"""SageMaker's `POST /invocations`, as vLLM serves it (vllm/entrypoints/sagemaker/api_router.py): one route whose
body's shape picks the endpoint that answers it, tried in vLLM's order: a chat (`messages`: chat completions, or
/classify's chat form on a classifier), a completion (`prompt`), a classification (`input`), a rerank (`query` +
`documents`), a score (one of vLLM's spellings of the two sides). The chosen endpoint answers exactly as on its own
route (its checks, statuses, metrics method and error shape); a body that fits none is vLLM's 400, "Cannot find
suitable handler for request". vLLM tries each request type's full schema in turn; here the field that names the
type decides, and a body of that type with a bad field gets that endpoint's own refusal."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from pyscore import errors

from .gate import Gate
from .http_call import Call, described, error_response, json_of, read_body
from .http_rerank import SIDES
from .metrics import Metrics
from .scheduler import Unavailable

Endpoint = Callable[[Request], Awaitable[Response]]
EXPECTED = ["ChatCompletionRequest", "CompletionRequest", "ClassificationRequest", "RerankRequest", "ScoreRequest"]


def target_path(data: Any, classifier: bool) -> str | None:
    """The route that answers a body of this shape (vLLM's order of request types), or None."""
    if not isinstance(data, dict):
        return None
    if "messages" in data:
        return "/classify" if classifier else "/v1/chat/completions"
    if "prompt" in data:
        return "/v1/completions"
    if "input" in data:
        return "/classify"
    if "query" in data and "documents" in data:
        return "/rerank"
    if any(a in data and b in data for a, b in SIDES):
        return "/score"
    return None


def replayed(request: Request, body: bytes) -> Request:
    """The request again with its body already read: the endpoint reads `body`, then the client's own messages
    (a disconnect) as they come."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


def invocations(endpoints: Mapping[str, Endpoint], gate: Gate, *, limit: int, metrics: Metrics | None) -> Endpoint:
    async def dispatch(request: Request) -> Response:
        try:
            body = await read_body(request, limit)
            data = json_of(body)
            path = target_path(data, classifier=_classifier(gate))
            if path is None:
                raise errors.InvalidArgument("", "Cannot find suitable handler for request. Expected one of: "
                                             f"{EXPECTED}")
        except Exception as e:  # refused here: counted and logged as a Score call, as gRPC counts a bad request
            status, message, param, http_status = described(e, {})
            Call("Score", request.url.path, metrics).finish(status, http_status)
            return error_response(status, message, param, http_status)
        return await endpoints[path](replayed(request, body))

    return dispatch


def _classifier(gate: Gate) -> bool:
    """Whether the served model has a classification head (a chat is then classified); False while loading (the
    chosen endpoint answers 503 then)."""
    try:
        return gate.ready(None)[1].kind == "classifier"
    except Unavailable:
        return False
