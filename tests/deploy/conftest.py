"""Deployment fixtures: three `python -m server` replicas (`--threads 1`, a tiny random model, a 4 s drain
delay) started once per session and brought back before every test (a test may stop one), and Envoy running
deploy/envoy/envoy.yaml in front of them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.fleet import Envoy, Replica, start_replicas, stop_replicas

DRAIN_DELAY_S = 4.0  # long enough for Envoy's 1 s health checks to see NOT_SERVING while the replica still serves
FLAGS = ("--threads", "1", "--dtype", "float32", "--drain-delay-s", str(DRAIN_DELAY_S), "--grace-s", "5",
         "--log-level", "WARNING")


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    from tests.helpers import make_model_dir

    root = tmp_path_factory.mktemp("fleet")
    model = make_model_dir(root / "model", "qwen3")
    replicas = start_replicas(3, ("--model", str(model), *FLAGS), root)
    yield replicas
    stop_replicas(replicas)


@pytest.fixture
def replicas(fleet: list[Replica]) -> list[Replica]:
    """The three replicas, each alive and SERVING (restarted on its port if a test stopped it)."""
    for r in fleet:
        if not r.alive():
            r.start()
            r.wait_serving()
    return fleet


@pytest.fixture(scope="session")
def envoy_process(fleet: list[Replica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    envoy = Envoy([r.port for r in fleet], tmp_path_factory.mktemp("envoy"))
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture
def envoy(envoy_process: Envoy, replicas: list[Replica]) -> Envoy:
    """Envoy with every replica healthy in both of its clusters."""
    envoy_process.wait_healthy({r.port for r in replicas})
    return envoy_process

