"""The soak's memory diagnostics: the probe's JSON lines (RSS, glibc's mallinfo2 and malloc_info totals,
tracemalloc growth), and malloc_trim under load as a control."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from pyscore.client import ScorerClient
from server.memory import MemoryProbe
from tests.server.conftest import wait_for
from tests.server.fake_engine import FakeEngine


def test_probe_writes_rss_allocator_and_python_growth(tmp_path: Path) -> None:
    path = tmp_path / "memory.jsonl"
    probe = MemoryProbe(path, every_s=3600)
    tracemalloc.start()
    try:
        probe.sample()
        hoard = [bytearray(1000) for _ in range(2000)]  # ~2 MB of Python allocations at one site
        probe.sample()
    finally:
        tracemalloc.stop()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert second["VmRSS"] > 0 and second["VmHWM"] >= second["VmRSS"]
    if "mallinfo2" in first:  # glibc >= 2.33
        assert second["mallinfo2"]["uordblks"] > 0 and second["malloc_info"]["heaps"] >= 1
        assert second["malloc_info"]["system_current"] > 0
    top = second["tracemalloc"]["grown_since_first"][0]
    assert "test_memory_probe.py" in top["site"] and top["bytes"] > 1_000_000, top
    del hoard


def test_trim_under_load(start_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import server.batcher as batcher_module

    trims: list[bool] = []
    monkeypatch.setenv("PYSCORE_TRIM_UNDER_LOAD", "1")
    monkeypatch.setattr(batcher_module, "TRIM_EVERY_S", 0.02)
    fake = FakeEngine(delay_s=0.01)
    server = start_server(fake)
    monkeypatch.setattr(batcher_module, "trim_heap", lambda: trims.append(bool(server.batcher.running_generations())))
    with ScorerClient(server.target, timeout=10) as client:
        assert client.generate("long", max_tokens=50).token_ids
    wait_for(lambda: any(trims), what="a trim while a generation ran")
