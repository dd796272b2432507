"""A burst of long Generate calls against a real `python -m server` on a tiny random model: the server stays up,
its memory stays bounded by its admission limits (not by the size of the burst), every admitted generation
finishes, and a refusal is RESOURCE_EXHAUSTED naming the limit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pyscore.client import AsyncScorerClient, ScorerClient

ROOT = Path(__file__).resolve().parents[2]
BURST, PROMPT_TOKENS, MAX_TOKENS = 50, 1000, 8
MAX_BATCH_TOKENS, MAX_KV_TOKENS = 2048, 16384
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x (k, v) x kv heads x head_dim x fp32
# What the burst may add to the server's peak RSS: the KV store (--kv-cache-mb 32: MAX_KV_TOKENS tokens' worth),
# one prefill pass of at most MAX_BATCH_TOKENS tokens (~18 KiB of live activations a token: 36 MiB) and the
# allocator's slack; measured 77-96 MiB. Without the bounds the 50 prompts (50k tokens) were all admitted and
# prefilled in one packed pass: +605 MiB.
PEAK_GROWTH_LIMIT_MB = MAX_KV_TOKENS * KV_BYTES_PER_TOKEN / 2**20 + 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider tiny Qwen3 (hidden 256, MLP 1024) with a 2048-token context: activations that weigh something."""
    from tests.helpers import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("wide"), "qwen3", hidden_size=256, intermediate_size=1024,
                          head_dim=64, max_position_embeddings=2048)


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "server", "--model", str(model_dir), "--dtype", "float32", "--threads", "1",
           "--port", "0", "--max-queue", "32", "--max-batch-tokens", str(MAX_BATCH_TOKENS),
           "--kv-cache-mb", str(MAX_KV_TOKENS * KV_BYTES_PER_TOKEN / 2**20)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline()
        assert listening.startswith("pyscore: listening on "), listening + proc.stderr.read()  # type: ignore
        serving = proc.stdout.readline()
        assert serving.startswith("pyscore: serving "), serving + proc.stderr.read()  # type: ignore
        yield proc, listening.split()[3]
    finally:
        proc.kill()
        proc.wait(10)


async def burst(target: str) -> list[object]:
    async with AsyncScorerClient(target, timeout=300) as client:
        calls = [client.generate([5 + (i * 7 + j) % 300 for j in range(PROMPT_TOKENS)],
                                 max_tokens=MAX_TOKENS) for i in range(BURST)]
        return await asyncio.gather(*calls, return_exceptions=True)


def test_burst_of_long_generations_stays_within_memory(server: tuple[subprocess.Popen[str], str]) -> None:
    proc, target = server
    with ScorerClient(target, timeout=60) as client:  # touch the code paths of long prompts once
        client.generate([5 + j % 300 for j in range(PROMPT_TOKENS)], max_tokens=2)
    idle_kib = kib(proc.pid, "VmRSS")
    outcomes = asyncio.run(burst(target))
    growth_mb = (kib(proc.pid, "VmHWM") - idle_kib) / 1024
    assert proc.poll() is None, "the server died"
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    assert len(done) + len(refused) == BURST, [o for o in outcomes if isinstance(o, BaseException)][:1]
    assert all(len(r.token_ids) == MAX_TOKENS or r.finish_reason == "eos" for r in done)  # type: ignore[attr-defined]
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue" in e.details() for e in refused)
    assert done, "nothing was admitted"
    assert growth_mb <= PEAK_GROWTH_LIMIT_MB, f"peak RSS grew {growth_mb:.0f} MiB during the burst"
    with ScorerClient(target, timeout=30) as client:  # still serving
        assert client.generate([5, 6, 7], max_tokens=2).token_ids
