"""bench's `pyscore-http` target asks our HTTP front door what the gRPC target asks over gRPC: on one server (the
fake engine) both decide every question the same way with the same token accounting, and a serving run over it
reports the server-side timing."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bench import serving
from bench.dataset import Dataset
from bench.serving import LoadPoint, Settings
from bench.targets import GrpcTarget, PyscoreHTTPTarget, make_target
from tests.server import fake_engine
from tests.server.conftest import ServerThread
from tests.server.fake_engine import FakeEngine

PATHS = ["mis", "sis", "generate", "setwise", "loglik"]  # fused: the fake engine has no chat template


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(fake_engine, "MAX_CONTEXT", 4096)  # a 16-option setwise prompt is ~600 fake words
    s = ServerThread(FakeEngine(), http_port=0)
    yield s
    s.stop()


def test_http_target_decides_as_the_grpc_target(server):
    http_spec = f"pyscore-http://127.0.0.1:{server.app.http_port}"
    assert isinstance(make_target(http_spec, prefix_cache="off"), PyscoreHTTPTarget)

    def outcome(d, path):
        """loglik: one echo request of every option over HTTP (as lm-evaluation-harness sends it), one Generate
        each over gRPC: the calls differ, the decision and the tokens do not."""
        return {k: v for k, v in dataclasses.asdict(d).items()
                if not k.startswith("server_") and not (k == "calls" and path == "loglik")}

    async def both():
        grpc_target, http_target = GrpcTarget(server.target), make_target(http_spec)
        grpc_info, http_info = await grpc_target.open(), await http_target.open()
        try:
            assert (http_info.model, http_info.label_token_ids, http_info.marker) == (
                grpc_info.model, grpc_info.label_token_ids, grpc_info.marker)
            for q in Dataset.synthetic(4, seed=3).questions:
                for path in PATHS:
                    over_http = await http_target.decide(path, q)
                    assert outcome(over_http, path) == outcome(await grpc_target.decide(path, q), path), path
                    assert over_http.server_compute_ms is not None and over_http.server_compute_ms > 0
        finally:
            await grpc_target.close()
            await http_target.close()

    asyncio.run(both())


def test_a_serving_run_over_http(server, tmp_path):
    spec = f"pyscore-http://127.0.0.1:{server.app.http_port}"
    settings = Settings(reps=1, num_questions=4, duration_s=0.3, warmup=1, progress=False)
    summaries = asyncio.run(serving.run(spec, PATHS, [LoadPoint(concurrency=2)], Dataset.synthetic(4, seed=1),
                                        settings, tmp_path, timeout=10))
    assert [s["num_errors"] for s in summaries] == [0] * len(PATHS)
    assert all(s["target"] == spec and s["server_compute_ms"]["p50"] > 0 for s in summaries)


def test_http_target_rerank_decides_as_mis(server):
    """The `rerank` path (vLLM's /rerank on our front door, what bench.peers --ours-http compares with vLLM's LLM
    reranker) picks what MIS over gRPC picks, from the same tokens."""
    async def both():
        grpc_target = GrpcTarget(server.target)
        http_target = make_target(f"pyscore-http://127.0.0.1:{server.app.http_port}")
        await grpc_target.open()
        await http_target.open()
        try:
            for q in Dataset.synthetic(4, seed=5).questions:
                over_http, over_grpc = await http_target.decide("rerank", q), await grpc_target.decide("mis", q)
                assert (over_http.choice, over_http.prompt_tokens) == (over_grpc.choice, over_grpc.prompt_tokens)
                assert over_http.server_compute_ms is not None and over_http.server_compute_ms > 0
        finally:
            await grpc_target.close()
            await http_target.close()

    asyncio.run(both())
