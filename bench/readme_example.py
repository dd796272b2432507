"""Recomputes the README's order-status example in process (bf16, the server's default) and prints the rows,
so the numbers the README shows come from a recorded run: python -m bench.readme_example."""

from __future__ import annotations

from bench.common import machine
from pyscore.engine import Engine

QUERY = ("Customer: Where is my order #1234? It was due yesterday. Should the support agent do this? "
         "Answer Yes or No. Action:")
ITEMS = [" Look up the order's shipping status. Answer:", " Reset the customer's password. Answer:",
         " Recommend a new laptop. Answer:"]


def main() -> None:
    engine = Engine.from_pretrained()
    result = engine.score(QUERY, ITEMS, labels=[" Yes", " No"], apply_softmax=True)
    print(f"# {machine()} | {engine.model_name} {engine.info().dtype}")
    print(f"mode {result.mode} labels {result.label_token_ids} tokens {result.usage.prompt_tokens} prompt / "
          f"{result.usage.computed_tokens} computed")
    for item, rows in zip(ITEMS, result.scores, strict=True):
        print(f"{item.strip():45s} " + "  ".join(f"{v:.4f}" for v in rows[0]))


if __name__ == "__main__":
    main()
