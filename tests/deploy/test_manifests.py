"""deploy/: every Kubernetes manifest validates (strict schema, offline, `kubernetes-validate`) against the
oldest release it needs (1.30: native gRPC probes, the preStop `sleep` action) and the newest known; the objects
agree with each other and with the server (selectors, ports, flags the server parses, probe service, drain
timing, the HPA's metric, the memory request the server's plan asks for); the real Envoy binary accepts
deploy/envoy/envoy.yaml as shipped."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.fleet import ENVOY_CONFIG, Envoy, envoy_binary
from pyscore.balancing import SCORER_SERVICE
from server.__main__ import memory_request, parse_args, plan_memory
from server.metrics import Metrics
from tests.deploy.helpers import needs_envoy, wait_for
from tests.server.test_lifecycle import free_port

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str, path: Path) -> dict[str, Any]:
    (obj,) = [o for o in objects(path) if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path: Path, version: str) -> None:
    for obj in objects(path):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_what_it_should() -> None:
    deployment = find("Deployment", "pyscore", K8S / "cpu" / "deployment.yaml")
    typo = copy.deepcopy(deployment)
    container(typo)["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_the_deployment_agrees_with_the_server_and_the_services(variant: str) -> None:
    deployment = find("Deployment", "pyscore", K8S / variant / "deployment.yaml")
    pod = deployment["spec"]["template"]
    c = container(deployment)
    config, _ = parse_args(c["args"])  # the flags exist and parse as the server parses them
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (config.port, config.metrics_port, config.host) == (ports["grpc"], ports["metrics"], "0.0.0.0")
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(config.metrics_port)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": config.port, "service": SCORER_SERVICE}, probe
    assert c["livenessProbe"]["grpc"]["port"] == config.port
    # the pod's whole shutdown fits in its grace period: preStop, drain delay, in-flight grace
    stop = c["lifecycle"]["preStop"]["sleep"]["seconds"] + config.drain_delay_s + config.grace_s
    assert pod["spec"]["terminationGracePeriodSeconds"] >= stop + 1
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    headless = find("Service", "pyscore-headless", K8S / "services.yaml")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in headless["spec"]["ports"]} <= ports.keys()
    if variant == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and config.device == "cuda"


def test_the_cpu_memory_request_is_the_servers_memory_plan(smollm2_dir: Path) -> None:
    """requests = limits = the plan's expected total for the manifest's flags, rounded up to GiB (what
    `python -m server --plan-memory` prints): a flag that grows a pool must grow the request with it."""
    c = container(find("Deployment", "pyscore", K8S / "cpu" / "deployment.yaml"))
    config, _ = parse_args(c["args"])
    _, plan = plan_memory(dataclasses.replace(config, device="cpu"))
    resources = c["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == memory_request(plan)


def test_the_hpa_scales_the_deployment_on_a_metric_the_server_exports() -> None:
    hpa = find("HorizontalPodAutoscaler", "pyscore", K8S / "hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pyscore"
    (metric,) = hpa["spec"]["metrics"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert metric["pods"]["metric"]["name"] in exported


def test_envoy_reaches_the_replicas_and_serves_the_envoy_service() -> None:
    config = yaml.safe_load(ENVOY_CONFIG.read_text())
    headless = find("Service", "pyscore-headless", K8S / "services.yaml")
    grpc_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc")
    for cluster in config["static_resources"]["clusters"]:
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert (address["address"], address["port_value"]) == (headless["metadata"]["name"], grpc_port)
        assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == SCORER_SERVICE
    deployment = find("Deployment", "pyscore-envoy", K8S / "envoy.yaml")
    c = container(deployment)
    listener_port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == listener_port
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert c["args"][:2] == ["-c", f"{mount['mountPath']}/{ENVOY_CONFIG.name}"]
    service = find("Service", "pyscore-envoy", K8S / "services.yaml")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@needs_envoy
def test_envoy_accepts_the_shipped_config() -> None:
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(ENVOY_CONFIG)],  # type: ignore[list-item]
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    assert "deprecated" not in done.stderr.lower(), done.stderr


@needs_envoy
def test_envoy_pre_stop_drains_http2_clients(tmp_path: Path) -> None:
    """The Envoy pod's preStop command, run against a real Envoy started with the pod's drain flags: the next
    call's answer carries a GOAWAY, so the client reconnects (to another Envoy pod, in a cluster)."""
    c = container(find("Deployment", "pyscore-envoy", K8S / "envoy.yaml"))
    flags = c["args"][c["args"].index("--drain-time-s"):]
    shell, dash_c, script = c["lifecycle"]["preStop"]["exec"]["command"]
    envoy = Envoy([free_port()], tmp_path, tuple(flags))
    envoy.start()
    try:
        states: list[grpc.ChannelConnectivity] = []
        with grpc.insecure_channel(envoy.target) as channel:
            channel.subscribe(states.append, try_to_connect=True)
            stub = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest()
            with pytest.raises(grpc.RpcError):  # no replica behind it: Envoy answers UNAVAILABLE itself
                stub.Check(check, timeout=5)
            # connectivity callbacks arrive on gRPC's own thread, possibly after the call returned (even the
            # first: `states` may still be empty here)
            wait_for(lambda: states[-1:] == [grpc.ChannelConnectivity.READY], what="a connection to Envoy")
            script = script.replace("/9901", f"/{envoy.admin_port}").replace("sleep 30", "sleep 0")
            done = subprocess.run([shell, dash_c, script], capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            with pytest.raises(grpc.RpcError):
                stub.Check(check, timeout=5)
            wait_for(lambda: states[-1:] == [grpc.ChannelConnectivity.IDLE], what="Envoy's GOAWAY")
            channel.unsubscribe(states.append)
    finally:
        envoy.stop()
