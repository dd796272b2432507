"""A seeded synthetic decision question shaped like the Open-Jev pointwise workload: a ~270-token query
(context + question) and N candidate items of ~30 tokens, each asking for a Yes/No judgement."""

from __future__ import annotations

import random

WORDS = [
    "order", "shipment", "customer", "refund", "warehouse", "status", "invoice", "carrier", "tracking",
    "delayed", "delivered", "address", "payment", "account", "support", "ticket", "priority", "escalation",
    "policy", "inventory", "return", "label", "package", "route", "agent", "action", "confirm", "cancel",
    "update", "notify", "schedule", "verify", "region", "express", "standard",
]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def question(num_items: int, seed: int = 0, query_words: int = 228, item_words: int = 14) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    state = " ".join(_sentence(rng, 12) for _ in range(query_words // 12))
    query = f"Context:\n{state}\n\nQuestion: which action should the agent take next?\n"
    items = [f"Proposed answer: {_sentence(rng, item_words)}\nIs this proposed answer correct? Answer Yes or No."
             for _ in range(num_items)]
    return query, items
