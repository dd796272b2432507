"""Three real replicas on loopback, reached two ways — gRPC client-side balancing (`ipv4:a,b,c` target:
round_robin, health checking, retries) and Envoy running deploy/envoy/envoy.yaml: calls spread per call over
one connection; a replica SIGTERMed mid-run costs no call, gets no new call once NOT_SERVING (while it still
listens, draining), and gets calls again once restarted; with the prefix header, equal prefixes stick to one
replica and move together when it dies. Which replica answered is read from each one's metrics endpoint."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.fleet import CLUSTERS, Envoy, Replica, client_target
from pyscore.balancing import SCORER_SERVICE
from pyscore.client import ScorerClient
from tests.deploy.helpers import ClosedLoop, calls, needs_envoy, score, wait_for


def not_serving(replica: Replica) -> bool:
    with grpc.insecure_channel(replica.target) as channel:
        request = health_pb2.HealthCheckRequest(service=SCORER_SERVICE)
        status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
    return status == health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Route:
    """How the test reaches the replicas, and how it knows the router has stopped picking one."""

    name: str
    client: Callable[..., ScorerClient]
    wait_unpicked: Callable[[Replica], None]


def client_side(replicas: list[Replica]) -> Route:
    def unpicked(r: Replica) -> None:
        # The client's health watch hears NOT_SERVING when the replica's own Check does, on gRPC's own threads,
        # and a call picked just before is still on its way: on a busy 2-core machine both can take a while to
        # land. Give them the moment the Envoy route gives (no event marks either as done).
        wait_for(lambda: not_serving(r), what=f"{r.target} NOT_SERVING")
        time.sleep(1.0)

    return Route("client-side", lambda **kw: ScorerClient(client_target(replicas), timeout=10, **kw), unpicked)


def through_envoy(envoy: Envoy) -> Route:
    def unpicked(r: Replica) -> None:
        wait_for(lambda: all(r.port not in envoy.healthy_ports(c) for c in CLUSTERS), what=f"Envoy to drop {r.target}")
        # The admin view changes on Envoy's main thread first; its workers get the new host set by a posted
        # update, and a call a worker picked just before is still on its way: on a busy 2-core machine both
        # took long enough to be counted as "new" calls. Give them a moment, as the client-side route does.
        time.sleep(1.0)

    return Route("envoy", lambda **kw: ScorerClient(envoy.target, timeout=10, **kw), unpicked)


@pytest.fixture(params=["client-side", pytest.param("envoy", marks=needs_envoy)])
def route(request: pytest.FixtureRequest, replicas: list[Replica]) -> Route:
    if request.param == "envoy":
        return through_envoy(request.getfixturevalue("envoy"))
    return client_side(replicas)


def test_calls_spread_per_call_over_one_connection(route: Route, replicas: list[Replica]) -> None:
    before = calls(replicas)
    with route.client() as client:  # one channel: per-connection balancing would pin every call to one replica
        for i in range(60):
            score(client, f"question {i}")
    got = [b - a for a, b in zip(before, calls(replicas), strict=True)]
    assert sum(got) == 60, got
    assert min(got) >= 5, f"{route.name}: calls per replica {got}"


def test_sigterm_mid_run_fails_no_call_and_not_serving_gets_none(route: Route, replicas: list[Replica]) -> None:
    victim = replicas[-1]
    with route.client() as client, ClosedLoop(client, workers=4) as load:
        load.wait_answers(40)
        assert victim.calls("Score", "OK") > 0
        victim.signal(signal.SIGTERM)  # NOT_SERVING now; keeps serving for the drain delay, then closes
        route.wait_unpicked(victim)
        wait_for(lambda: victim.in_flight() == 0, what="the victim's in-flight calls to finish")
        served = victim.calls("Score", "OK")
        load.wait_answers(40)
        assert victim.alive(), "the victim closed before the check ran: it proves nothing"
        assert victim.calls("Score", "OK") == served, f"{route.name}: a NOT_SERVING replica got new calls"
        assert victim.wait() == 0
        victim.start()  # the same port, a fresh process
        victim.wait_serving()
        # the client reconnects on gRPC's backoff (1 s, x1.6, jittered), grown while the replica was down and
        # slow to restart: its next try can come many seconds after SERVING
        wait_for(lambda: victim.calls("Score", "OK") > 0, timeout=60, what="calls to the restarted replica")
        load.wait_answers(40)
    assert load.failures == [], f"{route.name}: {len(load.failures)} failed of {load.ok + len(load.failures)}"


@needs_envoy
def test_prefix_affinity_sticks_and_moves_with_the_replica(envoy: Envoy, replicas: list[Replica]) -> None:
    shared = "Context: the customer's order history and the support policy, shared by many questions. "

    def landed(client: ScorerClient, queries: list[str]) -> list[float]:
        before = calls(replicas)
        for q in queries:
            score(client, q)
        return [b - a for a, b in zip(before, calls(replicas), strict=True)]

    same_prefix = [shared + f"Question {i}: should the agent refund?" for i in range(40)]
    with ScorerClient(envoy.target, timeout=10, prefix_affinity=len(shared)) as client:
        got = landed(client, same_prefix)
        owner = got.index(max(got))
        assert max(got) >= 0.95 * len(same_prefix), f"equal prefixes spread: {got}"
        others = landed(client, [f"Context {i}: another customer. Refund?" for i in range(24)])
        assert sum(n > 0 for n in others) >= 2, f"distinct prefixes all hashed to one replica: {others}"

        replicas[owner].signal(signal.SIGKILL)
        replicas[owner].wait()
        wait_for(lambda: replicas[owner].port not in envoy.healthy_ports("pyscore_affinity"),
                 what="Envoy to drop the dead replica")
        moved = landed(client, same_prefix)
        assert moved[owner] == 0 and max(moved) >= 0.95 * len(same_prefix), f"after the owner died: {moved}"

        replicas[owner].start()
        replicas[owner].wait_serving()
        envoy.wait_healthy({r.port for r in replicas})
        back = landed(client, same_prefix[:20])
        assert back[owner] >= 0.95 * 20, f"the prefix did not return to its replica: {back}"
