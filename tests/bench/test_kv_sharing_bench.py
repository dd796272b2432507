"""bench.memory --kv-sharing on a tiny model: the generations share the cached system prompt's pages (held once),
and the table checks the target."""

from __future__ import annotations

from bench import memory as bench
from tests.helpers import make_model_dir


def test_shared_system_prompt_is_held_once(tmp_path) -> None:
    from pyscore.engine import Engine

    engine = Engine.from_pretrained(make_model_dir(tmp_path / "llama", "llama"), dtype="float32", device="cpu",
                                    threads=1)
    row = bench.kv_measure(engine, users=4, system=200, suffix=20, max_tokens=3)
    b = engine.kv_store.block_tokens  # 16 on the CPU
    shared, tail = divmod(200, b)
    assert row["shared_pages"] == shared  # 200 = 12 x 16 + 8: twelve whole pages referenced by every table
    # each sequence: its 8-token tail of the system prompt + 20 + up to 2 new tokens in pages of its own
    own = -(-(tail + 20 + 2) // b)
    assert row["held_pages"] == shared + 4 * own and row["table_pages"] == 4 * (shared + own)
    assert row["before_bytes"] > row["held_bytes"]
    lines = bench.kv_table([row])
    assert lines[2].startswith("| 20 | 3 |") and f"| {4 * (shared + own)} ({shared + 4 * own}) |" in lines[2]
    assert "| pass |" in lines[2] or "| FAIL |" in lines[2]
