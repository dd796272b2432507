"""Fixtures of the client tests: the server fixtures of tests/server (a real server on a free loopback port,
the FakeEngine or the real engine on a tiny random model), and where the client tools are."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.server.conftest import fake, start_server, tiny_model_dir, tiny_server  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "clients" / "node"


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with the packages `make setup` installs (npm ci in tests/clients/node)."""
    binary = shutil.which("node")
    if binary is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.skip("needs node and tests/clients/node/node_modules (make setup)")
    return binary
