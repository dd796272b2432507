"""The code blocks of the README's "Calling from other languages" section, so that the tests run exactly what a
reader pastes."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Calling from other languages"


def snippets(language: str) -> list[str]:
    """The ```<language> blocks of the section, in order."""
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end >= 0 else len(text)]
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


# The request of the README's order-status example, which the snippets send.
ORDER_STATUS = {
    "query": "Customer: Where is my order #1234? It was due yesterday. Should the support agent do this? "
             "Answer Yes or No. Action:",
    "items": [" Look up the order's shipping status. Answer:", " Reset the customer's password. Answer:",
              " Recommend a new laptop. Answer:"],
    "labels": [" Yes", " No"],
}
