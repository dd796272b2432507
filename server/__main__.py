"""`python -m server` (installed: `pyscore-server`, or `python -m pyscore_server`): serve pyscore.v1.Scorer on
the given model (default: the embedded SmolLM2).

Prints `pyscore: listening on HOST:PORT` as soon as it listens (health NOT_SERVING while the model loads) and
`pyscore: serving MODEL on HOST:PORT (DEVICE, DTYPE)` once SERVING. SIGTERM/SIGINT stop it gracefully; it then exits 0.
A model that cannot fit in the memory available exits 1 before loading, naming the numbers. `--plan-memory` prints
what the model takes in memory with the other flags given (no weight is read) and the memory request to give a
replica, and exits.

Test-only: the hidden `--engine module:Class` flag replaces pyscore.engine.Engine with any class that has
the same `from_pretrained` and API (the server tests pass tests.server.fake_engine:FakeEngine).
"""

from __future__ import annotations

import argparse
import logging

from pyscore.types import MemoryPlan

from .app import ServerConfig, main


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> tuple[ServerConfig, str]:
    """The server config and the log level."""
    config, level, _ = parse_command(argv, prog)
    return config, level


def parse_command(argv: list[str] | None = None, prog: str | None = None) -> tuple[ServerConfig, str, bool]:
    """The server config, the log level and whether only the memory plan is asked for."""
    d = ServerConfig()
    # `python -m server` in a checkout, `python -m pyscore_server` where the wheel is installed
    p = argparse.ArgumentParser(prog=prog or f"python -m {__package__}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help="model directory, file or name (default: embedded SmolLM2)")
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (0 = any free one; default %(default)s)")
    p.add_argument("--dtype", default=d.dtype,
                   help="auto, bfloat16, float16 or float32; float16 on the CPU runs the slow reference ops "
                        "(default %(default)s)")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: the layers' projections in int8 W8A8 (a scale per 64 input channels on weights and "
                        "activations, exact int32 sums per group: MIS = SIS and batch invariance hold); the rest in "
                        "--dtype. Its drift is in docs/guarantees.md (default: off)")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads for the model (default: all cores)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget of one packed forward pass (default %(default)s)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=0,
                   help="a request computing more than --max-batch-tokens has its Score query or Generate prompt "
                        "prefilled through the prefix cache in chunks of at most this many tokens, other requests "
                        "running between them; smaller chunks cut their wait and lengthen the long request (0 = "
                        "--max-batch-tokens, the default; at most that)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests allowed to wait; more answer RESOURCE_EXHAUSTED (default %(default)s)")
    p.add_argument("--max-items", type=int, default=d.max_items,
                   help="items per Score request; more answer RESOURCE_EXHAUSTED (default %(default)s)")
    p.add_argument("--max-message-mb", type=int, default=d.max_message_mb,
                   help="largest gRPC message sent or received, MiB; protobuf parses it on the event loop, ~25 ms "
                        "per MB of tiny repeated fields at worst (default %(default)s)")
    p.add_argument("--max-running-generations", type=int, default=d.max_running_generations,
                   help="generations decoded at once; more wait in the queue (default %(default)s)")
    p.add_argument("--kv-cache-mb", type=float, default=d.kv_cache_mb,
                   help="MiB of the paged KV store: keys/values of running generations (prompt + max_tokens each "
                        "reserved in whole 64-token pages; more wait in the queue, and one that can never fit "
                        "answers RESOURCE_EXHAUSTED) and of recent query and prompt prefixes kept for reuse (least "
                        "recently used pages no generation holds are evicted; scores are the same hit or miss) "
                        "(default: 65536 tokens' worth + 1024)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="keep no query or prompt prefix for reuse: every request computes its tokens in full, and "
                        "long requests are not prefilled in chunks (default: the prefix cache is on)")
    p.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens,
                   help="tokens one request may make the model compute (Score: as its mode computes; Generate: "
                        "prompt + max_tokens); more answer RESOURCE_EXHAUSTED; 0 = no limit (default %(default)s)")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA certificate: require client certificates it signed (mTLS)")
    p.add_argument("--auth-token-file",
                   help="file holding a token; calls must send `authorization: Bearer <token>` (health stays open)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0 = any free port; default off)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the HTTP/JSON front door (SGLang /v1/score, vLLM /generative_scoring, /rerank, "
                        "/score, /classify, OpenAI /v1/completions and /v1/chat/completions, /health, /metrics) on "
                        "http(s)://HOST:PORT, with the same token, TLS and limits (0 = any free port; default off)")
    p.add_argument("--rerank-labels", nargs="+", default=list(d.rerank_labels), metavar="LABEL",
                   help="HTTP /rerank and /score on a causal LM: the single-token labels whose softmax gives a "
                        "document's relevance, positive first (vLLM's classifier_from_token; default: yes no)")
    p.add_argument("--grace-s", type=float, default=d.grace_s,
                   help="seconds in-flight requests get to finish on shutdown (default %(default)s)")
    p.add_argument("--drain-delay-s", type=float, default=d.drain_delay_s,
                   help="on SIGTERM, seconds to keep serving after health turns NOT_SERVING, so that balancers move "
                        "traffic away before the listener closes (default %(default)s)")
    p.add_argument("--max-connection-age-s", type=float, default=None,
                   help="close each client connection (GOAWAY) after this many seconds, so long-lived clients "
                        "re-resolve and reach new replicas (default: never)")
    p.add_argument("--max-connection-age-grace-s", type=float, default=None,
                   help="calls still running on an aged connection get this long (default: no limit)")
    p.add_argument("--plan-memory", action="store_true",
                   help="print what the model takes in memory under these flags (weights, pools, expected total) "
                        "and the memory request to give a replica, then exit without loading it")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ... (default %(default)s)")
    p.add_argument("--engine", default=d.engine, help=argparse.SUPPRESS)  # test-only, see the docstring
    a = p.parse_args(argv)
    if a.prefill_chunk_tokens < 0:
        p.error("--prefill-chunk-tokens must be 0 (= --max-batch-tokens) or positive")
    for flag in ("max_batch_tokens", "max_queue", "max_items", "max_running_generations"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if a.kv_cache_mb is not None and a.kv_cache_mb <= 0:
        p.error("--kv-cache-mb must be positive")
    if bool(a.tls_cert) != bool(a.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if a.tls_client_ca and not a.tls_cert:
        p.error("--tls-client-ca needs --tls-cert and --tls-key")
    return ServerConfig(model=a.model, host=a.host, port=a.port, dtype=a.dtype, device=a.device, threads=a.threads,
                        max_batch_tokens=a.max_batch_tokens, max_queue=a.max_queue, max_items=a.max_items,
                        max_message_mb=a.max_message_mb, max_request_tokens=a.max_request_tokens or None,
                        max_running_generations=a.max_running_generations, prefix_cache=a.prefix_cache,
                        kv_cache_mb=a.kv_cache_mb, quantize=a.quantize,
                        prefill_chunk_tokens=a.prefill_chunk_tokens or None,
                        tls_cert=a.tls_cert, tls_key=a.tls_key, tls_client_ca=a.tls_client_ca,
                        auth_token_file=a.auth_token_file, metrics_port=a.metrics_port, http_port=a.http_port,
                        rerank_labels=tuple(a.rerank_labels), grace_s=a.grace_s,
                        drain_delay_s=a.drain_delay_s, max_connection_age_s=a.max_connection_age_s,
                        max_connection_age_grace_s=a.max_connection_age_grace_s, engine=a.engine), \
        a.log_level.upper(), a.plan_memory


def plan_memory(config: ServerConfig) -> tuple[str, MemoryPlan]:
    """(what it is, the plan) of serving config.model with the config's dtype, device and pools."""
    from pyscore.engine import resolve_device, resolve_dtype
    from pyscore.memory import Pools
    from pyscore.model.loading import memory_plan

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    pools = Pools(config.max_batch_tokens, config.max_running_generations, config.kv_cache_mb)
    name, plan = memory_plan(config.model, dtype, pools, config.quantize)
    quantized = " with int8 projections" * bool(config.quantize)
    return f"{name} in {str(dtype).removeprefix('torch.')}{quantized} on {device}", plan


def memory_request(plan: MemoryPlan) -> str:
    """The plan's expected total rounded up to whole GiB, as a Kubernetes quantity."""
    return f"{-(-plan.expected_total_bytes // 2**30)}Gi"


def serve(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Parse the command line and serve until SIGTERM / SIGINT (or, with --plan-memory, print the plan)."""
    config, level, plan_only = parse_command(argv, prog)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not plan_only:
        main(config)
        return
    from pyscore.memory import describe

    what, plan = plan_memory(config)
    print(f"pyscore: {what} takes {describe(plan)} with every pool full")
    if what.endswith(" on cpu"):
        print(f"memory request: {memory_request(plan)}")
    else:  # the weights and pools live on the GPU, which the server checks at start; the host keeps the runtime
        print(f"GPU memory: {(plan.expected_total_bytes - plan.runtime_bytes) / 2**30:.2f} GiB")


if __name__ == "__main__":
    serve()
