"""Prometheus metrics of one server (prometheus-client, a registry of its own so that several servers can live
in one process): requests by method and status, requests in flight, latency, queue depth, running generations and
the KV-cache tokens they reserve, batch sizes, token accounting — computed tokens, tokens read from the prefix
cache, and the tokens MIS saved against SIS (prompt − computed) — and the prefix cache itself (hit and missed
tokens, evicted blocks, bytes held), read from the engine at each scrape. Exposed over HTTP on `--metrics-port`
(no auth: counts only, no request content)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 8192, 16384, 65536)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pyscore_requests", "Scorer calls by method and final status", ["method", "status"],
                                registry=r)
        self.latency = Histogram("pyscore_request_latency_seconds", "Scorer call latency, arrival to answer",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("pyscore_requests_in_flight", "Scorer calls being served (queued or running)",
                               ["method"], registry=r)
        self.queue_depth = Gauge("pyscore_queue_depth", "requests admitted and waiting to run (--max-queue)",
                                 registry=r)
        self.generations_running = Gauge("pyscore_generations_running",
                                         "generations running (--max-running-generations)", registry=r)
        self.kv_tokens_reserved = Gauge("pyscore_kv_tokens_reserved",
                                        "KV-store tokens reserved by running generations, whole pages (--kv-cache-mb)",
                                        registry=r)
        self.batch_requests = Histogram("pyscore_batch_requests", "Score requests per packed forward pass",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("pyscore_batch_tokens", "computed tokens per packed forward pass",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.tokens_computed = Counter("pyscore_tokens_computed", "tokens run through the model, by method",
                                       ["method"], registry=r)
        self.tokens_prompt = Counter("pyscore_tokens_prompt",
                                     "tokens of the requests as single-item scoring would run them, by method",
                                     ["method"], registry=r)
        self.tokens_saved = Counter("pyscore_tokens_saved_by_mis",
                                    "Score tokens MIS did not compute that SIS would have (prompt - computed)",
                                    registry=r)
        self.tokens_cached = Counter("pyscore_tokens_cached",
                                     "query / prompt tokens read from the prefix cache instead of computed, by method",
                                     ["method"], registry=r)
        self._http: Any = None

    def track_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)

    def track_generations(self, running: Callable[[], int], kv_tokens: Callable[[], int]) -> None:
        self.generations_running.set_function(running)
        self.kv_tokens_reserved.set_function(kv_tokens)

    def track_prefix_cache(self, stats: Callable[[], Any]) -> None:
        """Export the engine's prefix cache counters (`stats()`: a PrefixCacheStats, or None when off)."""
        self.registry.register(StatsCollector(stats, PREFIX_CACHE_COUNTERS, PREFIX_CACHE_GAUGES))

    def track_kv_store(self, stats: Callable[[], Any]) -> None:
        """Export the KV store's pages held (`stats()`: a KVStoreStats, or None for an engine without one)."""
        self.registry.register(StatsCollector(stats, gauges=KV_STORE_GAUGES))

    def observe_call(self, method: str, status: str, seconds: float, response: Any) -> None:
        """One finished Scorer call; `response` is its (last streamed) response message or None."""
        self.in_flight.labels(method).dec()
        self.requests.labels(method, status).inc()
        self.latency.labels(method).observe(seconds)
        if response is None or "usage" not in response.DESCRIPTOR.fields_by_name or not response.HasField("usage"):
            return
        prompt, computed = response.usage.prompt_tokens, response.usage.computed_tokens
        self.tokens_prompt.labels(method).inc(prompt)
        self.tokens_computed.labels(method).inc(computed)
        self.tokens_cached.labels(method).inc(response.usage.cached_tokens)
        if method == "Score":
            self.tokens_saved.inc(max(0, prompt - computed))

    def call_started(self, method: str) -> None:
        self.in_flight.labels(method).inc()

    def observe_batch(self, requests: int, tokens: int) -> None:
        """Called by the batcher's worker thread for every run_prepared call."""
        self.batch_requests.observe(requests)
        self.batch_tokens.observe(tokens)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (/metrics) in a daemon thread; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop(self) -> None:
        """Stop the HTTP endpoint (blocking, up to its 0.5 s poll interval)."""
        if self._http is not None:
            http, self._http = self._http, None
            http.shutdown()
            http.server_close()


# (name, help, value from the stats object) of the metrics read from the engine at each scrape.
Readings = tuple[tuple[str, str, Callable[[Any], float]], ...]
PREFIX_CACHE_COUNTERS: Readings = (
    ("pyscore_prefix_cache_hit_tokens", "cacheable query/prompt tokens found in the prefix cache",
     lambda s: s.hit_tokens),
    ("pyscore_prefix_cache_miss_tokens", "cacheable tokens (whole blocks) looked up and not found",
     lambda s: s.miss_tokens),
    ("pyscore_prefix_cache_evicted_blocks", "blocks evicted to make room (least recently used first)",
     lambda s: s.evicted_blocks))
PREFIX_CACHE_GAUGES: Readings = (
    ("pyscore_prefix_cache_bytes", "bytes of keys/values (and hybrid models' linear states) the prefix cache "
     "holds", lambda s: s.bytes),
    ("pyscore_prefix_cache_blocks", "pages the prefix cache holds (blocks, and hybrid models' linear states)",
     lambda s: s.blocks),
    ("pyscore_prefix_cache_capacity_bytes", "the most of the KV store the prefix cache may hold",
     lambda s: s.capacity_bytes))
KV_STORE_GAUGES: Readings = (
    ("pyscore_kv_store_held_bytes", "bytes of the KV store's pages in use (prefix cache and generations)",
     lambda s: s.held_bytes),
    ("pyscore_kv_store_capacity_bytes", "the KV store's byte budget (--kv-cache-mb)",
     lambda s: s.capacity_pages * s.block_bytes))


class StatsCollector(Collector):
    """Counters and gauges read at scrape time from `stats()` (ints the engine's worker updates; None: nothing to
    report, e.g. the prefix cache off)."""

    def __init__(self, stats: Callable[[], Any], counters: Readings = (), gauges: Readings = ()) -> None:
        self.stats, self.counters, self.gauges = stats, counters, gauges

    def collect(self) -> Any:
        s = self.stats()
        if s is None:
            return
        for name, doc, value in self.counters:
            yield CounterMetricFamily(name, doc, value=value(s))
        for name, doc, value in self.gauges:
            yield GaugeMetricFamily(name, doc, value=value(s))
