"""Server test fixtures: a real grpc.aio server (ScorerApp) on a free loopback port, running in its own event
loop thread, and real channels to it. The engine behind it is the FakeEngine unless a test says otherwise."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pyscore.client import ScorerClient
from server.app import ScorerApp, ServerConfig
from server.batcher import Batcher
from tests.server.fake_engine import FakeEngine


class ServerThread:
    """A ScorerApp serving `engine` on 127.0.0.1:<free port> from a background event loop."""

    def __init__(self, engine: Any, **config: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.loop_thread.start()
        self.app: ScorerApp = self.run(self._start(ServerConfig(host="127.0.0.1", port=0, **config)))
        self.target = f"127.0.0.1:{self.app.port}"

    async def _start(self, config: ServerConfig) -> ScorerApp:
        app = ScorerApp(config)
        await app.start()
        if self.engine is not None:
            await app.serve_engine(self.engine)
        return app

    @property
    def batcher(self) -> Batcher:
        assert self.app.batcher is not None
        return self.app.batcher

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if isinstance(self.engine, FakeEngine):
            self.engine.resume()
        self.run(self.app.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(10)
        self.loop.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """start_server(engine, **ServerConfig overrides) -> ServerThread, stopped after the test."""
    started: list[ServerThread] = []

    def start(engine: Any, **config: Any) -> ServerThread:
        started.append(ServerThread(engine, **config))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def server(start_server: Callable[..., ServerThread], fake: FakeEngine) -> ServerThread:
    return start_server(fake, max_items=8)


@pytest.fixture
def client(server: ServerThread) -> Iterator[ScorerClient]:
    with ScorerClient(server.target, timeout=10) as c:
        yield c


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


# -- the real engine on a tiny random model -------------------------------------------------------------------
def make_tiny_engine(path: Path) -> Any:
    from pyscore.engine import Engine

    return Engine.from_pretrained(path, dtype="float32", device="cpu", threads=2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (causal LM, 512-token context) with its byte-level BPE tokenizer."""
    from tests.helpers import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """A server on the real Engine over the tiny model, shared by the real-engine tests."""
    # --max-message-mb 64: the hostile-input matrix sends up to ~16 MB, what an operator's larger limit admits
    server = ServerThread(make_tiny_engine(tiny_model_dir), max_batch_tokens=256, max_message_mb=64)
    yield server
    server.stop()
