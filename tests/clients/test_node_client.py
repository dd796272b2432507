"""Node clients (@grpc/grpc-js + @grpc/proto-loader with docs/clients.md's loader options) against a real server:
tests/clients/node/plan_client.js for Score, GenerateStream, an invalid request (with its google.rpc.BadRequest
details) and a deadline on the real engine over a tiny model, and docs/clients.md's Node snippet as pasted, over
plaintext and over TLS with a bearer token. Every score must equal the Python client's bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from pyscore.client import ScorerClient, field_violations
from tests.clients.conftest import NODE_DIR, ROOT
from tests.clients.readme import ORDER_STATUS, snippets
from tests.server.certs import make_pki
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine

TOKEN = "node-test-token"


def run_node(node: str, script: Path, target: str, stdin: str = "", **env: str) -> Any:
    environment = dict(os.environ, PYSCORE_TARGET=target, NODE_PATH=str(NODE_DIR / "node_modules"), **env)
    done = subprocess.run([node, str(script)], input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=environment)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def scores_of(response: dict[str, Any]) -> list[list[list[float]]]:
    return [[row["values"] for row in item["rows"]] for item in response["scores"]]


def score_plan(client: ScorerClient) -> list[dict[str, Any]]:
    """Score requests in the proto's JSON field names, valid for the tiny model's vocabulary."""
    ids, tokens = client.tokenize(" the cat sat on the mat", add_special_tokens=False)
    return [
        dict(query="Is this a good answer?", items=["yes it is", "no", "maybe so"], label_token_ids=ids[:2],
             apply_softmax=True),
        dict(query_token_ids=ids, item_token_ids=[dict(ids=ids[:3]), dict(ids=ids[2:])], label_token_ids=ids[1:4],
             mode="SCORING_MODE_SIS"),
        dict(query="the query", items=["first", "second"], label_token_ids=[ids[0]], mode="SCORING_MODE_MIS"),
        dict(query="the query", items=["first", "second"], labels=[tokens[0]], item_first=True),
    ]


def python_score(client: ScorerClient, request: dict[str, Any]) -> Any:
    r = dict(request)
    query = r.pop("query", None) or r.pop("query_token_ids")
    items = r.pop("items", None) or [i["ids"] for i in r.pop("item_token_ids")]
    if "mode" in r:
        r["mode"] = r["mode"].removeprefix("SCORING_MODE_").lower()
    return client.score(query, items, **r)


def test_node_client_equals_python(node: str, tiny_server: ServerThread) -> None:
    with ScorerClient(tiny_server.target, timeout=60) as client:
        plan = dict(score=score_plan(client),
                    stream=dict(prompt="Once upon a time", max_tokens=12, top_logprobs=2),
                    invalid=dict(query="q", items=["a"], labels=["a"], label_token_ids=[5]),
                    deadline=dict(request=dict(prompt_token_ids=[5, 6, 7], max_tokens=400), ms=1))
        out = run_node(node, NODE_DIR / "plan_client.js", tiny_server.target, json.dumps(plan))

        for request, got in zip(plan["score"], out["score"], strict=True):
            expected = python_score(client, request)
            assert scores_of(got) == expected.scores, request  # float32 values, compared exactly
            assert got["mode"] == f"SCORING_MODE_{expected.mode.upper()}"
            assert got["label_token_ids"] == expected.label_token_ids
            assert (got["usage"]["prompt_tokens"], got["usage"]["computed_tokens"]) == (
                expected.usage.prompt_tokens, expected.usage.computed_tokens)
            assert isinstance(got["usage"]["prompt_tokens"], int)  # uint32: a number, not a string or a Long

        unary = client.generate("Once upon a time", max_tokens=12, top_logprobs=2)
        chunks = out["stream"]
        assert "".join(c["text"] for c in chunks) == unary.text
        assert [t for c in chunks for t in c["token_ids"]] == unary.token_ids
        assert [lp["logprob"] for c in chunks for lp in c["logprobs"]] == [lp.logprob for lp in unary.logprobs]
        assert [c["finish_reason"] for c in chunks] == ["FINISH_REASON_UNSPECIFIED"] * (len(chunks) - 1) + [
            f"FINISH_REASON_{unary.finish_reason.upper()}"]
        assert chunks[-1]["usage"]["computed_tokens"] == unary.usage.computed_tokens

        with pytest.raises(grpc.RpcError) as err:
            python_score(client, plan["invalid"])
        assert out["invalid"]["code"] == "INVALID_ARGUMENT" and out["invalid"]["details"] == err.value.details()
        assert [(v["field"], v["description"]) for v in out["invalid"]["violations"]] == field_violations(err.value)
        assert out["invalid"]["violations"][0]["field"] == "labels"

    assert out["deadline"]["code"] == "DEADLINE_EXCEEDED"


@pytest.fixture
def readme_js(tmp_path: Path) -> Path:
    (code,) = snippets("js")
    script = tmp_path / "score.js"
    script.write_text(code)
    return script


def test_readme_node_snippet_plaintext(node: str, readme_js: Path, start_server: Any) -> None:
    server: ServerThread = start_server(FakeEngine())
    got = run_node(node, readme_js, server.target)
    with ScorerClient(server.target, timeout=10) as client:
        expected = readme_request(client)
    assert scores_of(got) == expected.scores and got["mode"] == "SCORING_MODE_MIS"


def test_readme_node_snippet_tls_and_token(node: str, readme_js: Path, start_server: Any, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    (tmp_path / "token").write_text(TOKEN)
    server: ServerThread = start_server(FakeEngine(), tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                        auth_token_file=str(tmp_path / "token"))
    target = f"localhost:{server.app.port}"
    got = run_node(node, readme_js, target, PYSCORE_TLS_CA=str(pki.ca), PYSCORE_AUTH_TOKEN=TOKEN)
    with ScorerClient(target, timeout=10, tls_ca=pki.ca, auth_token=TOKEN) as client:
        assert scores_of(got) == readme_request(client).scores
    environment = dict(os.environ, PYSCORE_TARGET=target, NODE_PATH=str(NODE_DIR / "node_modules"),
                       PYSCORE_TLS_CA=str(pki.ca), PYSCORE_AUTH_TOKEN="wrong")
    denied = subprocess.run([node, str(readme_js)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env=environment)
    assert denied.returncode == 1 and denied.stderr.startswith("UNAUTHENTICATED: "), denied.stderr


def readme_request(client: ScorerClient) -> Any:
    return client.score(ORDER_STATUS["query"], ORDER_STATUS["items"], labels=ORDER_STATUS["labels"],
                        apply_softmax=True)
