"""docs/clients.md's Java snippet as pasted, compiled with protoc 3.21, the grpc-java plugin and Debian's grpc-java 1.41
jars (tests/clients/java/setup.sh installs them), run against a real server: plaintext, with a bearer token, and
a request the model refuses (INVALID_ARGUMENT with its field violation). Its scores must equal the Python
client's bit for bit. Plaintext only: Debian's Netty 4.1.48 cannot negotiate ALPN with the JDK, so the snippet's
TLS branch compiles here but does not run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyscore.client import ScorerClient
from tests.clients.conftest import ROOT
from tests.clients.readme import ORDER_STATUS, snippets
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine, FakeTokenizer

JARS = Path("/usr/share/java")
# Debian's unversioned jar names: grpc-java, its transport and runtime, and javax.annotation.Generated (which the
# grpc-java 1.41 plugin's code uses and Java 11 dropped)
CLASSPATH = ["geronimo-annotation-1.3-spec", "grpc-api", "grpc-context", "grpc-core", "grpc-netty", "grpc-protobuf",
             "grpc-protobuf-lite", "grpc-stub", "protobuf", "proto-google-common-protos", "guava", "failureaccess",
             "perfmark-api", "gson",
             "netty-buffer", "netty-codec", "netty-codec-http", "netty-codec-http2", "netty-codec-socks",
             "netty-common", "netty-handler", "netty-handler-proxy", "netty-resolver", "netty-transport"]
PLUGIN = Path("/usr/bin/grpc_java_plugin")
TOKEN = "java-test-token"


def missing() -> list[str]:
    tools = [t for t in ("java", "javac", "protoc") if shutil.which(t) is None]
    jars = [f"{j}.jar" for j in CLASSPATH if not (JARS / f"{j}.jar").exists() and j != "failureaccess"]
    return tools + jars + ([] if PLUGIN.exists() else [str(PLUGIN)])


pytestmark = pytest.mark.skipif(bool(missing()), reason=f"needs Debian's grpc-java (tests/clients/java/setup.sh): "
                                                        f"missing {', '.join(missing())}")


@pytest.fixture(scope="module")
def classes(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The class path with the generated pyscore.v1 classes and docs/clients.md's Score.java compiled."""
    import grpc_tools

    work = tmp_path_factory.mktemp("java")
    gen, out = work / "gen", work / "classes"
    gen.mkdir()
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/duration.proto
    subprocess.run(["protoc", f"-I{ROOT / 'proto'}", f"-I{well_known}", f"--java_out={gen}", f"--grpc-java_out={gen}",
                    f"--plugin=protoc-gen-grpc-java={PLUGIN}", "pyscore/v1/scorer.proto"], check=True)
    (code,) = snippets("java")
    (gen / "Score.java").write_text(code)
    jars = ":".join(str(JARS / f"{j}.jar") for j in CLASSPATH if (JARS / f"{j}.jar").exists())
    sources = [str(p) for p in gen.rglob("*.java")]
    done = subprocess.run(["javac", "-nowarn", "-encoding", "UTF-8", "-cp", jars, "-d", str(out), *sources],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return f"{out}:{jars}"


def run_score(classes: str, target: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["java", "-cp", classes, "Score"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYSCORE_TARGET=target, **env))


def printed_scores(stdout: str) -> list[list[float]]:
    """The snippet's `[0.1787682, 0.8212318]` lines (Float.toString: the shortest decimal that is that float)."""
    rows = [line.strip("[]").split(", ") for line in stdout.splitlines() if line.startswith("[")]
    return [[float(np.float32(v)) for v in row] for row in rows]


def readme_scores(client: ScorerClient) -> list[list[float]]:
    result = client.score(ORDER_STATUS["query"], ORDER_STATUS["items"], labels=ORDER_STATUS["labels"],
                          apply_softmax=True)
    return [rows[0] for rows in result.scores]


class SplitsYes(FakeTokenizer):
    """A vocabulary in which "Yes" is two tokens, so the snippet's labels are refused."""

    def encode_words(self, text: str) -> list[int]:
        return super().encode_words(text.replace("Yes", "Y es"))


def test_readme_java_snippet(classes: str, start_server: Any, tmp_path: Path) -> None:
    plain: ServerThread = start_server(FakeEngine())
    done = run_score(classes, plain.target)
    assert done.returncode == 0, done.stderr
    with ScorerClient(plain.target, timeout=10) as client:
        assert printed_scores(done.stdout) == readme_scores(client)
    assert "SCORING_MODE_MIS, " in done.stdout

    # The token (on plaintext: Debian's Netty 4.1.48 cannot negotiate ALPN with the JDK, so TLS is not run here)
    (tmp_path / "token").write_text(TOKEN)
    locked: ServerThread = start_server(FakeEngine(), auth_token_file=str(tmp_path / "token"))
    done = run_score(classes, locked.target, PYSCORE_AUTH_TOKEN=TOKEN)
    assert done.returncode == 0, done.stderr
    with ScorerClient(locked.target, timeout=10, auth_token=TOKEN) as client:
        assert printed_scores(done.stdout) == readme_scores(client)
    denied = run_score(classes, locked.target, PYSCORE_AUTH_TOKEN="wrong")
    assert denied.returncode == 1 and denied.stderr.startswith("UNAUTHENTICATED: "), denied.stderr


def test_readme_java_snippet_reads_the_field_violation(classes: str, start_server: Any) -> None:
    """INVALID_ARGUMENT: the snippet prints the status and then the BadRequest field violation naming the labels."""
    server: ServerThread = start_server(FakeEngine(tokenizer=SplitsYes()))
    done = run_score(classes, server.target)
    assert done.returncode == 1
    first, *violations = done.stderr.splitlines()
    assert first.startswith("INVALID_ARGUMENT: labels[0]: "), done.stderr
    assert violations == [first.removeprefix("INVALID_ARGUMENT: ")]
