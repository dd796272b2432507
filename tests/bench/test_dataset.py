"""The question loader: the Open-Jev parquet layout and the seeded synthetic set behind one type."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.dataset import BUCKETS, COLUMNS, Dataset, bucket_of


def write_split(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def row(i, options, answer, kind="choice"):
    return {"id": f"q{i}", "source": "unit", "state_json": json.dumps({"step": i}), "question": f"Pick {i}?",
            "options": options, "target": [1.0 if j == answer else 0.0 for j in range(len(options))], "kind": kind}


def test_parquet_split_file_keeps_choice_rows(tmp_path):
    write_split(tmp_path / "test.parquet", [row(0, ["a", "b"], 1), row(1, ["x", "y", "z"], 2, kind="freeform"),
                                            row(2, ["p", "q", "r", "s", "t"], 0)])
    write_split(tmp_path / "train.parquet", [row(9, ["no", "no"], 0)])
    ds = Dataset.load(tmp_path, split="test", seed=0)
    assert sorted(q.id for q in ds.questions) == ["q0", "q2"]
    q0 = next(q for q in ds.questions if q.id == "q0")
    assert (q0.options, q0.answer, q0.state_json, q0.question, q0.kind) == (["a", "b"], 1, '{"step": 0}', "Pick 0?",
                                                                           "choice")
    assert ds.by_bucket == {2: 1, 5: 1, 9: 0, 16: 0}
    assert ds.origin.startswith("open-jev:")


def test_parquet_hf_layout_and_limit(tmp_path):
    write_split(tmp_path / "data" / "validation-00000-of-00002.parquet", [row(i, ["a", "b"], 0) for i in range(3)])
    write_split(tmp_path / "data" / "validation-00001-of-00002.parquet", [row(i, ["a", "b"], 0) for i in range(3, 6)])
    assert len(Dataset.load(tmp_path, split="validation")) == 6
    assert len(Dataset.load(tmp_path, split="validation", limit=4)) == 4


def test_parquet_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="ood"):
        Dataset.load(tmp_path, split="ood")
    with pytest.raises(ValueError, match="split"):
        Dataset.load(tmp_path, split="dev")
    pq.write_table(pa.Table.from_pylist([{"id": "x", "options": ["a"]}]), tmp_path / "test.parquet")
    with pytest.raises(ValueError, match="missing Open-Jev columns"):
        Dataset.load(tmp_path, split="test")


def test_synthetic_is_seeded_and_covers_the_buckets():
    a, b, c = Dataset.load(None, limit=40, seed=3), Dataset.synthetic(40, seed=3), Dataset.synthetic(40, seed=4)
    assert a.questions == b.questions and a.questions != c.questions
    assert a.by_bucket == {2: 10, 5: 10, 9: 10, 16: 10}
    assert len(Dataset.load(None)) == 64
    for q in a.questions:
        assert set(vars(q)) == set(COLUMNS)
        assert isinstance(json.loads(q.state_json), dict)
        assert 2 <= q.num_candidates <= 16 and q.bucket in BUCKETS
        assert q.target[q.answer] == 1.0 and sum(q.target) == 1.0
        # Character / word bounds behind the measured SmolLM2 token counts (state 158-383, options 10-40).
        assert 450 <= len(q.state_json) <= 1600
        assert all(9 <= len(o.split()) <= 37 for o in q.options)


def test_buckets():
    assert [bucket_of(n) for n in (2, 3, 4, 6, 7, 12, 13, 16, 20)] == [2, 2, 5, 5, 9, 9, 16, 16, 16]
    with pytest.raises(ValueError):
        bucket_of(1)
