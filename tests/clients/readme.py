"""The code blocks of the docs' "Calling from other languages" page (docs/clients.md; the README links to it), so
that the tests run exactly what a reader pastes."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
TITLE = "# Calling from other languages"


def snippets(language: str) -> list[str]:
    """The ```<language> blocks of the page, in order."""
    text = PAGE.read_text()
    assert text.startswith(TITLE), f"{PAGE} no longer starts with {TITLE!r}"
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


# The request of the order-status example (README, docs/quickstart.md), which the snippets send.
ORDER_STATUS = {
    "query": "Customer: Where is my order #1234? It was due yesterday. Should the support agent do this? "
             "Answer Yes or No. Action:",
    "items": [" Look up the order's shipping status. Answer:", " Reset the customer's password. Answer:",
              " Recommend a new laptop. Answer:"],
    "labels": [" Yes", " No"],
}
