"""bench.memory: the random checkpoints it writes load and score like any model directory, and its table checks the
issue's targets row by row."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import memory as bench

GiB = 2**30


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3.5"])
def test_a_written_checkpoint_loads_and_scores(tmp_path: Path, shape: str, smollm2_dir: Path) -> None:
    from pyscore.engine import Engine

    bench.write_checkpoint(shape, tmp_path / shape)
    assert sorted(p.name for p in tmp_path.iterdir()) == [shape]  # no .partial left behind
    engine = Engine.from_pretrained(tmp_path / shape, dtype="bfloat16", device="cpu", threads=1, kv_cache_mb=16)
    # token ids: the tiny shapes' vocabulary (1024) is smaller than the tokenizer's
    result = engine.score([1, 17, 99, 300], [[5, 6, 7], [8]], label_token_ids=[10, 11], mode="mis")
    assert result.mode == "mis" and all(0 < v < 1 for item in result.scores for v in item[0])
    assert engine.memory.weight_bytes > 0


def row(weights: float, peak: float, steady: float) -> dict:
    return dict(weight_bytes=int(weights * GiB), load_peak_bytes=int(peak * GiB), steady_bytes=int(steady * GiB),
                load_s=1.0, scores=[[0.5, 0.5], [0.5, 0.5]])


def test_the_table_checks_each_target() -> None:
    lines = bench.table({"a": row(8, 10.4, 9.2), "b": row(8, 10.6, 9.4), "c": dict(error="MemoryError")})
    assert "| a | 8.00 | 10.40 (10.50) | pass | 9.20 (9.30) | pass |" in lines[2]
    assert "| FAIL |" in lines[3] and lines[3].count("FAIL") == 2
    assert lines[4] == "| c | error: MemoryError |"


def test_int8_rows_meet_the_int8_target_and_go_to_their_own_record() -> None:
    # steady 9.6 GiB on 8 GiB of weights: over bf16's 1.10 x + 0.5 (9.3), under int8's 1.15 x + 0.5 (9.7)
    rows = {"a": row(8, 10.4, 9.6)}
    assert "FAIL" in bench.table(rows)[2]
    assert "| a | 8.00 | 10.40 (10.50) | pass | 9.60 (9.70) | pass |" in bench.table(rows, "int8")[2]
    assert bench.record_name("int8") == "memory_int8" and bench.record_name(None) == "memory"
