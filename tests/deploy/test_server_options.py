"""The server's side of running several replicas, in process on the fake engine: on shutdown health goes
NOT_SERVING before the listener closes and calls are still served for the drain delay; `max_connection_age_s`
ends client connections (GOAWAY) so long-lived clients reconnect (and re-resolve); the client's balancing
settings and prefix-affinity key."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pyscore import balancing
from pyscore.client import ScorerClient
from server.__main__ import parse_args
from tests.deploy.helpers import wait_for
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def server_thread() -> object:
    started: list[ServerThread] = []

    def start(**config: object) -> ServerThread:
        started.append(ServerThread(FakeEngine(), **config))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def health(target: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=balancing.SCORER_SERVICE)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_stop_goes_not_serving_then_serves_through_the_drain_delay(server_thread) -> None:
    from grpc_health.v1 import health_pb2

    server = server_thread()
    with ScorerClient(server.target, timeout=5) as client:
        client.score("before", ["a"], labels=["Yes"])
        stopping = asyncio.run_coroutine_threadsafe(server.app.stop(0.5, drain_delay=1.5), server.loop)
        wait_for(lambda: health(server.target) == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
        assert client.score("during the drain delay", ["a"], labels=["Yes"]).scores  # the listener is still open
        assert not stopping.done()
        stopping.result(10)
        with pytest.raises(grpc.RpcError) as err:
            client.score("after", ["a"], labels=["Yes"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_max_connection_age_ends_connections(server_thread) -> None:
    server = server_thread(max_connection_age_s=0.3, max_connection_age_grace_s=0.5)
    states: list[grpc.ChannelConnectivity] = []
    with ScorerClient(server.target, timeout=5) as client:
        client.channel.subscribe(states.append, try_to_connect=True)
        client.score("first", ["a"], labels=["Yes"])
        # gRPC delivers connectivity callbacks on its own thread: READY may land after the call returns.
        wait_for(lambda: grpc.ChannelConnectivity.READY in states, timeout=10, what="READY")
        ready = states.index(grpc.ChannelConnectivity.READY)
        wait_for(lambda: grpc.ChannelConnectivity.IDLE in states[ready:], timeout=10, what="the server's GOAWAY")
        assert client.score("on a new connection", ["a"], labels=["Yes"]).scores
        client.channel.unsubscribe(states.append)


def test_server_flags() -> None:
    config, _ = parse_args(["--drain-delay-s", "5", "--max-connection-age-s", "300",
                            "--max-connection-age-grace-s", "60"])
    assert (config.drain_delay_s, config.max_connection_age_s, config.max_connection_age_grace_s) == (5, 300, 60)
    assert parse_args([])[0].max_connection_age_s is None


def test_client_balancing_settings() -> None:
    assert balancing.balances("ipv4:127.0.0.1:1,127.0.0.1:2", None)
    assert balancing.balances("dns:///pyscore-headless.ns.svc:50051", None)
    assert not balancing.balances("127.0.0.1:50051", None)  # one server: gRPC's defaults, its own errors
    assert balancing.balances("127.0.0.1:50051", True) and not balancing.balances("dns:///x:1", False)
    options = dict(balancing.channel_options("dns:///x:1", None))
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "pyscore.v1.Scorer"}
    (method,) = config["methodConfig"]
    assert {n["method"] for n in method["name"]} >= {"Score", "Tokenize", "GetModelInfo"}
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert balancing.channel_options("127.0.0.1:50051", None) == []


def test_prefix_key() -> None:
    key = balancing.prefix_key("Context: shared. Question 1", 16)
    assert key == balancing.prefix_key("Context: shared. Question 2", 16)  # equal leading characters
    assert key != balancing.prefix_key("Context: other.. Question 1", 16)
    assert len(key) == 16 and int(key, 16) >= 0
    assert balancing.prefix_key([1, 2, 3, 4], 3) == balancing.prefix_key([1, 2, 3, 9], 3)
    assert balancing.prefix_key([1, 2, 3], 3) != balancing.prefix_key("\x01\x02\x03", 3)
    with pytest.raises(ValueError, match="prefix_affinity"):
        ScorerClient("127.0.0.1:1", prefix_affinity=0)
