"""pyproject.toml against what the code needs, without building anything: the generated gRPC code's own version
floors are the dependencies' lower bounds, the client install has no torch, and scripts/requirements.py (what
`make setup` installs from) reads the layers right. tests/test_packaging.py builds and installs for real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import pyscore
from scripts.requirements import requirements, tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
GENERATED = ROOT / "pyscore" / "_proto" / "pyscore" / "v1"


def _by_name(lines: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name: r for line in lines}


def _floor(req: Requirement) -> str:
    """The version of a `>=X` (or `==X`) requirement."""
    (spec,) = [s for s in req.specifier if s.operator in (">=", "==")]
    return spec.version


def test_dependency_floors_are_what_the_generated_code_checks() -> None:
    # The generated code raises at import on a grpcio older than grpcio-tools, or a protobuf older than its protoc.
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", (GENERATED / "scorer_pb2_grpc.py").read_text())
    protobuf_generated = re.search(r"Protobuf Python Version: (\S+)", (GENERATED / "scorer_pb2.py").read_text())
    assert grpc_generated and protobuf_generated
    build = _by_name(PYPROJECT["build-system"]["requires"])
    base = _by_name(PYPROJECT["project"]["dependencies"])
    assert str(build["grpcio-tools"].specifier) == f"=={grpc_generated[1]}"
    assert _floor(base["grpcio"]) == grpc_generated[1]
    assert _floor(base["protobuf"]) == protobuf_generated[1]


def test_client_install_has_no_torch_and_the_server_extra_does() -> None:
    base = _by_name(PYPROJECT["project"]["dependencies"])
    assert set(base) == {"grpcio", "protobuf", "grpcio-status", "grpcio-health-checking"}
    server = _by_name(PYPROJECT["project"]["optional-dependencies"]["server"])
    # a lower bound for users; the CI's exact pin lives in constraints.txt
    assert {s.operator for s in server["torch"].specifier} == {">="}
    assert "torch==" in (ROOT / "constraints.txt").read_text()


def test_version_comes_from_the_package() -> None:
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pyscore.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pyscore.__version__)


def test_requirements_script_layers() -> None:
    base = requirements([])
    assert not any(line.startswith("torch") for line in base)
    server = requirements(["server"])
    assert server[: len(base)] == base and "torch>=2.6" in server
    with_build = requirements(["server"], build_system=True)
    assert set(with_build) == set(server) | set(PYPROJECT["build-system"]["requires"])
    with pytest.raises(KeyError, match="no extra nope"):
        requirements(["nope"])
