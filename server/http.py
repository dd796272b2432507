"""The HTTP/JSON front door (`--http-port`): a Starlette app under uvicorn, served from the grpc.aio server's own
event loop and process, over the same servicer gate (model loaded, model name, --max-items,
--max-request-tokens), the same batcher (HTTP and gRPC requests share forward passes), the same bearer token,
TLS certificates and Prometheus metrics. gRPC stays the primary contract; this is a thin, exact adapter.

Routes, each shaped like its peer's so that the peer's clients work unchanged:
  POST /v1/score              SGLang's ScoringRequest / ScoringResponse (+ pyscore's labels, mode, setwise marker,
                              prefix-cache salt / bypass)                                     server/http_score.py
                              or, when the body is vLLM's (text_1/text_2, queries, data_1/data_2), vLLM's score
  POST /score                 vLLM's score (pairs 1:1, 1:N, N:N)                            server/http_rerank.py
  POST /rerank, /v1/rerank, /v2/rerank   vLLM's (Jina's, Cohere's) rerank                   server/http_rerank.py
  POST /classify              vLLM's classify (classifier models; `input` or `messages`)     server/http_rerank.py
  POST /generative_scoring    vLLM's generative scoring                                       server/http_score.py
  POST /invocations           SageMaker's, as vLLM's: the body's shape picks the route   server/http_invocations.py
  POST /v1/completions        OpenAI completions (SSE streaming)                              server/http_openai.py
  POST /v1/chat/completions   OpenAI chat completions over the model's chat template         server/http_openai.py
  POST /generate              SGLang's native generate (batch, logprobs from a prompt position) server/http_sglang.py
  POST /tokenize              vLLM's tokenize (`prompt`, or `messages` under the chat template -> `tokens`)
                                                                                              server/http_openai.py
  POST /detokenize            vLLM's detokenize (`tokens` -> `prompt`)
  GET  /version               {"version": pyscore's}; GET|POST /ping: as /health (vLLM's, SageMaker's probe)
  GET  /v1/models             the one model served
  GET  /health                200 while SERVING, 503 otherwise (loading, draining); open without the token
  GET  /metrics               the server's Prometheus metrics (the same registry as --metrics-port)
With --auth-token-file every route but /health and /ping needs `Authorization: Bearer <token>` (401 otherwise, before
any handler runs). Bodies over --max-message-mb are refused (413) while being read; how calls are parsed, mapped
to statuses, logged, counted and cancelled on disconnect is server/http_call.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pyscore import __version__, errors

from .gate import Gate
from .http_call import JSON, Call, endpoint, error_body, error_response, route_error_body, sglang_error_body
from .http_invocations import invocations
from .http_openai import CHAT_FIELDS, COMPLETION_FIELDS, OpenAIEndpoints, tokenize_schema
from .http_rerank import RERANK_LABELS, RerankEndpoints, is_vllm_score
from .http_schema import (
    ChatCompletionBody,
    ClassifyBody,
    CompletionBody,
    DetokenizeBody,
    GenerativeScoringBody,
    RerankBody,
    ScoringBody,
    SGLangGenerateBody,
    VLLMScoreBody,
)
from .http_score import SCORE_FIELDS, ScoreEndpoints
from .http_sglang import SGLANG_FIELDS, SGLangEndpoints
from .metrics import Metrics
from .security import DENIED, bearer_credentials

OPEN_PATHS = ("/health", "/ping")


class BearerAuth:
    """ASGI middleware: every request but OPEN_PATHS must carry the token (compared in constant time)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response("UNAUTHENTICATED", DENIED.replace("metadata", "header"),
                                  headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = bearer_credentials([(k.decode("latin-1").lower(), v) for k, v in scope["headers"]])
        return given is not None and hmac.compare_digest(given, self.token)


def build_app(gate: Gate, metrics: Metrics, serving: Callable[[], bool], *, max_body_bytes: int,
              token: str | None = None, rerank_labels: list[str] | None = None) -> ASGIApp:
    scoring, openai, sglang = ScoreEndpoints(gate), OpenAIEndpoints(gate), SGLangEndpoints(gate)
    rerank = RerankEndpoints(gate, rerank_labels or RERANK_LABELS)

    def either_score(data: Any) -> type[ScoringBody] | type[VLLMScoreBody]:
        """/v1/score is SGLang's (query + items) unless the body spells vLLM's sides."""
        return VLLMScoreBody if is_vllm_score(data) else ScoringBody

    def score_errors(data: Any) -> Any:
        """/v1/score answers SGLang's flat error object unless the body is vLLM's."""
        return error_body if is_vllm_score(data) else sglang_error_body

    async def any_score(call: Call, body: ScoringBody | VLLMScoreBody) -> Response:
        if isinstance(body, VLLMScoreBody):
            return await rerank.score(call, body)
        return await scoring.score(call, body)

    def post(path: str, method: str, schema: Any, handle: Any, renames: dict[str, str] | None = None,
             **options: Any) -> Route:
        return Route(path, endpoint(method, schema, handle, limit=max_body_bytes, metrics=metrics,
                                    renames=renames or {}, **options), methods=["POST"])

    async def models(call: Call, _: None) -> Response:
        _, info = gate.ready(None)
        return JSON({"object": "list", "data": [{"id": info.name, "object": "model", "created": int(time.time()),
                                                 "owned_by": "pyscore", "root": info.name,
                                                 "max_model_len": info.max_context}]})

    async def detokenize(call: Call, body: DetokenizeBody) -> Response:
        batcher, info = gate.ready(body.model)
        gate.check_ids("tokens", len(body.tokens))
        bad = [i for i, t in enumerate(body.tokens) if not 0 <= t < info.vocab_size]
        if bad:
            raise errors.InvalidArgument(f"tokens[{bad[0]}]", f"token id {body.tokens[bad[0]]} is outside the "
                                         f"vocabulary [0, {info.vocab_size})")
        text = await batcher.call(gate.engine.decode, body.tokens)
        return JSON({"prompt": text})

    async def version(request: Request) -> Response:
        return JSON({"version": __version__})

    async def health(request: Request) -> Response:
        up = serving()
        return JSON({"status": "SERVING" if up else "NOT_SERVING"}, status_code=200 if up else 503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def no_route(request: Request, exc: Exception) -> Response:
        """vLLM's body for a route it does not have (404) or a method a route does not take (405, with Allow)."""
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        headers = exc.headers if isinstance(exc, HTTPException) else None
        return JSON(route_error_body(status), status_code=status, headers=headers)

    routes = [
        post("/v1/score", "Score", either_score, any_score, SCORE_FIELDS, error_shape=score_errors),
        post("/score", "Score", VLLMScoreBody, rerank.score),
        *(post(path, "Score", RerankBody, rerank.rerank) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        post("/classify", "Score", ClassifyBody, rerank.classify),
        post("/generative_scoring", "Score", GenerativeScoringBody, scoring.generative_scoring, SCORE_FIELDS),
        post("/v1/completions", "Generate", CompletionBody, openai.completions, COMPLETION_FIELDS),
        post("/v1/chat/completions", "Generate", ChatCompletionBody, openai.chat, CHAT_FIELDS),
        post("/generate", "Generate", SGLangGenerateBody, sglang.generate, SGLANG_FIELDS),
        post("/tokenize", "Tokenize", tokenize_schema, openai.tokenize),
        post("/detokenize", "Tokenize", DetokenizeBody, detokenize),
        Route("/version", version, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/v1/models", endpoint("GetModelInfo", None, models, limit=max_body_bytes, metrics=metrics),
              methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    served = {route.path: route.endpoint for route in routes if isinstance(route, Route)}
    routes.append(Route("/invocations", invocations(served, gate, limit=max_body_bytes, metrics=metrics),
                        methods=["POST"]))
    app: ASGIApp = Starlette(routes=routes, exception_handlers={404: no_route, 405: no_route})
    return BearerAuth(app, token) if token else app


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn in a loop it does not own: the app (server/app.py) handles SIGTERM/SIGINT, not uvicorn."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0 = any free port); OSError if it cannot be. Its protocol is named: asyncio
    sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and without it every response waits out the
    client's delayed ACK (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class HttpFrontDoor:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                    tls_client_ca: str | None = None) -> int:
        """Listen on host:port in the running loop; returns the bound port."""
        sock = bind(host, port)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its "Started server process" is ours
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", ws="none",
                                ssl_certfile=tls_cert, ssl_keyfile=tls_key, ssl_ca_certs=tls_client_ca,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE)
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        listening = asyncio.ensure_future(self._server.listening.wait())
        await asyncio.wait([self._task, listening], return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            listening.cancel()
            self._task.result()  # raises what stopped it
            raise OSError(f"the HTTP server on {host}:{port} stopped while starting")
        return int(sock.getsockname()[1])

    async def stop(self, grace: float) -> None:
        """Close the listener; requests in flight get `grace` seconds, then are cancelled."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace  # type: ignore[assignment]
        self._server.should_exit = True
        await self._task
