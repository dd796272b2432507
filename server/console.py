"""`pyscore-server`, the console script. A base `pip install pyscore` installs it too (a script cannot belong to
an extra), so it first checks for the `[server]` extra and, without it, says how to install it instead of failing
on an import deep inside the server."""

from __future__ import annotations

import importlib.util
import sys

# The [server] extra's packages that the server imports first: the engine's (torch, transformers) and the
# server's own (reflection, metrics, the HTTP front door); the rest come with them or fail with their own names.
SERVER_EXTRA_MODULES = ("torch", "transformers", "grpc_reflection", "prometheus_client", "starlette", "uvicorn")


def missing_server_modules() -> list[str]:
    return [name for name in SERVER_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def run() -> None:
    missing = missing_server_modules()
    if missing:
        sys.exit(f"pyscore-server: the server needs the [server] extra ({', '.join(missing)} not installed): "
                 "pip install 'pyscore[server]'")
    from .__main__ import serve

    serve(prog="pyscore-server")
