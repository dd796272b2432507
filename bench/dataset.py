"""Choice questions for the serving benchmark, behind one loader type: `Dataset.load(dataset_dir=...)` reads the
Open-Jev parquet layout when given a directory and otherwise builds a seeded synthetic set with the same columns
and realistic shapes (state JSON of ~150-400 tokens, 2-16 options of ~10-40 tokens, candidate counts covering
the buckets 2, 5, 9 and 16)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "calibration", "validation", "test", "ood")
COLUMNS = ("id", "source", "state_json", "question", "options", "target", "kind")
BUCKETS = (2, 5, 9, 16)
# Which bucket a candidate count reports under: Open-Jev questions have any count from 2 to 16.
BUCKET_RANGES = {2: (2, 3), 5: (4, 6), 9: (7, 12), 16: (13, 10_000)}

WORDS = [
    "order", "shipment", "customer", "refund", "warehouse", "status", "invoice", "carrier", "tracking",
    "delayed", "delivered", "address", "payment", "account", "support", "ticket", "priority", "escalation",
    "policy", "inventory", "return", "label", "package", "route", "agent", "action", "confirm", "cancel",
    "update", "notify", "schedule", "verify", "region", "express", "standard", "balance", "credit", "window",
    "supplier", "quote", "budget", "meeting", "deadline", "contract", "review", "approval", "risk", "team",
]
QUESTIONS = [
    "Which action should the agent take next?",
    "What is the best next step for the operator?",
    "Which response resolves the customer's request?",
    "Which tool call should be made now?",
]


def bucket_of(num_candidates: int) -> int:
    """The candidate-count bucket (2, 5, 9 or 16) a question reports under."""
    for bucket, (lo, hi) in BUCKET_RANGES.items():
        if lo <= num_candidates <= hi:
            return bucket
    raise ValueError(f"num_candidates must be >= 2, got {num_candidates}")


@dataclass
class Question:
    """One Open-Jev row: `target` has one float per option and its argmax is the correct answer."""

    id: str
    source: str
    state_json: str
    question: str
    options: list[str]
    target: list[float]
    kind: str = "choice"

    @property
    def num_candidates(self) -> int:
        return len(self.options)

    @property
    def answer(self) -> int:
        return max(range(len(self.target)), key=self.target.__getitem__)

    @property
    def bucket(self) -> int:
        return bucket_of(self.num_candidates)


@dataclass
class Dataset:
    """An ordered list of choice questions and where they came from ("open-jev:DIR/test" or "synthetic:seed=0")."""

    questions: list[Question]
    origin: str
    by_bucket: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.by_bucket = {b: sum(q.bucket == b for q in self.questions) for b in BUCKETS}

    def __len__(self) -> int:
        return len(self.questions)

    def __getitem__(self, i: int) -> Question:
        return self.questions[i]

    @classmethod
    def load(cls, dataset_dir: str | Path | None = None, *, split: str = "test", limit: int | None = None,
             seed: int = 0) -> Dataset:
        """Open-Jev from `dataset_dir` (choice rows of `split`), else `limit` (default 64) synthetic questions.
        Real rows are shuffled with `seed` before `limit` applies, so a short run still mixes sources."""
        if dataset_dir is None:
            return cls.synthetic(64 if limit is None else limit, seed=seed)
        return cls.from_parquet(dataset_dir, split=split, limit=limit, seed=seed)

    @classmethod
    def from_parquet(cls, dataset_dir: str | Path, *, split: str = "test", limit: int | None = None,
                     seed: int = 0) -> Dataset:
        import pyarrow.parquet as pq

        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        files = split_files(Path(dataset_dir), split)
        rows: list[Question] = []
        for f in files:
            table = pq.read_table(f)
            missing = [c for c in COLUMNS if c not in table.column_names]
            if missing:
                raise ValueError(f"{f}: missing Open-Jev columns {missing}")
            for r in table.select(list(COLUMNS)).to_pylist():
                if r["kind"] != "choice" or len(r["options"]) < 2:
                    continue
                rows.append(Question(id=str(r["id"]), source=str(r["source"]), state_json=str(r["state_json"]),
                                     question=str(r["question"]), options=[str(o) for o in r["options"]],
                                     target=[float(t) for t in r["target"]], kind="choice"))
        random.Random(seed).shuffle(rows)
        return cls(rows[:limit] if limit is not None else rows, origin=f"open-jev:{dataset_dir}/{split}")

    @classmethod
    def synthetic(cls, num_questions: int, *, seed: int = 0) -> Dataset:
        """Candidate counts cycle through the buckets 2, 5, 9, 16 so every bucket is equally represented."""
        rng = random.Random(seed)
        questions = [synthetic_question(rng, i, BUCKETS[i % len(BUCKETS)]) for i in range(num_questions)]
        return cls(questions, origin=f"synthetic:seed={seed}")


def split_files(root: Path, split: str) -> list[Path]:
    """The parquet files of a split, in the layouts Open-Jev ships in: `split.parquet`, `split/*.parquet`,
    `data/split-*.parquet` (the Hugging Face datasets layout)."""
    patterns = [f"{split}.parquet", f"{split}/*.parquet", f"data/{split}-*.parquet", f"data/{split}/*.parquet"]
    files = sorted({p for pat in patterns for p in root.glob(pat)})
    if not files:
        raise FileNotFoundError(f"no parquet files for split {split!r} under {root} (tried {', '.join(patterns)})")
    return files


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def synthetic_state(rng: random.Random) -> str:
    """An agent state as JSON: 158-383 SmolLM2 tokens (median 276) over 400 seeded questions; options (see
    synthetic_question) are 10-40 tokens (median 25)."""
    events = [{"t": rng.randrange(10_000), "event": _words(rng, rng.randint(4, 9))}
              for _ in range(rng.randint(5, 14))]
    state = {
        "user": {"id": rng.randrange(100_000), "tier": rng.choice(["free", "pro", "enterprise"])},
        "goal": _words(rng, rng.randint(8, 16)),
        "open_items": [_words(rng, 3) for _ in range(rng.randint(1, 4))],
        "history": events,
        "budget_left": round(rng.uniform(0, 500), 2),
    }
    return json.dumps(state)


def synthetic_question(rng: random.Random, index: int, num_options: int) -> Question:
    options = [_words(rng, rng.randint(9, 37)).capitalize() + "." for _ in range(num_options)]
    answer = rng.randrange(num_options)
    return Question(id=f"syn-{index:05d}", source="synthetic", state_json=synthetic_state(rng),
                    question=rng.choice(QUESTIONS), options=options,
                    target=[1.0 if i == answer else 0.0 for i in range(num_options)])
