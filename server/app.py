"""The grpc.aio server: pyscore.v1.Scorer behind the logging/error interceptor (and, with a token, the auth
interceptor), grpc.health.v1 (with List) and server reflection (v1 and v1alpha), with explicit message-size
limits, optional TLS / mTLS and an optional Prometheus endpoint. GetModelInfo reports the limits and the
version. With `http_port`, the HTTP/JSON front door (server/http.py) serves from the same loop over the same
servicer, batcher and metrics, and stops together with gRPC.

Lifecycle: listen first with health NOT_SERVING (Scorer calls answer UNAVAILABLE); load the engine and warm
it up off the event loop; start the batcher; go SERVING. On SIGTERM/SIGINT: health NOT_SERVING for good, keep
serving for `drain_delay_s` so that health-checking balancers (gRPC clients watching health, Envoy's active
checks) move their traffic elsewhere, then stop the listener (no new calls; in-flight ones get `grace` seconds;
past it they answer UNAVAILABLE and the engine thread stops at its next layer boundary), join the engine thread,
return — so `python -m server` exits 0. `max_connection_age_s` makes every client
connection end (GOAWAY) after that age, so long-lived clients re-resolve their target and reach new replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import pyscore
from pyscore._proto.pyscore.v1 import scorer_pb2, scorer_pb2_grpc
from pyscore.budget import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_RUNNING_GENERATIONS,
)
from pyscore.memory import InsufficientMemoryError, freeze_heap
from pyscore.types import GenerateRequest, ModelInfo, ScoreRequest, ServerLimits

from .batcher import Batcher
from .engine_like import EngineLike
from .gate import Gate
from .health import HealthServicer
from .http import HttpFrontDoor
from .http import build_app as build_http_app
from .http_rerank import RERANK_LABELS
from .interceptors import LoggingErrorInterceptor
from .memory import MemoryProbe
from .metrics import Metrics
from .reflection_docs import DocumentedPool, add_reflection, reflection_handlers
from .security import AuthInterceptor, read_token, server_credentials
from .servicer import ScorerServicer

log = logging.getLogger(__name__)

SCORER_SERVICE = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name  # "pyscore.v1.Scorer"
HALT_MARGIN_S = 1.0  # past the grace period, how long halted calls get to send their status before gRPC cancels
T = TypeVar("T")


@dataclass
class ServerConfig:
    model: str | None = None  # None = the embedded SmolLM2
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_queue: int = 256
    max_items: int = 1024
    # 8 MiB: protobuf parses a message on the event loop (~25 ms per MB of tiny repeated fields), so this bounds the
    # longest stall one hostile message can cause (bench/results/hardening/bad_input_latency.txt)
    max_message_mb: int = 8
    max_request_tokens: int | None = 65536  # None = no limit
    max_running_generations: int = DEFAULT_MAX_RUNNING_GENERATIONS
    # The KV store (MiB): the prefix cache's pages and running generations', prompt + max_tokens each reserved at
    # admission. None: 65536 tokens' worth + 1024 MiB (pyscore.budget).
    kv_cache_mb: float | None = None
    prefix_cache: bool = True  # False (--no-prefix-cache): no prefix is kept for reuse, nothing is chunked
    prefill_chunk_tokens: int | None = None  # chunk size of a request over max_batch_tokens; None = max_batch_tokens
    grace_s: float = 10.0
    drain_delay_s: float = 0.0  # seconds between health NOT_SERVING and the listener closing, on SIGTERM
    max_connection_age_s: float | None = None  # None = connections live for ever
    max_connection_age_grace_s: float | None = None  # calls on an aged connection get this long; None = no limit
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, serve TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM CA: clients must present a certificate it signed (mTLS)
    auth_token_file: str | None = None  # calls must carry `authorization: Bearer <the token in this file>`
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0 = any free port); None = off
    http_port: int | None = None  # the HTTP/JSON front door (server/http.py) on host:port (0 = any free); None = off
    # /rerank and vLLM's /score on a causal LM: the labels whose softmax gives a document's relevance, positive first
    # (vLLM's classifier_from_token, set per server as vLLM sets it; a request's `labels` overrides)
    rerank_labels: tuple[str, ...] = tuple(RERANK_LABELS)
    engine: str = "pyscore.engine:Engine"  # "module:Class" with from_pretrained; tests swap in a fake
    quantize: str | None = None  # "int8": the projections in int8 W8A8 (Engine.from_pretrained)


def load_engine(config: ServerConfig) -> EngineLike:
    module, _, name = config.engine.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls.from_pretrained(config.model, dtype=config.dtype, device=config.device, threads=config.threads,
                               max_batch_tokens=config.max_batch_tokens, prefix_cache=config.prefix_cache,
                               kv_cache_mb=config.kv_cache_mb,
                               max_running_generations=config.max_running_generations,
                               prefill_chunk_tokens=config.prefill_chunk_tokens, quantize=config.quantize)


def warm_up(engine: EngineLike) -> None:
    """One tiny score (and, for causal LMs, a one-token generation) so the first request pays no start-up."""
    ids, _ = engine.tokenize("Hello world", add_special_tokens=False)
    causal = engine.info().kind == "causal_lm"
    prepared = engine.prepare_score(ScoreRequest(query=ids, items=[ids], label_token_ids=ids[:1] if causal else None))
    (result,) = engine.run_prepared([prepared])
    if isinstance(result, Exception):
        raise result
    if causal:
        gen = engine.start_generation(GenerateRequest(prompt_token_ids=ids, max_tokens=1))
        while not gen.finished:
            engine.step([gen])


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run blocking fn off the loop in a daemon thread (unlike to_thread, a signal can still end the process
    while it runs, e.g. during a long model load)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            loop.call_soon_threadsafe(settle, fn(), None)
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)

    threading.Thread(target=run, daemon=True).start()
    return await future


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    size = config.max_message_mb * 1024 * 1024
    options = [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
               ("grpc.so_reuseport", 0)]
    if config.max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", round(config.max_connection_age_s * 1000)))
    if config.max_connection_age_grace_s is not None:
        options.append(("grpc.max_connection_age_grace_ms", round(config.max_connection_age_grace_s * 1000)))
    return options


class ScorerApp:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        interceptors: list[grpc.aio.ServerInterceptor] = [LoggingErrorInterceptor(self.metrics)]
        if config.auth_token_file:  # inside the logging interceptor: denials are logged
            health_only = reflection_handlers([health.SERVICE_NAME], DocumentedPool(only=["grpc.health.v1"]))
            interceptors.append(AuthInterceptor(read_token(config.auth_token_file), open_handlers=health_only))
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(config))
        self.gate = Gate(max_items=config.max_items, max_request_tokens=config.max_request_tokens)
        self.servicer = ScorerServicer(self.gate)
        self.health = HealthServicer()
        scorer_pb2_grpc.add_ScorerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        add_reflection(self.server, (SCORER_SERVICE, health.SERVICE_NAME), DocumentedPool())
        self.batcher: Batcher | None = None
        self.metrics.track_queue(lambda: self.batcher.waiting() if self.batcher is not None else 0)
        self.engine: EngineLike | None = None
        self.metrics.track_generations(lambda: self.batcher.running_generations() if self.batcher is not None else 0,
                                       lambda: self.engine.kv_tokens_reserved() if self.engine is not None else 0)
        self.port = 0
        self.metrics_port = 0
        self.http: HttpFrontDoor | None = None
        self.http_port = 0
        self.memory_probe = MemoryProbe.from_env()  # bench.hardening soak's diagnostics; None unless asked for

    async def start(self) -> int:
        """Listen (health NOT_SERVING); returns the bound port."""
        c = self.config
        address = f"{c.host}:{c.port}"
        if c.tls_cert and c.tls_key:
            self.port = self.server.add_secure_port(address, server_credentials(c.tls_cert, c.tls_key, c.tls_client_ca))
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        if c.host not in ("127.0.0.1", "localhost", "::1") and not (c.tls_cert and c.auth_token_file):
            log.warning("listening on %s without %s: anyone who can reach it can use it", c.host,
                        " and ".join(w for w, on in (("TLS", c.tls_cert), ("a token", c.auth_token_file)) if not on))
        if c.metrics_port is not None:
            self.metrics_port = self.metrics.serve(c.host, c.metrics_port)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if c.http_port is not None:
            self.http_port = await self._start_http()
        if self.memory_probe is not None:
            self.memory_probe.start()
        return self.port

    async def _start_http(self) -> int:
        """The HTTP front door in this loop, over this server's gate, batcher, token, TLS and metrics."""
        c = self.config
        app = build_http_app(self.gate, self.metrics, self.health.serving,
                             max_body_bytes=c.max_message_mb * 1024 * 1024,
                             token=read_token(c.auth_token_file) if c.auth_token_file else None,
                             rerank_labels=list(c.rerank_labels))
        self.http = HttpFrontDoor(app)
        return await self.http.start(c.host, c.http_port or 0, tls_cert=c.tls_cert, tls_key=c.tls_key,
                                     tls_client_ca=c.tls_client_ca)

    async def serve_engine(self, engine: EngineLike) -> None:
        """Warm the engine up (off the loop), start the batcher on it and go SERVING."""
        await in_daemon_thread(lambda: warm_up(engine))
        c = self.config
        self.batcher = Batcher(engine, max_batch_tokens=c.max_batch_tokens, max_queue=c.max_queue,
                               max_request_tokens=c.max_request_tokens,
                               max_running_generations=c.max_running_generations,
                               on_batch=self.metrics.observe_batch,
                               trim_under_load=os.environ.get("PYSCORE_TRIM_UNDER_LOAD", "") not in ("", "0"))
        self.batcher.start()
        self.engine = engine
        self.metrics.track_prefix_cache(engine.prefix_cache_stats)
        self.metrics.track_kv_store(engine.kv_store_stats)
        self.gate.open(self.batcher, engine, self.model_info(engine))
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def model_info(self, engine: EngineLike) -> ModelInfo:
        """The engine's description of its model plus this server's limits (0 = none)."""
        c = self.config
        limits = ServerLimits(max_items=c.max_items, max_request_tokens=c.max_request_tokens or 0,
                              max_batch_tokens=c.max_batch_tokens, max_message_bytes=c.max_message_mb * 1024 * 1024,
                              max_queue=c.max_queue)
        return dataclasses.replace(engine.info(), limits=limits, server_version=pyscore.__version__)

    async def stop(self, grace: float | None = None, drain_delay: float | None = None) -> None:
        """NOT_SERVING for good, keep serving `drain_delay` seconds (balancers see the health change and stop
        sending), then refuse new calls and give the in-flight ones `grace` seconds. Calls still unfinished then
        answer UNAVAILABLE (batcher.HALTED; logged as such) and the engine thread stops at its next layer
        boundary; it is joined before this returns, so that no model code runs while the process exits."""
        grace = self.config.grace_s if grace is None else grace
        drain_delay = self.config.drain_delay_s if drain_delay is None else drain_delay
        await self.health.enter_graceful_shutdown()
        if drain_delay > 0:
            log.info("NOT_SERVING; draining for %.1f s before closing the listener", drain_delay)
            await asyncio.sleep(drain_delay)
        # gRPC would cancel what is left at its grace; ours ends first, so callers get our status, not a cancel
        closing = asyncio.ensure_future(self.server.stop(grace + HALT_MARGIN_S))
        http_closing = asyncio.ensure_future(self.http.stop(grace) if self.http else asyncio.sleep(0))
        done, _ = await asyncio.wait([closing], timeout=grace)
        if not done and self.batcher is not None:
            log.warning("grace period over: unfinished calls answer UNAVAILABLE; the engine stops at its next "
                        "layer boundary")
            self.batcher.halt()
        await asyncio.gather(closing, http_closing)
        if self.batcher is not None:
            await asyncio.to_thread(self.batcher.stop)
        await asyncio.to_thread(self.metrics.stop)
        if self.memory_probe is not None:
            await asyncio.to_thread(self.memory_probe.stop)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", SCORER_SERVICE):
            await self.health.set(service, status)


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code (0 after a graceful stop)."""
    app = ScorerApp(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await app.start()
    print(f"pyscore: listening on {config.host}:{port} (loading the model)", flush=True)
    if app.metrics_port:
        print(f"pyscore: metrics on http://{config.host}:{app.metrics_port}/metrics", flush=True)
    if app.http is not None:
        scheme = "https" if config.tls_cert else "http"
        print(f"pyscore: HTTP on {scheme}://{config.host}:{app.http_port} (/v1/score, /generative_scoring, "
              "/rerank, /score, /classify, /v1/completions, /v1/chat/completions)", flush=True)
    loading = asyncio.ensure_future(_load_and_serve(app, config))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loading.done() and isinstance(loading.exception(), InsufficientMemoryError):
        print(f"pyscore: {loading.exception()}", file=sys.stderr, flush=True)  # the numbers, not a traceback
        code = 1
    elif loading.done() and loading.exception() is not None:
        log.error("could not load the model", exc_info=loading.exception())
        code = 1
    elif loading.done():
        info = loading.result()
        tier = f", CPU tier {info.cpu_tier}" if info.cpu_tier else ""
        quantized = f", {info.quantize} projections" if info.quantize else ""
        print(f"pyscore: serving {info.name} on {config.host}:{port} ({info.device}, {info.dtype}{quantized}{tier})",
              flush=True)
        await stopping
    print("pyscore: shutting down", flush=True)
    loading.cancel()
    await app.stop()
    return code


async def _load_and_serve(app: ScorerApp, config: ServerConfig) -> ModelInfo:
    engine = await in_daemon_thread(lambda: load_engine(config))
    log.info(freeze_heap())  # on the loop, before SERVING: a collection holds the GIL wherever it runs
    await app.serve_engine(engine)
    return engine.info()


def main(config: ServerConfig) -> None:
    sys.exit(asyncio.run(serve(config)))
