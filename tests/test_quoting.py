"""Messages quote client input bounded: pyscore.errors.quoted (every message that quotes input) and the server's
backstop on a whole status message."""

from __future__ import annotations

from pyscore.errors import QUOTE_LIMIT, quoted
from server.interceptors import MAX_STATUS_BYTES, status_for


def test_short_input_is_quoted_whole() -> None:
    assert quoted("Yes please") == "'Yes please'"
    assert quoted([7, 7]) == "[7, 7]"


def test_long_input_is_elided_in_the_middle() -> None:
    text = "head" + "x" * 460_000 + "tail"
    q = quoted(text)
    assert len(q) < QUOTE_LIMIT + 40
    assert q.startswith("'headxx") and q.endswith("xxtail'") and "(459808 characters elided)" in q
    ids = quoted(list(range(5000)))
    assert ids.startswith("[0, 1, 2") and ids.endswith("4998, 4999]") and "(4984 more)" in ids
    assert len(quoted(["y" * 10_000] * 1000)) < QUOTE_LIMIT + 40


def test_a_status_message_is_bounded_whatever_raised() -> None:
    for message in ("x" * 10**6, "\U0001f642" * 10**5):
        _, text = status_for(RuntimeError(message))
        assert len(text.encode()) <= MAX_STATUS_BYTES
        assert text.startswith("internal error: RuntimeError: ")
