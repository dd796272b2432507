"""Client-side pieces for several replicas, all of them standard gRPC or Envoy mechanisms (no router of our own):

- `service_config()`: the gRPC service config a channel uses over every address its target resolves to —
  `round_robin` (per call, not per connection), client-side health checking (a replica whose
  `grpc.health.v1` status for pyscore.v1.Scorer is not SERVING, because it is loading or draining, gets no
  calls) and a retry policy for UNAVAILABLE (a replica that went away or refused the call) that gRPC runs on
  another replica. gRPC commits a call when its first response arrives, so a stream that delivered a token is
  never replayed.
- `prefix_key()`: the value of the `x-pyscore-prefix` header, a hash of a query's leading characters (or
  token ids), which a hashing gateway (Envoy's ring_hash/maglev route in deploy/envoy) maps to one replica:
  requests that share a prefix meet the same replica's prefix cache.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SCORER_SERVICE = "pyscore.v1.Scorer"
AFFINITY_HEADER = "x-pyscore-prefix"
RETRIED_METHODS = ("Score", "Tokenize", "GetModelInfo", "Generate", "GenerateStream")
# Targets in these forms may name several replicas (`ipv4:10.0.0.1:50051,10.0.0.2:50051`,
# `dns:///pyscore-headless.ns.svc:50051`); a plain HOST:PORT keeps gRPC's default (one connection, pick_first).
RESOLVER_SCHEMES = ("dns:", "ipv4:", "ipv6:")


def service_config(max_attempts: int = 4) -> dict[str, Any]:
    """round_robin + health checking + retries of UNAVAILABLE (`max_attempts` counts the first try; gRPC
    caps it at 5). Retry throttling stops retries when most calls fail (every replica down), so a dead fleet
    is not hammered."""
    return {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": SCORER_SERVICE},
        "methodConfig": [{
            "name": [{"service": SCORER_SERVICE, "method": m} for m in RETRIED_METHODS],
            "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.05s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
        "retryThrottling": {"maxTokens": 100, "tokenRatio": 0.1},
    }


def balances(target: str, balancing: bool | None) -> bool:
    """Whether a channel to `target` gets `service_config()`: `balancing` when given, else only for targets
    that name a resolver scheme (dns:, ipv4:, ipv6:), i.e. may stand for several replicas."""
    return target.startswith(RESOLVER_SCHEMES) if balancing is None else balancing


def channel_options(target: str, balancing: bool | None) -> list[tuple[str, Any]]:
    if not balances(target, balancing):
        return []
    return [("grpc.service_config", json.dumps(service_config())), ("grpc.enable_retries", 1)]


def prefix_key(query: str | list[int], leading: int) -> str:
    """A stable hash (16 hex digits) of the first `leading` characters of a text query or token ids of an id
    query; equal prefixes give equal keys in every process."""
    if isinstance(query, str):
        data = b"t" + query[:leading].encode()
    else:
        data = b"i" + b"".join(int(t).to_bytes(4, "little", signed=True) for t in query[:leading])
    return hashlib.blake2b(data, digest_size=8).hexdigest()
