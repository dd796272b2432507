"""Token-id decision questions with the lengths Qwen3's tokenizer gives the pointwise Open-Jev-like prompts of the
bench suite (bench/prompts.py `pointwise`): a query of 270-350 tokens (context + question) and one item of 25-40
tokens per candidate ("Proposed answer: ... Answer Yes or No."). Random ids: a random-weight model reads any ids
the same way, and token ids keep the real tokenizer out of the workload."""

from __future__ import annotations

import random
from dataclasses import dataclass

CANDIDATE_COUNTS = (2, 5, 9, 16)  # the study's buckets (bench/dataset.py BUCKETS)
QUERY_TOKENS = (270, 350)
ITEM_TOKENS = (25, 40)
YES_NO = (9454, 2753)  # Qwen3's " Yes" / " No"; any ids below the vocabulary would do


@dataclass
class IdQuestion:
    query: list[int]
    items: list[list[int]]

    @property
    def sis_tokens(self) -> int:
        return sum(len(self.query) + len(i) for i in self.items)

    @property
    def mis_tokens(self) -> int:
        return len(self.query) + sum(map(len, self.items))


def id_question(num_items: int, seed: int, vocab: int, query_tokens: tuple[int, int] = QUERY_TOKENS,
                item_tokens: tuple[int, int] = ITEM_TOKENS) -> IdQuestion:
    rng = random.Random(seed)
    low = min(1000, vocab // 2)  # skip the low ids, where tokenizers keep their special tokens

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    return IdQuestion(query=ids(rng.randint(*query_tokens)), items=[ids(rng.randint(*item_tokens))
                                                                     for _ in range(num_items)])


def id_questions(num_items: int, count: int, vocab: int, seed: int = 0, tiny: bool = False) -> list[IdQuestion]:
    """`count` distinct questions of `num_items` candidates; `tiny` shrinks the lengths for CPU tests."""
    lengths = dict(query_tokens=(20, 30), item_tokens=(3, 6)) if tiny else {}
    return [id_question(num_items, seed * 1000 + 17 * num_items + i, vocab, **lengths) for i in range(count)]


def labels_for(vocab: int) -> list[int]:
    return list(YES_NO) if vocab > max(YES_NO) else [vocab // 3, vocab // 2]
